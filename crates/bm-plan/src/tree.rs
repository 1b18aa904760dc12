//! The module tree: modules with class names, their parameters and buffers
//! in registration order, and the groups of tied parameters. Its JSON
//! document, `bigmodel-module-tree/1`, is read and written in `document.rs`.

use std::hash::BuildHasher;

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
    #[inline(always)]
    fn name(&self, at: NameAt) -> &str {
        &self.names[at.start as usize..(at.start + at.len) as usize]
    }

    fn node_name(&self, node: Node) -> &str {
        match node {
            Node::Module(m) => self.name(self.modules[m].name),
            Node::Tensor(t) => self.name(self.tensors[t].name),
        }
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
    by_name: NameIndex,
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
    /// Node codes added but not yet in `by_name`, in the order they were
    /// added, when the builder indexes in bulk
    /// ([`ModuleTreeBuilder::index_later`]); `None` when each name is
    /// indexed as it is added.
    unindexed: Option<Vec<u32>>,
}

/// Full names to nodes, for [`ModuleTree::find`] and the builder's checks.
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

/// [`NameIndex::insert_all`] inserts by runs of home slots, up to
/// `2^RUN_BITS` runs (of 64 slots each for a table of 2^18).
const RUN_BITS: u32 = 12;

/// `f` of every element, on two threads when there are this many or more.
const TWO_THREADS_FROM: usize = 1 << 16;

/// `f` of every element of `items`, in order; a large slice is split in two
/// halves mapped on two threads (hashing a large tree's names is a tenth
/// of reading its document, and nothing else waits on it).
fn map_halves<T: Sync>(items: &[T], f: impl Fn(&T) -> u32 + Sync) -> Vec<u32> {
    let threads = std::thread::available_parallelism().map_or(1, usize::from);
    if items.len() < TWO_THREADS_FROM || threads < 2 {
        return items.iter().map(f).collect();
    }
    let (first, second) = items.split_at(items.len() / 2);
    std::thread::scope(|scope| {
        let second = scope.spawn(|| second.iter().map(&f).collect::<Vec<u32>>());
        let mut out = Vec::with_capacity(items.len());
        out.extend(first.iter().map(&f));
        match second.join() {
            Ok(rest) => out.extend(rest),
            Err(panic) => std::panic::resume_unwind(panic),
        }
        out
    })
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
        if code % 2 == 0 {
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

    /// Adds the nodes of `codes` ([`NameIndex::code`]s, in the order they
    /// were added to the tree) under their names. Inserting them in the
    /// order of their home slots walks the table front to back: one
    /// insertion at a time costs a cache miss each, which was most of the
    /// time of building a 100k-node tree. A name taken twice has one home,
    /// and nodes of one run of homes go in the order they were added, so the node
    /// returned for a taken name is the later one; of several, the first
    /// added (where adding one at a time would have stopped). The index is
    /// then incomplete and the tree must not be finished.
    fn insert_all<'n>(
        &mut self,
        codes: &[u32],
        name_of: impl Fn(Node) -> &'n str + Sync,
    ) -> Result<(), Node> {
        let node = |code: u32| Self::node(u64::from(code) + 1);
        self.reserve(codes.len());
        let mask = self.slots.len() - 1;
        // Tags are 32 bits (see `tag`): kept in 32 to touch half the memory.
        let tags = map_halves(codes, |&code| self.tag(name_of(node(code))) as u32);
        // (tag, position in `codes`) by runs of home slots (a counting sort
        // on the home's top bits, which keeps the order nodes were added in
        // within a run): near enough to front to back for the cache.
        let run_bits = mask.count_ones().min(RUN_BITS);
        let run_of = |tag: u32| (tag as usize & mask) >> (mask.count_ones() - run_bits);
        let mut starts = vec![0u32; (1 << run_bits) + 1];
        for &tag in &tags {
            starts[run_of(tag) + 1] += 1;
        }
        for r in 1..starts.len() {
            starts[r] += starts[r - 1];
        }
        let mut order = vec![(0u32, 0u32); codes.len()];
        for (i, &tag) in tags.iter().enumerate() {
            let at = &mut starts[run_of(tag)];
            order[*at as usize] = (tag, i as u32);
            *at += 1;
        }
        let mut first_taken: Option<u32> = None;
        'next: for (tag, i) in order {
            let tag = u64::from(tag);
            let code = codes[i as usize];
            // The probe of `slot`, reading a name only on a matching tag:
            // reading each one would be the cache miss per node again.
            let mut slot = tag as usize & mask;
            while self.slots[slot] != 0 {
                let taken = self.slots[slot];
                if taken >> 32 == tag && name_of(Self::node(taken)) == name_of(node(code)) {
                    first_taken = Some(first_taken.map_or(i, |f| f.min(i)));
                    continue 'next;
                }
                slot = (slot + 1) & mask;
            }
            self.slots[slot] = tag << 32 | (u64::from(code) + 1);
            self.len += 1;
        }
        match first_taken {
            Some(i) => Err(node(codes[i as usize])),
            None => Ok(()),
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
            unindexed: None,
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
        if let Some(unindexed) = &mut self.unindexed {
            unindexed.push(NameIndex::code(node) as u32);
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

    /// From now on, names are checked and indexed in bulk by
    /// [`ModuleTreeBuilder::finish_indexing`] instead of one at a time: much
    /// faster for a large tree, for a builder that looks nothing up by name
    /// meanwhile ([`ModuleTreeBuilder::module_id`] sees only what was
    /// indexed).
    pub(crate) fn index_later(&mut self) {
        self.unindexed.get_or_insert_with(Vec::new);
    }

    /// Makes room for this many more modules and tensors, and bytes of
    /// names.
    pub(crate) fn reserve(&mut self, modules: usize, tensors: usize, name_bytes: usize) {
        self.tables.modules.reserve(modules);
        self.tables.tensors.reserve(tensors);
        self.tables.names.reserve(name_bytes);
        self.by_name.reserve(modules + tensors);
        if let Some(unindexed) = &mut self.unindexed {
            unindexed.reserve(modules + tensors);
        }
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
        debug_assert!(
            self.unindexed.is_none(),
            "a lookup while names wait to be indexed"
        );
        self.by_name.get(name, |n| self.tables.node_name(n))
    }

    /// Validates ties and computes traversal orders.
    pub fn finish(self) -> Result<ModuleTree, Error> {
        self.finish_indexing().map_err(|(_, e)| e)
    }

    /// [`ModuleTreeBuilder::finish`], which also indexes the names waiting
    /// since [`ModuleTreeBuilder::index_later`]: a name taken twice is an
    /// error about the later node, returned with it. The index and the
    /// orders need nothing of each other, so a large tree's are made side
    /// by side on two threads.
    pub(crate) fn finish_indexing(mut self) -> Result<ModuleTree, (Option<Node>, Error)> {
        let unindexed = self.unindexed.take();
        let tables = &self.tables;
        let by_name = &mut self.by_name;
        let index = move || match unindexed {
            Some(codes) => by_name.insert_all(&codes, |n| tables.node_name(n)),
            None => Ok(()),
        };
        let structure = || Structure::of(tables);
        let (indexed, structure) = if tables.modules.len() + tables.tensors.len()
            >= TWO_THREADS_FROM
            && std::thread::available_parallelism().is_ok_and(|n| n.get() >= 2)
        {
            std::thread::scope(|scope| {
                let structure = scope.spawn(structure);
                let indexed = index();
                match structure.join() {
                    Ok(structure) => (indexed, structure),
                    Err(panic) => std::panic::resume_unwind(panic),
                }
            })
        } else {
            (index(), structure())
        };
        indexed.map_err(|node| {
            let name = self.tables.node_name(node).to_string();
            (Some(node), Error::tree(name, DUPLICATE))
        })?;
        for (record, start) in self.tables.modules.iter_mut().zip(structure.starts) {
            record.links = start;
        }
        let mut tree = ModuleTree {
            tables: self.tables,
            links: structure.links,
            tied: Vec::with_capacity(self.tied_names.len()),
            preorder_pos: structure.preorder_pos,
            subtree_end: structure.subtree_end,
            preorder: structure.preorder,
            by_name: self.by_name,
        };
        let tied_names = std::mem::take(&mut self.tied_names);
        tree.tie(&tied_names).map_err(|e| (None, e))?;
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
        self.by_name.get(name, |n| self.tables.node_name(n))
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
    fn names_indexed_in_bulk_find_the_same_nodes_and_the_same_first_duplicate() {
        let meta = || TensorMeta::new(DType::F32, [2]);
        let build = |bulk: bool| {
            let mut b = ModuleTreeBuilder::new("Root");
            if bulk {
                b.index_later();
            }
            for i in 0..300 {
                let m = b.add_module(0, &i.to_string(), "Block").unwrap();
                b.add_param(m, "w", meta()).unwrap();
            }
            b
        };
        let one_at_a_time = build(false).finish().unwrap();
        let bulk = build(true).finish().unwrap();
        for i in 0..300 {
            for name in [i.to_string(), format!("{i}.w")] {
                assert_eq!(bulk.find(&name), one_at_a_time.find(&name), "{name}");
            }
        }
        // Two names taken twice: the first refused is the one adding one at
        // a time stops at.
        let mut b = build(true);
        let m = b.add_module(0, "x", "Block").unwrap();
        b.add_buffer(ModuleTreeBuilder::ROOT + 8, "w", meta(), true)
            .unwrap();
        b.add_module(0, "250", "Block").unwrap();
        b.add_param(m, "w", meta()).unwrap();
        let (node, e) = b.finish_indexing().unwrap_err();
        assert_eq!(node, Some(Node::Tensor(300)));
        assert!(e.to_string().contains("at 7.w: duplicate name"), "{e}");
    }

    #[test]
    fn a_large_tree_indexed_beside_its_orders_is_the_tree_built_one_name_at_a_time() {
        // Past `TWO_THREADS_FROM` nodes, the index and the orders are made
        // on two threads.
        let build = |bulk: bool| {
            let mut b = ModuleTreeBuilder::new("Root");
            if bulk {
                b.index_later();
            }
            for i in 0..260 {
                let m = b.add_module(0, &i.to_string(), "Block").unwrap();
                let inner = b.add_module(m, "inner", "Linear").unwrap();
                for p in 0..250 {
                    b.add_param(inner, &format!("p{p}"), TensorMeta::new(DType::F32, [2]))
                        .unwrap();
                }
                b.add_buffer(m, "buf", TensorMeta::new(DType::F32, [1]), i % 2 == 0)
                    .unwrap();
            }
            b.tie(&["7.inner.p3", "9.inner.p3"]);
            b.finish().unwrap()
        };
        let (bulk, one) = (build(true), build(false));
        assert!(bulk.module_count() + bulk.tensor_count() >= TWO_THREADS_FROM);
        assert_eq!(bulk.preorder(), one.preorder());
        for m in 0..one.module_count() {
            let (a, b) = (bulk.module(m), one.module(m));
            assert_eq!(
                (a.name, a.children, a.params, a.buffers),
                (b.name, b.children, b.params, b.buffers)
            );
            assert_eq!(bulk.subtree(m), one.subtree(m));
            assert_eq!(bulk.find(a.name), Some(Node::Module(m)));
        }
        for t in 0..one.tensor_count() {
            assert_eq!(bulk.find(one.tensor(t).name), Some(Node::Tensor(t)));
        }
        assert_eq!(bulk.tied_names(), [["7.inner.p3", "9.inner.p3"]]);
    }

    #[test]
    fn a_large_slice_mapped_in_halves_keeps_its_order() {
        let items: Vec<u32> = (0..TWO_THREADS_FROM as u32 + 3).collect();
        let mapped = map_halves(&items, |x| x.wrapping_mul(2_654_435_761));
        let one_by_one: Vec<u32> = items
            .iter()
            .map(|x| x.wrapping_mul(2_654_435_761))
            .collect();
        assert_eq!(mapped, one_by_one);
        assert_eq!(map_halves(&items[..5], |x| x + 1), [1, 2, 3, 4, 5]);
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
