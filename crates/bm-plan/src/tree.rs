//! The module tree: modules with class names, their parameters and buffers
//! in registration order, and the groups of tied parameters.

use std::collections::HashMap;

use bm_tensor::{DType, TensorMeta};

use crate::Error;

/// Index of a module in [`ModuleTree::modules`]; the root is 0.
pub type ModuleId = usize;
/// Index of a tensor in [`ModuleTree::tensors`].
pub type TensorId = usize;

/// The format tag of a module-tree document.
pub const FORMAT: &str = "bigmodel-module-tree/1";

/// Whether a tensor is a parameter or a buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TensorKind {
    /// A parameter (`named_parameters`).
    Param,
    /// A buffer; a non-persistent one is not in the state dict.
    Buffer {
        /// In the state dict (and so in a checkpoint).
        persistent: bool,
    },
}

/// A module of the tree.
#[derive(Clone, Debug)]
pub struct Module {
    /// Full dotted name; `""` for the root.
    pub name: String,
    /// Class name, e.g. `LlamaDecoderLayer`.
    pub class: String,
    /// The parent; `None` for the root.
    pub parent: Option<ModuleId>,
    /// Child modules in registration order.
    pub children: Vec<ModuleId>,
    /// Direct parameters in registration order.
    pub params: Vec<TensorId>,
    /// Direct buffers in registration order.
    pub buffers: Vec<TensorId>,
}

/// A parameter or buffer of the tree.
#[derive(Clone, Debug)]
pub struct Tensor {
    /// Full dotted name.
    pub name: String,
    /// The module that holds it directly.
    pub module: ModuleId,
    /// Dtype and shape.
    pub meta: TensorMeta,
    /// Parameter or buffer.
    pub kind: TensorKind,
    /// Index into [`ModuleTree::tied_groups`] when the tensor is tied.
    pub tie_group: Option<usize>,
    /// False for the second and later names of a tied tensor: the shared
    /// storage is counted once, under its first name in `named_parameters()`
    /// order.
    pub counted: bool,
}

/// A module tree: what the planner plans on.
#[derive(Clone, Debug)]
pub struct ModuleTree {
    modules: Vec<Module>,
    tensors: Vec<Tensor>,
    tied: Vec<Vec<TensorId>>,
    /// Position of each module in pre-order (root 0).
    preorder_pos: Vec<usize>,
    /// For each module, one past the pre-order position of its last descendant.
    subtree_end: Vec<usize>,
    /// Modules in pre-order.
    preorder: Vec<ModuleId>,
    by_name: HashMap<String, Node>,
}

/// A named node of the tree: a module or a tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Node {
    /// A module.
    Module(ModuleId),
    /// A parameter or buffer.
    Tensor(TensorId),
}

/// Builds a [`ModuleTree`] node by node; [`ModuleTreeBuilder::finish`]
/// validates ties and computes the orders the planner needs.
#[derive(Debug)]
pub struct ModuleTreeBuilder {
    modules: Vec<Module>,
    tensors: Vec<Tensor>,
    by_name: HashMap<String, Node>,
    tied_names: Vec<Vec<String>>,
}

fn join(prefix: &str, local: &str) -> String {
    if prefix.is_empty() {
        local.to_string()
    } else {
        let mut s = String::with_capacity(prefix.len() + 1 + local.len());
        s.push_str(prefix);
        s.push('.');
        s.push_str(local);
        s
    }
}

impl ModuleTreeBuilder {
    /// A tree whose root module has class `root_class`.
    pub fn new(root_class: impl Into<String>) -> Self {
        ModuleTreeBuilder {
            modules: vec![Module {
                name: String::new(),
                class: root_class.into(),
                parent: None,
                children: Vec::new(),
                params: Vec::new(),
                buffers: Vec::new(),
            }],
            tensors: Vec::new(),
            by_name: HashMap::new(),
            tied_names: Vec::new(),
        }
    }

    /// The root module.
    pub const ROOT: ModuleId = 0;

    fn claim(&mut self, parent: ModuleId, local: &str, node: Node) -> Result<String, Error> {
        let parent_name = &self.modules[parent].name;
        if local.is_empty() || local.contains('.') {
            return Err(Error::tree(
                join(parent_name, local),
                format!("name {local:?} must be non-empty and contain no '.'"),
            ));
        }
        let full = join(parent_name, local);
        if self.by_name.contains_key(&full) {
            return Err(Error::tree(full, "duplicate name among siblings"));
        }
        self.by_name.insert(full.clone(), node);
        Ok(full)
    }

    /// Adds a child module (after the existing children of `parent`).
    pub fn add_module(
        &mut self,
        parent: ModuleId,
        local: &str,
        class: impl Into<String>,
    ) -> Result<ModuleId, Error> {
        let id = self.modules.len();
        let name = self.claim(parent, local, Node::Module(id))?;
        self.modules.push(Module {
            name,
            class: class.into(),
            parent: Some(parent),
            children: Vec::new(),
            params: Vec::new(),
            buffers: Vec::new(),
        });
        self.modules[parent].children.push(id);
        Ok(id)
    }

    /// Adds a parameter to `module`.
    pub fn add_param(
        &mut self,
        module: ModuleId,
        local: &str,
        meta: TensorMeta,
    ) -> Result<TensorId, Error> {
        self.add_tensor(module, local, meta, TensorKind::Param)
    }

    /// Adds a buffer to `module`.
    pub fn add_buffer(
        &mut self,
        module: ModuleId,
        local: &str,
        meta: TensorMeta,
        persistent: bool,
    ) -> Result<TensorId, Error> {
        self.add_tensor(module, local, meta, TensorKind::Buffer { persistent })
    }

    fn add_tensor(
        &mut self,
        module: ModuleId,
        local: &str,
        meta: TensorMeta,
        kind: TensorKind,
    ) -> Result<TensorId, Error> {
        let id = self.tensors.len();
        let name = self.claim(module, local, Node::Tensor(id))?;
        if meta.checked_byte_len().is_none() {
            return Err(Error::tree(
                name,
                "shape is too large (byte size overflows)",
            ));
        }
        self.tensors.push(Tensor {
            name,
            module,
            meta,
            kind,
            tie_group: None,
            counted: true,
        });
        match kind {
            TensorKind::Param => self.modules[module].params.push(id),
            TensorKind::Buffer { .. } => self.modules[module].buffers.push(id),
        }
        Ok(id)
    }

    /// Declares that the named tensors share one storage.
    pub fn tie<S: AsRef<str>>(&mut self, names: &[S]) {
        self.tied_names
            .push(names.iter().map(|s| s.as_ref().to_string()).collect());
    }

    /// The id of a module by full name, while building.
    pub fn module_id(&self, name: &str) -> Option<ModuleId> {
        if name.is_empty() {
            return Some(0);
        }
        match self.by_name.get(name) {
            Some(Node::Module(id)) => Some(*id),
            _ => None,
        }
    }

    /// Validates ties and computes traversal orders.
    pub fn finish(mut self) -> Result<ModuleTree, Error> {
        // Pre-order over modules (iterative: trees can be deep).
        let n = self.modules.len();
        let mut preorder = Vec::with_capacity(n);
        let mut preorder_pos = vec![0usize; n];
        let mut subtree_end = vec![0usize; n];
        let mut stack: Vec<(ModuleId, bool)> = vec![(0, false)];
        while let Some((m, done)) = stack.pop() {
            if done {
                subtree_end[m] = preorder.len();
                continue;
            }
            preorder_pos[m] = preorder.len();
            preorder.push(m);
            stack.push((m, true));
            for &c in self.modules[m].children.iter().rev() {
                stack.push((c, false));
            }
        }

        // Tied groups: every name must exist, be unique to one group, and all
        // members must agree on dtype and shape.
        let mut tied: Vec<Vec<TensorId>> = Vec::with_capacity(self.tied_names.len());
        for (g, names) in self.tied_names.iter().enumerate() {
            if names.len() < 2 {
                return Err(Error::tree(
                    format!("tied[{g}]"),
                    "a tied group needs at least two names",
                ));
            }
            let mut group = Vec::with_capacity(names.len());
            for name in names {
                let id = match self.by_name.get(name) {
                    Some(Node::Tensor(t)) => *t,
                    _ => {
                        return Err(Error::tree(
                            format!("tied[{g}]"),
                            format!("{name:?} is not a parameter or buffer of the tree"),
                        ));
                    }
                };
                if let Some(other) = self.tensors[id].tie_group {
                    return Err(Error::tree(
                        format!("tied[{g}]"),
                        format!("{name:?} is already in tied group {other}"),
                    ));
                }
                let first = &self.tensors[group.first().copied().unwrap_or(id)];
                if first.meta != self.tensors[id].meta {
                    return Err(Error::tree(
                        format!("tied[{g}]"),
                        format!(
                            "{name:?} ({} {:?}) cannot share storage with {:?} ({} {:?})",
                            self.tensors[id].meta.dtype,
                            self.tensors[id].meta.shape,
                            first.name,
                            first.meta.dtype,
                            first.meta.shape
                        ),
                    ));
                }
                self.tensors[id].tie_group = Some(g);
                group.push(id);
            }
            tied.push(group);
        }

        let mut tree = ModuleTree {
            modules: self.modules,
            tensors: self.tensors,
            tied,
            preorder_pos,
            subtree_end,
            preorder,
            by_name: self.by_name,
        };
        // The counted name of a tied tensor is its first in
        // named_module_tensors order (params pre-order, then buffers).
        let mut seen = vec![false; tree.tied.len()];
        let params = tree
            .preorder
            .iter()
            .flat_map(|m| tree.modules[*m].params.iter().copied());
        let buffers = tree
            .preorder
            .iter()
            .flat_map(|m| tree.modules[*m].buffers.iter().copied());
        let order: Vec<TensorId> = params.chain(buffers).collect();
        for t in order {
            if let Some(g) = tree.tensors[t].tie_group {
                tree.tensors[t].counted = !seen[g];
                seen[g] = true;
            }
        }
        for group in &mut tree.tied {
            group.sort_by(|a, b| tree.tensors[*a].name.cmp(&tree.tensors[*b].name));
        }
        Ok(tree)
    }
}

impl ModuleTree {
    /// All modules; index 0 is the root.
    pub fn modules(&self) -> &[Module] {
        &self.modules
    }

    /// All tensors.
    pub fn tensors(&self) -> &[Tensor] {
        &self.tensors
    }

    /// A module.
    pub fn module(&self, id: ModuleId) -> &Module {
        &self.modules[id]
    }

    /// A tensor.
    pub fn tensor(&self, id: TensorId) -> &Tensor {
        &self.tensors[id]
    }

    /// Groups of tied tensors, each sorted by name.
    pub fn tied_groups(&self) -> &[Vec<TensorId>] {
        &self.tied
    }

    /// The groups of tied tensors as names, as `find_tied_parameters` returns
    /// them (each group sorted; groups in the order they were declared).
    pub fn tied_names(&self) -> Vec<Vec<String>> {
        self.tied
            .iter()
            .map(|g| g.iter().map(|t| self.tensors[*t].name.clone()).collect())
            .collect()
    }

    /// Looks a module or tensor up by full name (`""` is the root).
    pub fn find(&self, name: &str) -> Option<Node> {
        if name.is_empty() {
            return Some(Node::Module(0));
        }
        self.by_name.get(name).copied()
    }

    /// Modules in pre-order (`named_modules()` order).
    pub fn preorder(&self) -> &[ModuleId] {
        &self.preorder
    }

    /// True when `m` is `ancestor` or lies below it.
    pub fn is_within(&self, m: ModuleId, ancestor: ModuleId) -> bool {
        let p = self.preorder_pos[m];
        p >= self.preorder_pos[ancestor] && p < self.subtree_end[ancestor]
    }

    /// The name of a node.
    pub fn node_name(&self, node: Node) -> &str {
        match node {
            Node::Module(m) => &self.modules[m].name,
            Node::Tensor(t) => &self.tensors[t].name,
        }
    }

    /// Accelerate's `named_module_tensors(model, recurse=True)`: parameters
    /// in `named_parameters()` order with tied duplicates removed, then all
    /// buffers in `named_buffers()` order.
    pub fn named_module_tensors(&self) -> Vec<TensorId> {
        let mut out = Vec::with_capacity(self.tensors.len());
        let mut seen_group = vec![false; self.tied.len()];
        for &m in &self.preorder {
            for &t in &self.modules[m].params {
                if let Some(g) = self.tensors[t].tie_group {
                    if seen_group[g] {
                        continue;
                    }
                    seen_group[g] = true;
                }
                out.push(t);
            }
        }
        for &m in &self.preorder {
            for &t in &self.modules[m].buffers {
                if let Some(g) = self.tensors[t].tie_group {
                    if seen_group[g] {
                        continue;
                    }
                    seen_group[g] = true;
                }
                out.push(t);
            }
        }
        out
    }

    /// The tensors of `model.state_dict()`, in its order: per module in
    /// pre-order, its parameters then its persistent buffers. Tied names all
    /// appear.
    pub fn state_dict(&self) -> Vec<TensorId> {
        let mut out = Vec::with_capacity(self.tensors.len());
        for &m in &self.preorder {
            let module = &self.modules[m];
            out.extend(module.params.iter().copied());
            out.extend(module.buffers.iter().copied().filter(|t| {
                matches!(
                    self.tensors[*t].kind,
                    TensorKind::Buffer { persistent: true }
                )
            }));
        }
        out
    }

    /// The same tree with the dtype and shape of some tensors replaced
    /// (`(tensor, new meta)`; a tied tensor must not be among them).
    pub(crate) fn with_metas(&self, metas: Vec<(TensorId, TensorMeta)>) -> ModuleTree {
        let mut tree = self.clone();
        for (t, meta) in metas {
            debug_assert!(tree.tensors[t].tie_group.is_none());
            tree.tensors[t].meta = meta;
        }
        tree
    }

    /// Number of parameters (tied storages counted once).
    pub fn parameter_count(&self) -> u64 {
        self.tensors
            .iter()
            .filter(|t| t.kind == TensorKind::Param && t.counted)
            .map(|t| t.meta.numel() as u64)
            .sum()
    }

    /// Parses a `bigmodel-module-tree/1` document. Errors name the offending
    /// module or tensor path.
    pub fn from_json_str(text: &str) -> Result<ModuleTree, Error> {
        let doc: serde_json::Value = serde_json::from_str(text)
            .map_err(|e| Error::tree("", format!("not valid JSON: {e}")))?;
        ModuleTree::from_json(&doc)
    }

    /// Builds from a parsed `bigmodel-module-tree/1` document.
    pub fn from_json(doc: &serde_json::Value) -> Result<ModuleTree, Error> {
        let obj = doc
            .as_object()
            .ok_or_else(|| Error::tree("", "the document must be a JSON object"))?;
        match obj.get("format").and_then(|f| f.as_str()) {
            Some(FORMAT) => {}
            Some(other) => {
                return Err(Error::tree(
                    "format",
                    format!("unknown format {other:?}, expected {FORMAT:?}"),
                ));
            }
            None => {
                return Err(Error::tree(
                    "format",
                    format!("missing \"format\": {FORMAT:?}"),
                ));
            }
        }
        let root = obj
            .get("root")
            .ok_or_else(|| Error::tree("root", "missing"))?;
        let root_obj = root
            .as_object()
            .ok_or_else(|| Error::tree("root", "must be an object"))?;
        if root_obj.contains_key("name") {
            return Err(Error::tree("root", "the root module has no \"name\""));
        }
        let class = class_of(root_obj, "root")?;
        let mut builder = ModuleTreeBuilder::new(class);
        // Iterative walk: (json object, module id).
        let mut stack: Vec<(&serde_json::Map<String, serde_json::Value>, ModuleId)> =
            vec![(root_obj, 0)];
        while let Some((node, id)) = stack.pop() {
            let path = display_path(&builder.modules[id].name);
            for (key, kind) in [("params", None), ("buffers", Some(()))] {
                let Some(list) = node.get(key) else { continue };
                let list = list.as_array().ok_or_else(|| {
                    Error::tree(path.clone(), format!("\"{key}\" must be a list"))
                })?;
                for t in list {
                    let (local, meta, persistent) = tensor_of(t, &path, key)?;
                    if kind.is_none() {
                        if persistent.is_some() {
                            return Err(Error::tree(
                                join(&builder.modules[id].name, &local),
                                "\"persistent\" applies to buffers only",
                            ));
                        }
                        builder.add_param(id, &local, meta)?;
                    } else {
                        builder.add_buffer(id, &local, meta, persistent.unwrap_or(true))?;
                    }
                }
            }
            if let Some(children) = node.get("children") {
                let children = children
                    .as_array()
                    .ok_or_else(|| Error::tree(path.clone(), "\"children\" must be a list"))?;
                let mut created = Vec::with_capacity(children.len());
                for child in children {
                    let child = child
                        .as_object()
                        .ok_or_else(|| Error::tree(path.clone(), "each child must be an object"))?;
                    let local = child.get("name").and_then(|n| n.as_str()).ok_or_else(|| {
                        Error::tree(path.clone(), "a child module has no \"name\" string")
                    })?;
                    let child_path = join(&builder.modules[id].name, local);
                    let class = class_of(child, &child_path)?;
                    let cid = builder.add_module(id, local, class)?;
                    created.push((child, cid));
                }
                for item in created.into_iter().rev() {
                    stack.push(item);
                }
            }
        }
        if let Some(tied) = obj.get("tied") {
            let groups = tied
                .as_array()
                .ok_or_else(|| Error::tree("tied", "must be a list of lists"))?;
            for (g, group) in groups.iter().enumerate() {
                let names = group
                    .as_array()
                    .ok_or_else(|| Error::tree(format!("tied[{g}]"), "must be a list of names"))?;
                let names: Vec<&str> = names
                    .iter()
                    .map(|n| {
                        n.as_str().ok_or_else(|| {
                            Error::tree(format!("tied[{g}]"), "names must be strings")
                        })
                    })
                    .collect::<Result<_, _>>()?;
                builder.tie(&names);
            }
        }
        builder.finish()
    }

    /// Writes the tree as a `bigmodel-module-tree/1` document.
    pub fn to_json(&self) -> serde_json::Value {
        fn module_json(tree: &ModuleTree, id: ModuleId) -> serde_json::Value {
            let m = &tree.modules[id];
            let mut obj = serde_json::Map::new();
            if id != 0 {
                let local = m.name.rsplit('.').next().unwrap_or(&m.name);
                obj.insert("name".into(), local.into());
            }
            obj.insert("class".into(), m.class.clone().into());
            let tensor_json = |t: TensorId| {
                let t = &tree.tensors[t];
                let mut o = serde_json::Map::new();
                o.insert(
                    "name".into(),
                    t.name.rsplit('.').next().unwrap_or(&t.name).into(),
                );
                o.insert("shape".into(), t.meta.shape.clone().into());
                o.insert("dtype".into(), t.meta.dtype.as_safetensors_str().into());
                if let TensorKind::Buffer { persistent: false } = t.kind {
                    o.insert("persistent".into(), false.into());
                }
                serde_json::Value::Object(o)
            };
            if !m.params.is_empty() {
                obj.insert(
                    "params".into(),
                    m.params.iter().map(|t| tensor_json(*t)).collect(),
                );
            }
            if !m.buffers.is_empty() {
                obj.insert(
                    "buffers".into(),
                    m.buffers.iter().map(|t| tensor_json(*t)).collect(),
                );
            }
            if !m.children.is_empty() {
                obj.insert(
                    "children".into(),
                    m.children.iter().map(|c| module_json(tree, *c)).collect(),
                );
            }
            serde_json::Value::Object(obj)
        }
        serde_json::json!({
            "format": FORMAT,
            "root": module_json(self, 0),
            "tied": self.tied_names(),
        })
    }
}

fn display_path(name: &str) -> String {
    if name.is_empty() {
        "root".to_string()
    } else {
        name.to_string()
    }
}

fn class_of(
    node: &serde_json::Map<String, serde_json::Value>,
    path: &str,
) -> Result<String, Error> {
    node.get("class")
        .and_then(|c| c.as_str())
        .map(str::to_string)
        .ok_or_else(|| Error::tree(path, "missing \"class\" string"))
}

fn tensor_of(
    value: &serde_json::Value,
    module_path: &str,
    list: &str,
) -> Result<(String, TensorMeta, Option<bool>), Error> {
    let obj = value.as_object().ok_or_else(|| {
        Error::tree(
            module_path,
            format!("each entry of \"{list}\" must be an object"),
        )
    })?;
    let local = obj.get("name").and_then(|n| n.as_str()).ok_or_else(|| {
        Error::tree(
            module_path,
            format!("an entry of \"{list}\" has no \"name\" string"),
        )
    })?;
    let path = if module_path == "root" {
        local.to_string()
    } else {
        join(module_path, local)
    };
    let dtype_text = obj
        .get("dtype")
        .and_then(|d| d.as_str())
        .ok_or_else(|| Error::tree(&path, "missing \"dtype\" string"))?;
    let dtype = DType::ALL
        .iter()
        .copied()
        .find(|d| d.as_safetensors_str() == dtype_text)
        .ok_or_else(|| {
            Error::tree(
                &path,
                format!("unknown dtype {dtype_text:?} (expected F64 F32 F16 BF16 I64 I32 I16 I8 U8 BOOL F8_E4M3 F8_E5M2)"),
            )
        })?;
    let shape = obj
        .get("shape")
        .and_then(|s| s.as_array())
        .ok_or_else(|| Error::tree(&path, "missing \"shape\" list"))?;
    let shape: Vec<usize> = shape
        .iter()
        .map(|d| {
            d.as_u64()
                .and_then(|v| usize::try_from(v).ok())
                .ok_or_else(|| {
                    Error::tree(
                        &path,
                        format!("shape dimension {d} is not a non-negative integer"),
                    )
                })
        })
        .collect::<Result<_, _>>()?;
    let persistent = match obj.get("persistent") {
        None => None,
        Some(serde_json::Value::Bool(b)) => Some(*b),
        Some(other) => {
            return Err(Error::tree(
                &path,
                format!("\"persistent\" must be true or false, found {other}"),
            ));
        }
    };
    Ok((local.to_string(), TensorMeta::new(dtype, shape), persistent))
}

#[cfg(test)]
mod tests {
    use super::*;

    const SPEC_EXAMPLE: &str = r#"{
      "format": "bigmodel-module-tree/1",
      "root": {
        "class": "LlamaForCausalLM",
        "children": [
          {"name": "model", "class": "LlamaModel", "children": [
            {"name": "embed_tokens", "class": "Embedding",
             "params": [{"name": "weight", "shape": [32000, 4096], "dtype": "F16"}]},
            {"name": "rotary_emb", "class": "LlamaRotaryEmbedding",
             "buffers": [{"name": "inv_freq", "shape": [64], "dtype": "F32", "persistent": false}]}
          ]},
          {"name": "lm_head", "class": "Linear",
           "params": [{"name": "weight", "shape": [32000, 4096], "dtype": "F16"}]}
        ]
      },
      "tied": [["lm_head.weight", "model.embed_tokens.weight"]],
      "extra": "ignored"
    }"#;

    #[test]
    fn the_spec_example_parses_and_round_trips() {
        let tree = ModuleTree::from_json_str(SPEC_EXAMPLE).unwrap();
        let names: Vec<_> = tree
            .preorder()
            .iter()
            .map(|m| tree.module(*m).name.as_str())
            .collect();
        assert_eq!(
            names,
            [
                "",
                "model",
                "model.embed_tokens",
                "model.rotary_emb",
                "lm_head"
            ]
        );
        let emb = match tree.find("model.embed_tokens.weight") {
            Some(Node::Tensor(t)) => t,
            other => panic!("{other:?}"),
        };
        let head = match tree.find("lm_head.weight") {
            Some(Node::Tensor(t)) => t,
            other => panic!("{other:?}"),
        };
        assert!(
            tree.tensor(emb).counted,
            "first in named_parameters order is counted"
        );
        assert!(!tree.tensor(head).counted);
        assert_eq!(
            tree.tied_names(),
            vec![vec!["lm_head.weight", "model.embed_tokens.weight"]]
        );
        let again = ModuleTree::from_json(&tree.to_json()).unwrap();
        assert_eq!(again.to_json(), tree.to_json());
        // Non-persistent buffers are not in the state dict.
        let sd: Vec<_> = tree
            .state_dict()
            .iter()
            .map(|t| tree.tensor(*t).name.clone())
            .collect();
        assert_eq!(sd, ["model.embed_tokens.weight", "lm_head.weight"]);
    }

    fn err(doc: &str) -> String {
        ModuleTree::from_json_str(doc).unwrap_err().to_string()
    }

    #[test]
    fn malformed_documents_give_errors_naming_the_path() {
        assert!(
            err(r#"{"format":"bigmodel-module-tree/2","root":{"class":"M"}}"#)
                .contains("unknown format")
        );
        assert!(err(r#"{"root":{"class":"M"}}"#).contains("format"));
        assert!(err("[1]").contains("JSON object"));
        assert!(err("{").contains("not valid JSON"));
        let dup = r#"{"format":"bigmodel-module-tree/1","root":{"class":"M","children":[
            {"name":"a","class":"L"},{"name":"a","class":"L"}]}}"#;
        assert!(err(dup).contains("at a: duplicate name"), "{}", err(dup));
        let dtype = r#"{"format":"bigmodel-module-tree/1","root":{"class":"M","children":[
            {"name":"a","class":"L","params":[{"name":"w","shape":[2],"dtype":"F17"}]}]}}"#;
        assert!(
            err(dtype).contains("at a.w: unknown dtype \"F17\""),
            "{}",
            err(dtype)
        );
        let neg = r#"{"format":"bigmodel-module-tree/1","root":{"class":"M","children":[
            {"name":"a","class":"L","params":[{"name":"w","shape":[2,-1],"dtype":"F32"}]}]}}"#;
        assert!(
            err(neg).contains("at a.w: shape dimension -1"),
            "{}",
            err(neg)
        );
        let tie = r#"{"format":"bigmodel-module-tree/1","root":{"class":"M","children":[
            {"name":"a","class":"L","params":[{"name":"w","shape":[2],"dtype":"F32"}]}]},
            "tied":[["a.w","b.w"]]}"#;
        assert!(
            err(tie).contains("\"b.w\" is not a parameter"),
            "{}",
            err(tie)
        );
        let shape = r#"{"format":"bigmodel-module-tree/1","root":{"class":"M","children":[
            {"name":"a","class":"L","params":[{"name":"w","shape":[2],"dtype":"F32"}]},
            {"name":"b","class":"L","params":[{"name":"w","shape":[3],"dtype":"F32"}]}]},
            "tied":[["a.w","b.w"]]}"#;
        assert!(
            err(shape).contains("cannot share storage"),
            "{}",
            err(shape)
        );
        let named_root = r#"{"format":"bigmodel-module-tree/1","root":{"name":"x","class":"M"}}"#;
        assert!(err(named_root).contains("root"));
        let dotted = r#"{"format":"bigmodel-module-tree/1","root":{"class":"M","children":[{"name":"a.b","class":"L"}]}}"#;
        assert!(err(dotted).contains("no '.'"));
        let no_class =
            r#"{"format":"bigmodel-module-tree/1","root":{"class":"M","children":[{"name":"a"}]}}"#;
        assert!(err(no_class).contains("at a: missing \"class\""));
    }
}
