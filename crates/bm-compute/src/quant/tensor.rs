//! [`QuantizedTensor`]: a linear layer's weight in a bitsandbytes format,
//! as the plain byte buffers bitsandbytes stores, and its exchange with
//! transformers' safetensors key layout.

use std::borrow::Cow;
use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;

use bm_tensor::{DType, HostBuffer, TensorMeta};
use serde_json::{Map, Value};

use super::format::{self, FourBitType, NESTED_BLOCK_SIZE};
use crate::{Error, HostBytes, Tensor};

/// How a weight is quantized.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum QuantFormat {
    /// bitsandbytes' 4-bit blockwise format (`Linear4bit`, `Params4bit`).
    FourBit {
        /// NF4 or FP4.
        kind: FourBitType,
        /// Values sharing one absmax scale (64 in transformers and Accelerate).
        blocksize: usize,
        /// Whether the absmax scales are themselves quantized to 8 bits
        /// (`bnb_4bit_use_double_quant`, bitsandbytes' `compress_statistics`).
        double_quant: bool,
    },
    /// LLM.int8()'s weight format (`Linear8bitLt`, `Int8Params`): int8
    /// values with one absmax scale per output row (`SCB`).
    Int8 {
        /// The outlier threshold of LLM.int8()'s mixed-precision matmul
        /// (`llm_int8_threshold`, 6.0 by default): activation columns with
        /// a value at or above it are multiplied in the activation dtype;
        /// 0 quantizes every column.
        threshold: f32,
    },
}

impl QuantFormat {
    /// Bytes a `[rows, cols]` weight takes in this format, every part
    /// included: what [`QuantizedTensor::byte_len`] reports once it is
    /// quantized, and what a planner should size the weight by.
    pub fn byte_len(&self, rows: usize, cols: usize) -> usize {
        let n = rows * cols;
        match *self {
            QuantFormat::FourBit {
                blocksize,
                double_quant,
                ..
            } => {
                let blocks = n.div_ceil(blocksize);
                let scales = if double_quant {
                    // Code per block, nested absmax, nested map, offset.
                    blocks + 4 * blocks.div_ceil(NESTED_BLOCK_SIZE) + 4 * 256 + 4
                } else {
                    4 * blocks
                };
                n.div_ceil(2) + scales
            }
            QuantFormat::Int8 { .. } => n + 4 * rows,
        }
    }
}

/// Little-endian f32 values in host bytes, kept 4-byte aligned (a mapped
/// checkpoint may place them anywhere; misaligned ones are copied once).
#[derive(Debug)]
pub(crate) struct F32s(HostBytes);

impl F32s {
    pub(crate) fn new(bytes: HostBytes) -> Result<F32s, Error> {
        let b = bytes.as_bytes();
        debug_assert_eq!(b.len() % 4, 0);
        if b.as_ptr().align_offset(4) == 0 {
            Ok(F32s(bytes))
        } else {
            Ok(F32s(HostBytes::Owned(HostBuffer::from_bytes(b)?)))
        }
    }

    pub(crate) fn from_values(values: &[f32]) -> Result<F32s, Error> {
        F32s::new(HostBytes::Owned(HostBuffer::from_bytes(
            bytemuck::cast_slice(values),
        )?))
    }

    pub(crate) fn get(&self) -> &[f32] {
        bytemuck::cast_slice(self.0.as_bytes())
    }

    pub(crate) fn bytes(&self) -> &[u8] {
        self.0.as_bytes()
    }
}

/// The per-block scales of a 4-bit weight.
#[derive(Debug)]
pub(crate) enum Scales {
    /// One f32 absmax per block.
    Plain(F32s),
    /// Double quantization: block `b`'s scale is
    /// `map[codes[b]] * absmax[b / 256] + offset`.
    Nested {
        codes: HostBytes,
        absmax: F32s,
        map: F32s,
        offset: f32,
    },
}

/// A 4-bit weight's parts.
#[derive(Debug)]
pub(crate) struct FourBit {
    pub(crate) kind: FourBitType,
    pub(crate) blocksize: usize,
    /// Two codes a byte, the first in the high nibble, over the flattened
    /// weight; an odd count ends with a padding nibble.
    pub(crate) packed: HostBytes,
    pub(crate) scales: Scales,
}

impl FourBit {
    /// The absmax of block `b`, as bitsandbytes recovers it (f32 multiply,
    /// then f32 add of the offset).
    pub(crate) fn scale(&self, b: usize) -> f32 {
        match &self.scales {
            Scales::Plain(absmax) => absmax.get()[b],
            Scales::Nested {
                codes,
                absmax,
                map,
                offset,
            } => {
                map.get()[codes.as_bytes()[b] as usize] * absmax.get()[b / NESTED_BLOCK_SIZE]
                    + offset
            }
        }
    }

    /// The weight as the CPU kernels read it, in place.
    pub(crate) fn kernel_view(&self) -> crate::cpu::FourBitWeight<'_> {
        crate::cpu::FourBitWeight {
            packed: self.packed.as_bytes(),
            code: self.kind.code(),
            blocksize: self.blocksize,
            scales: self,
        }
    }

    /// Elements `start..start + out.len()` of the flattened weight.
    fn dequantize_range(&self, start: usize, out: &mut [f32]) {
        let pairs = self.kind.byte_pairs();
        let packed = self.packed.as_bytes();
        let end = start + out.len();
        let mut at = start;
        let mut done = 0;
        while at < end {
            let block = at / self.blocksize;
            let stop = ((block + 1) * self.blocksize).min(end);
            let scale = self.scale(block);
            decode_nibbles(packed, at, pairs, scale, &mut out[done..done + stop - at]);
            done += stop - at;
            at = stop;
        }
    }
}

impl crate::cpu::BlockScales for FourBit {
    fn scales_into(&self, blocks: Range<usize>, out: &mut [f32]) {
        match &self.scales {
            Scales::Plain(absmax) => out.copy_from_slice(&absmax.get()[blocks]),
            // `scale`'s formula, with the parts borrowed once.
            Scales::Nested {
                codes,
                absmax,
                map,
                offset,
            } => {
                let (codes, absmax, map) = (codes.as_bytes(), absmax.get(), map.get());
                let map: &[f32; 256] = map.try_into().expect("the nested map has 256 values");
                for (o, b) in out.iter_mut().zip(blocks) {
                    *o = map[usize::from(codes[b])] * absmax[b / NESTED_BLOCK_SIZE] + offset;
                }
            }
        }
    }
}

/// `out[i] = code[nibble(first + i)] * scale`, where `pairs[byte]` holds
/// the codes of a byte's high and low nibble: one table load per byte, then
/// one vectorised multiply.
fn decode_nibbles(
    packed: &[u8],
    first: usize,
    pairs: &[[f32; 2]; 256],
    scale: f32,
    out: &mut [f32],
) {
    let (mut at, mut rest) = (first, &mut out[..]);
    if at % 2 == 1 && !rest.is_empty() {
        let (head, tail) = rest.split_at_mut(1);
        head[0] = pairs[packed[at / 2] as usize][1];
        (at, rest) = (at + 1, tail);
    }
    let bytes = rest.len() / 2;
    let (body, tail) = rest.split_at_mut(2 * bytes);
    let body: &mut [[f32; 2]] = bytemuck::cast_slice_mut(body);
    for (o, &byte) in body.iter_mut().zip(&packed[at / 2..at / 2 + bytes]) {
        *o = pairs[byte as usize];
    }
    // An odd count ends on a high nibble.
    if let [last] = tail {
        *last = pairs[packed[at / 2 + bytes] as usize][0];
    }
    for v in out.iter_mut() {
        *v *= scale;
    }
}

/// An 8-bit weight's parts.
#[derive(Debug)]
pub(crate) struct Int8 {
    /// `[rows, cols]` int8 values, row-major.
    pub(crate) codes: HostBytes,
    /// Each row's absmax (`SCB`).
    pub(crate) scb: F32s,
    pub(crate) threshold: f32,
}

/// What `int8_vectorwise_dequant` multiplies by: 1/127 as bitsandbytes
/// writes it, rounded to f32.
#[allow(clippy::excessive_precision)]
pub(crate) const INV_127: f32 = 7.874_015_718_698_502e-3;

/// `1 / 127²` as bitsandbytes writes it in `int8_mm_dequant`.
pub(crate) const INV_127_SQUARED: f32 = 6.200124e-05;

impl Int8 {
    pub(crate) fn codes(&self) -> &[i8] {
        bytemuck::cast_slice(self.codes.as_bytes())
    }
}

#[derive(Debug)]
pub(crate) enum Data {
    FourBit(FourBit),
    Int8(Int8),
}

/// A linear layer's weight (`[out_features, in_features]`) quantized in a
/// bitsandbytes format.
///
/// Its parts are plain byte buffers ([`HostBytes`]): owned after
/// quantizing, or zero-copy windows of a mapped checkpoint written by
/// transformers, or bytes shared with whoever streams them. Nothing here
/// ever holds the weight dequantized: the matmul
/// ([`linear_quantized`](super::linear_quantized)) dequantizes a few rows
/// at a time into a per-thread buffer.
#[derive(Debug)]
pub struct QuantizedTensor {
    pub(crate) shape: [usize; 2],
    pub(crate) dtype: DType,
    pub(crate) compute_dtype: Option<DType>,
    pub(crate) data: Data,
}

/// One safetensors entry of a quantized weight, in transformers' layout.
#[derive(Debug)]
pub struct PackedEntry<'a> {
    /// Its key (`model.layers.0.mlp.up_proj.weight.absmax`).
    pub name: String,
    /// Dtype and shape as transformers writes them.
    pub meta: TensorMeta,
    /// The bytes.
    pub bytes: Cow<'a, [u8]>,
}

/// A safetensors entry read from a checkpoint, for
/// [`QuantizedTensor::from_entries`].
#[derive(Debug)]
pub struct Entry {
    /// Dtype and shape as stored.
    pub meta: TensorMeta,
    /// The bytes (a mapped view, usually).
    pub bytes: HostBytes,
}

/// The key of the packed non-tensor quant state of a 4-bit weight.
fn quant_state_key(weight: &str, kind: FourBitType) -> String {
    format!("{weight}.quant_state.bitsandbytes__{}", kind.name())
}

/// The module of a weight (`x.weight` -> `x`), where 8-bit state lives.
fn module_of(weight: &str) -> &str {
    weight.strip_suffix(".weight").unwrap_or(weight)
}

impl QuantizedTensor {
    /// The format.
    pub fn format(&self) -> QuantFormat {
        match &self.data {
            Data::FourBit(fb) => QuantFormat::FourBit {
                kind: fb.kind,
                blocksize: fb.blocksize,
                double_quant: matches!(fb.scales, Scales::Nested { .. }),
            },
            Data::Int8(i) => QuantFormat::Int8 {
                threshold: i.threshold,
            },
        }
    }

    /// The logical shape, `[out_features, in_features]`.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// The dtype the weight had when it was quantized (bitsandbytes keeps
    /// it in the quant state; 8-bit weights went through float16).
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The dtype a 4-bit matmul computes in (`bnb_4bit_compute_dtype`);
    /// `None` computes in the activation dtype.
    pub fn compute_dtype(&self) -> Option<DType> {
        self.compute_dtype
    }

    /// Sets the 4-bit compute dtype (F32, F16 or BF16; `None`: the
    /// activation's). Ignored by 8-bit weights, which compute as
    /// LLM.int8() does.
    pub fn set_compute_dtype(&mut self, dtype: Option<DType>) -> Result<(), Error> {
        if let Some(d) = dtype {
            crate::ops::check_compute_dtype("4-bit compute dtype", d)?;
        }
        self.compute_dtype = dtype;
        Ok(())
    }

    /// Bytes held, every part included (`QuantFormat::byte_len`).
    pub fn byte_len(&self) -> usize {
        match &self.data {
            Data::FourBit(fb) => {
                fb.packed.as_bytes().len()
                    + match &fb.scales {
                        Scales::Plain(a) => a.bytes().len(),
                        Scales::Nested {
                            codes, absmax, map, ..
                        } => codes.as_bytes().len() + absmax.bytes().len() + map.bytes().len() + 4,
                    }
            }
            Data::Int8(i) => i.codes.as_bytes().len() + i.scb.bytes().len(),
        }
    }

    /// Rows `start..end` dequantized to f32 in `out` (`(end - start) *
    /// in_features` values) as bitsandbytes dequantizes: 4-bit
    /// `code * absmax` in f32, 8-bit `value * SCB * (1/127)` in f32.
    pub(crate) fn dequantize_rows(&self, start: usize, end: usize, out: &mut [f32]) {
        let cols = self.shape[1];
        debug_assert_eq!(out.len(), (end - start) * cols);
        match &self.data {
            Data::FourBit(fb) => fb.dequantize_range(start * cols, out),
            Data::Int8(i) => {
                let scb = i.scb.get();
                for ((o, c), r) in out
                    .chunks_exact_mut(cols)
                    .zip(i.codes()[start * cols..end * cols].chunks_exact(cols))
                    .zip(start..end)
                {
                    for (o, &c) in o.iter_mut().zip(c) {
                        *o = c as f32 * scb[r] * INV_127;
                    }
                }
            }
        }
    }

    /// The whole weight dequantized to `dtype` (bitsandbytes'
    /// `dequantize_4bit` / `int8_vectorwise_dequant`, then `.to(dtype)`).
    /// A full copy: for inspection and tests; the matmul never makes one.
    pub fn dequantize(&self, dtype: DType) -> Result<Tensor, Error> {
        let [rows, _] = self.shape;
        Tensor::build(dtype, &self.shape, |out| self.dequantize_rows(0, rows, out))
    }

    /// The whole weight dequantized on `gpu` to `dtype` by bitsandbytes'
    /// dequantization kernels (its packed parts uploaded first): bit for
    /// bit [`QuantizedTensor::dequantize`]. A full copy on the GPU, as
    /// bitsandbytes makes for a 4-bit matmul of more than one row.
    pub fn dequantize_on(&self, gpu: &bm_device::Gpu, dtype: DType) -> Result<Tensor, Error> {
        crate::cuda::dequantize(self, gpu, dtype)
    }

    /// Reads a weight stored by transformers from a bitsandbytes model:
    /// `entries` maps keys to what the checkpoint holds (at least the keys
    /// of [`QuantizedTensor::state_keys`] that exist); the ones used are
    /// removed. `None` when `weight` has no quant state (a module left
    /// unquantized). `compute_dtype` and `threshold` come from the
    /// checkpoint's `quantization_config`. Missing or inconsistent parts
    /// are errors naming the weight and the part.
    pub fn from_entries(
        weight: &str,
        entries: &mut HashMap<String, Entry>,
        compute_dtype: Option<DType>,
        threshold: f32,
    ) -> Result<Option<QuantizedTensor>, Error> {
        let states: Vec<FourBitType> = [FourBitType::Nf4, FourBitType::Fp4]
            .into_iter()
            .filter(|k| entries.contains_key(&quant_state_key(weight, *k)))
            .collect();
        let scb_key = format!("{}.SCB", module_of(weight));
        match (states.as_slice(), entries.contains_key(&scb_key)) {
            ([], false) => Ok(None),
            ([kind], false) => {
                let mut q = read_four_bit(weight, *kind, entries)?;
                q.set_compute_dtype(compute_dtype)?;
                Ok(Some(q))
            }
            ([], true) => read_int8(weight, entries, threshold).map(Some),
            _ => Err(state_error(
                weight,
                "quant_state",
                "has more than one quant state (nf4, fp4 and 8-bit SCB are exclusive)",
            )),
        }
    }

    /// Every key a bitsandbytes quant state of `weight` may use in a
    /// transformers checkpoint (the weight itself included).
    pub fn state_keys(weight: &str) -> Vec<String> {
        let module = module_of(weight);
        let mut keys = vec![weight.to_string()];
        keys.extend(
            ["absmax", "quant_map", "nested_absmax", "nested_quant_map"]
                .map(|s| format!("{weight}.{s}")),
        );
        keys.extend([FourBitType::Nf4, FourBitType::Fp4].map(|k| quant_state_key(weight, k)));
        keys.extend([format!("{module}.SCB"), format!("{module}.weight_format")]);
        keys
    }

    /// The weight a quant-state entry of a transformers checkpoint belongs
    /// to (`<w>.absmax`, `<w>.quant_map`, `<w>.nested_absmax`,
    /// `<w>.nested_quant_map`, `<w>.quant_state.bitsandbytes__*`,
    /// `<module>.SCB`, `<module>.weight_format`), with the field's name;
    /// `None` for any other name (the weight itself included).
    pub fn state_owner(entry: &str) -> Option<(String, &'static str)> {
        const WEIGHT_PARTS: [(&str, &str); 5] = [
            (".quant_state.bitsandbytes__", "quant_state"),
            (".nested_absmax", "nested_absmax"),
            (".nested_quant_map", "nested_quant_map"),
            (".absmax", "absmax"),
            (".quant_map", "quant_map"),
        ];
        for (part, field) in WEIGHT_PARTS {
            if let Some((weight, rest)) = entry.split_once(part)
                && (rest.is_empty() || part.ends_with("__"))
            {
                return Some((weight.to_string(), field));
            }
        }
        for (suffix, field) in [(".SCB", "SCB"), (".weight_format", "weight_format")] {
            if let Some(module) = entry.strip_suffix(suffix) {
                return Some((format!("{module}.weight"), field));
            }
        }
        None
    }

    /// The entries transformers writes for this weight (`save_pretrained`
    /// of a bitsandbytes model), which `from_pretrained` reads back.
    pub fn to_entries(&self, weight: &str) -> Vec<PackedEntry<'_>> {
        let entry = |name: String, dtype, shape: Vec<usize>, bytes| PackedEntry {
            name,
            meta: TensorMeta::new(dtype, shape),
            bytes,
        };
        match &self.data {
            Data::FourBit(fb) => {
                let packed = fb.packed.as_bytes();
                let mut out = vec![entry(
                    weight.to_string(),
                    DType::U8,
                    vec![packed.len(), 1],
                    Cow::Borrowed(packed),
                )];
                let blocks = self.numel().div_ceil(fb.blocksize);
                let mut state = Map::new();
                state.insert("quant_type".into(), fb.kind.name().into());
                state.insert("blocksize".into(), fb.blocksize.into());
                state.insert(
                    "dtype".into(),
                    format::dtype_name(self.dtype).unwrap_or("float32").into(),
                );
                state.insert("shape".into(), self.shape.to_vec().into());
                match &fb.scales {
                    Scales::Plain(absmax) => out.push(entry(
                        format!("{weight}.absmax"),
                        DType::F32,
                        vec![blocks],
                        Cow::Borrowed(absmax.bytes()),
                    )),
                    Scales::Nested {
                        codes,
                        absmax,
                        map,
                        offset,
                    } => {
                        out.push(entry(
                            format!("{weight}.absmax"),
                            DType::U8,
                            vec![blocks],
                            Cow::Borrowed(codes.as_bytes()),
                        ));
                        out.push(entry(
                            format!("{weight}.nested_absmax"),
                            DType::F32,
                            vec![absmax.get().len()],
                            Cow::Borrowed(absmax.bytes()),
                        ));
                        out.push(entry(
                            format!("{weight}.nested_quant_map"),
                            DType::F32,
                            vec![256],
                            Cow::Borrowed(map.bytes()),
                        ));
                        state.insert("nested_blocksize".into(), NESTED_BLOCK_SIZE.into());
                        state.insert("nested_dtype".into(), "float32".into());
                        state.insert("nested_offset".into(), f64::from(*offset).into());
                    }
                }
                out.push(entry(
                    format!("{weight}.quant_map"),
                    DType::F32,
                    vec![16],
                    Cow::Owned(bytemuck::cast_slice(&fb.kind.code()).to_vec()),
                ));
                let json = python_json(&Value::Object(state)).into_bytes();
                out.push(entry(
                    quant_state_key(weight, fb.kind),
                    DType::U8,
                    vec![json.len()],
                    Cow::Owned(json),
                ));
                out
            }
            Data::Int8(i) => {
                let module = module_of(weight);
                vec![
                    entry(
                        weight.to_string(),
                        DType::I8,
                        self.shape.to_vec(),
                        Cow::Borrowed(i.codes.as_bytes()),
                    ),
                    entry(
                        format!("{module}.SCB"),
                        DType::F32,
                        vec![self.shape[0]],
                        Cow::Borrowed(i.scb.bytes()),
                    ),
                    // "row", the only layout bitsandbytes still loads.
                    entry(
                        format!("{module}.weight_format"),
                        DType::U8,
                        vec![],
                        Cow::Owned(vec![0]),
                    ),
                ]
            }
        }
    }

    /// The weight as one byte buffer of [`QuantizedTensor::byte_len`]
    /// bytes, the form a dispatcher holds, offloads and streams: the f32
    /// parts first (so they stay aligned), then the byte parts. 4-bit:
    /// `absmax` then the codes; with double quantization the offset, the
    /// nested absmax, the nested map, the absmax codes, then the codes.
    /// 8-bit: `SCB`, then the int8 values.
    /// [`QuantizedTensor::from_packed`] reads it back without a copy.
    pub fn to_packed(&self) -> Result<HostBuffer, Error> {
        let mut out = Vec::with_capacity(self.byte_len());
        match &self.data {
            Data::FourBit(fb) => {
                match &fb.scales {
                    Scales::Plain(absmax) => out.extend_from_slice(absmax.bytes()),
                    Scales::Nested {
                        codes,
                        absmax,
                        map,
                        offset,
                    } => {
                        out.extend_from_slice(&offset.to_le_bytes());
                        out.extend_from_slice(absmax.bytes());
                        out.extend_from_slice(map.bytes());
                        out.extend_from_slice(codes.as_bytes());
                    }
                }
                out.extend_from_slice(fb.packed.as_bytes());
            }
            Data::Int8(i) => {
                out.extend_from_slice(i.scb.bytes());
                out.extend_from_slice(i.codes.as_bytes());
            }
        }
        debug_assert_eq!(out.len(), self.byte_len());
        Ok(HostBuffer::from_bytes(&out)?)
    }

    /// Reads the form [`QuantizedTensor::to_packed`] writes: a `[rows,
    /// cols]` weight quantized from `dtype` in `format`. Its parts are
    /// windows of `bytes` (f32 parts are copied once if `bytes` is not
    /// 4-byte aligned). `name` names the weight in errors.
    pub fn from_packed(
        name: &str,
        format: QuantFormat,
        shape: [usize; 2],
        dtype: DType,
        bytes: HostBytes,
    ) -> Result<QuantizedTensor, Error> {
        // Before any size is computed from it (a block size of 0 divides).
        if let QuantFormat::FourBit { blocksize, .. } = format {
            format::check_four_bit_block_size(blocksize)
                .map_err(|e| state_error(name, "blocksize", e.to_string()))?;
        }
        let [rows, cols] = shape;
        let want = format.byte_len(rows, cols);
        if rows == 0 || cols == 0 || bytes.as_bytes().len() != want {
            return Err(state_error(
                name,
                "packed",
                format!(
                    "{} bytes for a {shape:?} {format:?} weight, expected {want}",
                    bytes.as_bytes().len()
                ),
            ));
        }
        let whole = Arc::new(bytes);
        let part = |range: Range<usize>| {
            HostBytes::Shared(Arc::new(Window {
                whole: whole.clone(),
                range,
            }))
        };
        let data = match (format, packed_layout(format, shape)) {
            (
                QuantFormat::FourBit {
                    kind, blocksize, ..
                },
                PackedLayout::FourBit { absmax, codes },
            ) => Data::FourBit(FourBit {
                kind,
                blocksize,
                packed: part(codes),
                scales: Scales::Plain(F32s::new(part(absmax))?),
            }),
            (
                QuantFormat::FourBit {
                    kind, blocksize, ..
                },
                PackedLayout::Nested {
                    offset,
                    nested,
                    map,
                    absmax_codes,
                    codes,
                },
            ) => Data::FourBit(FourBit {
                kind,
                blocksize,
                packed: part(codes),
                scales: Scales::Nested {
                    offset: F32s::new(part(offset))?.get()[0],
                    absmax: F32s::new(part(nested))?,
                    map: F32s::new(part(map))?,
                    codes: part(absmax_codes),
                },
            }),
            (QuantFormat::Int8 { threshold }, PackedLayout::Int8 { scb, codes }) => {
                Data::Int8(Int8 {
                    scb: F32s::new(part(scb))?,
                    codes: part(codes),
                    threshold,
                })
            }
            _ => unreachable!("packed_layout follows the format"),
        };
        Ok(QuantizedTensor {
            shape,
            dtype: if matches!(format, QuantFormat::Int8 { .. }) {
                DType::F16
            } else {
                dtype
            },
            compute_dtype: None,
            data,
        })
    }

    pub(crate) fn numel(&self) -> usize {
        self.shape[0] * self.shape[1]
    }
}

/// Byte ranges of a weight's parts in its packed form: the one statement
/// of the layout [`QuantizedTensor::to_packed`] writes, read by
/// [`QuantizedTensor::from_packed`] and by the GPU matmul.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum PackedLayout {
    /// 4-bit, one f32 absmax per block.
    FourBit {
        absmax: Range<usize>,
        codes: Range<usize>,
    },
    /// 4-bit with double quantization.
    Nested {
        offset: Range<usize>,
        nested: Range<usize>,
        map: Range<usize>,
        absmax_codes: Range<usize>,
        codes: Range<usize>,
    },
    /// LLM.int8().
    Int8 {
        scb: Range<usize>,
        codes: Range<usize>,
    },
}

/// The packed layout of a `[rows, cols]` weight in `format`: the f32 parts
/// first (so they stay aligned), then the byte parts.
pub(crate) fn packed_layout(format: QuantFormat, [rows, cols]: [usize; 2]) -> PackedLayout {
    let n = rows * cols;
    let mut at = 0;
    let mut next = |len: usize| {
        at += len;
        at - len..at
    };
    match format {
        QuantFormat::FourBit {
            blocksize,
            double_quant: false,
            ..
        } => PackedLayout::FourBit {
            absmax: next(4 * n.div_ceil(blocksize)),
            codes: next(n.div_ceil(2)),
        },
        QuantFormat::FourBit {
            blocksize,
            double_quant: true,
            ..
        } => {
            let blocks = n.div_ceil(blocksize);
            PackedLayout::Nested {
                offset: next(4),
                nested: next(4 * blocks.div_ceil(NESTED_BLOCK_SIZE)),
                map: next(4 * 256),
                absmax_codes: next(blocks),
                codes: next(n.div_ceil(2)),
            }
        }
        QuantFormat::Int8 { .. } => PackedLayout::Int8 {
            scb: next(4 * rows),
            codes: next(n),
        },
    }
}

/// A window of bytes another part of the weight shares.
struct Window {
    whole: Arc<HostBytes>,
    range: std::ops::Range<usize>,
}

impl AsRef<[u8]> for Window {
    fn as_ref(&self) -> &[u8] {
        &self.whole.as_bytes()[self.range.clone()]
    }
}

pub(crate) fn state_error(weight: &str, field: &str, message: impl Into<String>) -> Error {
    Error::QuantState {
        tensor: weight.to_string(),
        field: field.to_string(),
        message: message.into(),
    }
}

/// Takes entry `key` out of `entries`, or says it is missing.
fn take(
    weight: &str,
    entries: &mut HashMap<String, Entry>,
    key: &str,
    field: &str,
) -> Result<Entry, Error> {
    entries
        .remove(key)
        .ok_or_else(|| state_error(weight, field, format!("entry {key} is missing")))
}

/// Checks an entry's dtype and element count.
fn expect(weight: &str, field: &str, e: &Entry, dtype: DType, numel: usize) -> Result<(), Error> {
    if e.meta.dtype != dtype || e.meta.checked_numel() != Some(numel) {
        return Err(state_error(
            weight,
            field,
            format!(
                "expected {dtype} with {numel} values, found {} {:?}",
                e.meta.dtype, e.meta.shape
            ),
        ));
    }
    Ok(())
}

/// f32 values that must equal `want` bit for bit.
fn expect_table(
    weight: &str,
    field: &str,
    e: &Entry,
    want: &[f32],
    what: &str,
) -> Result<(), Error> {
    expect(weight, field, e, DType::F32, want.len())?;
    let same = e
        .bytes
        .as_bytes()
        .chunks_exact(4)
        .zip(want)
        .all(|(b, w)| u32::from_le_bytes([b[0], b[1], b[2], b[3]]) == w.to_bits());
    if !same {
        return Err(state_error(
            weight,
            field,
            format!("does not match {what} (bitsandbytes dequantizes with its built-in table)"),
        ));
    }
    Ok(())
}

fn read_four_bit(
    weight: &str,
    kind: FourBitType,
    entries: &mut HashMap<String, Entry>,
) -> Result<QuantizedTensor, Error> {
    let state_entry = take(
        weight,
        entries,
        &quant_state_key(weight, kind),
        "quant_state",
    )?;
    let state = parse_state(weight, &state_entry)?;
    let field = |key: &str| {
        state
            .get(key)
            .ok_or_else(|| state_error(weight, key, "missing from the quant state"))
    };
    let usize_field = |key: &str| {
        field(key)?
            .as_u64()
            .map(|n| n as usize)
            .ok_or_else(|| state_error(weight, key, "expected an integer"))
    };
    let quant_type = field("quant_type")?.as_str().unwrap_or_default();
    if quant_type != kind.name() {
        return Err(state_error(
            weight,
            "quant_type",
            format!(
                "{quant_type:?} differs from the entry's suffix bitsandbytes__{}",
                kind.name()
            ),
        ));
    }
    let blocksize = usize_field("blocksize")?;
    format::check_four_bit_block_size(blocksize)
        .map_err(|e| state_error(weight, "blocksize", e.to_string()))?;
    let dtype = field("dtype")?
        .as_str()
        .and_then(format::dtype_from_name)
        .ok_or_else(|| state_error(weight, "dtype", "expected float32, float16 or bfloat16"))?;
    let shape = parse_shape(weight, field("shape")?)?;
    let numel = shape[0] * shape[1];
    let blocks = numel.div_ceil(blocksize);

    let packed = take(weight, entries, weight, "weight")?;
    if packed.bytes.as_bytes().len() != numel.div_ceil(2) {
        return Err(state_error(
            weight,
            "weight",
            format!(
                "{} packed bytes ({} {:?}) for a {shape:?} weight, expected {}",
                packed.bytes.as_bytes().len(),
                packed.meta.dtype,
                packed.meta.shape,
                numel.div_ceil(2)
            ),
        ));
    }
    let quant_map = take(weight, entries, &format!("{weight}.quant_map"), "quant_map")?;
    expect_table(
        weight,
        "quant_map",
        &quant_map,
        &kind.code(),
        &format!("the {} table", kind.name()),
    )?;
    let absmax = take(weight, entries, &format!("{weight}.absmax"), "absmax")?;
    let nested_keys = [
        format!("{weight}.nested_absmax"),
        format!("{weight}.nested_quant_map"),
    ];
    let nested_in_state = state.contains_key("nested_offset");
    let scales = if nested_in_state {
        let nested_blocksize = usize_field("nested_blocksize")?;
        if nested_blocksize != NESTED_BLOCK_SIZE {
            return Err(state_error(
                weight,
                "nested_blocksize",
                format!(
                    "{nested_blocksize} is not supported (bitsandbytes' matmul needs {NESTED_BLOCK_SIZE})"
                ),
            ));
        }
        if field("nested_dtype")?.as_str() != Some("float32") {
            return Err(state_error(weight, "nested_dtype", "expected float32"));
        }
        let offset = field("nested_offset")?
            .as_f64()
            .map(|v| v as f32)
            .filter(|v| v.is_finite())
            .ok_or_else(|| state_error(weight, "nested_offset", "expected a finite number"))?;
        expect(weight, "absmax", &absmax, DType::U8, blocks)?;
        let nested_absmax = take(weight, entries, &nested_keys[0], "nested_absmax")?;
        expect(
            weight,
            "nested_absmax",
            &nested_absmax,
            DType::F32,
            blocks.div_ceil(NESTED_BLOCK_SIZE),
        )?;
        let map = take(weight, entries, &nested_keys[1], "nested_quant_map")?;
        expect(weight, "nested_quant_map", &map, DType::F32, 256)?;
        Scales::Nested {
            codes: absmax.bytes,
            absmax: F32s::new(nested_absmax.bytes)?,
            map: F32s::new(map.bytes)?,
            offset,
        }
    } else {
        if let Some(key) = nested_keys.iter().find(|k| entries.contains_key(*k)) {
            return Err(state_error(
                weight,
                "nested_offset",
                format!("missing from the quant state, but {key} is present"),
            ));
        }
        expect(weight, "absmax", &absmax, DType::F32, blocks)?;
        Scales::Plain(F32s::new(absmax.bytes)?)
    };
    Ok(QuantizedTensor {
        shape,
        dtype,
        compute_dtype: None,
        data: Data::FourBit(FourBit {
            kind,
            blocksize,
            packed: packed.bytes,
            scales,
        }),
    })
}

fn read_int8(
    weight: &str,
    entries: &mut HashMap<String, Entry>,
    threshold: f32,
) -> Result<QuantizedTensor, Error> {
    let module = module_of(weight);
    let codes = take(weight, entries, weight, "weight")?;
    let shape = match codes.meta.shape[..] {
        [rows, cols] if codes.meta.dtype == DType::I8 && rows > 0 && cols > 0 => [rows, cols],
        _ => {
            return Err(state_error(
                weight,
                "weight",
                format!(
                    "expected a non-empty I8 matrix, found {} {:?}",
                    codes.meta.dtype, codes.meta.shape
                ),
            ));
        }
    };
    let scb = take(weight, entries, &format!("{module}.SCB"), "SCB")?;
    expect(weight, "SCB", &scb, DType::F32, shape[0])?;
    if let Some(f) = entries.remove(&format!("{module}.weight_format")) {
        // bitsandbytes' LINEAR_8BIT_WEIGHTS_FORMAT_MAPPING: only 0 ("row")
        // is still loadable.
        if f.meta.dtype != DType::U8 || f.bytes.as_bytes() != [0] {
            return Err(state_error(
                weight,
                "weight_format",
                format!(
                    "expected U8 0 (\"row\"), found {} {:?}",
                    f.meta.dtype,
                    f.bytes.as_bytes()
                ),
            ));
        }
    }
    Ok(QuantizedTensor {
        shape,
        dtype: DType::F16,
        compute_dtype: None,
        data: Data::Int8(Int8 {
            codes: codes.bytes,
            scb: F32s::new(scb.bytes)?,
            threshold,
        }),
    })
}

/// The JSON object of a `quant_state.bitsandbytes__*` entry (UTF-8 bytes).
fn parse_state(weight: &str, e: &Entry) -> Result<Map<String, Value>, Error> {
    let bad = |m: String| state_error(weight, "quant_state", m);
    if e.meta.dtype != DType::U8 {
        return Err(bad(format!("expected U8 bytes, found {}", e.meta.dtype)));
    }
    match serde_json::from_slice(e.bytes.as_bytes()) {
        Ok(Value::Object(map)) => Ok(map),
        Ok(other) => Err(bad(format!("expected a JSON object, found {other}"))),
        Err(err) => Err(bad(format!("invalid JSON: {err}"))),
    }
}

fn parse_shape(weight: &str, v: &Value) -> Result<[usize; 2], Error> {
    let dims: Option<Vec<usize>> = v
        .as_array()
        .map(|a| a.iter().map(|d| d.as_u64().map(|n| n as usize)).collect())
        .unwrap_or(None);
    match dims.as_deref() {
        Some(&[rows, cols]) if rows > 0 && cols > 0 && rows.checked_mul(cols).is_some() => {
            Ok([rows, cols])
        }
        _ => Err(state_error(
            weight,
            "shape",
            format!("{v} is not the shape of a non-empty matrix"),
        )),
    }
}

/// JSON as Python's `json.dumps` writes it (`", "` and `": "` separators,
/// floats as `repr`), so the blob matches what bitsandbytes writes.
fn python_json(v: &Value) -> String {
    match v {
        Value::Object(map) => {
            let items: Vec<String> = map
                .iter()
                .map(|(k, v)| format!("{}: {}", Value::from(k.as_str()), python_json(v)))
                .collect();
            format!("{{{}}}", items.join(", "))
        }
        Value::Array(items) => {
            let items: Vec<String> = items.iter().map(python_json).collect();
            format!("[{}]", items.join(", "))
        }
        Value::Number(n) if n.is_f64() => python_float(n.as_f64().unwrap_or_default()),
        other => other.to_string(),
    }
}

/// Python's `repr` of a finite float: the shortest digits that round-trip,
/// positional for exponents -4..16, else `d.ddde-XX`.
fn python_float(x: f64) -> String {
    let sci = format!("{x:e}");
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    if (-4..16).contains(&exp) {
        let s = format!("{x}");
        if s.contains('.') { s } else { format!("{s}.0") }
    } else {
        let sign = if exp < 0 { '-' } else { '+' };
        format!("{mantissa}e{sign}{:02}", exp.abs())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nibbles_decode_from_any_start() {
        // Codes 0..10 packed high nibble first; an odd start reads a low nibble.
        let packed = [0x01, 0x23, 0x45, 0x67, 0x89];
        let pairs: [[f32; 2]; 256] = std::array::from_fn(|b| [(b >> 4) as f32, (b & 15) as f32]);
        for start in 0..5 {
            for len in 0..(10 - start) {
                let mut out = vec![0.0; len];
                decode_nibbles(&packed, start, &pairs, 2.0, &mut out);
                let want: Vec<f32> = (start..start + len).map(|i| 2.0 * i as f32).collect();
                assert_eq!(out, want, "start {start} len {len}");
            }
        }
    }

    #[test]
    fn python_floats_are_repr() {
        assert_eq!(
            python_float(0.205_826_982_855_796_81),
            "0.20582698285579681"
        );
        assert_eq!(python_float(1.0), "1.0");
        assert_eq!(python_float(1e-5), "1e-05");
        assert_eq!(python_float(2.5e-7), "2.5e-07");
        assert_eq!(python_float(0.0001), "0.0001");
        assert_eq!(python_float(1.5e16), "1.5e+16");
    }

    #[test]
    fn byte_len_counts_every_part() {
        let nf4 = QuantFormat::FourBit {
            kind: FourBitType::Nf4,
            blocksize: 64,
            double_quant: true,
        };
        // 4097 values: 2049 packed bytes, 65 blocks (65 code bytes, one
        // nested absmax), the 256-entry nested map, the offset.
        assert_eq!(nf4.byte_len(1, 4097), 2049 + 65 + 4 + 1024 + 4);
        assert_eq!(QuantFormat::Int8 { threshold: 6.0 }.byte_len(3, 5), 15 + 12);
    }
}
