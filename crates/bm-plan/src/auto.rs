//! bigmodel's own planner.
//!
//! It plans on *units*: a module of a no-split class or with no children is
//! one unit; any other module contributes its direct tensors as units and
//! recurses into its children. Tied units travel together. Units keep
//! traversal order, and the devices are filled in order (GPUs, `cpu`,
//! `disk`), as in Accelerate, with these differences:
//!
//! * Room for streaming offloaded weights is reserved only when something
//!   is offloaded, only on the device that executes offloaded layers (the
//!   first GPU, or `cpu` when there is none), and only as large as the
//!   largest units that are actually offloaded (plus the runtime bytes of
//!   the offloaded units); on the CPU no weight room at all, since
//!   offloaded layers run there from their mapping in place. The
//!   reservation is found by re-planning until it is stable.
//! * A unit that does not fit an *empty* device skips ahead without leaving
//!   that device behind: the next units still fill it.
//! * A unit never goes to a slower tier (cpu, disk) while an earlier, faster
//!   device still has room for it (back-fill).
//! * A `disk` budget is honoured; per-device reserves and overheads
//!   (staging, GEMM workspace, CUDA context) come off the budgets, and the
//!   runtime items of the ledger ([`crate::ledger`]: KV cache and logits
//!   held, the largest activation peak) are charged where a unit executes:
//!   on its own device when that computes (a GPU, or the CPU when it is the
//!   execution device), else on the execution device.
//! * `balanced` finds the smallest per-GPU load that still fits the model on
//!   the GPUs (a binary search over a greedy fill), so the largest unit of
//!   every no-split class is accounted for, not the first one.
//! * When nothing fits, the error says per device what was asked, what was
//!   placed and by how much the budgets fall short.

use crate::Error;
use crate::device::{Device, MaxMemory};
use crate::experts::expert_lists;
use crate::ledger::{Ledger, LedgerItem};
use crate::plan::{DeviceMap, Mode, Plan, PlanOptions, ResolvedMap};
use crate::size::human_bytes;
use crate::sizes::{ModuleSizes, SizeRule};
use crate::tree::{ModuleTree, Node};

/// A group of units placed together (a unit plus its tied partners; with
/// `experts_on`, also the parts of a no-split module split around its
/// experts).
struct Item {
    first: Node,
    /// The tied partners, if any: most items have none, and a `Vec` per
    /// item would cost an allocation per module of a large tree.
    partners: Vec<Node>,
    bytes: u64,
    /// Held where the item executes: KV cache plus logits.
    runtime: u64,
    kv: u64,
    logits: u64,
    /// Transient bytes while it executes.
    peak: u64,
    /// One expert of an experts list, placed on its own (`experts_on`).
    expert: bool,
    /// The item whose offloaded bytes stream with this one's: for an
    /// expert, the rest of its layer (its *home*, the item of the nearest
    /// non-expert unit before it); for any other item, itself.
    group: usize,
}

impl Item {
    fn units(&self) -> impl Iterator<Item = Node> + '_ {
        std::iter::once(self.first).chain(self.partners.iter().copied())
    }
}

/// The modules `experts_on` places on their own: `expert[m]` for every
/// expert (a child of an experts list, [`expert_lists`]), `holds[m]` for
/// every experts list and module above one.
struct ExpertModules {
    expert: Vec<bool>,
    holds: Vec<bool>,
}

impl ExpertModules {
    fn of(tree: &ModuleTree) -> ExpertModules {
        let n = tree.modules().len();
        let (mut expert, mut holds) = (vec![false; n], vec![false; n]);
        for list in expert_lists(tree) {
            for &c in tree.module(list).children {
                expert[c] = true;
            }
            let mut at = Some(list);
            while let Some(m) = at.filter(|&m| !holds[m]) {
                holds[m] = true;
                at = tree.module(m).parent;
            }
        }
        ExpertModules { expert, holds }
    }
}

fn items_of(tree: &ModuleTree, sizes: &ModuleSizes, options: &PlanOptions) -> Vec<Item> {
    let experts = options.experts_on.map(|_| ExpertModules::of(tree));
    let is_expert = |m: usize| experts.as_ref().is_some_and(|e| e.expert[m]);
    let holds_experts = |m: usize| experts.as_ref().is_some_and(|e| e.holds[m]);
    // Units in traversal order. With `experts_on`, every expert is a unit,
    // and a no-split module holding experts is split down to them: its
    // other units (the *owner*'s rest) are joined again below. Sized for
    // the most there can be (every module and tensor): a large tree's
    // lists are not copied as they grow.
    let most = tree.modules().len() + tree.tensors().len();
    let mut units: Vec<Node> = Vec::with_capacity(most);
    // The no-split module a unit was split from (`NO_OWNER` for none).
    let mut owner_of_unit: Vec<u32> = Vec::with_capacity(most);
    let mut stack: Vec<(Node, u32)> = vec![(Node::Module(0), NO_OWNER)];
    while let Some((node, owner)) = stack.pop() {
        match node {
            Node::Module(m) => {
                let module = tree.module(m);
                let no_split = options.no_split.iter().any(|c| c == module.class);
                let leaf =
                    module.children.is_empty() || is_expert(m) || (no_split && !holds_experts(m));
                if leaf {
                    units.push(node);
                    owner_of_unit.push(owner);
                    continue;
                }
                let owner = if owner == NO_OWNER && no_split {
                    m as u32
                } else {
                    owner
                };
                for t in module.buffers.iter().rev() {
                    stack.push((Node::Tensor(*t), owner));
                }
                for c in module.children.iter().rev() {
                    stack.push((Node::Module(*c), owner));
                }
                for t in module.params.iter().rev() {
                    stack.push((Node::Tensor(*t), owner));
                }
            }
            Node::Tensor(_) => {
                units.push(node);
                owner_of_unit.push(owner);
            }
        }
    }
    let unit_is_expert = |u: usize| matches!(units[u], Node::Module(m) if is_expert(m));
    // The unit holding each module and tensor, for ties and runtime
    // charges (a large tree often has neither).
    let charged = !(options.runtime_bytes.is_empty()
        && options.logits_bytes.is_empty()
        && options.activation_peaks.is_empty());
    let (mut unit_of_module, mut unit_of_tensor) = (Vec::new(), Vec::new());
    if charged || !tree.tied_groups().is_empty() {
        unit_of_module = vec![usize::MAX; tree.modules().len()];
        unit_of_tensor = vec![usize::MAX; tree.tensors().len()];
        for (i, unit) in units.iter().enumerate() {
            match *unit {
                Node::Module(m) => unit_of_module[m] = i,
                Node::Tensor(t) => unit_of_tensor[t] = i,
            }
        }
        for &m in tree.preorder() {
            if unit_of_module[m] == usize::MAX
                && let Some(p) = tree.module(m).parent
            {
                unit_of_module[m] = unit_of_module[p];
            }
        }
        for (t, tensor) in tree.tensors().enumerate() {
            if unit_of_tensor[t] == usize::MAX {
                unit_of_tensor[t] = unit_of_module[tensor.module];
            }
        }
    }
    // Tied units join the item of the first of them (union-find).
    let mut parent: Vec<usize> = (0..units.len()).collect();
    fn root(parent: &mut [usize], mut i: usize) -> usize {
        while parent[i] != i {
            parent[i] = parent[parent[i]];
            i = parent[i];
        }
        i
    }
    fn join(parent: &mut [usize], a: usize, b: usize) {
        let (a, b) = (root(parent, a), root(parent, b));
        let (lo, hi) = if a < b { (a, b) } else { (b, a) };
        parent[hi] = lo;
    }
    for group in tree.tied_groups() {
        let mut members = group
            .iter()
            .map(|t| unit_of_tensor[*t])
            .filter(|u| *u != usize::MAX);
        if let Some(first) = members.next() {
            for u in members {
                join(&mut parent, first, u);
            }
        }
    }
    // The rest of a no-split module split around its experts stays one
    // item.
    let mut first_of_owner: Vec<(u32, usize)> = Vec::new();
    for (u, &owner) in owner_of_unit.iter().enumerate() {
        if owner == NO_OWNER || unit_is_expert(u) {
            continue;
        }
        match first_of_owner.iter().rev().find(|(o, _)| *o == owner) {
            Some(&(_, first)) => join(&mut parent, first, u),
            None => first_of_owner.push((owner, u)),
        }
    }
    let mut item_of_root = vec![usize::MAX; units.len()];
    let mut items: Vec<Item> = Vec::with_capacity(units.len());
    // The nearest non-expert unit before an expert is its home.
    let mut last_plain = None;
    for (i, unit) in units.iter().enumerate() {
        let r = root(&mut parent, i);
        let expert = unit_is_expert(i);
        let home = if expert { last_plain } else { None };
        if !expert {
            last_plain = Some(i);
        }
        if item_of_root[r] == usize::MAX {
            item_of_root[r] = items.len();
            // The home's item came first: the home unit is before this one.
            let group = match home {
                Some(h) => item_of_root[root(&mut parent, h)],
                None => items.len(),
            };
            items.push(Item {
                first: *unit,
                partners: Vec::new(),
                bytes: 0,
                runtime: 0,
                kv: 0,
                logits: 0,
                peak: 0,
                expert,
                group,
            });
        } else {
            items[item_of_root[r]].partners.push(*unit);
        }
        let item = &mut items[item_of_root[r]];
        // An expert tied to anything else is placed as that is.
        if !expert && item.expert {
            item.expert = false;
            item.group = item_of_root[r];
        }
        item.bytes = item.bytes.saturating_add(sizes.of(*unit));
    }
    // A module's runtime bytes are charged to its own unit's item, or to
    // the item of the first of its units when it was split.
    let mut item_charged = |m: usize| -> Option<usize> {
        let unit = match unit_of_module.get(m).copied() {
            Some(u) if u != usize::MAX => u,
            _ => units.iter().position(|n| match *n {
                Node::Module(x) => tree.is_within(x, m),
                Node::Tensor(t) => tree.is_within(tree.tensor(t).module, m),
            })?,
        };
        Some(item_of_root[root(&mut parent, unit)])
    };
    for &(m, bytes) in &options.runtime_bytes {
        if let Some(i) = item_charged(m) {
            items[i].kv = items[i].kv.saturating_add(bytes);
        }
    }
    for &(m, bytes) in &options.logits_bytes {
        if let Some(i) = item_charged(m) {
            items[i].logits = items[i].logits.saturating_add(bytes);
        }
    }
    for &(m, bytes) in &options.activation_peaks {
        if let Some(i) = item_charged(m) {
            items[i].peak = items[i].peak.max(bytes);
        }
    }
    for item in &mut items {
        item.runtime = item.kv.saturating_add(item.logits);
    }
    items
}

/// No owner: a unit not split from a no-split module.
const NO_OWNER: u32 = u32::MAX;

/// Speed tier: GPUs, then host RAM, then disk.
fn tier(d: Device) -> u8 {
    match d {
        Device::Gpu(_) => 0,
        Device::Cpu => 1,
        Device::Disk => 2,
    }
}

struct Fill {
    device_of_item: Vec<usize>,
    /// The reservation this fill needs on the execution device.
    needed_reserve: u64,
    /// The largest activation peak of the offloaded units, which run on
    /// the execution device.
    needed_peak: u64,
    /// The largest offloaded streaming group (by its item).
    largest_offloaded: Option<usize>,
    /// Experts that found no room on the `experts_on` device and went to
    /// a slower one: how many, and their bytes.
    experts_spilled: (usize, u64),
}

/// True when `d` computes the units placed on it: a GPU, or the execution
/// device (the CPU when there is no GPU). Units on other devices are
/// offloaded and run on the execution device.
fn executes(devices: &[Device], exec: usize, d: usize) -> bool {
    d == exec || devices[d].is_gpu()
}

/// The device that executes offloaded units, and the streaming room it
/// holds back for them.
#[derive(Clone, Copy)]
struct Streaming {
    /// Index of the execution device.
    exec: usize,
    /// Bytes held back on it.
    reserve: u64,
    /// Offloaded units loaded ahead of the running one.
    prefetch_depth: usize,
    /// The activation peak of the offloaded units, held on it too.
    peak: u64,
}

/// True when offloaded units that execute on `device` take room there:
/// bm-dispatch copies their weights onto a GPU for each pass, but on the
/// CPU it hands a forward the host bytes where they are (the disk tier's
/// mapping of the checkpoint or offload file; the CPU tier is resident
/// there), allocating nothing.
fn streams_onto(device: Device) -> bool {
    device.is_gpu()
}

/// What streaming the items at `offloaded` (indices into `items`) needs on
/// the execution device `exec`: the bytes of the `1 + prefetch_depth`
/// largest streaming groups (one running, the next ones prefetched; a
/// layer split around its experts is one group, as the prompt of a pass
/// may hold all of its offloaded experts at once) where weights are copied
/// onto it ([`streams_onto`]), else nothing; and the largest group.
fn streamed_bytes(
    items: &[Item],
    offloaded: impl Iterator<Item = usize>,
    exec: Device,
    prefetch_depth: usize,
) -> (u64, Option<usize>) {
    let mut group_bytes: Vec<Option<u64>> = vec![None; items.len()];
    for i in offloaded {
        let g = &mut group_bytes[items[i].group];
        *g = Some(g.unwrap_or(0).saturating_add(items[i].bytes));
    }
    let mut largest: Option<(usize, u64)> = None;
    let mut sizes = Vec::new();
    for (g, bytes) in group_bytes.into_iter().enumerate() {
        let Some(bytes) = bytes else { continue };
        if largest.is_none_or(|(_, l)| bytes > l) {
            largest = Some((g, bytes));
        }
        sizes.push(bytes);
    }
    if !streams_onto(exec) {
        return (0, largest.map(|(g, _)| g));
    }
    let in_flight = prefetch_depth.saturating_add(1).min(sizes.len());
    if in_flight > 0 {
        sizes.select_nth_unstable_by(in_flight - 1, |a, b| b.cmp(a));
    }
    let streamed = sizes[..in_flight]
        .iter()
        .fold(0u64, |sum, b| sum.saturating_add(*b));
    (streamed, largest.map(|(g, _)| g))
}

/// Why [`fill`] put an item where it did (for `--explain`).
enum Why {
    /// The device being filled.
    InOrder,
    /// An earlier, faster device that still has room.
    BackFill,
    /// A later device: the one being filled has no room for it.
    SkippedAhead,
    /// An expert on the device that computes the rest of its layer.
    BesideItsLayer,
    /// An expert on the `experts_on` device.
    ExpertsOn,
    /// An expert on a device slower than the full `experts_on` one.
    ExpertsOnFull,
}

/// Fills devices with `caps` (bytes usable per device), holding back the
/// streaming reserve: every item but the experts in traversal order, the
/// devices in order, then (with `experts_on`, the index of its device when
/// it has a budget) each expert beside the rest of its layer when that
/// computes and has room, else on the `experts_on` device, else on a
/// slower one. Returns the item that fits nowhere on failure.
fn fill(
    items: &[Item],
    devices: &[Device],
    caps: &[u64],
    streaming: Streaming,
    experts_on: Option<usize>,
    trace: &mut Option<&mut Vec<String>>,
    tree: &ModuleTree,
) -> Result<Fill, (usize, Vec<u64>)> {
    let Streaming {
        exec,
        reserve,
        prefetch_depth,
        peak: offloaded_peak,
    } = streaming;
    let n = devices.len();
    let mut used = vec![0u64; n];
    // The largest activation peak of what each device executes.
    let mut peak = vec![0u64; n];
    peak[exec] = offloaded_peak;
    let mut device_of_item = vec![usize::MAX; items.len()];
    let mut experts_spilled = (0usize, 0u64);
    let mut pointer = 0usize;
    let mut previous = None;
    let room = |d: usize, used: &[u64], peak: &[u64]| -> u64 {
        let cap = if d == exec {
            caps[d].saturating_sub(reserve)
        } else {
            caps[d]
        };
        cap.saturating_sub(used[d]).saturating_sub(peak[d])
    };
    // What placing `item` on `d` adds: its bytes, its held runtime bytes
    // and the growth of the device's activation peak where `d` executes.
    let need = |item: &Item, d: usize, peak: &[u64]| -> u64 {
        // Saturating: a need past u64 fits no device, which is what it means.
        if executes(devices, exec, d) {
            item.bytes
                .saturating_add(item.runtime)
                .saturating_add(item.peak.saturating_sub(peak[d]))
        } else {
            item.bytes
        }
    };
    // Experts come last: the rest of every layer first claims the fast
    // devices, experts fill the room left.
    let plain = (0..items.len()).filter(|&i| !items[i].expert);
    let experts = (0..items.len()).filter(|&i| items[i].expert);
    for i in plain.chain(experts) {
        let item = &items[i];
        // Weightless units (dropout, activations) stay with their neighbour.
        if item.bytes == 0 && item.runtime == 0 && item.peak == 0 {
            device_of_item[i] = previous.unwrap_or(pointer);
            continue;
        }
        let fits = |d: usize| need(item, d, &peak) <= room(d, &used, &peak);
        let (chosen, why) = if item.expert {
            let home = Some(device_of_item[item.group])
                .filter(|&h| item.group != i && executes(devices, exec, h));
            // Offloaded: the `experts_on` device, else a slower tier.
            let slower = |d: &usize| {
                experts_on.is_some_and(|t| *d != t && tier(devices[*d]) > tier(devices[t]))
            };
            let offloaded = experts_on.into_iter().chain((0..n).filter(slower));
            let Some(chosen) = home.into_iter().chain(offloaded).find(|&d| fits(d)) else {
                return Err((i, used));
            };
            let why = if Some(chosen) == home {
                Why::BesideItsLayer
            } else if Some(chosen) == experts_on {
                Why::ExpertsOn
            } else {
                experts_spilled.0 += 1;
                experts_spilled.1 = experts_spilled.1.saturating_add(item.bytes);
                Why::ExpertsOnFull
            };
            (chosen, why)
        } else {
            let ahead = (pointer..n).find(|&d| fits(d));
            let behind = (0..pointer).find(|&d| fits(d));
            let chosen = match (behind, ahead) {
                (Some(b), Some(a)) if tier(devices[b]) < tier(devices[a]) => b,
                (_, Some(a)) => a,
                (Some(b), None) => b,
                (None, None) => return Err((i, used)),
            };
            let why = match chosen.cmp(&pointer) {
                std::cmp::Ordering::Less => Why::BackFill,
                std::cmp::Ordering::Equal => Why::InOrder,
                std::cmp::Ordering::Greater => Why::SkippedAhead,
            };
            (chosen, why)
        };
        if let Some(trace) = trace.as_deref_mut() {
            let why = match why {
                Why::InOrder => String::new(),
                Why::BackFill => " (back-fill: a faster device still has room)".into(),
                Why::SkippedAhead => format!(
                    " ({} has {} free, needs {})",
                    devices[pointer],
                    human_bytes(room(pointer, &used, &peak)),
                    human_bytes(need(item, pointer, &peak))
                ),
                Why::BesideItsLayer => " (expert, beside the rest of its layer)".into(),
                Why::ExpertsOn => " (expert, no room beside its layer)".into(),
                Why::ExpertsOnFull => " (expert, the experts-on device is full)".into(),
            };
            trace.push(format!(
                "{}: {} -> {}{why}",
                item_name(tree, item),
                human_bytes(need(item, chosen, &peak)),
                devices[chosen]
            ));
        }
        if executes(devices, exec, chosen) {
            used[chosen] = used[chosen].saturating_add(item.bytes.saturating_add(item.runtime));
            peak[chosen] = peak[chosen].max(item.peak);
        } else {
            used[chosen] = used[chosen].saturating_add(item.bytes);
        }
        device_of_item[i] = chosen;
        previous = Some(chosen);
        if !item.expert && chosen > pointer && used[pointer] > 0 {
            pointer = chosen;
        }
    }
    // What the execution device must hold back for streaming: the largest
    // groups executed from a slower tier (the running one plus those being
    // prefetched), plus the runtime bytes of all of them.
    let offloaded = || (0..items.len()).filter(|&i| !executes(devices, exec, device_of_item[i]));
    let mut runtime = 0u64;
    let mut needed_peak = 0u64;
    for i in offloaded() {
        runtime = runtime.saturating_add(items[i].runtime);
        needed_peak = needed_peak.max(items[i].peak);
    }
    let (streamed, largest_offloaded) =
        streamed_bytes(items, offloaded(), devices[exec], prefetch_depth);
    Ok(Fill {
        device_of_item,
        // Saturated, it exceeds every device: an error below.
        needed_reserve: streamed.saturating_add(runtime),
        needed_peak,
        largest_offloaded,
        experts_spilled,
    })
}

/// A reserve for a message: saturated means past 64 bits.
fn reserve_bytes(bytes: u64) -> String {
    if bytes == u64::MAX {
        "more than 2^64 bytes".into()
    } else {
        human_bytes(bytes)
    }
}

fn item_name(tree: &ModuleTree, item: &Item) -> String {
    let names: Vec<&str> = item
        .units()
        .map(|u| {
            let n = tree.node_name(u);
            if n.is_empty() { "(root)" } else { n }
        })
        .collect();
    names.join(" + ")
}

/// The smallest cap `t` in `[0, high]` for which `feasible(t)` holds,
/// assuming monotonicity and `feasible(high)`.
fn smallest_feasible(high: u64, mut feasible: impl FnMut(u64) -> bool) -> u64 {
    let (mut lo, mut hi) = (0u64, high);
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        if feasible(mid) {
            hi = mid
        } else {
            lo = mid + 1
        }
    }
    hi
}

/// Greedy contiguous fill over GPUs only: true when every item lands.
fn fits_on_gpus(items: &[Item], caps: &[u64]) -> bool {
    let mut g = 0usize;
    let (mut used, mut peak) = (0u64, 0u64);
    for item in items {
        let need = item.bytes.saturating_add(item.runtime);
        loop {
            if g >= caps.len() {
                return false;
            }
            if used
                .saturating_add(need)
                .saturating_add(peak.max(item.peak))
                <= caps[g]
            {
                used = used.saturating_add(need);
                peak = peak.max(item.peak);
                break;
            }
            g += 1;
            (used, peak) = (0, 0);
        }
    }
    true
}

/// Plans `tree` with bigmodel's planner.
pub fn plan(tree: &ModuleTree, options: &PlanOptions) -> Result<Plan, Error> {
    let sizes = options.sizes(tree, SizeRule::Loaded);
    let items = items_of(tree, &sizes, options);
    if options.experts_on.is_some() && !items.iter().any(|i| i.expert) {
        return Err(Error::NoExperts);
    }
    let mut devices: Vec<Device> = options.max_memory.devices().collect();
    if !devices.contains(&Device::Disk) {
        devices.push(Device::Disk);
    }
    let experts_on = options
        .experts_on
        .and_then(|t| devices.iter().position(|d| *d == t));
    let mut caps: Vec<u64> = Vec::with_capacity(devices.len());
    for &d in &devices {
        let budget = match (d, options.max_memory.get(d)) {
            (_, Some(b)) => b,
            (Device::Disk, None) => u64::MAX,
            (_, None) => 0,
        };
        let reserve = options.reserve.get(d).unwrap_or(0);
        caps.push(
            budget
                .saturating_sub(reserve)
                .saturating_sub(overhead(options, d)),
        );
    }
    for (d, _) in options.reserve.iter() {
        if !devices.contains(&d) {
            return Err(Error::BadBudget {
                what: format!("--reserve {d}"),
                reason: "the device has no budget".into(),
            });
        }
    }
    for &(d, item, _) in &options.overheads {
        if !devices.contains(&d) {
            return Err(Error::BadBudget {
                what: format!("{item} on {d}"),
                reason: "the device has no budget".into(),
            });
        }
    }
    let mut trace: Vec<String> = Vec::new();
    let gpu_indices: Vec<usize> = (0..devices.len())
        .filter(|&i| devices[i].is_gpu() && caps[i] > 0)
        .collect();

    // Balancing: shrink GPU caps when the model fits on the GPUs anyway.
    if options.mode != Mode::Sequential && gpu_indices.len() > 1 {
        let gpu_caps: Vec<u64> = gpu_indices.iter().map(|&i| caps[i]).collect();
        if fits_on_gpus(&items, &gpu_caps) {
            let high = gpu_caps.iter().copied().max().unwrap_or(0);
            let new_caps: Vec<u64> = if options.mode == Mode::BalancedLow0 {
                let mut without_first = gpu_caps.clone();
                without_first[0] = 0;
                if fits_on_gpus(&items, &without_first) {
                    let t = smallest_feasible(high, |t| {
                        let c: Vec<u64> = without_first.iter().map(|&c| c.min(t)).collect();
                        fits_on_gpus(&items, &c)
                    });
                    without_first.iter().map(|&c| c.min(t)).collect()
                } else {
                    let c0 = smallest_feasible(gpu_caps[0], |c0| {
                        let mut c = gpu_caps.clone();
                        c[0] = c0;
                        fits_on_gpus(&items, &c)
                    });
                    let mut c = gpu_caps.clone();
                    c[0] = c0;
                    c
                }
            } else {
                let t = smallest_feasible(high, |t| {
                    let c: Vec<u64> = gpu_caps.iter().map(|&c| c.min(t)).collect();
                    fits_on_gpus(&items, &c)
                });
                gpu_caps.iter().map(|&c| c.min(t)).collect()
            };
            for (k, &i) in gpu_indices.iter().enumerate() {
                if options.explain && new_caps[k] != caps[i] {
                    trace.push(format!(
                        "balanced: {} capped at {} (was {})",
                        devices[i],
                        human_bytes(new_caps[k]),
                        human_bytes(caps[i])
                    ));
                }
                caps[i] = new_caps[k];
            }
        } else if options.explain {
            trace.push(
                "balanced: the model does not fit on the GPUs, so they are filled in order".into(),
            );
        }
    }

    let exec = gpu_indices
        .first()
        .copied()
        .unwrap_or_else(|| devices.iter().position(|d| *d == Device::Cpu).unwrap_or(0));
    if options.explain {
        trace.push(format!(
            "{} units in {} placement groups; offloaded layers execute on {}",
            items.iter().map(|i| i.units().count()).sum::<usize>(),
            items.len(),
            devices[exec]
        ));
    }
    // Room to prefetch is worth having only while the execution device
    // still holds something of its own: otherwise plan with less of it.
    // More units in flight than there are units is the same plan.
    let mut depth = options.prefetch_depth.min(items.len());
    let mut reserve = 0u64;
    let mut offloaded_peak = 0u64;
    let mut result = None;
    for _round in 0..64 * (options.prefetch_depth.min(8) + 1) {
        let mut round_trace = Vec::new();
        let fill_result = {
            let mut t = if options.explain {
                Some(&mut round_trace)
            } else {
                None
            };
            fill(
                &items,
                &devices,
                &caps,
                Streaming {
                    exec,
                    reserve,
                    prefetch_depth: depth,
                    peak: offloaded_peak,
                },
                experts_on,
                &mut t,
                tree,
            )
        };
        let filled = match fill_result {
            Ok(f) => f,
            Err((item, used)) => {
                return Err(does_not_fit(
                    tree, &items, item, &devices, &caps, &used, options, reserve,
                ));
            }
        };
        if filled.needed_reserve <= reserve && filled.needed_peak <= offloaded_peak {
            let exec_holds_nothing =
                filled.largest_offloaded.is_some() && !filled.device_of_item.contains(&exec);
            let exec_overflows = reserve.saturating_add(offloaded_peak) > caps[exec];
            // Less depth frees room only where offloaded weights take some.
            if depth > 0 && streams_onto(devices[exec]) && (exec_holds_nothing || exec_overflows) {
                if options.explain {
                    trace.push(format!(
                        "room to prefetch {depth} offloaded layer(s) leaves {} nothing of its own: planning with prefetch depth {}",
                        devices[exec],
                        depth - 1
                    ));
                }
                depth -= 1;
                reserve = 0;
                offloaded_peak = 0;
                continue;
            }
            if options.explain {
                match filled.largest_offloaded {
                    Some(_) if !streams_onto(devices[exec]) => trace.push(format!(
                        "offloaded layers run on {} from their host bytes in place: no streaming room",
                        devices[exec]
                    )),
                    Some(i) => trace.push(format!(
                        "reserved {} on {} to stream offloaded layers (largest offloaded: {})",
                        human_bytes(reserve),
                        devices[exec],
                        item_name(tree, &items[i])
                    )),
                    None => trace.push("nothing is offloaded: no streaming reserve".into()),
                }
                trace.extend(round_trace);
            }
            result = Some(filled);
            break;
        }
        reserve = reserve.max(filled.needed_reserve);
        offloaded_peak = offloaded_peak.max(filled.needed_peak);
    }
    let filled = result.ok_or_else(|| {
        Error::DoesNotFit("the streaming reserve did not settle after 64 rounds".into())
    })?;

    let mut module_unit = vec![None; tree.modules().len()];
    let mut tensor_unit = vec![None; tree.tensors().len()];
    for (i, item) in items.iter().enumerate() {
        let device = devices[filled.device_of_item[i]];
        for unit in item.units() {
            match unit {
                Node::Module(m) => module_unit[m] = Some(device),
                Node::Tensor(t) => tensor_unit[t] = Some(device),
            }
        }
    }
    let device_map = cleaned_map(tree, &module_unit, &tensor_unit);

    let mut placed = vec![0u64; devices.len()];
    for (i, item) in items.iter().enumerate() {
        let d = filled.device_of_item[i];
        placed[d] = placed[d].saturating_add(item.bytes);
    }
    let mut max_memory = MaxMemory::default();
    for (i, &d) in devices.iter().enumerate() {
        if let Some(budget) = options.max_memory.get(d) {
            let held = options
                .reserve
                .get(d)
                .unwrap_or(0)
                .saturating_add(overhead(options, d));
            max_memory.set(d, caps[i].saturating_add(held).min(budget));
        }
    }
    let device_bytes = devices
        .iter()
        .zip(&placed)
        .filter(|(_, b)| **b > 0)
        .map(|(d, b)| (*d, *b))
        .collect();
    let ledger = ledger_of(
        &items,
        &filled.device_of_item,
        &devices,
        exec,
        depth,
        options,
    );
    if reserve.saturating_add(offloaded_peak) > caps[exec] {
        let peak = if offloaded_peak > 0 {
            format!(" and their activation peak {}", human_bytes(offloaded_peak))
        } else {
            String::new()
        };
        return Err(Error::DoesNotFit(format!(
            "the streaming reserve on {} (the offloaded unit running and {depth} prefetched, with the runtime bytes, such as KV cache, of every offloaded unit) needs {}{peak}, more than its {}: offloaded layers could not run there",
            devices[exec],
            reserve_bytes(reserve),
            human_bytes(caps[exec])
        )));
    }
    let mut warnings = Vec::new();
    if let (Some(t), (spilled @ 1.., bytes)) = (options.experts_on, filled.experts_spilled) {
        warnings.push(format!(
            "experts on {t}: {spilled} expert(s) ({}) found no room there and went to a slower device",
            human_bytes(bytes)
        ));
    }
    let mut unknown: Vec<&str> = options
        .no_split
        .iter()
        .filter(|c| !tree.modules().any(|m| m.class == *c))
        .map(String::as_str)
        .collect();
    unknown.dedup();
    if !unknown.is_empty() {
        warnings.push(format!(
            "no module has the no-split class(es) {}",
            unknown.join(", ")
        ));
    }
    Ok(Plan {
        device_map,
        max_memory,
        device_bytes,
        warnings,
        info: Vec::new(),
        trace,
        ledger,
        prefetch_depth: depth,
    })
}

/// The fixed overheads the caller listed for `d`.
fn overhead(options: &PlanOptions, d: Device) -> u64 {
    options
        .overheads
        .iter()
        .filter(|(x, _, _)| *x == d)
        .fold(0u64, |a, (_, _, b)| a.saturating_add(*b))
}

/// The ledger of a placement of `items` (by index into `devices`), offloaded
/// units executing on `devices[exec]` with `prefetch_depth` of them
/// prefetched: the one accounting behind [`plan`]'s result and [`ledger`].
fn ledger_of(
    items: &[Item],
    device_of_item: &[usize],
    devices: &[Device],
    exec: usize,
    prefetch_depth: usize,
    options: &PlanOptions,
) -> Ledger {
    let mut ledger = Ledger::default();
    // Summed per device first: a large tree has ~100k items, and the
    // ledger's rows are sorted (its sums saturate either way).
    #[derive(Clone, Copy, Default)]
    struct Sums {
        weights: u64,
        kv: u64,
        logits: u64,
        peak: u64,
    }
    let mut sums = vec![Sums::default(); devices.len()];
    for (item, &d) in items.iter().zip(device_of_item) {
        sums[d].weights = sums[d].weights.saturating_add(item.bytes);
        let runs_on = &mut sums[if executes(devices, exec, d) { d } else { exec }];
        runs_on.kv = runs_on.kv.saturating_add(item.kv);
        runs_on.logits = runs_on.logits.saturating_add(item.logits);
        runs_on.peak = runs_on.peak.max(item.peak);
    }
    for (&d, sums) in devices.iter().zip(sums) {
        ledger.add(d, LedgerItem::Weights, sums.weights);
        ledger.add(d, LedgerItem::KvCache, sums.kv);
        ledger.add(d, LedgerItem::Logits, sums.logits);
        ledger.add(d, LedgerItem::Activations, sums.peak);
    }
    let offloaded = (0..items.len()).filter(|&i| !executes(devices, exec, device_of_item[i]));
    let (streamed, _) = streamed_bytes(items, offloaded, devices[exec], prefetch_depth);
    ledger.add(devices[exec], LedgerItem::Streaming, streamed);
    for &(d, item, bytes) in &options.overheads {
        ledger.add(d, item, bytes);
    }
    for (d, bytes) in options.reserve.iter() {
        ledger.add(d, LedgerItem::Reserve, bytes);
    }
    ledger
}

/// The module a unit is or belongs to.
fn unit_module(tree: &ModuleTree, unit: Node) -> usize {
    match unit {
        Node::Module(m) => m,
        Node::Tensor(t) => tree.tensor(t).module,
    }
}

/// The ledger of any device map of `tree` (a user's, or one Accelerate's
/// planner made) under `options`' runtime charges and overheads: units are
/// the auto planner's (`options.no_split`), each on the device its first
/// module or tensor resolves to; offloaded units execute on the map's first
/// GPU, or the CPU (as bm-dispatch runs them).
pub fn ledger(tree: &ModuleTree, map: &DeviceMap, options: &PlanOptions) -> Result<Ledger, Error> {
    LedgerUnits::of(tree, options).ledger(map)
}

/// The units of [`ledger`], sized once: they do not depend on the map, so
/// they can be made while a planner makes the map (the CLI's `plan` does,
/// for Accelerate's planner, which keeps no ledger).
pub struct LedgerUnits<'a> {
    tree: &'a ModuleTree,
    options: &'a PlanOptions,
    items: Vec<Item>,
}

impl<'a> LedgerUnits<'a> {
    /// The units of `tree` under `options`, sized as loading allocates.
    pub fn of(tree: &'a ModuleTree, options: &'a PlanOptions) -> LedgerUnits<'a> {
        let sizes = options.sizes(tree, SizeRule::Loaded);
        let items = items_of(tree, &sizes, options);
        LedgerUnits {
            tree,
            options,
            items,
        }
    }

    /// The ledger of `map`.
    pub fn ledger(&self, map: &DeviceMap) -> Result<Ledger, Error> {
        self.ledger_resolved(map, &map.resolve(self.tree))
    }

    /// The ledger of `map`, given `map.resolve(tree)` (which a caller can
    /// make while the units are being sized).
    pub fn ledger_resolved(
        &self,
        map: &DeviceMap,
        resolved: &ResolvedMap,
    ) -> Result<Ledger, Error> {
        let (tree, options, items) = (self.tree, self.options, &self.items);
        let mut devices: Vec<Device> = map.iter().map(|(_, d)| d).collect();
        devices.extend(options.overheads.iter().map(|(d, _, _)| *d));
        devices.extend(options.reserve.devices());
        devices.push(Device::Cpu);
        devices.sort();
        devices.dedup();
        let main = Device::execution(map.iter().map(|(_, d)| d));
        let index = |device: Device| devices.iter().position(|d| *d == device).unwrap_or(0);
        let exec = index(main);
        let mut device_of_item = Vec::with_capacity(items.len());
        for item in items {
            // A unit the map splits (experts placed apart) runs where its
            // first placed tensor is; its weights are all counted there.
            let first_tensor = || {
                tree.subtree(unit_module(tree, item.first))
                    .iter()
                    .flat_map(|&m| {
                        let module = tree.module(m);
                        module.params.iter().chain(module.buffers)
                    })
                    .filter(|&&t| resolved.tensor[t].is_some())
                    .min()
                    .and_then(|&t| resolved.tensor[t])
            };
            let device = match resolved.of(item.first).or_else(first_tensor) {
                Some(d) => d,
                // A weightless module the map need not name runs beside the
                // previous one.
                None if item.bytes == 0 => device_of_item.last().map_or(main, |&i| devices[i]),
                None => {
                    return Err(Error::BadDeviceMap(format!(
                        "no device for {}",
                        item_name(tree, item)
                    )));
                }
            };
            device_of_item.push(index(device));
        }
        Ok(ledger_of(
            items,
            &device_of_item,
            &devices,
            exec,
            options.prefetch_depth,
            options,
        ))
    }
}

/// The device map of a unit placement, cleaned as Accelerate's
/// `clean_device_map` would (at least two keys under a module on one device
/// become that module's key), built on the tree in one linear pass and
/// emitted in traversal order.
fn cleaned_map(
    tree: &ModuleTree,
    module_unit: &[Option<Device>],
    tensor_unit: &[Option<Device>],
) -> DeviceMap {
    #[derive(Clone, Copy, PartialEq)]
    enum Shared {
        Nothing,
        One(Device),
        Mixed,
    }
    fn merge(a: Shared, d: Device) -> Shared {
        match a {
            Shared::Nothing => Shared::One(d),
            Shared::One(x) if x == d => a,
            _ => Shared::Mixed,
        }
    }
    enum Step {
        Module(usize),
        Key(String, Device),
    }
    let n = tree.modules().len();
    let mut keys_below = vec![0usize; n];
    let mut shared = vec![Shared::Nothing; n];
    for &m in tree.preorder().iter().rev() {
        if module_unit[m].is_some() {
            continue;
        }
        let module = tree.module(m);
        let (mut count, mut state) = (0usize, Shared::Nothing);
        for &t in module.params.iter().chain(module.buffers) {
            if let Some(d) = tensor_unit[t] {
                count += 1;
                state = merge(state, d);
            }
        }
        for &c in module.children {
            match module_unit[c] {
                Some(d) => {
                    count += 1;
                    state = merge(state, d);
                }
                None => {
                    count += keys_below[c];
                    state = match (state, shared[c]) {
                        (s, Shared::Nothing) => s,
                        (s, Shared::One(d)) => merge(s, d),
                        _ => Shared::Mixed,
                    };
                }
            }
        }
        keys_below[m] = count;
        shared[m] = state;
    }
    let mut entries = Vec::new();
    let mut stack = vec![Step::Module(0)];
    while let Some(step) = stack.pop() {
        let m = match step {
            Step::Key(name, d) => {
                entries.push((name, d));
                continue;
            }
            Step::Module(m) => m,
        };
        let module = tree.module(m);
        if let Some(d) = module_unit[m] {
            entries.push((module.name.to_string(), d));
            continue;
        }
        if keys_below[m] >= 2
            && let Shared::One(d) = shared[m]
        {
            entries.push((module.name.to_string(), d));
            continue;
        }
        let mut steps = Vec::new();
        for &t in module.params {
            if let Some(d) = tensor_unit[t] {
                steps.push(Step::Key(tree.tensor(t).name.to_string(), d));
            }
        }
        steps.extend(module.children.iter().map(|c| Step::Module(*c)));
        for &t in module.buffers {
            if let Some(d) = tensor_unit[t] {
                steps.push(Step::Key(tree.tensor(t).name.to_string(), d));
            }
        }
        stack.extend(steps.into_iter().rev());
    }
    DeviceMap::from_entries(entries)
}

#[allow(clippy::too_many_arguments)]
fn does_not_fit(
    tree: &ModuleTree,
    items: &[Item],
    failed: usize,
    devices: &[Device],
    caps: &[u64],
    used: &[u64],
    options: &PlanOptions,
    reserve: u64,
) -> Error {
    let total: u64 = items.iter().map(|i| i.bytes).sum();
    let capacity: u64 = caps.iter().fold(0u64, |a, c| a.saturating_add(*c));
    let mut lines = Vec::new();
    for (i, d) in devices.iter().enumerate() {
        let asked = options.max_memory.get(*d);
        let asked = match asked {
            Some(b) => human_bytes(b),
            None => "unlimited".into(),
        };
        let held = options.reserve.get(*d).unwrap_or(0);
        lines.push(format!(
            "  {d}: asked {asked}{}, placed {}",
            if held > 0 {
                format!(" (minus reserve {})", human_bytes(held))
            } else {
                String::new()
            },
            human_bytes(used[i])
        ));
    }
    let item = &items[failed];
    let short = total.saturating_sub(capacity);
    let mut msg = format!(
        "the model does not fit: {} ({}) fits on no device (streaming reserve {});\n{}",
        item_name(tree, item),
        human_bytes(item.bytes),
        human_bytes(reserve),
        lines.join("\n")
    );
    if short > 0 {
        msg += &format!(
            "\nthe model needs {} in all, the budgets hold {}: short by {} ({short} bytes)",
            human_bytes(total),
            human_bytes(capacity),
            human_bytes(short)
        );
    } else {
        msg += "\nthe budgets hold the model in all, but not in whole layers: raise a budget or allow disk offload";
    }
    Error::DoesNotFit(msg)
}
