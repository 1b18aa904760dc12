//! The module tree: modules with class names, their parameters and buffers
//! in registration order, and the groups of tied parameters. Its JSON
//! document, `bigmodel-module-tree/1`, is read and written in `document.rs`.

use std::collections::HashMap;
use std::hash::BuildHasher;
use std::sync::OnceLock;

use bm_tensor::TensorMeta;

use crate::Error;

mod document;

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

/// A module of the tree, as [`ModuleTree::module`] shows it: a view into
/// the tree's tables.
#[derive(Clone, Copy, Debug)]
pub struct Module<'t> {
    /// Full dotted name; `""` for the root.
    pub name: &'t str,
    /// Class name, e.g. `LlamaDecoderLayer`.
    pub class: &'t str,
    /// The parent; `None` for the root.
    pub parent: Option<ModuleId>,
    /// Child modules in registration order.
    pub children: &'t [ModuleId],
    /// Direct parameters in registration order.
    pub params: &'t [TensorId],
    /// Direct buffers in registration order.
    pub buffers: &'t [TensorId],
}

/// A parameter or buffer of the tree, as [`ModuleTree::tensor`] shows it.
#[derive(Clone, Copy, Debug)]
pub struct Tensor<'t> {
    /// Full dotted name.
    pub name: &'t str,
    /// The module that holds it directly.
    pub module: ModuleId,
    /// Dtype and shape.
    pub meta: &'t TensorMeta,
    /// Parameter or buffer.
    pub kind: TensorKind,
    /// Index into [`ModuleTree::tied_groups`] when the tensor is tied.
    pub tie_group: Option<usize>,
    /// False for the second and later names of a tied tensor: the shared
    /// storage is counted once, under its first name in `named_parameters()`
    /// order.
    pub counted: bool,
}

// The tree is stored as a few flat tables rather than one struct with
// owned strings and lists per module: a tree of 100k modules was ~400k
// small allocations, and building it cost more in fresh heap pages than in
// reading its document. Indices and offsets are 32 bits (node codes already
// are; `claim` refuses names past 4 GiB).

/// Bytes `start..start + len` of [`ModuleTree::names`].
#[derive(Clone, Copy, Debug)]
struct NameAt {
    start: u32,
    len: u32,
}

impl NameAt {
    /// Where the part of a child's name after this module's name and its
    /// dot starts, from the start of the child's name (0 under the root).
    fn parts_from(self) -> u32 {
        if self.len == 0 { 0 } else { self.len + 1 }
    }
}

/// `u32::MAX`: no parent, no tied group.
const NONE: u32 = u32::MAX;

#[derive(Clone, Debug)]
struct ModuleRecord {
    name: NameAt,
    /// Index into `classes`.
    class: u32,
    parent: u32,
    /// Its children, params and buffers are `links[links..]`, in that
    /// order, `children`, `params` and `buffers` long (filled by `finish`).
    links: u32,
    children: u32,
    params: u32,
    buffers: u32,
}

#[derive(Clone, Debug)]
struct TensorRecord {
    meta: TensorMeta,
    name: NameAt,
    module: u32,
    tie_group: u32,
    kind: TensorKind,
    counted: bool,
}

/// The tables a tree and its builder share.
#[derive(Clone, Debug, Default)]
struct Tables {
    /// Every full name, one after another.
    names: String,
    /// Distinct class names.
    classes: Vec<Box<str>>,
    modules: Vec<ModuleRecord>,
    tensors: Vec<TensorRecord>,
}

impl Tables {
    /// Unchecked: a view's name is then free when its caller reads other
    /// fields (a checked slice reads the names' bytes at both ends, a cache
    /// miss per `tree.module(m).parent` in a loop over a large tree).
    #[inline(always)]
    fn name(&self, at: NameAt) -> &str {
        let range = at.start as usize..(at.start + at.len) as usize;
        debug_assert!(self.names.get(range.clone()).is_some());
        // SAFETY: every `NameAt` is a whole name `claim` appended to `names`
        // (which only grows while it is used), or the part of one after a
        // `.` (`WideLinks`): in bounds, on character boundaries.
        unsafe { self.names.get_unchecked(range) }
    }

    fn name_at(&self, node: Node) -> NameAt {
        match node {
            Node::Module(m) => self.modules[m].name,
            Node::Tensor(t) => self.tensors[t].name,
        }
    }

    fn node_name(&self, node: Node) -> &str {
        self.name(self.name_at(node))
    }
}

/// A module tree: what the planner plans on.
#[derive(Clone, Debug)]
pub struct ModuleTree {
    tables: Tables,
    /// Each module's children, params and buffers (see [`ModuleRecord`]).
    links: Vec<usize>,
    tied: Vec<Vec<TensorId>>,
    /// Position of each module in pre-order (root 0).
    preorder_pos: Vec<usize>,
    /// For each module, one past the pre-order position of its last descendant.
    subtree_end: Vec<usize>,
    /// Modules in pre-order.
    preorder: Vec<ModuleId>,
    /// Made by the first lookup in a module with more than [`NARROW`]
    /// links.
    wide: OnceLock<WideLinks>,
}

/// A module with this many children, params and buffers or fewer is
/// searched one by one for a name.
const NARROW: usize = 32;

/// The links of each module with more than [`NARROW`] of them, sorted by
/// name, for a binary search. A tree keeps no index of full names: a name
/// is found from the root down, one part at a time, and making a large
/// tree's index (hashing every full name) cost more than planning it.
#[derive(Clone, Debug, Default)]
struct WideLinks {
    /// Where a wide module's sorted links start in `links`.
    start: HashMap<ModuleId, usize>,
    links: Vec<WideLink>,
}

#[derive(Clone, Copy, Debug)]
struct WideLink {
    key: PartKey,
    /// Its part of the name, in the tree's names.
    part: NameAt,
    node: Node,
}

/// What orders parts of names without reading them, mostly: their length,
/// then their first 8 bytes (big-endian, so in byte order). Parts equal
/// in both are then compared in full.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct PartKey {
    len: usize,
    head: u64,
}

impl PartKey {
    fn of(part: &str) -> PartKey {
        let mut head = [0u8; 8];
        let n = part.len().min(8);
        head[..n].copy_from_slice(&part.as_bytes()[..n]);
        PartKey {
            len: part.len(),
            head: u64::from_be_bytes(head),
        }
    }
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
    tables: Tables,
    /// Class name to its index in `tables.classes`.
    class_ids: std::collections::HashMap<Box<str>, u32>,
    /// The classes looked up last, the latest first (`NONE` for none).
    recent_classes: [u32; 8],
    by_name: NameIndex,
    tied_names: Vec<Vec<String>>,
    /// False once [`ModuleTreeBuilder::siblings_checked_by_caller`]: names
    /// are then neither indexed nor checked for duplicates as they come.
    indexing: bool,
}

/// Full names to nodes, for the builder's checks and lookups while it
/// builds.
///
/// An open-addressing table of node ids only: the names stay where they
/// are, in the modules and tensors (a `HashMap<String, Node>` held a second
/// copy of every name). Names are hashed with the standard library's keyed
/// SipHash, so a crafted document cannot make lookups quadratic.
#[derive(Clone, Debug, Default)]
struct NameIndex {
    /// `hash tag << 32 | (node code + 1)`, 0 for a free slot; the slot of a
    /// name is found from its tag, so growing needs no names. The length is
    /// 0 or a power of two, at least twice the number of entries.
    slots: Vec<u64>,
    len: usize,
    hasher: std::hash::RandomState,
}

/// Why a name is refused when another node has it.
const DUPLICATE: &str = "duplicate name among siblings";

/// Node codes fit in 32 bits with one left for the free slot.
const MAX_NODE_CODE: usize = u32::MAX as usize - 1;

impl NameIndex {
    fn code(node: Node) -> usize {
        match node {
            Node::Module(m) => 2 * m,
            Node::Tensor(t) => 2 * t + 1,
        }
    }

    fn node(code: u64) -> Node {
        let code = (code & u64::from(u32::MAX)) as usize - 1;
        if code.is_multiple_of(2) {
            Node::Module(code / 2)
        } else {
            Node::Tensor(code / 2)
        }
    }

    fn tag(&self, name: &str) -> u64 {
        self.hasher.hash_one(name) >> 32
    }

    /// The slot holding `name`, or the free slot where it would go.
    fn slot<'n>(&self, name: &str, tag: u64, name_of: impl Fn(Node) -> &'n str) -> usize {
        let mask = self.slots.len() - 1;
        let mut i = tag as usize & mask;
        loop {
            let slot = self.slots[i];
            if slot == 0 || (slot >> 32 == tag && name_of(Self::node(slot)) == name) {
                return i;
            }
            i = (i + 1) & mask;
        }
    }

    fn get<'n>(&self, name: &str, name_of: impl Fn(Node) -> &'n str) -> Option<Node> {
        if self.len == 0 {
            return None;
        }
        let slot = self.slots[self.slot(name, self.tag(name), name_of)];
        (slot != 0).then(|| Self::node(slot))
    }

    /// Makes room for `more` entries without growing again.
    fn reserve(&mut self, more: usize) {
        let want = ((self.len + more) * 2).next_power_of_two().max(16);
        if want <= self.slots.len() {
            return;
        }
        let old = std::mem::replace(&mut self.slots, vec![0; want]);
        let mask = want - 1;
        for slot in old.into_iter().filter(|s| *s != 0) {
            let mut i = (slot >> 32) as usize & mask;
            while self.slots[i] != 0 {
                i = (i + 1) & mask;
            }
            self.slots[i] = slot;
        }
    }

    /// Adds `name` → `node`; false (and nothing added) when the name is taken.
    fn insert<'n>(&mut self, name: &str, node: Node, name_of: impl Fn(Node) -> &'n str) -> bool {
        self.reserve(1);
        let tag = self.tag(name);
        let i = self.slot(name, tag, name_of);
        if self.slots[i] != 0 {
            return false;
        }
        self.slots[i] = tag << 32 | (Self::code(node) + 1) as u64;
        self.len += 1;
        true
    }
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
        let mut builder = ModuleTreeBuilder {
            tables: Tables::default(),
            class_ids: Default::default(),
            recent_classes: [NONE; 8],
            by_name: NameIndex::default(),
            tied_names: Vec::new(),
            indexing: true,
        };
        let class = builder.class_id(&root_class.into());
        builder.tables.modules.push(ModuleRecord {
            name: NameAt { start: 0, len: 0 },
            class,
            parent: NONE,
            links: 0,
            children: 0,
            params: 0,
            buffers: 0,
        });
        builder
    }

    /// The root module.
    pub const ROOT: ModuleId = 0;

    fn class_id(&mut self, class: &str) -> u32 {
        // A tree's modules cycle through a few classes (a layer's, then
        // its parts'): the recent ones are found without hashing.
        let classes = &self.tables.classes;
        if let Some(&id) = self
            .recent_classes
            .iter()
            .find(|&&id| classes.get(id as usize).is_some_and(|c| **c == *class))
        {
            return id;
        }
        let id = match self.class_ids.get(class) {
            Some(&id) => id,
            None => {
                let classes = &mut self.tables.classes;
                classes.push(class.into());
                let id = (classes.len() - 1) as u32;
                self.class_ids.insert(class.into(), id);
                id
            }
        };
        self.recent_classes.rotate_right(1);
        self.recent_classes[0] = id;
        id
    }

    /// Checks `local` and appends `parent`'s full name, a dot and `local`
    /// to the names; indexes the name for `node` unless indexing waits.
    fn claim(&mut self, parent: ModuleId, local: &str, node: Node) -> Result<NameAt, Error> {
        let parent_at = self.tables.modules[parent].name;
        let error = |tables: &Tables, reason: &str| {
            Error::tree(join(tables.name(parent_at), local), reason)
        };
        // A byte loop: names are a few bytes, shorter than a call to memchr.
        if local.is_empty() || local.bytes().any(|b| b == b'.') {
            return Err(error(
                &self.tables,
                &format!("name {local:?} must be non-empty and contain no '.'"),
            ));
        }
        if NameIndex::code(node) > MAX_NODE_CODE {
            return Err(error(
                &self.tables,
                "the tree has more than 2^31 modules or tensors",
            ));
        }
        let dot = usize::from(parent_at.len > 0);
        let len = parent_at.len as usize + dot + local.len();
        let names = &mut self.tables.names;
        let start = names.len();
        if start + len > u32::MAX as usize {
            return Err(error(&self.tables, "the full names of the tree pass 4 GiB"));
        }
        names.reserve(len);
        let parent_range = parent_at.start as usize..(parent_at.start + parent_at.len) as usize;
        // SAFETY: the bytes copied are a whole name, UTF-8 that starts and
        // ends on character boundaries, so `names` stays UTF-8.
        // (`String::extend_from_within` is newer than the toolchain the
        // workspace supports.)
        unsafe { names.as_mut_vec() }.extend_from_within(parent_range);
        if dot == 1 {
            names.push('.');
        }
        names.push_str(local);
        let at = NameAt {
            start: start as u32,
            len: len as u32,
        };
        if !self.indexing {
            return Ok(at);
        }
        let tables = &self.tables;
        let name = &tables.names[start..];
        let fresh = self.by_name.insert(name, node, |n| tables.node_name(n));
        if !fresh {
            let name = name.to_string();
            self.tables.names.truncate(start);
            return Err(Error::tree(name, DUPLICATE));
        }
        Ok(at)
    }

    /// From now on, names are neither indexed nor checked for duplicates:
    /// the caller has checked that no two children, params and buffers of
    /// one module share a name (a document's reader does, module by module,
    /// where the names are at hand), and looks nothing up by name while
    /// building ([`ModuleTreeBuilder::module_id`] sees only what was
    /// indexed). Two siblings are the only way two nodes can have one full
    /// name, as a name has no `.`.
    pub(crate) fn siblings_checked_by_caller(&mut self) {
        self.indexing = false;
    }

    /// Makes room for this many more modules and tensors, and bytes of
    /// names.
    pub(crate) fn reserve(&mut self, modules: usize, tensors: usize, name_bytes: usize) {
        self.tables.modules.reserve(modules);
        self.tables.tensors.reserve(tensors);
        self.tables.names.reserve(name_bytes);
        if self.indexing {
            self.by_name.reserve(modules + tensors);
        }
    }

    /// The number of tensors added.
    pub(crate) fn tensor_count(&self) -> usize {
        self.tables.tensors.len()
    }

    /// The bytes of all full names added.
    pub(crate) fn name_bytes(&self) -> usize {
        self.tables.names.len()
    }

    /// The full name of a node added.
    pub(crate) fn node_name(&self, node: Node) -> &str {
        self.tables.node_name(node)
    }

    /// Adds a child module (after the existing children of `parent`).
    pub fn add_module(
        &mut self,
        parent: ModuleId,
        local: &str,
        class: impl AsRef<str>,
    ) -> Result<ModuleId, Error> {
        let id = self.tables.modules.len();
        let name = self.claim(parent, local, Node::Module(id))?;
        let class = self.class_id(class.as_ref());
        self.tables.modules.push(ModuleRecord {
            name,
            class,
            parent: parent as u32,
            links: 0,
            children: 0,
            params: 0,
            buffers: 0,
        });
        self.tables.modules[parent].children += 1;
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
        let id = self.tables.tensors.len();
        let name = self.claim(module, local, Node::Tensor(id))?;
        if meta.checked_byte_len().is_none() {
            return Err(Error::tree(
                self.tables.name(name),
                "shape is too large (byte size overflows)",
            ));
        }
        self.tables.tensors.push(TensorRecord {
            meta,
            name,
            module: module as u32,
            tie_group: NONE,
            kind,
            counted: true,
        });
        let record = &mut self.tables.modules[module];
        match kind {
            TensorKind::Param => record.params += 1,
            TensorKind::Buffer { .. } => record.buffers += 1,
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
        match self.find(name) {
            Some(Node::Module(id)) => Some(id),
            _ => None,
        }
    }

    fn find(&self, name: &str) -> Option<Node> {
        debug_assert!(self.indexing, "a lookup in a builder that does not index");
        self.by_name.get(name, |n| self.tables.node_name(n))
    }

    /// Validates ties and computes traversal orders. The builder's name
    /// index is dropped: the tree finds names from the root down.
    pub fn finish(self) -> Result<ModuleTree, Error> {
        let structure = Structure::of(&self.tables);
        self.finish_with(structure)
    }

    /// [`ModuleTreeBuilder::finish`] with the links and orders its caller
    /// made as it added the nodes ([`Structure::of`] would make the same).
    fn finish_with(self, structure: Structure) -> Result<ModuleTree, Error> {
        let mut tables = self.tables;
        for (record, start) in tables.modules.iter_mut().zip(structure.starts) {
            record.links = start;
        }
        let mut tree = ModuleTree {
            tables,
            links: structure.links,
            tied: Vec::with_capacity(self.tied_names.len()),
            preorder_pos: structure.preorder_pos,
            subtree_end: structure.subtree_end,
            preorder: structure.preorder,
            wide: OnceLock::new(),
        };
        tree.tie(&self.tied_names)?;
        Ok(tree)
    }
}

/// The links and orders of a tree, made from its tables.
struct Structure {
    /// Where each module's part of `links` starts ([`ModuleRecord::links`]).
    starts: Vec<u32>,
    links: Vec<usize>,
    preorder: Vec<ModuleId>,
    preorder_pos: Vec<usize>,
    subtree_end: Vec<usize>,
}

impl Structure {
    fn of(tables: &Tables) -> Structure {
        let (starts, links) = Self::links(tables);
        let mut structure = Structure {
            starts,
            links,
            preorder: Vec::new(),
            preorder_pos: Vec::new(),
            subtree_end: Vec::new(),
        };
        structure.orders(tables);
        structure
    }

    /// Each module's children, params and buffers as one list: children
    /// in the order they were added (ascending ids, as each was added after
    /// its parent's earlier ones), then params, then buffers.
    fn links(tables: &Tables) -> (Vec<u32>, Vec<usize>) {
        let mut next = 0u32;
        let starts: Vec<u32> = tables
            .modules
            .iter()
            .map(|record| {
                let start = next;
                next += record.children + record.params + record.buffers;
                start
            })
            .collect();
        // Where the next child, param and buffer of each module goes.
        let mut fill: Vec<[u32; 3]> = tables
            .modules
            .iter()
            .zip(&starts)
            .map(|(r, &start)| {
                let params = start + r.children;
                [start, params, params + r.params]
            })
            .collect();
        let mut links = vec![0usize; next as usize];
        for (id, record) in tables.modules.iter().enumerate().skip(1) {
            let at = &mut fill[record.parent as usize][0];
            links[*at as usize] = id;
            *at += 1;
        }
        for (id, record) in tables.tensors.iter().enumerate() {
            let list = match record.kind {
                TensorKind::Param => 1,
                TensorKind::Buffer { .. } => 2,
            };
            let at = &mut fill[record.module as usize][list];
            links[*at as usize] = id;
            *at += 1;
        }
        (starts, links)
    }

    /// Pre-order over modules (iterative: trees can be deep).
    fn orders(&mut self, tables: &Tables) {
        let n = tables.modules.len();
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
            let start = self.starts[m] as usize;
            let children = &self.links[start..start + tables.modules[m].children as usize];
            for &c in children.iter().rev() {
                stack.push((c, false));
            }
        }
        self.preorder = preorder;
        self.preorder_pos = preorder_pos;
        self.subtree_end = subtree_end;
    }
}

impl WideLinks {
    fn of(tree: &ModuleTree) -> WideLinks {
        let mut wide = WideLinks::default();
        for m in 0..tree.module_count() {
            let module = tree.module(m);
            let count = module.children.len() + module.params.len() + module.buffers.len();
            if count <= NARROW {
                continue;
            }
            let from = wide.links.len();
            wide.start.insert(m, from);
            let skip = tree.tables.modules[m].name.parts_from();
            let children = module.children.iter().map(|&c| Node::Module(c));
            let tensors = module.params.iter().chain(module.buffers);
            let nodes = children.chain(tensors.map(|&t| Node::Tensor(t)));
            let name = |at: NameAt| tree.tables.name(at);
            wide.links.extend(nodes.map(|node| {
                let at = tree.tables.name_at(node);
                let part = NameAt {
                    start: at.start + skip,
                    len: at.len - skip,
                };
                let key = PartKey::of(name(part));
                WideLink { key, part, node }
            }));
            wide.links[from..].sort_unstable_by(|a, b| {
                (a.key.cmp(&b.key)).then_with(|| name(a.part).cmp(name(b.part)))
            });
        }
        wide
    }
}

impl ModuleTree {
    /// Validates the tied groups (`names`) and records them.
    fn tie(&mut self, tied_names: &[Vec<String>]) -> Result<(), Error> {
        let tree = self;
        // Tied groups: every name must exist, be unique to one group, and all
        // members must agree on dtype and shape.
        for (g, names) in tied_names.iter().enumerate() {
            if names.len() < 2 {
                return Err(Error::tree(
                    format!("tied[{g}]"),
                    "a tied group needs at least two names",
                ));
            }
            let mut group = Vec::with_capacity(names.len());
            for name in names {
                let id = match tree.find(name) {
                    Some(Node::Tensor(t)) => t,
                    _ => {
                        return Err(Error::tree(
                            format!("tied[{g}]"),
                            format!("{name:?} is not a parameter or buffer of the tree"),
                        ));
                    }
                };
                let this = tree.tensor(id);
                if let Some(other) = this.tie_group {
                    return Err(Error::tree(
                        format!("tied[{g}]"),
                        format!("{name:?} is already in tied group {other}"),
                    ));
                }
                let first = tree.tensor(group.first().copied().unwrap_or(id));
                if first.meta != this.meta {
                    return Err(Error::tree(
                        format!("tied[{g}]"),
                        format!(
                            "{name:?} ({} {:?}) cannot share storage with {:?} ({} {:?})",
                            this.meta.dtype,
                            this.meta.shape,
                            first.name,
                            first.meta.dtype,
                            first.meta.shape
                        ),
                    ));
                }
                tree.tables.tensors[id].tie_group = g as u32;
                group.push(id);
            }
            tree.tied.push(group);
        }

        if tree.tied.is_empty() {
            return Ok(());
        }
        // The counted name of a tied tensor is its first in
        // named_module_tensors order (params pre-order, then buffers).
        let mut seen = vec![false; tree.tied.len()];
        let params = tree.preorder.iter().flat_map(|m| tree.module(*m).params);
        let buffers = tree.preorder.iter().flat_map(|m| tree.module(*m).buffers);
        let order: Vec<TensorId> = params.chain(buffers).copied().collect();
        for t in order {
            if let Some(g) = tree.tensor(t).tie_group {
                tree.tables.tensors[t].counted = !seen[g];
                seen[g] = true;
            }
        }
        let mut tied = std::mem::take(&mut tree.tied);
        for group in &mut tied {
            group.sort_by(|a, b| tree.tensor(*a).name.cmp(tree.tensor(*b).name));
        }
        tree.tied = tied;
        Ok(())
    }
}

impl ModuleTree {
    /// The number of modules, the root included.
    pub fn module_count(&self) -> usize {
        self.tables.modules.len()
    }

    /// The number of tensors.
    pub fn tensor_count(&self) -> usize {
        self.tables.tensors.len()
    }

    /// All modules, by id; the first is the root.
    pub fn modules(
        &self,
    ) -> impl ExactSizeIterator<Item = Module<'_>> + DoubleEndedIterator + Clone + '_ {
        (0..self.module_count()).map(|m| self.module(m))
    }

    /// All tensors, by id.
    pub fn tensors(
        &self,
    ) -> impl ExactSizeIterator<Item = Tensor<'_>> + DoubleEndedIterator + Clone + '_ {
        (0..self.tensor_count()).map(|t| self.tensor(t))
    }

    /// A module.
    // Always inlined: a caller reads one or two fields, and the others'
    // lookups then vanish (a call cost ~60 instructions on every
    // `tree.module(m).parent`).
    #[inline(always)]
    pub fn module(&self, id: ModuleId) -> Module<'_> {
        let r = &self.tables.modules[id];
        let start = r.links as usize;
        let links = &self.links[start..start + (r.children + r.params + r.buffers) as usize];
        let (children, own) = links.split_at(r.children as usize);
        let (params, buffers) = own.split_at(r.params as usize);
        Module {
            name: self.tables.name(r.name),
            class: &self.tables.classes[r.class as usize],
            parent: (r.parent != NONE).then_some(r.parent as usize),
            children,
            params,
            buffers,
        }
    }

    /// A tensor.
    #[inline(always)]
    pub fn tensor(&self, id: TensorId) -> Tensor<'_> {
        let r = &self.tables.tensors[id];
        Tensor {
            name: self.tables.name(r.name),
            module: r.module as usize,
            meta: &r.meta,
            kind: r.kind,
            tie_group: (r.tie_group != NONE).then_some(r.tie_group as usize),
            counted: r.counted,
        }
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
            .map(|g| g.iter().map(|t| self.tensor(*t).name.to_string()).collect())
            .collect()
    }

    /// Looks a module or tensor up by full name (`""` is the root).
    pub fn find(&self, name: &str) -> Option<Node> {
        if name.is_empty() {
            return Some(Node::Module(0));
        }
        let mut node = Node::Module(0);
        for part in name.split('.') {
            let Node::Module(m) = node else {
                return None;
            };
            node = self.link_named(m, part)?;
        }
        Some(node)
    }

    /// The child, param or buffer of `m` whose name ends in `.part` (or is
    /// `part`, under the root). Siblings' names differ, so at most one does.
    fn link_named(&self, m: ModuleId, part: &str) -> Option<Node> {
        let r = &self.tables.modules[m];
        let start = r.links as usize;
        let count = (r.children + r.params + r.buffers) as usize;
        let links = &self.links[start..start + count];
        let (children, tensors) = links.split_at(r.children as usize);
        // A link's name is its module's, a dot and its part: only one of
        // the right length is read.
        let skip = r.name.parts_from();
        let is_part = |at: NameAt| {
            at.len as usize == skip as usize + part.len()
                && self.tables.names.as_bytes()[(at.start + skip) as usize..][..part.len()]
                    == *part.as_bytes()
        };
        // The children of a list (`ModuleList`, `Sequential`) are named by
        // their place in it.
        if let Ok(i) = part.parse::<usize>()
            && let Some(&c) = children.get(i)
            && is_part(self.tables.modules[c].name)
        {
            return Some(Node::Module(c));
        }
        if count <= NARROW {
            return children
                .iter()
                .find(|&&c| is_part(self.tables.modules[c].name))
                .map(|&c| Node::Module(c))
                .or_else(|| {
                    tensors
                        .iter()
                        .find(|&&t| is_part(self.tables.tensors[t].name))
                        .map(|&t| Node::Tensor(t))
                });
        }
        let wide = self.wide.get_or_init(|| WideLinks::of(self));
        let from = wide.start[&m];
        let sorted = &wide.links[from..from + count];
        let key = PartKey::of(part);
        let at = sorted
            .binary_search_by(|link| {
                (link.key.cmp(&key)).then_with(|| self.tables.name(link.part).cmp(part))
            })
            .ok()?;
        Some(sorted[at].node)
    }

    /// Modules in pre-order (`named_modules()` order).
    pub fn preorder(&self) -> &[ModuleId] {
        &self.preorder
    }

    /// Module `m` and every module below it, in pre-order: one slice of
    /// [`ModuleTree::preorder`], found without a scan.
    pub fn subtree(&self, m: ModuleId) -> &[ModuleId] {
        &self.preorder[self.preorder_pos[m]..self.subtree_end[m]]
    }

    /// True when `m` is `ancestor` or lies below it.
    pub fn is_within(&self, m: ModuleId, ancestor: ModuleId) -> bool {
        let p = self.preorder_pos[m];
        p >= self.preorder_pos[ancestor] && p < self.subtree_end[ancestor]
    }

    /// The name of a node.
    pub fn node_name(&self, node: Node) -> &str {
        self.tables.node_name(node)
    }

    /// Accelerate's `named_module_tensors(model, recurse=True)`: parameters
    /// in `named_parameters()` order with tied duplicates removed, then all
    /// buffers in `named_buffers()` order.
    pub fn named_module_tensors(&self) -> Vec<TensorId> {
        let mut out = Vec::with_capacity(self.tensor_count());
        let mut seen_group = vec![false; self.tied.len()];
        let mut keep = |t: TensorId, out: &mut Vec<TensorId>| {
            if let Some(g) = self.tensor(t).tie_group {
                if seen_group[g] {
                    return;
                }
                seen_group[g] = true;
            }
            out.push(t);
        };
        for &m in &self.preorder {
            for &t in self.module(m).params {
                keep(t, &mut out);
            }
        }
        for &m in &self.preorder {
            for &t in self.module(m).buffers {
                keep(t, &mut out);
            }
        }
        out
    }

    /// The tensors of `model.state_dict()`, in its order: per module in
    /// pre-order, its parameters then its persistent buffers. Tied names all
    /// appear.
    pub fn state_dict(&self) -> Vec<TensorId> {
        let mut out = Vec::with_capacity(self.tensor_count());
        for &m in &self.preorder {
            let module = self.module(m);
            out.extend(module.params.iter().copied());
            out.extend(module.buffers.iter().copied().filter(|t| {
                matches!(
                    self.tensor(*t).kind,
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
            debug_assert!(tree.tensor(t).tie_group.is_none());
            tree.tables.tensors[t].meta = meta;
        }
        tree
    }

    /// Number of parameters (tied storages counted once).
    pub fn parameter_count(&self) -> u64 {
        self.tensors()
            .filter(|t| t.kind == TensorKind::Param && t.counted)
            .map(|t| t.meta.numel() as u64)
            .sum()
    }
}

/// Checks that `tree`'s links and orders are what [`Structure::of`] makes
/// of its tables (for a tree whose builder was given them).
#[cfg(test)]
pub(crate) fn assert_structure_of_tables(tree: &ModuleTree) {
    let made = Structure::of(&tree.tables);
    assert_eq!(tree.preorder, made.preorder);
    assert_eq!(tree.preorder_pos, made.preorder_pos);
    assert_eq!(tree.subtree_end, made.subtree_end);
    for (m, record) in tree.tables.modules.iter().enumerate() {
        let count = (record.children + record.params + record.buffers) as usize;
        let own = &tree.links[record.links as usize..][..count];
        assert_eq!(
            own,
            &made.links[made.starts[m] as usize..][..count],
            "module {m}"
        );
    }
}

#[cfg(test)]
mod tests {
    use bm_tensor::DType;

    use super::*;

    #[test]
    fn the_name_index_finds_every_node_and_refuses_duplicates() {
        let mut b = ModuleTreeBuilder::new("Root");
        assert_eq!(b.module_id(""), Some(0));
        assert_eq!(b.module_id("missing"), None);
        // Enough nodes to grow the table several times.
        for i in 0..300 {
            let m = b.add_module(0, &i.to_string(), "Block").unwrap();
            b.add_param(m, "w", TensorMeta::new(DType::F32, [2]))
                .unwrap();
        }
        let e = b.add_module(0, "7", "Block").unwrap_err().to_string();
        assert!(e.contains("at 7: duplicate name among siblings"), "{e}");
        let e = b
            // Module 8 is "7".
            .add_buffer(8, "w", TensorMeta::new(DType::F32, [2]), true)
            .unwrap_err()
            .to_string();
        assert!(e.contains("at 7.w: duplicate name"), "{e}");
        b.tie(&["5.w", "299.w"]);
        let tree = b.finish().unwrap();
        for i in 0..300 {
            let module = tree.find(&i.to_string());
            assert_eq!(module, Some(Node::Module(i + 1)));
            assert_eq!(tree.find(&format!("{i}.w")), Some(Node::Tensor(i)));
        }
        assert_eq!(tree.find("300"), None);
        assert_eq!(tree.find("5.w.x"), None);
        assert_eq!(tree.tied_names(), [["299.w", "5.w"]]);
    }

    #[test]
    fn names_are_found_from_the_root_down_in_narrow_and_wide_modules() {
        let meta = || TensorMeta::new(DType::F32, [2]);
        let mut b = ModuleTreeBuilder::new("Root");
        // A wide module (more than `NARROW` links) of children, params and
        // buffers whose names sort apart from the order they were added,
        // beside narrow ones.
        let wide = b.add_module(0, "experts", "List").unwrap();
        for i in (0..3 * NARROW).rev() {
            let e = b.add_module(wide, &i.to_string(), "Expert").unwrap();
            b.add_param(e, "w", meta()).unwrap();
        }
        b.add_param(wide, "scale", meta()).unwrap();
        // Parts alike in their length and first 8 bytes.
        b.add_param(wide, "projection_b", meta()).unwrap();
        b.add_param(wide, "projection_a", meta()).unwrap();
        b.add_buffer(wide, "ids", meta(), false).unwrap();
        // A list, its children named by their place.
        let list = b.add_module(0, "layers", "ModuleList").unwrap();
        for i in 0..NARROW + 2 {
            b.add_module(list, &i.to_string(), "Layer").unwrap();
        }
        let narrow = b.add_module(0, "norm", "Norm").unwrap();
        b.add_param(narrow, "weight", meta()).unwrap();
        b.add_param(0, "bias", meta()).unwrap();
        let tree = b.finish().unwrap();
        for m in 0..tree.module_count() {
            assert_eq!(tree.find(tree.module(m).name), Some(Node::Module(m)));
        }
        for t in 0..tree.tensor_count() {
            let name = tree.tensor(t).name;
            assert_eq!(tree.find(name), Some(Node::Tensor(t)), "{name}");
        }
        for missing in [
            "experts.96",
            "experts.1.w.x",
            "experts.0x",
            "experts.",
            ".experts",
            "experts..1",
            "experts.scale.w",
            "experts.projection_c",
            "experts.projection",
            "experts.+5",
            "experts.05",
            "layers.+5",
            "layers.34",
            "norm.weigh",
            "bias.x",
            "Root",
            "expert",
        ] {
            assert_eq!(tree.find(missing), None, "{missing}");
        }
        assert_eq!(tree.find(""), Some(Node::Module(0)));
    }

    #[test]
    fn a_subtree_is_the_module_and_everything_below_it_in_preorder() {
        let mut b = ModuleTreeBuilder::new("Root");
        let a = b.add_module(0, "a", "L").unwrap();
        let c = b.add_module(0, "c", "L").unwrap();
        let ax = b.add_module(a, "x", "L").unwrap();
        let axy = b.add_module(ax, "y", "L").unwrap();
        let az = b.add_module(a, "z", "L").unwrap();
        let tree = b.finish().unwrap();
        assert_eq!(tree.subtree(0), tree.preorder());
        assert_eq!(tree.subtree(a), [a, ax, axy, az]);
        assert_eq!(tree.subtree(ax), [ax, axy]);
        assert_eq!(tree.subtree(c), [c]);
        for m in 0..tree.module_count() {
            for &x in tree.preorder() {
                assert_eq!(tree.subtree(m).contains(&x), tree.is_within(x, m));
            }
        }
    }
}
