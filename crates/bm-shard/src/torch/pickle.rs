//! A restricted unpickler: it rebuilds tensors, storages and plain
//! containers from a pickle and never runs code.
//!
//! Python's unpickler imports whatever module a pickle names and calls
//! whatever it finds there, which is how a `.bin` file runs `os.system`.
//! This one knows a closed set of names, the ones torch's own
//! `weights_only=True` unpickler allows for a state dict
//! (`collections.OrderedDict`, `torch._utils._rebuild_tensor_v2` and its
//! siblings, the `torch.*Storage` types, torch dtypes), and interprets them
//! itself: "calling" `_rebuild_tensor_v2` records a tensor description. Any
//! other global is refused with its name, and so is every opcode that could
//! build an arbitrary object (`INST`, `OBJ`, `NEWOBJ`, `EXT*`).
//!
//! Resource use is bounded by the pickle's length: values are cheap to
//! copy (strings and tuples are shared), lists and dicts live in an arena
//! and are referred to by index (so memo references and cycles cost
//! nothing), every length is checked against the bytes that remain before
//! anything is allocated, and nested tuples are limited in depth so that
//! nothing recurses deeply, not even their drop.

use std::collections::HashMap;
use std::rc::Rc;

use bm_tensor::DType;

/// Deepest nesting of tuples accepted (a state dict needs 3).
const MAX_TUPLE_DEPTH: u32 = 32;

/// A torch storage type as named by a pickle.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum StorageType {
    /// `torch.FloatStorage` and the like: elements of one dtype. `dtype` is
    /// `None` for torch types with no safetensors dtype (complex, quantized).
    Typed {
        name: &'static str,
        dtype: Option<DType>,
    },
    /// `torch.storage.UntypedStorage`: bytes, the tensor gives the dtype.
    Untyped,
}

impl StorageType {
    /// Bytes per element the storage's declared size counts.
    pub fn element_size(self) -> Option<usize> {
        match self {
            StorageType::Typed { dtype, .. } => dtype.map(DType::size_in_bytes),
            StorageType::Untyped => Some(1),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            StorageType::Typed { name, .. } => name,
            StorageType::Untyped => "torch.storage.UntypedStorage",
        }
    }
}

/// A global the pickle may name: the only things it can "call".
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Global {
    OrderedDict,
    RebuildTensor,
    RebuildTensorV2,
    RebuildTensorV3,
    RebuildParameter,
    RebuildParameterWithState,
    Storage(StorageType),
    /// `torch.float16` and the like (`dtype` is `None` for a torch dtype
    /// with no safetensors dtype).
    TorchDType {
        name: &'static str,
        dtype: Option<DType>,
    },
}

/// The allowlist of functions and classes, by full name.
const FUNCTIONS: [(&str, Global); 7] = [
    ("collections.OrderedDict", Global::OrderedDict),
    ("torch._utils._rebuild_tensor", Global::RebuildTensor),
    ("torch._utils._rebuild_tensor_v2", Global::RebuildTensorV2),
    ("torch._utils._rebuild_tensor_v3", Global::RebuildTensorV3),
    ("torch._utils._rebuild_parameter", Global::RebuildParameter),
    (
        "torch._utils._rebuild_parameter_with_state",
        Global::RebuildParameterWithState,
    ),
    (
        "torch.storage.UntypedStorage",
        Global::Storage(StorageType::Untyped),
    ),
];

/// torch's typed storage classes, with the safetensors dtype of their
/// elements (`None`: complex and quantized types, which have none).
const STORAGE_TYPES: [(&str, Option<DType>); 17] = [
    ("torch.DoubleStorage", Some(DType::F64)),
    ("torch.FloatStorage", Some(DType::F32)),
    ("torch.HalfStorage", Some(DType::F16)),
    ("torch.BFloat16Storage", Some(DType::BF16)),
    ("torch.LongStorage", Some(DType::I64)),
    ("torch.IntStorage", Some(DType::I32)),
    ("torch.ShortStorage", Some(DType::I16)),
    ("torch.CharStorage", Some(DType::I8)),
    ("torch.ByteStorage", Some(DType::U8)),
    ("torch.BoolStorage", Some(DType::Bool)),
    ("torch.ComplexDoubleStorage", None),
    ("torch.ComplexFloatStorage", None),
    ("torch.QUInt8Storage", None),
    ("torch.QInt8Storage", None),
    ("torch.QInt32Storage", None),
    ("torch.QUInt4x2Storage", None),
    ("torch.QUInt2x4Storage", None),
];

/// torch dtypes a pickle may name (`_rebuild_tensor_v3`), with the
/// safetensors dtype each is stored as (`None`: it has none).
const TORCH_DTYPES: [(&str, Option<DType>); 38] = [
    ("torch.float64", Some(DType::F64)),
    ("torch.float32", Some(DType::F32)),
    ("torch.float16", Some(DType::F16)),
    ("torch.bfloat16", Some(DType::BF16)),
    ("torch.int64", Some(DType::I64)),
    ("torch.int32", Some(DType::I32)),
    ("torch.int16", Some(DType::I16)),
    ("torch.int8", Some(DType::I8)),
    ("torch.uint8", Some(DType::U8)),
    ("torch.bool", Some(DType::Bool)),
    ("torch.float8_e4m3fn", Some(DType::F8E4M3)),
    ("torch.float8_e5m2", Some(DType::F8E5M2)),
    ("torch.uint16", None),
    ("torch.uint32", None),
    ("torch.uint64", None),
    ("torch.complex32", None),
    ("torch.complex64", None),
    ("torch.complex128", None),
    ("torch.float8_e4m3fnuz", None),
    ("torch.float8_e5m2fnuz", None),
    ("torch.float8_e8m0fnu", None),
    ("torch.float4_e2m1fn_x2", None),
    ("torch.qint8", None),
    ("torch.quint8", None),
    ("torch.qint32", None),
    ("torch.quint4x2", None),
    ("torch.quint2x4", None),
    ("torch.uint1", None),
    ("torch.uint2", None),
    ("torch.uint3", None),
    ("torch.uint4", None),
    ("torch.uint5", None),
    ("torch.uint6", None),
    ("torch.uint7", None),
    ("torch.int1", None),
    ("torch.int2", None),
    ("torch.int4", None),
    ("torch.bits8", None),
];

/// The allowlist: what `module.name` means, or why it is refused.
fn resolve_global(module: &str, name: &str) -> Result<Global, String> {
    let full = format!("{module}.{name}");
    let found = FUNCTIONS
        .iter()
        .find(|(n, _)| *n == full)
        .map(|&(_, g)| g)
        .or_else(|| {
            STORAGE_TYPES
                .iter()
                .find(|(n, _)| *n == full)
                .map(|&(name, dtype)| Global::Storage(StorageType::Typed { name, dtype }))
        })
        .or_else(|| {
            TORCH_DTYPES
                .iter()
                .find(|(n, _)| *n == full)
                .map(|&(name, dtype)| Global::TorchDType { name, dtype })
        });
    // Protocol 2 spells some modules as Python 2 did; say what they load.
    let python3 = match module {
        "__builtin__" => Some("builtins"),
        "commands" => Some("subprocess"),
        "copy_reg" => Some("copyreg"),
        _ => None,
    };
    let full = match python3 {
        Some(m) => format!("{full} ({m}.{name})"),
        None => full,
    };
    found.ok_or_else(|| {
        format!(
            "global {full} is not allowed: only tensors (torch._utils._rebuild_tensor_v2 and its siblings), storages, dtypes and plain containers are rebuilt, and no pickle code is ever run"
        )
    })
}

impl Global {
    fn name(self) -> &'static str {
        match self {
            Global::Storage(ty) => ty.name(),
            Global::TorchDType { name, .. } => name,
            other => FUNCTIONS
                .iter()
                .find(|(_, g)| *g == other)
                .map_or("?", |(n, _)| n),
        }
    }
}

/// A value on the unpickler's stack. Cloning is O(1).
#[derive(Clone, Debug)]
pub(crate) enum Value {
    None,
    Bool(bool),
    Int(i128),
    /// A float (its value is never needed).
    Float,
    Str(Rc<str>),
    Tuple(Rc<Tuple>),
    /// A list or dict in the arena.
    Object(usize),
    Global(Global),
    /// A storage declared through a persistent id (index into `storages`).
    Storage(usize),
    /// A rebuilt tensor (index into `tensors`).
    Tensor(usize),
}

#[derive(Debug)]
pub(crate) struct Tuple {
    depth: u32,
    items: Vec<Value>,
}

#[derive(Debug)]
pub(crate) enum Object {
    List(Vec<Value>),
    Dict(Vec<(Value, Value)>),
}

impl Value {
    fn kind(&self, objects: &[Object]) -> &'static str {
        match self {
            Value::None => "None",
            Value::Bool(_) => "a bool",
            Value::Int(_) => "an int",
            Value::Float => "a float",
            Value::Str(_) => "a str",
            Value::Tuple(_) => "a tuple",
            Value::Object(i) => match objects[*i] {
                Object::List(_) => "a list",
                Object::Dict(_) => "a dict",
            },
            Value::Global(_) => "a global",
            Value::Storage(_) => "a storage",
            Value::Tensor(_) => "a tensor",
        }
    }
}

/// A storage as its persistent id declares it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct StorageDecl {
    /// The key: the record `data/<key>` in a zip archive.
    pub key: String,
    pub ty: StorageType,
    /// Elements (bytes for an untyped storage).
    pub numel: u64,
}

/// A tensor as a rebuild function describes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct TensorDecl {
    pub storage: usize,
    /// The dtype, or the torch name of one with no safetensors dtype.
    pub dtype: Result<DType, &'static str>,
    /// Offset into the storage, in elements.
    pub offset: u64,
    pub shape: Vec<u64>,
    /// Strides in elements.
    pub strides: Vec<u64>,
}

/// What a pickle held: its root value, the objects, storages and tensors
/// it refers to, and where the pickle ended.
#[derive(Debug)]
pub(crate) struct Unpickled {
    pub root: Value,
    pub objects: Vec<Object>,
    pub storages: Vec<StorageDecl>,
    pub tensors: Vec<TensorDecl>,
    /// Offset just past the STOP opcode.
    pub end: usize,
}

/// How persistent ids are read: the zip format's 5-tuple, or the legacy
/// format's 6-tuple with a view (always `None` since PyTorch 1.x).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Format {
    Zip,
    Legacy,
}

/// Unpickles `bytes` up to its STOP opcode. Errors say what is wrong and at
/// which byte offset.
pub(crate) fn unpickle(bytes: &[u8], format: Format) -> Result<Unpickled, String> {
    let mut m = Machine {
        bytes,
        pos: 0,
        format,
        stack: Vec::new(),
        marks: Vec::new(),
        memo: HashMap::new(),
        objects: Vec::new(),
        storages: Vec::new(),
        storage_keys: HashMap::new(),
        tensors: Vec::new(),
    };
    loop {
        let at = m.pos;
        let op = m.take(1).map_err(|e| format!("byte {at}: {e}"))?[0];
        match m.step(op) {
            Ok(true) => {}
            Ok(false) => {
                let root = m.pop().map_err(|e| format!("byte {at} (STOP): {e}"))?;
                return Ok(Unpickled {
                    root,
                    objects: m.objects,
                    storages: m.storages,
                    tensors: m.tensors,
                    end: m.pos,
                });
            }
            Err(e) => return Err(format!("byte {at} ({}): {e}", opcode_name(op))),
        }
    }
}

struct Machine<'a> {
    bytes: &'a [u8],
    pos: usize,
    format: Format,
    stack: Vec<Value>,
    /// Stacks saved by MARK.
    marks: Vec<Vec<Value>>,
    memo: HashMap<u32, Value>,
    objects: Vec<Object>,
    storages: Vec<StorageDecl>,
    storage_keys: HashMap<String, usize>,
    tensors: Vec<TensorDecl>,
}

impl Machine<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8], String> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&e| e <= self.bytes.len())
            .ok_or_else(|| {
                format!(
                    "needs {n} bytes, {} remain (truncated pickle)",
                    self.bytes.len() - self.pos
                )
            })?;
        let s = &self.bytes[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    fn take_array<const N: usize>(&mut self) -> Result<[u8; N], String> {
        Ok(self.take(N)?.try_into().unwrap())
    }

    fn line(&mut self) -> Result<&str, String> {
        let rest = &self.bytes[self.pos..];
        let len = rest
            .iter()
            .position(|&b| b == b'\n')
            .ok_or("has no end of line (truncated pickle)")?;
        self.pos += len + 1;
        std::str::from_utf8(&rest[..len]).map_err(|_| "names a global that is not UTF-8".into())
    }

    fn text(&mut self, len: u64) -> Result<Value, String> {
        let len = usize::try_from(len).map_err(|_| "declares a string longer than memory")?;
        let s =
            std::str::from_utf8(self.take(len)?).map_err(|_| "holds a string that is not UTF-8")?;
        Ok(Value::Str(s.into()))
    }

    fn pop(&mut self) -> Result<Value, String> {
        self.stack.pop().ok_or_else(|| "the stack is empty".into())
    }

    fn top(&mut self) -> Result<&mut Value, String> {
        self.stack
            .last_mut()
            .ok_or_else(|| "needs a value on the stack, which is empty".into())
    }

    /// The values pushed since the last MARK, restoring the stack before it.
    fn pop_mark(&mut self) -> Result<Vec<Value>, String> {
        let outer = self.marks.pop().ok_or("has no MARK to pop to")?;
        Ok(std::mem::replace(&mut self.stack, outer))
    }

    fn tuple(items: Vec<Value>) -> Result<Value, String> {
        let depth = 1 + items
            .iter()
            .filter_map(|v| match v {
                Value::Tuple(t) => Some(t.depth),
                _ => None,
            })
            .max()
            .unwrap_or(0);
        if depth > MAX_TUPLE_DEPTH {
            return Err(format!(
                "tuples nest more than {MAX_TUPLE_DEPTH} deep; a state dict needs 3"
            ));
        }
        Ok(Value::Tuple(Rc::new(Tuple { depth, items })))
    }

    fn new_object(&mut self, object: Object) -> Value {
        self.objects.push(object);
        Value::Object(self.objects.len() - 1)
    }

    fn push_global(&mut self, module: &str, name: &str) -> Result<(), String> {
        let global = resolve_global(module, name)?;
        self.stack.push(Value::Global(global));
        Ok(())
    }

    fn memo_put(&mut self, key: u32) -> Result<(), String> {
        let value = self.top()?.clone();
        self.memo.insert(key, value);
        Ok(())
    }

    fn memo_get(&mut self, key: u32) -> Result<(), String> {
        let value = self
            .memo
            .get(&key)
            .cloned()
            .ok_or_else(|| format!("reads memo entry {key}, which was never stored"))?;
        self.stack.push(value);
        Ok(())
    }

    fn dict_at(&mut self, target: &Value, what: &str) -> Result<&mut Vec<(Value, Value)>, String> {
        match target {
            Value::Object(i) => match &mut self.objects[*i] {
                Object::Dict(d) => Ok(d),
                Object::List(_) => Err(format!("{what} a list; only dicts take items")),
            },
            other => Err(format!(
                "{what} {}; only dicts take items",
                other.kind(&self.objects)
            )),
        }
    }

    /// Runs one opcode; `Ok(false)` at STOP.
    fn step(&mut self, op: u8) -> Result<bool, String> {
        match op {
            b'.' => return Ok(false),
            0x80 => {
                let proto = self.take(1)?[0];
                if !(2..=5).contains(&proto) {
                    return Err(format!(
                        "asks for protocol {proto}; torch.save writes protocol 2 (up to 5 is read)"
                    ));
                }
            }
            // FRAME: protocol 4's framing, which changes nothing here.
            0x95 => {
                self.take(8)?;
            }
            b'c' => {
                let module = self.line()?.to_string();
                let name = self.line()?.to_string();
                self.push_global(&module, &name)?;
            }
            0x93 => {
                let name = self.pop()?;
                let module = self.pop()?;
                match (module, name) {
                    (Value::Str(m), Value::Str(n)) => self.push_global(&m, &n)?,
                    _ => return Err("needs two strings (module and name)".into()),
                }
            }
            b'R' => {
                let args = self.pop()?;
                let func = self.pop()?;
                let Value::Tuple(args) = args else {
                    return Err("needs a tuple of arguments".into());
                };
                let result = self.call(func, &args.items)?;
                self.stack.push(result);
            }
            b'b' => {
                // BUILD sets an object's state: transformers' state dicts
                // carry `_metadata` (module versions) this way. It is not
                // needed to read tensors, so it is checked and dropped.
                let _state = self.pop()?;
                let target = self.top()?.clone();
                self.dict_at(&target, "builds")?;
            }
            b'i' => {
                // INST imports and calls a class in one go: name it when it
                // is not allowed, refuse it either way.
                let module = self.line()?.to_string();
                let name = self.line()?.to_string();
                resolve_global(&module, &name)?;
                return Err("builds an object, which a state dict never does".into());
            }
            b'(' => {
                let outer = std::mem::take(&mut self.stack);
                self.marks.push(outer);
            }
            b't' => {
                let items = self.pop_mark()?;
                let t = Self::tuple(items)?;
                self.stack.push(t);
            }
            b')' => self.stack.push(Self::tuple(Vec::new())?),
            0x85..=0x87 => {
                let n = usize::from(op - 0x84);
                let at = self
                    .stack
                    .len()
                    .checked_sub(n)
                    .ok_or_else(|| format!("needs {n} values on the stack"))?;
                let items = self.stack.split_off(at);
                let t = Self::tuple(items)?;
                self.stack.push(t);
            }
            b']' => {
                let v = self.new_object(Object::List(Vec::new()));
                self.stack.push(v);
            }
            b'}' => {
                let v = self.new_object(Object::Dict(Vec::new()));
                self.stack.push(v);
            }
            b'a' | b'e' => {
                let items = if op == b'a' {
                    vec![self.pop()?]
                } else {
                    self.pop_mark()?
                };
                let target = self.top()?.clone();
                match target {
                    Value::Object(i) if matches!(self.objects[i], Object::List(_)) => {
                        if let Object::List(list) = &mut self.objects[i] {
                            list.extend(items);
                        }
                    }
                    other => {
                        return Err(format!(
                            "appends to {}; only lists take items",
                            other.kind(&self.objects)
                        ));
                    }
                }
            }
            b's' | b'u' => {
                let items = if op == b's' {
                    let v = self.pop()?;
                    let k = self.pop()?;
                    vec![k, v]
                } else {
                    self.pop_mark()?
                };
                if items.len() % 2 != 0 {
                    return Err("has a key without a value".into());
                }
                let target = self.top()?.clone();
                let dict = self.dict_at(&target, "sets items of")?;
                let mut items = items.into_iter();
                while let (Some(k), Some(v)) = (items.next(), items.next()) {
                    dict.push((k, v));
                }
            }
            b'N' => self.stack.push(Value::None),
            0x88 => self.stack.push(Value::Bool(true)),
            0x89 => self.stack.push(Value::Bool(false)),
            b'J' => {
                let v = i32::from_le_bytes(self.take_array()?);
                self.stack.push(Value::Int(v.into()));
            }
            b'K' => {
                let v = self.take(1)?[0];
                self.stack.push(Value::Int(v.into()));
            }
            b'M' => {
                let v = u16::from_le_bytes(self.take_array()?);
                self.stack.push(Value::Int(v.into()));
            }
            0x8a => {
                let n = usize::from(self.take(1)?[0]);
                if n > 16 {
                    return Err(format!(
                        "holds a {n}-byte integer; at most 16 bytes are read"
                    ));
                }
                let raw = self.take(n)?;
                // Two's complement, little-endian, sign-extended to 128 bits.
                let fill = if raw.last().is_some_and(|b| b & 0x80 != 0) {
                    0xff
                } else {
                    0
                };
                let mut wide = [fill; 16];
                wide[..n].copy_from_slice(raw);
                self.stack.push(Value::Int(i128::from_le_bytes(wide)));
            }
            b'G' => {
                self.take(8)?;
                self.stack.push(Value::Float);
            }
            b'X' => {
                let len = u32::from_le_bytes(self.take_array()?);
                let v = self.text(len.into())?;
                self.stack.push(v);
            }
            0x8c | b'U' => {
                let len = self.take(1)?[0];
                let v = self.text(len.into())?;
                self.stack.push(v);
            }
            0x8d => {
                let len = u64::from_le_bytes(self.take_array()?);
                let v = self.text(len)?;
                self.stack.push(v);
            }
            b'Q' => {
                let pid = self.pop()?;
                let storage = self.persistent_load(pid)?;
                self.stack.push(storage);
            }
            b'h' => {
                let key = self.take(1)?[0];
                self.memo_get(key.into())?;
            }
            b'j' => {
                let key = u32::from_le_bytes(self.take_array()?);
                self.memo_get(key)?;
            }
            b'q' => {
                let key = self.take(1)?[0];
                self.memo_put(key.into())?;
            }
            b'r' => {
                let key = u32::from_le_bytes(self.take_array()?);
                self.memo_put(key)?;
            }
            0x94 => {
                let key = u32::try_from(self.memo.len()).map_err(|_| "overflows the memo")?;
                self.memo_put(key)?;
            }
            _ => {
                return Err(
                    "opcode not supported: a state dict needs only tensors and plain containers, and no pickle code is ever run".into(),
                );
            }
        }
        Ok(true)
    }

    /// BINPERSID: a storage, declared once per key.
    fn persistent_load(&mut self, pid: Value) -> Result<Value, String> {
        let Value::Tuple(pid) = pid else {
            return Err("needs a tuple ('storage', type, key, location, size)".into());
        };
        let items = &pid.items;
        let expected = match self.format {
            Format::Zip => 5,
            Format::Legacy => 6,
        };
        let (
            Some(Value::Str(tag)),
            Some(Value::Global(Global::Storage(ty))),
            Some(Value::Str(key)),
            Some(Value::Str(_location)),
            Some(Value::Int(numel)),
        ) = (
            items.first(),
            items.get(1),
            items.get(2),
            items.get(3),
            items.get(4),
        )
        else {
            return Err("needs a tuple ('storage', storage type, key, location, size)".into());
        };
        if &**tag != "storage" || items.len() != expected {
            return Err(format!(
                "needs a {expected}-tuple starting with 'storage', found {} items starting with {tag:?}",
                items.len()
            ));
        }
        if self.format == Format::Legacy && !matches!(items[5], Value::None) {
            return Err(format!(
                "storage {key} is a view of another storage (PyTorch < 1.0 format); load it with torch and re-save it"
            ));
        }
        let numel = u64::try_from(*numel).map_err(|_| format!("storage {key} has size {numel}"))?;
        let decl = StorageDecl {
            key: key.to_string(),
            ty: *ty,
            numel,
        };
        let index = match self.storage_keys.get(&decl.key) {
            Some(&i) if self.storages[i] == decl => i,
            Some(&i) => {
                let first = &self.storages[i];
                return Err(format!(
                    "storage {key} is declared twice, as {} of {} and as {} of {}",
                    first.ty.name(),
                    first.numel,
                    decl.ty.name(),
                    decl.numel
                ));
            }
            None => {
                self.storage_keys
                    .insert(decl.key.clone(), self.storages.len());
                self.storages.push(decl);
                self.storages.len() - 1
            }
        };
        Ok(Value::Storage(index))
    }

    /// REDUCE: what calling an allowed global means here.
    fn call(&mut self, func: Value, args: &[Value]) -> Result<Value, String> {
        let Value::Global(global) = func else {
            return Err(format!(
                "calls {}; only allowed globals are called",
                func.kind(&self.objects)
            ));
        };
        match global {
            Global::OrderedDict if args.is_empty() => Ok(self.new_object(Object::Dict(Vec::new()))),
            Global::RebuildTensor | Global::RebuildTensorV2 | Global::RebuildTensorV3 => {
                let (min, max) = match global {
                    Global::RebuildTensor => (4, 4),
                    Global::RebuildTensorV2 => (6, 7),
                    _ => (7, 8),
                };
                if !(min..=max).contains(&args.len()) {
                    return Err(format!(
                        "calls a tensor rebuild function with {} arguments, expected {min} to {max}",
                        args.len()
                    ));
                }
                let Value::Storage(storage) = args[0] else {
                    return Err("rebuilds a tensor whose first argument is not a storage".into());
                };
                let ty = self.storages[storage].ty;
                let dtype = match (global, ty) {
                    (Global::RebuildTensorV3, StorageType::Untyped) => match &args[6] {
                        Value::Global(Global::TorchDType { name, dtype }) => dtype.ok_or(*name),
                        _ => {
                            return Err(
                                "rebuilds a tensor whose dtype argument is not a torch dtype"
                                    .into(),
                            );
                        }
                    },
                    (Global::RebuildTensorV3, _) => {
                        return Err(format!(
                            "rebuilds a v3 tensor over a {}, expected an untyped storage",
                            ty.name()
                        ));
                    }
                    (_, StorageType::Typed { name, dtype }) => dtype.ok_or(name),
                    (_, StorageType::Untyped) => {
                        return Err(
                            "rebuilds a tensor over an untyped storage without a dtype".into()
                        );
                    }
                };
                let offset = non_negative(&args[1], "storage offset")?;
                let shape = int_tuple(&args[2], "size")?;
                let strides = int_tuple(&args[3], "stride")?;
                if shape.len() != strides.len() {
                    return Err(format!(
                        "rebuilds a tensor with {} sizes and {} strides",
                        shape.len(),
                        strides.len()
                    ));
                }
                self.tensors.push(TensorDecl {
                    storage,
                    dtype,
                    offset,
                    shape,
                    strides,
                });
                Ok(Value::Tensor(self.tensors.len() - 1))
            }
            Global::RebuildParameter | Global::RebuildParameterWithState => {
                let n = if global == Global::RebuildParameter {
                    3
                } else {
                    4
                };
                match args.first() {
                    Some(Value::Tensor(t)) if args.len() == n => Ok(Value::Tensor(*t)),
                    _ => Err(format!(
                        "rebuilds a parameter from something other than ({n} arguments, the first a tensor)"
                    )),
                }
            }
            Global::OrderedDict | Global::Storage(_) | Global::TorchDType { .. } => Err(format!(
                "calls {} with {} arguments, which a state dict never does",
                global.name(),
                args.len()
            )),
        }
    }
}

fn non_negative(v: &Value, what: &str) -> Result<u64, String> {
    match v {
        Value::Int(i) => u64::try_from(*i).map_err(|_| format!("has {what} {i}")),
        _ => Err(format!("has a {what} that is not an integer")),
    }
}

fn int_tuple(v: &Value, what: &str) -> Result<Vec<u64>, String> {
    match v {
        Value::Tuple(t) => t.items.iter().map(|i| non_negative(i, what)).collect(),
        _ => Err(format!("has a {what} that is not a tuple")),
    }
}

/// The name of a pickle opcode, for messages.
fn opcode_name(op: u8) -> String {
    let name = match op {
        b'(' => "MARK",
        b'.' => "STOP",
        b'0' => "POP",
        b'1' => "POP_MARK",
        b'2' => "DUP",
        b'F' => "FLOAT",
        b'I' => "INT",
        b'J' => "BININT",
        b'K' => "BININT1",
        b'L' => "LONG",
        b'M' => "BININT2",
        b'N' => "NONE",
        b'P' => "PERSID",
        b'Q' => "BINPERSID",
        b'R' => "REDUCE",
        b'S' => "STRING",
        b'T' => "BINSTRING",
        b'U' => "SHORT_BINSTRING",
        b'V' => "UNICODE",
        b'X' => "BINUNICODE",
        b'a' => "APPEND",
        b'b' => "BUILD",
        b'c' => "GLOBAL",
        b'd' => "DICT",
        b'}' => "EMPTY_DICT",
        b'e' => "APPENDS",
        b'g' => "GET",
        b'h' => "BINGET",
        b'i' => "INST",
        b'j' => "LONG_BINGET",
        b'l' => "LIST",
        b']' => "EMPTY_LIST",
        b'o' => "OBJ",
        b'p' => "PUT",
        b'q' => "BINPUT",
        b'r' => "LONG_BINPUT",
        b's' => "SETITEM",
        b't' => "TUPLE",
        b')' => "EMPTY_TUPLE",
        b'u' => "SETITEMS",
        b'G' => "BINFLOAT",
        0x80 => "PROTO",
        0x81 => "NEWOBJ",
        0x82 => "EXT1",
        0x83 => "EXT2",
        0x84 => "EXT4",
        0x85 => "TUPLE1",
        0x86 => "TUPLE2",
        0x87 => "TUPLE3",
        0x88 => "NEWTRUE",
        0x89 => "NEWFALSE",
        0x8a => "LONG1",
        0x8b => "LONG4",
        0x8c => "SHORT_BINUNICODE",
        0x8d => "BINUNICODE8",
        0x8e => "BINBYTES8",
        0x8f => "EMPTY_SET",
        0x90 => "ADDITEMS",
        0x91 => "FROZENSET",
        0x92 => "NEWOBJ_EX",
        0x93 => "STACK_GLOBAL",
        0x94 => "MEMOIZE",
        0x95 => "FRAME",
        0x96 => "BYTEARRAY8",
        0x97 => "NEXT_BUFFER",
        0x98 => "READONLY_BUFFER",
        b'B' => "BINBYTES",
        b'C' => "SHORT_BINBYTES",
        _ => return format!("opcode 0x{op:02x}"),
    };
    name.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `GLOBAL module name` as torch writes it.
    fn global(module: &str, name: &str) -> Vec<u8> {
        format!("c{module}\n{name}\n").into_bytes()
    }

    fn unicode(s: &str) -> Vec<u8> {
        let mut v = vec![b'X'];
        v.extend_from_slice(&(s.len() as u32).to_le_bytes());
        v.extend_from_slice(s.as_bytes());
        v
    }

    /// A protocol-2 pickle of `{name: tensor}` for one F32 tensor over
    /// storage "0" of 12 elements.
    fn state_dict(name: &str, offset: u8, shape: &[u8], stride: &[u8]) -> Vec<u8> {
        let mut p = vec![0x80, 2, b'}', b'(']; // PROTO 2, EMPTY_DICT, MARK
        p.extend(unicode(name));
        p.extend(global("torch._utils", "_rebuild_tensor_v2"));
        p.push(b'(');
        p.push(b'(');
        p.extend(unicode("storage"));
        p.extend(global("torch", "FloatStorage"));
        p.extend(unicode("0"));
        p.extend(unicode("cpu"));
        p.extend([b'K', 12, b't', b'Q', b'K', offset]);
        for dims in [shape, stride] {
            p.push(b'(');
            for &d in dims {
                p.extend([b'K', d]);
            }
            p.push(b't');
        }
        p.push(0x89); // NEWFALSE
        p.extend(global("collections", "OrderedDict"));
        p.extend([b')', b'R', b't', b'R', b'u', b'.']);
        p
    }

    fn run(bytes: &[u8]) -> Result<Unpickled, String> {
        unpickle(bytes, Format::Zip)
    }

    #[test]
    fn rebuilds_a_state_dict_of_one_tensor() {
        let u = run(&state_dict("w", 1, &[3, 2], &[1, 3])).unwrap();
        let Value::Object(root) = u.root else {
            panic!("{:?}", u.root)
        };
        let Object::Dict(items) = &u.objects[root] else {
            panic!()
        };
        assert!(matches!(&items[0], (Value::Str(k), Value::Tensor(0)) if &**k == "w"));
        assert_eq!(
            u.storages,
            [StorageDecl {
                key: "0".into(),
                ty: StorageType::Typed {
                    name: "torch.FloatStorage",
                    dtype: Some(DType::F32)
                },
                numel: 12
            }]
        );
        assert_eq!(
            u.tensors,
            [TensorDecl {
                storage: 0,
                dtype: Ok(DType::F32),
                offset: 1,
                shape: vec![3, 2],
                strides: vec![1, 3]
            }]
        );
        assert_eq!(u.end, state_dict("w", 1, &[3, 2], &[1, 3]).len());
    }

    #[test]
    fn refuses_every_global_outside_the_allowlist_by_name() {
        for (module, name, shown) in [
            ("posix", "system", "posix.system"),
            ("os", "system", "os.system"),
            ("__builtin__", "eval", "__builtin__.eval (builtins.eval)"),
            ("builtins", "exec", "builtins.exec"),
            ("commands", "Popen", "commands.Popen (subprocess.Popen)"),
            ("subprocess", "Popen", "subprocess.Popen"),
            ("torch", "load", "torch.load"),
            (
                "torch._utils",
                "_rebuild_qtensor",
                "torch._utils._rebuild_qtensor",
            ),
        ] {
            let mut p = vec![0x80, 2];
            p.extend(global(module, name));
            p.extend([b'(', b't', b'R', b'.']);
            let e = run(&p).unwrap_err();
            assert!(
                e.starts_with(&format!("byte 2 (GLOBAL): global {shown} is not allowed")),
                "{e}"
            );
            // INST names it too, and STACK_GLOBAL.
            let mut p = vec![0x80, 2, b'('];
            p.extend(format!("i{module}\n{name}\n").into_bytes());
            let e = run(&p).unwrap_err();
            assert!(e.contains(&format!("global {shown} is not allowed")), "{e}");
            let mut p = vec![0x80, 4];
            for s in [module, name] {
                p.extend([0x8c, s.len() as u8]);
                p.extend(s.as_bytes());
            }
            p.extend([0x93, b'.']);
            let e = run(&p).unwrap_err();
            assert!(
                e.contains(&format!("(STACK_GLOBAL): global {shown}")),
                "{e}"
            );
        }
    }

    #[test]
    fn refuses_code_building_opcodes_and_unknown_ones() {
        for (bytes, op) in [
            (&b"\x80\x02\x81."[..], "NEWOBJ"),
            (b"\x80\x02\x92.", "NEWOBJ_EX"),
            (b"\x80\x02o.", "OBJ"),
            (b"\x80\x02\x82\x01.", "EXT1"),
            (b"\x80\x02P1\n.", "PERSID"),
            (b"\x80\x02\x8f.", "EMPTY_SET"),
            (b"\x80\x02\xff.", "opcode 0xff"),
        ] {
            let e = run(bytes).unwrap_err();
            assert!(
                e.starts_with(&format!("byte 2 ({op}): opcode not supported")),
                "{e}"
            );
        }
    }

    #[test]
    fn truncation_and_stack_abuse_are_errors() {
        let full = state_dict("w", 0, &[3, 4], &[4, 1]);
        for cut in 0..full.len() {
            assert!(run(&full[..cut]).is_err(), "cut at {cut}");
        }
        for (bytes, why) in [
            (&b"\x80\x02."[..], "the stack is empty"),
            (b"\x80\x02t.", "has no MARK"),
            (b"\x80\x02h\x07.", "memo entry 7, which was never stored"),
            (b"\x80\x02q\x00.", "needs a value on the stack"),
            (
                b"\x80\x02X\xff\xff\xff\xff",
                "needs 4294967295 bytes, 0 remain",
            ),
            (b"\x80\x02\x8a\x20", "32-byte integer"),
            (b"\x80\x01.", "protocol 1"),
            (b"\x80\x02N)R.", "calls None"),
            (b"\x80\x02K\x01K\x02a.", "appends to an int"),
            (b"\x80\x02]K\x01K\x02s.", "sets items of a list"),
            (b"\x80\x02K\x01Nb.", "builds an int"),
        ] {
            let e = run(bytes).unwrap_err();
            assert!(e.contains(why), "{bytes:?}: {e}");
        }
    }

    #[test]
    fn deep_tuples_are_refused_before_they_could_overflow_a_drop() {
        let mut p = vec![0x80, 2, b')'];
        p.extend(std::iter::repeat_n(0x85, 100_000)); // TUPLE1, nesting each time
        p.push(b'.');
        let e = run(&p).unwrap_err();
        assert!(e.contains("tuples nest more than 32 deep"), "{e}");
    }

    #[test]
    fn memo_references_share_and_cycles_cost_nothing() {
        // A list appended to itself 10_000 times through the memo: ten
        // thousand indices, no copies, and unpickling ends.
        let mut p = vec![0x80, 2, b']', b'q', 0];
        for _ in 0..10_000 {
            p.extend([b'h', 0, b'a']);
        }
        p.push(b'.');
        let u = run(&p).unwrap();
        let Object::List(items) = &u.objects[0] else {
            panic!()
        };
        assert_eq!(items.len(), 10_000);
        assert_eq!(u.objects.len(), 1);
    }

    #[test]
    fn persistent_ids_are_checked() {
        let mut p = vec![0x80, 2, b'(', b'K', 1, b't', b'Q', b'.'];
        let e = run(&p).unwrap_err();
        assert!(e.contains("(BINPERSID): needs a tuple ('storage'"), "{e}");
        // The same key declared with two types.
        p = vec![0x80, 2, b'('];
        for ty in ["FloatStorage", "LongStorage"] {
            p.push(b'(');
            p.extend(unicode("storage"));
            p.extend(global("torch", ty));
            p.extend(unicode("0"));
            p.extend(unicode("cpu"));
            p.extend([b'K', 2, b't', b'Q']);
        }
        p.extend([b't', b'.']);
        let e = run(&p).unwrap_err();
        assert!(
            e.contains("storage 0 is declared twice, as torch.FloatStorage of 2 and as torch.LongStorage of 2"),
            "{e}"
        );
    }

    #[test]
    fn legacy_ints_and_strings() {
        // LONG1 of the legacy magic number, then SHORT_BINSTRING and
        // BINUNICODE8 strings in a tuple.
        let mut p = vec![0x80, 2, b'(', 0x8a, 10];
        p.extend_from_slice(&0x1950a86a20f9469cfc6c_i128.to_le_bytes()[..10]);
        p.extend([0x8a, 1, 0xff, b'U', 2, b'h', b'i', 0x8d]);
        p.extend(2u64.to_le_bytes());
        p.extend(b"yo");
        p.extend([b'J', 0xfe, 0xff, 0xff, 0xff, b'M', 1, 1, b'G']);
        p.extend(1.5f64.to_be_bytes());
        p.extend([0x88, b'N', b't', b'.']);
        let u = unpickle(&p, Format::Legacy).unwrap();
        let Value::Tuple(t) = u.root else { panic!() };
        assert!(matches!(t.items[0], Value::Int(0x1950a86a20f9469cfc6c)));
        assert!(matches!(t.items[1], Value::Int(-1)));
        assert!(matches!(&t.items[2], Value::Str(s) if &**s == "hi"));
        assert!(matches!(&t.items[3], Value::Str(s) if &**s == "yo"));
        assert!(matches!(t.items[4], Value::Int(-2)));
        assert!(matches!(t.items[5], Value::Int(257)));
        assert!(matches!(t.items[6], Value::Float));
        assert!(matches!(t.items[7], Value::Bool(true)));
        assert!(matches!(t.items[8], Value::None));
    }
}
