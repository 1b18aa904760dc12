//! Accelerate's planner, reproduced: `get_balanced_memory` and
//! `infer_auto_device_map` with the same traversal, reservation and
//! splitting decisions, and the same verbose trace.
//!
//! Deviations (each a documented Accelerate bug, listed in docs/compat.md):
//! tied groups are matched by dotted prefix instead of substring; a module
//! that holds several tied parameters is counted once; a tied partner that is
//! already placed or sits directly in the queue is found instead of raising
//! `IndexError`; a split module's direct buffers are queued after its
//! children; `balanced_low_0` sums the other GPUs by id, not by position; a
//! `"disk"` budget does not crash the balancing. Output order is traversal
//! order instead of Python `set` order.
//!
//! Where Accelerate rescans the queue (`get_max_layer_size` after every
//! split, `pop(0)`), this version keeps the queue as a stack with running
//! maxima and per-subtree precomputed layer sizes, so planning is linear in
//! the size of the tree.

use std::collections::HashMap;

use crate::Error;
use crate::device::{Device, MaxMemory};
use crate::plan::{DeviceMap, Mode, Plan, PlanOptions};
use crate::sizes::{ModuleSizes, SizeRule};
use crate::tree::{ModuleId, ModuleTree, Node};

/// Accelerate's `get_balanced_memory`. `sizes` must be computed with
/// [`SizeRule::Accelerate`].
pub fn get_balanced_memory(
    tree: &ModuleTree,
    sizes: &ModuleSizes,
    max_memory: &MaxMemory,
    no_split: &[String],
    low_zero: bool,
    user_set: bool,
) -> MaxMemory {
    let mut max_memory = max_memory.clone();
    let gpus: Vec<u32> = max_memory
        .gpus()
        .filter(|(_, b)| *b > 0)
        .map(|(i, _)| i)
        .collect();
    let num_devices = gpus.len() as u64;
    if num_devices == 0 {
        return max_memory;
    }
    let mut low_zero = low_zero;
    if num_devices == 1 {
        low_zero = false;
        let first = max_memory.gpus().next();
        if !user_set && let Some((first, bytes)) = first {
            // `max_memory[key] *= 0.9` in Python (a float from then on).
            max_memory.set(Device::Gpu(first), (bytes as f64 * 0.9) as u64);
        }
    }
    let total = sizes.total();
    let per_gpu_share = total
        / if low_zero {
            num_devices - 1
        } else {
            num_devices
        };

    // Size of the first instance (in size-dict order) of each no-split class.
    let mut buffer = 0u64;
    if !no_split.is_empty() {
        let mut seen: Vec<&str> = Vec::new();
        for m in first_touch_order(tree) {
            let class = tree.module(m).class;
            if m != 0 && no_split.iter().any(|c| c == class) && !seen.contains(&class) {
                seen.push(class);
                buffer = buffer.max(sizes.module[m]);
                if seen.len() == no_split.len() {
                    break;
                }
            }
        }
    }
    // Mean size of the "final" modules: those holding counted tensors with
    // no child module that holds any.
    let has_key = modules_with_counted_tensors(tree);
    let mut leaf_sum = 0u64;
    let mut leaf_count = 0u64;
    for (m, module) in tree.modules().enumerate() {
        if m != 0 && has_key[m] && !module.children.iter().any(|c| has_key[*c]) {
            leaf_sum += sizes.module[m];
            leaf_count += 1;
        }
    }
    let mean_leaves = (leaf_sum as f64 / leaf_count.max(1) as f64) as u64;
    let buffer = (1.25 * buffer.max(mean_leaves) as f64) as u64;
    let per_gpu = per_gpu_share + buffer;

    let first_gpu = gpus[0];
    for &idx in &gpus[..gpus.len() - 1] {
        let current = max_memory.get(Device::Gpu(idx)).unwrap_or(0);
        if !(low_zero && idx == first_gpu) {
            max_memory.set(Device::Gpu(idx), per_gpu.min(current));
        }
    }
    if low_zero {
        let others: u64 = gpus[1..]
            .iter()
            .map(|g| max_memory.get(Device::Gpu(*g)).unwrap_or(0))
            .sum();
        let min_zero = total.saturating_sub(others);
        let zero = max_memory.get(Device::Gpu(first_gpu)).unwrap_or(0);
        max_memory.set(Device::Gpu(first_gpu), min_zero.min(zero));
    }
    max_memory
}

/// Modules in the order `compute_module_sizes` first touches them.
fn first_touch_order(tree: &ModuleTree) -> Vec<ModuleId> {
    let mut seen = vec![false; tree.modules().len()];
    let mut out = Vec::new();
    let mut chain = Vec::new();
    for t in tree.named_module_tensors() {
        chain.clear();
        let mut m = Some(tree.tensor(t).module);
        while let Some(id) = m {
            if seen[id] {
                break;
            }
            chain.push(id);
            m = tree.module(id).parent;
        }
        for &id in chain.iter().rev() {
            seen[id] = true;
            out.push(id);
        }
    }
    out
}

fn modules_with_counted_tensors(tree: &ModuleTree) -> Vec<bool> {
    let mut has = vec![false; tree.modules().len()];
    for t in tree.tensors() {
        if t.counted {
            has[t.module] = true;
        }
    }
    for &m in tree.preorder().iter().rev() {
        if has[m]
            && let Some(p) = tree.module(m).parent
        {
            has[p] = true;
        }
    }
    has
}

/// `get_max_layer_size` per module: the largest "layer" below it (a module
/// with no children or of a no-split class) and how many layers reach it.
fn layer_maxima(tree: &ModuleTree, sizes: &ModuleSizes, no_split: &[String]) -> Vec<(u64, u64)> {
    let mut out = vec![(0u64, 0u64); tree.modules().len()];
    for &m in tree.preorder().iter().rev() {
        let module = tree.module(m);
        out[m] = if module.children.is_empty() || no_split.iter().any(|c| c == module.class) {
            (sizes.module[m], 1)
        } else {
            module
                .children
                .iter()
                .fold((0, 0), |acc, c| combine(acc, out[*c]))
        };
    }
    out
}

fn combine(a: (u64, u64), b: (u64, u64)) -> (u64, u64) {
    match a.0.cmp(&b.0) {
        std::cmp::Ordering::Greater => a,
        std::cmp::Ordering::Less => b,
        std::cmp::Ordering::Equal => (a.0, a.1 + b.1),
    }
}

/// The planner's queue: `modules_to_treat` stored back to front so that
/// popping and prepending are O(1), with running layer maxima.
struct Queue {
    stack: Vec<Node>,
    /// `acc[i]` = combined layer maxima of module entries `stack[..=i]`.
    acc: Vec<(u64, u64)>,
    in_queue: Vec<bool>,
    module_count: usize,
}

impl Queue {
    fn slot(&self, node: Node) -> usize {
        match node {
            Node::Module(m) => m,
            Node::Tensor(t) => self.module_count + t,
        }
    }

    fn value(node: Node, layers: &[(u64, u64)]) -> (u64, u64) {
        match node {
            Node::Module(m) => layers[m],
            Node::Tensor(_) => (0, 0),
        }
    }

    fn push_front(&mut self, node: Node, layers: &[(u64, u64)]) {
        let below = self.acc.last().copied().unwrap_or((0, 0));
        self.acc.push(combine(below, Queue::value(node, layers)));
        self.stack.push(node);
        let s = self.slot(node);
        self.in_queue[s] = true;
    }

    fn pop_front(&mut self) -> Option<Node> {
        let node = self.stack.pop()?;
        self.acc.pop();
        let s = self.slot(node);
        self.in_queue[s] = false;
        Some(node)
    }

    fn contains(&self, node: Node) -> bool {
        self.in_queue[self.slot(node)]
    }

    /// Layer maxima over the module entries.
    fn max_layer(&self) -> (u64, u64) {
        self.acc.last().copied().unwrap_or((0, 0))
    }

    /// Front-to-back order.
    fn to_list(&self) -> Vec<Node> {
        self.stack.iter().rev().copied().collect()
    }

    fn replace_all(&mut self, front_to_back: &[Node], layers: &[(u64, u64)]) {
        for node in self.stack.drain(..) {
            let s = match node {
                Node::Module(m) => m,
                Node::Tensor(t) => self.module_count + t,
            };
            self.in_queue[s] = false;
        }
        self.acc.clear();
        for &node in front_to_back.iter().rev() {
            self.push_front(node, layers);
        }
    }
}

/// What a split module expands into: direct params, children, then (the fix
/// of accelerate#4014) direct buffers.
fn expansion(tree: &ModuleTree, m: ModuleId) -> Vec<Node> {
    let module = tree.module(m);
    let mut out =
        Vec::with_capacity(module.params.len() + module.children.len() + module.buffers.len());
    out.extend(module.params.iter().map(|t| Node::Tensor(*t)));
    out.extend(module.children.iter().map(|c| Node::Module(*c)));
    out.extend(module.buffers.iter().map(|t| Node::Tensor(*t)));
    out
}

/// Tie bookkeeping: for each module, how many members of each tied group
/// lie in its subtree.
struct Ties {
    per_module: HashMap<ModuleId, Vec<(usize, usize)>>,
}

impl Ties {
    fn new(tree: &ModuleTree) -> Self {
        let mut per_module: HashMap<ModuleId, Vec<(usize, usize)>> = HashMap::new();
        for (g, group) in tree.tied_groups().iter().enumerate() {
            for &t in group {
                let mut m = Some(tree.tensor(t).module);
                while let Some(id) = m {
                    let entry = per_module.entry(id).or_default();
                    match entry.iter_mut().find(|(gg, _)| *gg == g) {
                        Some((_, n)) => *n += 1,
                        None => entry.push((g, 1)),
                    }
                    m = tree.module(id).parent;
                }
            }
        }
        Ties { per_module }
    }

    /// The tied tensors outside `node` that share storage with tensors inside
    /// it (Accelerate's `tied_params`), plus the groups involved.
    fn partners(&self, tree: &ModuleTree, node: Node) -> (Vec<usize>, Vec<crate::tree::TensorId>) {
        let groups: Vec<usize> = match node {
            Node::Tensor(t) => tree.tensor(t).tie_group.into_iter().collect(),
            Node::Module(m) => self
                .per_module
                .get(&m)
                .map(|v| {
                    let mut gs: Vec<usize> = v
                        .iter()
                        .filter(|(g, n)| *n < tree.tied_groups()[*g].len())
                        .map(|(g, _)| *g)
                        .collect();
                    gs.sort_unstable();
                    gs
                })
                .unwrap_or_default(),
        };
        let mut params = Vec::new();
        for &g in &groups {
            for &t in &tree.tied_groups()[g] {
                let inside = match node {
                    Node::Tensor(x) => x == t,
                    Node::Module(m) => tree.is_within(tree.tensor(t).module, m),
                };
                if !inside {
                    params.push(t);
                }
            }
        }
        (groups, params)
    }
}

/// The queue entry holding tensor `t` (itself, its module or an ancestor).
fn holder_in(queue: &Queue, tree: &ModuleTree, t: crate::tree::TensorId) -> Option<Node> {
    if queue.contains(Node::Tensor(t)) {
        return Some(Node::Tensor(t));
    }
    let mut m = Some(tree.tensor(t).module);
    while let Some(id) = m {
        if queue.contains(Node::Module(id)) {
            return Some(Node::Module(id));
        }
        m = tree.module(id).parent;
    }
    None
}

fn holder_in_list(list: &[Node], tree: &ModuleTree, t: crate::tree::TensorId) -> Option<Node> {
    list.iter().copied().find(|n| match *n {
        Node::Tensor(x) => x == t,
        Node::Module(m) => tree.is_within(tree.tensor(t).module, m),
    })
}

/// Accelerate's `get_module_size_with_ties`, each partner module counted once.
fn size_with_ties(
    sizes: &ModuleSizes,
    module_size: u64,
    tied_params: &[crate::tree::TensorId],
    holders: impl Fn(crate::tree::TensorId) -> Option<Node>,
) -> (u64, Vec<Node>) {
    let mut total = module_size;
    let mut modules: Vec<Node> = Vec::new();
    for &p in tied_params {
        let Some(holder) = holders(p) else { continue };
        if !modules.contains(&holder) {
            modules.push(holder);
            total += sizes.of(holder);
        }
        total = total.saturating_sub(sizes.tensor[p]);
    }
    (total, modules)
}

fn python_list(tree: &ModuleTree, nodes: &[Node]) -> String {
    let items: Vec<String> = nodes
        .iter()
        .map(|n| format!("'{}'", tree.node_name(*n)))
        .collect();
    format!("[{}]", items.join(", "))
}

fn tensor_list(tree: &ModuleTree, tensors: &[crate::tree::TensorId]) -> String {
    let items: Vec<String> = tensors
        .iter()
        .map(|t| format!("'{}'", tree.tensor(*t).name))
        .collect();
    format!("[{}]", items.join(", "))
}

/// Runs `get_balanced_memory` (unless the mode is `sequential`) and then
/// `infer_auto_device_map`, as `load_checkpoint_and_dispatch` does.
pub fn plan(tree: &ModuleTree, options: &PlanOptions) -> Result<Plan, Error> {
    let sizes = options.sizes(tree, SizeRule::Accelerate);
    let max_memory = match options.mode {
        Mode::Sequential => options.max_memory.clone(),
        mode => get_balanced_memory(
            tree,
            &sizes,
            &options.max_memory,
            &options.no_split,
            mode == Mode::BalancedLow0,
            options.max_memory_from_user,
        ),
    };
    Ok(infer_auto_device_map(tree, &sizes, &max_memory, options))
}

/// Accelerate's `infer_auto_device_map` on precomputed sizes (computed with
/// [`SizeRule::Accelerate`] and the same dtype options).
pub fn infer_auto_device_map(
    tree: &ModuleTree,
    sizes: &ModuleSizes,
    max_memory: &MaxMemory,
    options: &PlanOptions,
) -> Plan {
    let no_split = &options.no_split;
    let mut devices: Vec<Device> = max_memory.devices().collect();
    if !devices.contains(&Device::Disk) {
        devices.push(Device::Disk);
    }
    let first_gpu = devices.iter().copied().find(|d| d.is_gpu());
    let is_main = |d: Device| Some(d) == first_gpu || d == Device::Cpu;
    let budget = |d: Device| max_memory.get(d).unwrap_or(0) as i128;

    let layers = layer_maxima(tree, sizes, no_split);
    let ties = Ties::new(tree);
    let mut trace = Vec::new();
    let explain = options.explain;
    macro_rules! say {
        ($($arg:tt)*) => {
            if explain {
                trace.push(format!($($arg)*));
            }
        };
    }

    let root = tree.module(0);
    let mut queue = Queue {
        stack: Vec::new(),
        acc: Vec::new(),
        in_queue: vec![false; tree.modules().len() + tree.tensors().len()],
        module_count: tree.modules().len(),
    };
    let mut initial: Vec<Node> = Vec::new();
    initial.extend(root.params.iter().map(|t| Node::Tensor(*t)));
    initial.extend(root.children.iter().map(|c| Node::Module(*c)));
    initial.extend(root.buffers.iter().map(|t| Node::Tensor(*t)));
    queue.replace_all(&initial, &layers);

    // The first reservation also counts the root's direct tensors as layers.
    let mut max_layer = initial.iter().fold((0, 0), |acc, n| match *n {
        Node::Module(m) => combine(acc, layers[m]),
        Node::Tensor(t) => combine(acc, (sizes.tensor[t], 1)),
    });
    // `max_layer.1` counts the layer names still listed; a node's names are
    // removed once per listing (`generation`).
    let mut generation = 0u32;
    let mut removed_in = vec![u32::MAX; queue.in_queue.len()];
    let contribution = |node: Node, max_size: u64, generation: u32| -> u64 {
        match node {
            Node::Module(m) if layers[m].0 == max_size => layers[m].1,
            Node::Tensor(t)
                if generation == 0 && tree.tensor(t).module == 0 && sizes.tensor[t] == max_size =>
            {
                1
            }
            _ => 0,
        }
    };

    let mut entries: Vec<(String, Device)> = Vec::new();
    let mut current_device = 0usize;
    let mut used: Vec<i128> = vec![0; devices.len()];
    let mut placed: Vec<u64> = vec![0; devices.len()];
    let mut buffer_sizes: HashMap<Device, u64> = HashMap::new();
    let mut minimum_assignment: Vec<(Device, i128)> = Vec::new();

    while let Some(node) = queue.pop_front() {
        let name = tree.node_name(node);
        say!("\nTreating module {name}.");
        let slot = queue.slot(node);
        if removed_in[slot] != generation {
            removed_in[slot] = generation;
            max_layer.1 -= contribution(node, max_layer.0, generation).min(max_layer.1);
        }
        if max_layer.1 == 0 {
            max_layer = queue.max_layer();
            generation += 1;
            removed_in[slot] = generation;
        }
        let module_size = sizes.of(node);
        let (groups, tied_params) = ties.partners(tree, node);
        if !groups.is_empty() {
            let names: Vec<String> = groups
                .iter()
                .map(|g| tensor_list(tree, &tree.tied_groups()[*g]))
                .collect();
            say!(
                "  Found the relevant tied param groups [{}]",
                names.join(", ")
            );
        }
        if !tied_params.is_empty() {
            say!(
                "  So those parameters need to be taken into account {}",
                tensor_list(tree, &tied_params)
            );
        }
        let device = devices[current_device];
        let mut current_max: Option<i128> = if device == Device::Disk {
            None
        } else {
            Some(budget(device))
        };
        let mut reserved: i128 = 0;
        if is_main(device) {
            current_max = current_max.map(|c| c - max_layer.0 as i128);
            reserved = max_layer.0 as i128;
        }
        let (with_ties, tied_modules) = size_with_ties(sizes, module_size, &tied_params, |p| {
            holder_in(&queue, tree, p)
        });
        let d = current_device;

        // A) it fits.
        if current_max.is_none_or(|c| used[d] + with_ties as i128 <= c) {
            if explain {
                let mut line = format!("Putting {name}");
                if tied_modules.is_empty() {
                    line += &format!(" (size={module_size})");
                } else {
                    line += &format!(" and {}", python_list(tree, &tied_modules));
                }
                if let Some(c) = current_max {
                    line += &format!(" (available={})", c - used[d]);
                }
                say!("{line} on {device}.");
            }
            used[d] += with_ties as i128;
            placed[d] += with_ties;
            entries.push((name.to_string(), device));
            if !tied_modules.is_empty() {
                let list: Vec<Node> = queue
                    .to_list()
                    .into_iter()
                    .filter(|n| !tied_modules.contains(n))
                    .collect();
                queue.replace_all(&list, &layers);
                for tm in &tied_modules {
                    entries.push((tree.node_name(*tm).to_string(), device));
                }
            }
            if !options.offload_buffers
                && let Node::Module(m) = node
            {
                *buffer_sizes.entry(device).or_default() += sizes.buffers[m];
            }
            continue;
        }
        let current_max = current_max.unwrap_or(i128::MAX);

        // B) it would fit without its tied partners: split a partner.
        if !tied_params.is_empty() && used[d] + module_size as i128 <= current_max {
            say!(
                "Not enough space on {device} to put {name} and {} (space available {}, needed size {with_ties}).",
                python_list(tree, &tied_modules),
                current_max - used[d]
            );
            let splittable = tied_modules.iter().find_map(|tm| match *tm {
                Node::Module(m)
                    if !tree.module(m).children.is_empty()
                        && !no_split.iter().any(|c| c == tree.module(m).class) =>
                {
                    Some(m)
                }
                _ => None,
            });
            if let Some(m) = splittable {
                say!("Splitting {}.", tree.module(m).name);
                let mut list = vec![node];
                for n in queue.to_list() {
                    if n == Node::Module(m) {
                        list.extend(expansion(tree, m));
                    } else {
                        list.push(n);
                    }
                }
                queue.replace_all(&list, &layers);
                max_layer = queue.max_layer();
                generation += 1;
                continue;
            }
            say!("None of the tied module can be split, going to the next device.");
        }

        // C) split the module itself.
        if used[d] + module_size as i128 >= current_max {
            say!(
                "Not enough space on {device} to put {name} (space available {}, module size {module_size}).",
                current_max - used[d]
            );
            match node {
                Node::Module(m)
                    if !tree.module(m).children.is_empty()
                        && !no_split.iter().any(|c| c == tree.module(m).class) =>
                {
                    say!("Splitting {name}.");
                    for child in expansion(tree, m).into_iter().rev() {
                        queue.push_front(child, &layers);
                    }
                    max_layer = queue.max_layer();
                    generation += 1;
                    continue;
                }
                _ => say!("This module cannot be split, going to the next device."),
            }
        }

        // D) fallback allocation on an empty device.
        if used[d] == 0 && options.fallback_allocation && device != Device::Disk {
            let limit = budget(device) - max_layer.0.max(with_ties) as i128 - used[d];
            let list = queue.to_list();
            if let Some((found, rest)) =
                fallback_allocate(tree, sizes, &ties, &list, limit, no_split)
            {
                let mut new_list = vec![found, node];
                new_list.extend(rest);
                queue.replace_all(&new_list, &layers);
                continue;
            }
        }

        // E) next device.
        if used[d] == 0 {
            minimum_assignment.push((device, with_ties as i128 + reserved));
        }
        used[d] += reserved;
        current_device += 1;
        queue.push_front(node, &layers);
    }

    let mut device_map = DeviceMap::from_entries(entries);
    device_map.clean(tree);

    let mut warnings = Vec::new();
    let non_gpu_buffer = buffer_sizes.get(&Device::Cpu).copied().unwrap_or(0)
        + buffer_sizes.get(&Device::Disk).copied().unwrap_or(0);
    if non_gpu_buffer > 0 && !options.offload_buffers {
        let fits_any = max_memory
            .iter()
            .filter(|(d, _)| d.is_gpu())
            .any(|(gpu, gpu_max)| {
                let gpu_used = devices
                    .iter()
                    .position(|x| *x == gpu)
                    .map(|i| used[i])
                    .unwrap_or(0);
                gpu_max as i128 >= non_gpu_buffer as i128 + gpu_used
            });
        if first_gpu.is_some() && !fits_any {
            warnings.push(format!(
                "Current model requires {non_gpu_buffer} bytes of buffer for offloaded layers, which seems does not fit any GPU's remaining memory. If you are experiencing a OOM later, please consider using offload_buffers=True."
            ));
        }
    }
    let mut info = Vec::new();
    if !minimum_assignment.is_empty() {
        let lines: Vec<String> = minimum_assignment
            .iter()
            .map(|(d, m)| format!("  - {d}: {m} bytes required"))
            .collect();
        info.push(format!(
            "Based on the current allocation process, no modules could be assigned to the following devices due to insufficient memory:\n{}\nThese minimum requirements are specific to this allocation attempt and may vary. Consider increasing the available memory for these devices to at least the specified minimum, or adjusting the model config.",
            lines.join("\n")
        ));
    }
    let device_bytes = devices
        .iter()
        .zip(&placed)
        .filter(|(_, b)| **b > 0)
        .map(|(d, b)| (*d, *b))
        .collect();
    Plan {
        device_map,
        max_memory: max_memory.clone(),
        device_bytes,
        warnings,
        info,
        trace,
        ledger: Default::default(),
        prefetch_depth: options.prefetch_depth,
    }
}

/// Accelerate's `fallback_allocate`: the first entry (searching depth first)
/// whose size with ties fits `limit`, and the queue with its ancestors
/// expanded in place and the entry removed.
fn fallback_allocate(
    tree: &ModuleTree,
    sizes: &ModuleSizes,
    ties: &Ties,
    modules: &[Node],
    limit: i128,
    no_split: &[String],
) -> Option<(Node, Vec<Node>)> {
    let mut search: Vec<Node> = modules.iter().rev().copied().collect();
    let mut found = None;
    while let Some(node) = search.pop() {
        let (_, tied_params) = ties.partners(tree, node);
        let front_to_back: Vec<Node> = search.iter().rev().copied().collect();
        let (with_ties, _) = size_with_ties(sizes, sizes.of(node), &tied_params, |p| {
            holder_in_list(&front_to_back, tree, p)
        });
        if with_ties as i128 <= limit {
            found = Some(node);
            break;
        }
        if let Node::Module(m) = node
            && !tree.module(m).children.is_empty()
            && !no_split.iter().any(|c| c == tree.module(m).class)
        {
            for child in expansion(tree, m).into_iter().rev() {
                search.push(child);
            }
        }
    }
    let found = found?;
    let mut list = modules.to_vec();
    // Expand every ancestor present in the list, outermost first.
    let mut ancestors = Vec::new();
    let mut m = match found {
        Node::Module(m) => tree.module(m).parent,
        Node::Tensor(t) => Some(tree.tensor(t).module),
    };
    while let Some(id) = m {
        ancestors.push(id);
        m = tree.module(id).parent;
    }
    for &a in ancestors.iter().rev() {
        if let Some(i) = list.iter().position(|n| *n == Node::Module(a)) {
            list.splice(i..=i, expansion(tree, a));
        }
    }
    let i = list.iter().position(|n| *n == found)?;
    list.remove(i);
    Some((found, list))
}
