//! Where each tensor goes and which modules stream their weights, decided
//! here once for loading, dispatch and hooks alike.
//!
//! * A device map gives a [`MapPlacement`]: the main device (where
//!   offloaded entries compute: Accelerate's first GPU of the map), per map
//!   entry its execution device and whether it offloads, and per slot its
//!   [`Target`]. `load_checkpoint_in_model` writes every tensor straight to
//!   its target; `dispatch_model` moves what is not there yet, then
//!   attaches one hook per entry.
//! * `cpu_offload` and `disk_offload` attach an offloading hook to every
//!   module with tensors, or to a whole preloaded subtree
//!   ([`offload_entries`]).
//! * What an `AlignDevicesHook` does to its module's storages when it is
//!   attached or detached ([`attach`], [`detach`]), Accelerate's
//!   `init_hook` and `detach_hook`.

use std::sync::Arc;

use bm_device::{Device, DeviceSet};
use bm_plan::{DeviceLookup, DeviceMap, ModuleId, ModuleTree, Node, TensorId, TensorKind};

use crate::model::Model;
use crate::slots::{SlotId, SlotState, SlotTable, Tier, weights};
use crate::transfer::{move_bytes, pin};
use crate::{Error, Result};

/// Where one storage goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Target {
    /// Resident on a device, used where it is.
    Resident(Device),
    /// Offloaded to a tier and streamed to the execution device.
    Offloaded(Tier),
}

/// One module entry of a device map, as dispatch runs it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Entry {
    /// The module's full name (the map key).
    pub(crate) name: String,
    /// The module.
    pub(crate) module: ModuleId,
    /// Where it computes: its GPU, else the main device.
    pub(crate) exec: Device,
    /// Its weights are offloaded (CPU entries when a GPU computes, disk
    /// entries always) and streamed in for each forward.
    pub(crate) offload: bool,
}

/// The placement a device map gives a model.
#[derive(Clone, Debug)]
pub(crate) struct MapPlacement {
    /// Where offloaded entries compute.
    pub(crate) main: Device,
    /// The map's module entries, in map order.
    pub(crate) entries: Vec<Entry>,
    /// The target of every slot, by slot id.
    pub(crate) slots: Vec<Target>,
}

/// Accelerate's main device: the first GPU of the map (the lowest ordinal
/// here, where Accelerate takes a set's first element), else the CPU.
pub(crate) fn main_device(map: &DeviceMap) -> Device {
    map.iter()
        .filter_map(|(_, d)| match d {
            bm_plan::Device::Gpu(i) => Some(i as usize),
            _ => None,
        })
        .min()
        .map_or(Device::Cpu, Device::Gpu)
}

/// The modules the map sends to disk.
pub(crate) fn disk_modules(map: &DeviceMap) -> Vec<String> {
    map.iter()
        .filter(|(_, d)| *d == bm_plan::Device::Disk)
        .map(|(n, _)| n.to_string())
        .collect()
}

impl MapPlacement {
    /// Checks `map` against the model and its devices (every tensor
    /// covered, Accelerate's message; every key a module or tensor; every
    /// GPU present) and places the model under it, offloaded entries
    /// computing on `main`.
    pub(crate) fn new(
        model: &Model,
        map: &DeviceMap,
        main: Device,
        offload_buffers: bool,
    ) -> Result<MapPlacement> {
        let tree = model.tree();
        validate(tree, map, model.devices())?;
        let entries = map
            .iter()
            .filter_map(|(name, device)| {
                let Some(Node::Module(module)) = tree.find(name) else {
                    return None;
                };
                let (exec, offload) = match device {
                    bm_plan::Device::Gpu(i) => (Device::Gpu(i as usize), false),
                    bm_plan::Device::Cpu => (main, main != Device::Cpu),
                    bm_plan::Device::Disk => (main, true),
                };
                Some(Entry {
                    name: name.to_string(),
                    module,
                    exec,
                    offload,
                })
            })
            .collect();
        let table = model.slots();
        let lookup = map.lookup();
        let slots = (0..table.len())
            .map(|s| {
                // A tied storage follows its first name in registration order.
                let t = table.first_tensor(s).unwrap_or(0);
                target_of(tree, t, &lookup, main, offload_buffers)
            })
            .collect();
        Ok(MapPlacement {
            main,
            entries,
            slots,
        })
    }

    /// The offloaded entries' modules in execution (pre)order: the blocks
    /// the prefetch worker streams.
    pub(crate) fn streaming_order(&self, tree: &ModuleTree) -> Vec<ModuleId> {
        tree.preorder()
            .iter()
            .copied()
            .filter(|m| self.entries.iter().any(|e| e.offload && e.module == *m))
            .collect()
    }
}

/// Where tensor `t` goes: GPU entries stay resident; CPU entries are
/// resident when the CPU computes, offloaded when a GPU does; disk entries
/// are offloaded. Buffers of offloaded modules stay resident on the main
/// device unless `offload_buffers` (non-persistent ones always do).
fn target_of(
    tree: &ModuleTree,
    t: TensorId,
    map: &DeviceLookup<'_>,
    main: Device,
    offload_buffers: bool,
) -> Target {
    let tensor = tree.tensor(t);
    let mapped = map.device_of(tensor.name).unwrap_or(bm_plan::Device::Cpu);
    let tier = match mapped {
        bm_plan::Device::Gpu(i) => return Target::Resident(Device::Gpu(i as usize)),
        bm_plan::Device::Cpu if main == Device::Cpu => return Target::Resident(Device::Cpu),
        bm_plan::Device::Cpu => Tier::Cpu,
        bm_plan::Device::Disk => Tier::Disk,
    };
    match tensor.kind {
        TensorKind::Buffer { persistent: false } => Target::Resident(main),
        TensorKind::Buffer { .. } if !offload_buffers => Target::Resident(main),
        _ => Target::Offloaded(tier),
    }
}

fn validate(tree: &ModuleTree, map: &DeviceMap, devices: &DeviceSet) -> Result<()> {
    for (name, device) in map.iter() {
        if tree.find(name).is_none() {
            return Err(Error::BadOption(format!(
                "The device_map key {name:?} does not match any module or tensor of the model"
            )));
        }
        if let bm_plan::Device::Gpu(i) = device
            && i as usize >= devices.gpu_count()
        {
            return Err(Error::NoSuchDevice {
                what: format!("device_map entry {name:?}"),
                device: Device::Gpu(i as usize),
            });
        }
    }
    bm_plan::check_device_map(tree, map)?;
    Ok(())
}

/// Accelerate's `attach_align_device_hook(offload=True)`: the modules that
/// get an offloading hook, each with whether it loads its whole subtree
/// (a module of a `preload` class) or only its direct tensors (any other
/// module that has some).
pub(crate) fn offload_entries(tree: &ModuleTree, preload: &[String]) -> Vec<(ModuleId, bool)> {
    let mut out = Vec::new();
    let mut skip_below: Option<ModuleId> = None;
    for &m in tree.preorder() {
        if skip_below.is_some_and(|p| tree.is_within(m, p)) {
            continue;
        }
        let module = tree.module(m);
        let whole = preload.iter().any(|c| c == module.class);
        if whole {
            skip_below = Some(m);
        }
        if whole || !module.params.is_empty() || !module.buffers.is_empty() {
            out.push((m, whole));
        }
    }
    out
}

/// How an `AlignDevicesHook` places its module.
#[derive(Clone, Copy, Debug)]
pub(crate) struct HookRule {
    /// Where the module computes.
    pub(crate) exec: Device,
    /// The module's weights are offloaded and streamed in.
    pub(crate) offload: bool,
    /// The whole subtree, not only the module's direct tensors.
    pub(crate) subtree: bool,
    /// Persistent buffers are offloaded with the weights.
    pub(crate) offload_buffers: bool,
}

/// Slots of `module`'s buffers (all of them, or the non-persistent ones).
fn buffers(
    table: &SlotTable,
    tree: &ModuleTree,
    module: ModuleId,
    subtree: bool,
    non_persistent_only: bool,
) -> Vec<SlotId> {
    table.of_module(tree, module, subtree, |kind| match kind {
        TensorKind::Buffer { persistent } => !(non_persistent_only && persistent),
        TensorKind::Param => false,
    })
}

/// What attaching a hook with `rule` to `module` does to its storages.
/// Without offload, every resident tensor moves to the execution device.
/// With offload, the resident weights become the offloaded copy (page-locked
/// when a GPU executes them; a tied storage another entry keeps on a GPU
/// stays there: one copy, on the faster device), and the buffers that are
/// not offloaded move to the execution device.
pub(crate) fn attach(model: &Model, module: ModuleId, rule: HookRule) -> Result<()> {
    let (tree, table, devices) = (model.tree(), model.slots(), model.devices());
    let move_to_exec =
        |slots: &[SlotId]| table.move_resident(tree, slots, rule.exec, model.uploader());
    if !rule.offload {
        return move_to_exec(&table.of_module(tree, module, rule.subtree, |_| true));
    }
    let tied: Vec<SlotId> = (0..tree.tensors().len())
        .filter(|&t| tree.tensor(t).tie_group.is_some())
        .map(|t| table.slot_of(t))
        .collect();
    let offloaded = table.of_module(tree, module, rule.subtree, weights(rule.offload_buffers));
    table.update(&offloaded, |s, state| {
        let SlotState::Resident(b) = state else {
            return Ok(None);
        };
        if b.device() != Device::Cpu && tied.contains(&s) {
            return Ok(None);
        }
        let what = table.name(tree, s);
        let bytes = match (rule.exec, b.host()) {
            (Device::Gpu(_), Some(host)) => Arc::new(pin(&what, host, devices)?),
            (Device::Cpu, Some(_)) => Arc::clone(b),
            (_, None) => move_bytes(&what, b, Device::Cpu, devices, None)?,
        };
        Ok(Some(SlotState::Offloaded {
            bytes,
            tier: Tier::Cpu,
        }))
    })?;
    move_to_exec(&buffers(
        table,
        tree,
        module,
        rule.subtree,
        rule.offload_buffers,
    ))
}

/// What detaching an offloading hook from `module` does: the offloaded
/// copies of its weights (`subtree` and `offload_buffers` as the hook
/// offloaded them) become the module's tensors again, where they are.
pub(crate) fn detach(
    model: &Model,
    module: ModuleId,
    subtree: bool,
    offload_buffers: bool,
) -> Result<()> {
    let (tree, table) = (model.tree(), model.slots());
    let offloaded = table.of_module(tree, module, subtree, weights(offload_buffers));
    table.update(&offloaded, |_, state| match state {
        SlotState::Offloaded { bytes, .. } => Ok(Some(SlotState::Resident(Arc::clone(bytes)))),
        _ => Ok(None),
    })
}
