//! The result of planning (an ordered device map) and the options both
//! planners share; `check_device_map` and `clean_device_map`.

use std::collections::{HashMap, HashSet};

use bm_tensor::DType;

use crate::Error;
use crate::device::{Device, MaxMemory};
use crate::ledger::{Ledger, LedgerItem};
use crate::sizes::{ModuleSizes, SizeOptions, SizeRule};
use crate::tree::{ModuleId, ModuleTree, Node};

/// How budgets are shared out, as `device_map=` spells it in Accelerate.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Mode {
    /// Accelerate's `"auto"`: the same as `balanced`.
    #[default]
    Auto,
    /// Spread the model evenly over the GPUs.
    Balanced,
    /// Like `balanced`, but keep GPU 0 as empty as possible.
    BalancedLow0,
    /// Fill each device in turn.
    Sequential,
}

impl Mode {
    /// Parses `auto`, `balanced`, `balanced_low_0` or `sequential`.
    pub fn parse(text: &str) -> Option<Mode> {
        Some(match text {
            "auto" => Mode::Auto,
            "balanced" => Mode::Balanced,
            "balanced_low_0" => Mode::BalancedLow0,
            "sequential" => Mode::Sequential,
            _ => return None,
        })
    }
}

/// Which planner answers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Compat {
    /// bigmodel's planner (see [`crate::auto`]).
    #[default]
    Auto,
    /// Accelerate's planner, bug for bug except the documented bugs
    /// (see [`crate::accelerate`] and docs/compat.md).
    Accelerate,
}

/// Everything a plan depends on besides the tree.
#[derive(Clone, Debug, Default)]
pub struct PlanOptions {
    /// Budget per device.
    pub max_memory: MaxMemory,
    /// False when `max_memory` holds defaults read from the machine
    /// (Accelerate then keeps 10 % of a single GPU free).
    pub max_memory_from_user: bool,
    /// Class names that are never split across devices.
    pub no_split: Vec<String>,
    /// The dtype weights are loaded in.
    pub dtype: Option<DType>,
    /// Per-tensor dtype overrides.
    pub special_dtypes: HashMap<String, DType>,
    /// How budgets are shared out.
    pub mode: Mode,
    /// Offloaded modules keep their buffers offloaded too.
    pub offload_buffers: bool,
    /// Accelerate's `fallback_allocation` (compat planner only).
    pub fallback_allocation: bool,
    /// Bytes held back per device for activations and the like (auto planner).
    pub reserve: MaxMemory,
    /// Record the decision trace (`--explain`); off by default because it
    /// costs a string per decision.
    pub explain: bool,
    /// Extra bytes a module needs at run time where it executes, e.g. the KV
    /// cache of a decoder layer (auto planner).
    pub runtime_bytes: Vec<(ModuleId, u64)>,
    /// How many offloaded units the dispatch layer loads ahead of the one
    /// running (its prefetch depth). The auto planner holds back room for
    /// `1 + prefetch_depth` of the largest offloaded units on the execution
    /// device, so prefetching can overlap copies with compute, and plans
    /// with less depth when that room would leave the device nothing else.
    pub prefetch_depth: usize,
    /// Transient bytes a module needs while it executes (its activation
    /// peak, [`crate::ledger::ModelShape::activation_peak`]): a device holds
    /// the largest of the modules it executes, not their sum (auto planner).
    pub activation_peaks: Vec<(ModuleId, u64)>,
    /// Bytes the module computing the head holds for its output (the
    /// logits buffer), where it executes (auto planner).
    pub logits_bytes: Vec<(ModuleId, u64)>,
    /// Fixed costs per device besides the model (pinned staging, GEMM
    /// workspace, CUDA context), measured or known by the caller: taken off
    /// the device's budget and listed in the ledger (auto planner).
    pub overheads: Vec<(Device, LedgerItem, u64)>,
    /// Mixture-of-experts models (`--experts-on`, llama.cpp's
    /// `--n-cpu-moe`): every expert is placed on its own. The auto planner
    /// places the rest of every layer first, then each expert beside the
    /// rest of its layer while that device computes and has room, then on
    /// this device (the CPU or disk), then a slower one
    /// ([`crate::auto`]); Accelerate's planner places whole layers and
    /// the experts are moved here afterwards ([`crate::place_experts`]).
    /// The ledger of any map counts experts as the units they then are.
    pub experts_on: Option<Device>,
}

impl PlanOptions {
    /// The sizes of `tree`'s modules and tensors in these options' dtype
    /// and special dtypes, counted by `rule`.
    pub fn sizes(&self, tree: &ModuleTree, rule: SizeRule) -> ModuleSizes {
        ModuleSizes::compute(
            tree,
            &SizeOptions {
                dtype: self.dtype,
                special_dtypes: self.special_dtypes.clone(),
                rule,
            },
        )
    }
}

/// A device per module (or tensor), in traversal order.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DeviceMap {
    entries: Vec<(String, Device)>,
}

/// A [`DeviceMap`] indexed by key ([`DeviceMap::lookup`]).
#[derive(Clone, Debug)]
pub struct DeviceLookup<'m> {
    keys: HashMap<&'m str, Device>,
}

/// A [`DeviceMap`] resolved on a tree ([`DeviceMap::resolve`]): the
/// device of each module and tensor by id.
#[derive(Clone, Debug)]
pub struct ResolvedMap {
    /// Per [`ModuleId`].
    pub module: Vec<Option<Device>>,
    /// Per tensor id.
    pub tensor: Vec<Option<Device>>,
}

impl ResolvedMap {
    /// The device of a node.
    pub fn of(&self, node: Node) -> Option<Device> {
        match node {
            Node::Module(m) => self.module[m],
            Node::Tensor(t) => self.tensor[t],
        }
    }
}

impl DeviceLookup<'_> {
    /// The device a tensor or module resolves to: the longest key that is
    /// `name` or a dotted prefix of it (`""` covers everything).
    pub fn device_of(&self, name: &str) -> Option<Device> {
        let mut prefix = name;
        loop {
            if let Some(d) = self.keys.get(prefix) {
                return Some(*d);
            }
            match prefix.rfind('.') {
                Some(i) => prefix = &prefix[..i],
                None => return self.keys.get("").copied(),
            }
        }
    }
}

impl DeviceMap {
    /// Wraps entries as given.
    pub fn from_entries(entries: Vec<(String, Device)>) -> Self {
        DeviceMap { entries }
    }

    /// Parses a `{name: 0 | "cpu" | "disk"}` JSON object.
    pub fn from_json(value: &serde_json::Value) -> Result<Self, Error> {
        let object = value.as_object().ok_or_else(|| {
            Error::BadDeviceMap("expected a JSON object {module: 0 | \"cpu\" | \"disk\"}".into())
        })?;
        let mut entries = Vec::with_capacity(object.len());
        for (name, device) in object {
            let device = Device::from_json(device)
                .map_err(|e| Error::BadDeviceMap(format!("module {name:?}: {e}")))?;
            entries.push((name.clone(), device));
        }
        Ok(DeviceMap { entries })
    }

    /// The JSON object form, in order.
    pub fn to_json(&self) -> serde_json::Value {
        let mut object = serde_json::Map::new();
        for (name, device) in &self.entries {
            object.insert(name.clone(), device.to_json());
        }
        serde_json::Value::Object(object)
    }

    /// Entries in order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, Device)> + '_ {
        self.entries.iter().map(|(n, d)| (n.as_str(), *d))
    }

    /// Number of entries.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The device of exactly `name`.
    pub fn get(&self, name: &str) -> Option<Device> {
        self.entries
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, d)| *d)
    }

    /// The device a tensor or module resolves to: its longest matching key.
    /// This indexes the map for the one name; to resolve many names, index
    /// it once with [`DeviceMap::lookup`].
    pub fn device_of(&self, name: &str) -> Option<Device> {
        self.lookup().device_of(name)
    }

    /// The device of every module and tensor of `tree`, as
    /// [`DeviceMap::device_of`] would give it for each name (`None` where no
    /// key covers it), in one pass down the tree: each key is looked up
    /// once, and a node without a key of its own takes its module's. For a
    /// 100k-module tree this is one hash lookup per key rather than one per
    /// dotted prefix of every name. Keys that name nothing in the tree are
    /// ignored, as they match no name there.
    pub fn resolve(&self, tree: &ModuleTree) -> ResolvedMap {
        let mut module = vec![None; tree.modules().len()];
        let mut tensor = vec![None; tree.tensors().len()];
        for (name, device) in self.iter() {
            match tree.find(name) {
                Some(Node::Module(m)) => module[m] = Some(device),
                Some(Node::Tensor(t)) => tensor[t] = Some(device),
                None => {}
            }
        }
        for &m in tree.preorder() {
            if module[m].is_none()
                && let Some(p) = tree.module(m).parent
            {
                module[m] = module[p];
            }
        }
        for (t, device) in tensor.iter_mut().enumerate() {
            if device.is_none() {
                *device = module[tree.tensor(t).module];
            }
        }
        ResolvedMap { module, tensor }
    }

    /// The map indexed by key, for resolving many names.
    pub fn lookup(&self) -> DeviceLookup<'_> {
        DeviceLookup {
            keys: self.iter().collect(),
        }
    }

    /// Bytes per device under this map, in device order: each tensor of
    /// `tree` where its longest key puts it, at its size in `sizes`.
    pub fn bytes_per_device(&self, tree: &ModuleTree, sizes: &ModuleSizes) -> Vec<(Device, u64)> {
        let resolved = self.resolve(tree);
        let mut bytes: Vec<(Device, u64)> = Vec::new();
        for (i, device) in resolved.tensor.iter().enumerate() {
            if let Some(d) = *device {
                match bytes.iter_mut().find(|(x, _)| *x == d) {
                    Some((_, b)) => *b = b.saturating_add(sizes.tensor[i]),
                    None => bytes.push((d, sizes.tensor[i])),
                }
            }
        }
        bytes.sort();
        bytes
    }

    /// Accelerate's `clean_device_map`: every set of at least two keys under
    /// one module that share a device becomes that module's key. Unlike
    /// Accelerate (which goes through a `set`), the result is put in
    /// traversal order.
    pub fn clean(&mut self, tree: &ModuleTree) {
        // A trie of the dotted keys.
        struct TrieNode {
            children: Vec<(String, usize)>,
            key: Option<Device>,
        }
        let mut nodes = vec![TrieNode {
            children: Vec::new(),
            key: None,
        }];
        let mut child_index: HashMap<(usize, String), usize> = HashMap::new();
        for (name, device) in &self.entries {
            let mut at = 0;
            if !name.is_empty() {
                for part in name.split('.') {
                    let next = match child_index.get(&(at, part.to_string())) {
                        Some(&n) => n,
                        None => {
                            nodes.push(TrieNode {
                                children: Vec::new(),
                                key: None,
                            });
                            let n = nodes.len() - 1;
                            nodes[at].children.push((part.to_string(), n));
                            child_index.insert((at, part.to_string()), n);
                            n
                        }
                    };
                    at = next;
                }
            }
            nodes[at].key = Some(*device);
        }
        // For each trie node: number of keys strictly below it and whether they
        // all share one device (children come after parents in `nodes`).
        let mut below = vec![0usize; nodes.len()];
        let mut device_below: Vec<Option<Option<Device>>> = vec![None; nodes.len()];
        for n in (0..nodes.len()).rev() {
            let mut count = 0;
            let mut shared: Option<Option<Device>> = None;
            let merge = |d: Option<Device>, shared: &mut Option<Option<Device>>| match shared {
                None => *shared = Some(d),
                Some(s) if *s != d => *shared = Some(None),
                _ => {}
            };
            for (_, c) in &nodes[n].children {
                if let Some(d) = nodes[*c].key {
                    count += 1;
                    merge(Some(d), &mut shared);
                }
                count += below[*c];
                if below[*c] > 0 {
                    merge(device_below[*c].flatten(), &mut shared);
                }
            }
            below[n] = count;
            device_below[n] = shared;
        }
        // Walk down: collapse where at least two keys below share a device.
        let mut out = Vec::new();
        let mut stack = vec![(0usize, String::new())];
        while let Some((n, name)) = stack.pop() {
            if let Some(d) = nodes[n].key
                && (n != 0 || below[n] == 0)
            {
                out.push((name.clone(), d));
            }
            if below[n] >= 2
                && let Some(Some(d)) = device_below[n]
                && nodes[n].key.is_none_or(|k| k == d)
            {
                if nodes[n].key.is_none() {
                    out.push((name, d));
                }
                continue;
            }
            for (part, c) in &nodes[n].children {
                let child_name = if name.is_empty() {
                    part.clone()
                } else {
                    format!("{name}.{part}")
                };
                stack.push((*c, child_name));
            }
        }
        self.entries = out;
        self.sort_traversal(tree);
    }

    /// Sorts the keys in traversal order: a module's direct parameters, then
    /// its children, then its direct buffers, recursively. Keys that name
    /// nothing in the tree go last, in their current order.
    pub fn sort_traversal(&mut self, tree: &ModuleTree) {
        let keys: Vec<Option<Vec<usize>>> = self
            .entries
            .iter()
            .map(|(n, _)| traversal_key(tree, n))
            .collect();
        let mut order: Vec<usize> = (0..self.entries.len()).collect();
        order.sort_by(|a, b| match (&keys[*a], &keys[*b]) {
            (Some(x), Some(y)) => x.cmp(y),
            (Some(_), None) => std::cmp::Ordering::Less,
            (None, Some(_)) => std::cmp::Ordering::Greater,
            (None, None) => a.cmp(b),
        });
        self.entries = order.into_iter().map(|i| self.entries[i].clone()).collect();
    }
}

/// The path of positions from the root to `name`, where a module's slots are
/// its params, then its children, then its buffers.
fn traversal_key(tree: &ModuleTree, name: &str) -> Option<Vec<usize>> {
    let node = tree.find(name)?;
    let mut path = Vec::new();
    let (mut module, slot) = match node {
        Node::Module(m) => (m, None),
        Node::Tensor(t) => {
            let tensor = tree.tensor(t);
            let owner = tree.module(tensor.module);
            let slot = if let Some(i) = place_in(owner.params, t) {
                i
            } else {
                owner.params.len() + owner.children.len() + place_in(owner.buffers, t)?
            };
            (tensor.module, Some(slot))
        }
    };
    if let Some(s) = slot {
        path.push(s);
    }
    while let Some(parent) = tree.module(module).parent {
        let p = tree.module(parent);
        let i = place_in(p.children, module)?;
        path.push(p.params.len() + i);
        module = parent;
    }
    path.reverse();
    Some(path)
}

/// Where `id` is in `list`: found at once where the list's ids are
/// consecutive, as a module's children, params or buffers added together
/// are (a list of 512 experts was a scan of 256 on average per key).
fn place_in(list: &[usize], id: usize) -> Option<usize> {
    let at_once = list
        .first()
        .and_then(|&first| id.checked_sub(first))
        .filter(|&i| list.get(i) == Some(&id));
    at_once.or_else(|| list.iter().position(|&x| x == id))
}

/// A device map with what was used to compute it.
#[derive(Clone, Debug, Default)]
pub struct Plan {
    /// Module (or tensor) to device, in traversal order.
    pub device_map: DeviceMap,
    /// The budgets used, after balancing.
    pub max_memory: MaxMemory,
    /// Bytes placed per device (weights and buffers, not reserves).
    pub device_bytes: Vec<(Device, u64)>,
    /// Warnings (Accelerate's, or the planner's own).
    pub warnings: Vec<String>,
    /// Informational messages (Accelerate's `logger.info`).
    pub info: Vec<String>,
    /// The trace printed by `--explain`.
    pub trace: Vec<String>,
    /// What each device must hold to run the plan (auto planner; empty for
    /// Accelerate's, which keeps no ledger).
    pub ledger: Ledger,
    /// The prefetch depth the plan holds streaming room for (the auto
    /// planner lowers the asked depth when its room would leave the
    /// execution device nothing); dispatch with it so the run streams no
    /// more than the plan made room for.
    pub prefetch_depth: usize,
}

impl Plan {
    /// The JSON document `bigmodel plan --json` prints.
    pub fn to_json(&self) -> serde_json::Value {
        let mut bytes = serde_json::Map::new();
        for (d, b) in &self.device_bytes {
            bytes.insert(d.to_string(), (*b).into());
        }
        let mut doc = serde_json::json!({
            "device_map": self.device_map.to_json(),
            "max_memory": self.max_memory.to_json(),
            "device_bytes": bytes,
        });
        if self.ledger != Ledger::default() {
            doc["ledger"] = self.ledger.to_json();
        }
        doc
    }
}

/// Accelerate's `check_device_map`: every state-dict tensor must be covered
/// by a key (`""`, its own name or a dotted prefix). Returns the warnings
/// (keys that name a tensor rather than a module); uncovered tensors are an
/// error listing them in state-dict order. Unlike Accelerate, which only
/// warns, a key naming nothing in the model is an error listing the closest
/// real names: a misspelt key would otherwise be dropped silently.
pub fn check_device_map(tree: &ModuleTree, map: &DeviceMap) -> Result<Vec<String>, Error> {
    let unknown: Vec<(String, Vec<String>)> = map
        .iter()
        .map(|(n, _)| n)
        .filter(|n| tree.find(n).is_none())
        .map(|n| (n.to_string(), closest_names(tree, n)))
        .collect();
    if !unknown.is_empty() {
        return Err(Error::UnknownDeviceMapKeys(unknown));
    }
    let mut warnings = Vec::new();
    let invalid: Vec<&str> = map
        .iter()
        .map(|(n, _)| n)
        .filter(|n| !n.is_empty() && !matches!(tree.find(n), Some(Node::Module(_))))
        .collect();
    if !invalid.is_empty() {
        let list: Vec<String> = invalid.iter().map(|n| format!("'{n}'")).collect();
        warnings.push(format!(
            "The following device_map keys do not match any submodules in the model: [{}]",
            list.join(", ")
        ));
    }
    let keys: HashSet<&str> = map.iter().map(|(n, _)| n).collect();
    if keys.contains("") {
        return Ok(warnings);
    }
    let mut covered_module = vec![false; tree.modules().len()];
    for &m in tree.preorder() {
        let module = tree.module(m);
        covered_module[m] =
            keys.contains(module.name) || module.parent.is_some_and(|p| covered_module[p]);
    }
    let missing: Vec<String> = tree
        .state_dict()
        .into_iter()
        .map(|t| tree.tensor(t))
        .filter(|t| !covered_module[t.module] && !keys.contains(t.name))
        .map(|t| t.name.to_string())
        .collect();
    if missing.is_empty() {
        Ok(warnings)
    } else {
        Err(Error::UncoveredTensors(missing))
    }
}

/// Up to three names of the model nearest to `key`, which names nothing:
/// among what its deepest existing ancestor module holds (children and
/// tensors), by edit distance of the next name component. Cheap whatever
/// the model or key size: one module's contents, components cut to 64
/// characters.
fn closest_names(tree: &ModuleTree, key: &str) -> Vec<String> {
    const COMPONENT: usize = 64;
    let mut ancestor = 0;
    let mut rest = key;
    for (i, _) in key.match_indices('.').collect::<Vec<_>>().into_iter().rev() {
        if let Some(Node::Module(m)) = tree.find(&key[..i]) {
            ancestor = m;
            rest = &key[i + 1..];
            break;
        }
    }
    let wanted: String = rest
        .split('.')
        .next()
        .unwrap_or("")
        .chars()
        .take(COMPONENT)
        .collect();
    let module = tree.module(ancestor);
    let children = module.children.iter().map(|&c| tree.module(c).name);
    let tensors = module
        .params
        .iter()
        .chain(module.buffers)
        .map(|&t| tree.tensor(t).name);
    let mut ranked: Vec<(usize, &str)> = children
        .chain(tensors)
        .map(|name| {
            let last: String = name
                .rsplit('.')
                .next()
                .unwrap_or(name)
                .chars()
                .take(COMPONENT)
                .collect();
            (edit_distance(&wanted, &last), name)
        })
        .collect();
    // Stable: equally close names keep registration order.
    ranked.sort_by_key(|&(d, _)| d);
    ranked
        .into_iter()
        .take(3)
        .map(|(_, n)| n.to_string())
        .collect()
}

/// Levenshtein distance over characters.
fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut diagonal = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let above = row[j + 1];
            row[j + 1] = (diagonal + usize::from(ca != *cb))
                .min(above + 1)
                .min(row[j] + 1);
            diagonal = above;
        }
    }
    row[b.len()]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::model_for_test;
    use bm_tensor::DType;

    fn map(pairs: &[(&str, Device)]) -> DeviceMap {
        DeviceMap::from_entries(pairs.iter().map(|(n, d)| (n.to_string(), *d)).collect())
    }

    #[test]
    fn check_device_map_cases() {
        let tree = model_for_test(DType::F32);
        let g = Device::Gpu;
        assert!(
            check_device_map(&tree, &map(&[("", g(0))]))
                .unwrap()
                .is_empty()
        );
        let err =
            check_device_map(&tree, &map(&[("linear1", g(0)), ("linear2", g(1))])).unwrap_err();
        assert_eq!(
            err.to_string(),
            "The device_map provided does not give any device for the following parameters: batchnorm.weight, batchnorm.bias, batchnorm.running_mean, batchnorm.running_var, batchnorm.num_batches_tracked"
        );
        assert!(
            check_device_map(
                &tree,
                &map(&[("linear1", g(0)), ("linear2", g(1)), ("batchnorm", g(1))])
            )
            .is_ok()
        );
        // Accelerate only warns about keys naming nothing; here they are
        // an error naming the closest real names.
        let err = check_device_map(
            &tree,
            &map(&[
                ("linear1", Device::Cpu),
                ("batchnorm", Device::Cpu),
                ("linear2", Device::Cpu),
                ("invalid_module", g(0)),
                ("linear3.weight", g(1)),
                ("batchnorm.bias.x", g(1)),
            ]),
        )
        .unwrap_err();
        assert_eq!(
            err.to_string(),
            "the device map names what is not in the model: \"invalid_module\" (closest: \"linear1\", \"batchnorm\", \"linear2\"); \"linear3.weight\" (closest: \"linear1\", \"linear2\", \"batchnorm\"); \"batchnorm.bias.x\" (closest: \"batchnorm.bias\", \"batchnorm.weight\", \"batchnorm.running_var\")"
        );
        let err = check_device_map(&tree, &map(&[("", Device::Cpu), ("batchnrom", g(0))]))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("\"batchnrom\" (closest: \"batchnorm\","),
            "{err}"
        );
        // A parameter-level key warns but covers its tensor.
        let w = check_device_map(
            &tree,
            &map(&[
                ("linear1.weight", g(0)),
                ("linear1.bias", g(0)),
                ("batchnorm", g(0)),
                ("linear2", g(0)),
            ]),
        )
        .unwrap();
        assert_eq!(w.len(), 1);
    }

    fn tree_of(names: &[&str]) -> ModuleTree {
        // Modules for every dotted prefix, in the order given.
        let mut b = crate::tree::ModuleTreeBuilder::new("Root");
        for name in names {
            let mut parent = 0;
            let mut full = String::new();
            for part in name.split('.') {
                if !full.is_empty() {
                    full.push('.');
                }
                full.push_str(part);
                parent = match b.module_id(&full) {
                    Some(id) => id,
                    None => b.add_module(parent, part, "M").unwrap(),
                };
            }
        }
        b.finish().unwrap()
    }

    fn cleaned(pairs: &[(&str, Device)]) -> Vec<(String, Device)> {
        let names: Vec<&str> = pairs.iter().map(|(n, _)| *n).collect();
        let tree = tree_of(&names);
        let mut m = map(pairs);
        m.clean(&tree);
        m.iter().map(|(n, d)| (n.to_string(), d)).collect()
    }

    fn owned(pairs: &[(&str, Device)]) -> Vec<(String, Device)> {
        pairs.iter().map(|(n, d)| (n.to_string(), *d)).collect()
    }

    #[test]
    fn clean_device_map_cases() {
        let g = Device::Gpu;
        assert_eq!(
            cleaned(&[("a", g(0)), ("b", g(0)), ("c", g(0))]),
            owned(&[("", g(0))])
        );
        assert_eq!(
            cleaned(&[
                ("a.x", g(0)),
                ("a.y", g(0)),
                ("b.x", g(1)),
                ("b.y", g(1)),
                ("c", g(1))
            ]),
            owned(&[("a", g(0)), ("b", g(1)), ("c", g(1))])
        );
        assert_eq!(
            cleaned(&[
                ("a.x", g(0)),
                ("a.y", g(0)),
                ("b.x.0", g(1)),
                ("b.x.1", g(1)),
                ("b.y.0", g(2)),
                ("b.y.1", g(2)),
                ("c", g(2))
            ]),
            owned(&[("a", g(0)), ("b.x", g(1)), ("b.y", g(2)), ("c", g(2))])
        );
        assert_eq!(
            cleaned(&[("a.1", g(0)), ("a.10", g(0)), ("a.2", g(1))]),
            owned(&[("a.1", g(0)), ("a.10", g(0)), ("a.2", g(1))])
        );
        assert_eq!(
            cleaned(&[("a.x", g(0)), ("a.y", g(0)), ("ab.x", g(1)), ("ab.y", g(1))]),
            owned(&[("a", g(0)), ("ab", g(1))])
        );
        // A single key under a module is not merged.
        assert_eq!(
            cleaned(&[("a.x", g(0)), ("b", g(1))]),
            owned(&[("a.x", g(0)), ("b", g(1))])
        );
    }

    #[test]
    fn a_map_resolved_on_the_tree_gives_every_name_its_longest_key() {
        let tree = model_for_test(DType::F32);
        let module = |i: usize| tree.module(i).name.to_string();
        let tensor = |i: usize| tree.tensor(i).name.to_string();
        let maps = [
            map(&[("", Device::Cpu)]),
            map(&[
                (&module(1), Device::Gpu(0)),
                (&tensor(0), Device::Disk),
                ("not.in.the.tree", Device::Gpu(1)),
            ]),
            map(&[
                ("", Device::Disk),
                (&module(2), Device::Cpu),
                (&tensor(tree.tensors().len() - 1), Device::Gpu(1)),
            ]),
            map(&[]),
        ];
        for map in maps {
            let resolved = map.resolve(&tree);
            for (m, module) in tree.modules().enumerate() {
                let expected = map.device_of(module.name);
                assert_eq!(resolved.of(Node::Module(m)), expected, "{}", module.name);
            }
            for (t, tensor) in tree.tensors().enumerate() {
                let expected = map.device_of(tensor.name);
                assert_eq!(resolved.of(Node::Tensor(t)), expected, "{}", tensor.name);
            }
        }
    }

    #[test]
    fn device_maps_parse_from_json() {
        let m = DeviceMap::from_json(
            &serde_json::json!({"a": 0, "b": "cpu", "c": "disk", "d": "cuda:1"}),
        )
        .unwrap();
        assert_eq!(m.get("d"), Some(Device::Gpu(1)));
        assert_eq!(m.device_of("b.x.y"), Some(Device::Cpu));
        assert!(DeviceMap::from_json(&serde_json::json!({"a": "gpu"})).is_err());
        assert!(DeviceMap::from_json(&serde_json::json!([1])).is_err());
    }
}
