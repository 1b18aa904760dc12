//! `dispatch_model`, `cpu_offload`, `disk_offload`: placing a loaded model
//! over its devices and attaching the hooks that run it there.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use bm_device::Device;
use bm_plan::{DeviceMap, ModuleId, Node};
use bm_shard::offload::{OffloadEntry, OffloadFolder, save_index};
use bm_tensor::MmapView;

use crate::bytes::{Bytes, move_bytes, pin};
use crate::hooks::{AlignDevicesHook, ModelHook};
use crate::load::{Target, disk_modules, main_device, target_of, validate_map, write_dat};
use crate::model::{Model, SlotState, Tier};
use crate::{Error, Result};

/// Options of [`dispatch_model`], [`cpu_offload`] and [`disk_offload`].
#[derive(Clone, Debug)]
pub struct DispatchOptions {
    /// Where offloaded modules compute; default: the map's first GPU, else the CPU.
    pub main_device: Option<Device>,
    /// The offload folder for disk-mapped modules.
    pub offload_dir: Option<PathBuf>,
    /// Buffers of offloaded modules are offloaded too.
    pub offload_buffers: bool,
    /// Named inputs never moved (e.g. `past_key_values`).
    pub skip_keys: Vec<String>,
    /// Classes whose whole subtree is loaded at once by one hook
    /// ([`cpu_offload`] and [`disk_offload`]; offloaded device-map entries
    /// are always loaded whole).
    pub preload_module_classes: Vec<String>,
    /// Attach hooks even when the map has a single device.
    pub force_hooks: bool,
    /// Offloaded blocks fetched ahead of the one computing (default 1).
    pub prefetch_depth: usize,
    /// Bytes of offloaded weights allowed to stay on the execution device
    /// across forward passes (default 0).
    pub resident_budget: u64,
}

impl Default for DispatchOptions {
    fn default() -> Self {
        DispatchOptions {
            main_device: None,
            offload_dir: None,
            offload_buffers: false,
            skip_keys: Vec::new(),
            preload_module_classes: Vec::new(),
            force_hooks: false,
            prefetch_depth: 1,
            resident_budget: 0,
        }
    }
}

/// Accelerate's `dispatch_model`: checks the map, puts every tensor where
/// the map says (offloaded ones as the streaming source), and attaches
/// [`AlignDevicesHook`]s: one per map entry (an offloaded entry's weights
/// are loaded together, which is what lets the next entry be prefetched
/// while this one computes), plus a root hook that returns outputs to the
/// inputs' device. A single-device map without `force_hooks` just moves
/// the model.
pub fn dispatch_model(
    model: &Model,
    device_map: &DeviceMap,
    options: &DispatchOptions,
) -> Result<()> {
    let tree = model.tree();
    validate_map(tree, device_map, model.devices())?;
    let mut distinct: Vec<bm_plan::Device> = device_map.iter().map(|(_, d)| d).collect();
    distinct.sort();
    distinct.dedup();
    let has_disk = distinct.contains(&bm_plan::Device::Disk);
    if distinct.len() <= 1 && !has_disk && !options.force_hooks {
        let device = match distinct.first() {
            Some(bm_plan::Device::Gpu(i)) => Device::Gpu(*i as usize),
            _ => Device::Cpu,
        };
        model.to(device)?;
        model.set_device_map(Some(device_map.clone()));
        return Ok(());
    }
    let disk = disk_modules(device_map);
    if !disk.is_empty() && options.offload_dir.is_none() {
        return Err(Error::NoOffloadFolder { modules: disk });
    }
    let main = options
        .main_device
        .unwrap_or_else(|| main_device(device_map));
    place(model, device_map, main, options)?;

    let mut order: Vec<ModuleId> = Vec::new();
    for (name, device) in device_map.iter() {
        let Some(Node::Module(m)) = tree.find(name) else {
            continue;
        };
        let offload = match device {
            bm_plan::Device::Disk => true,
            bm_plan::Device::Cpu => main != Device::Cpu,
            bm_plan::Device::Gpu(_) => false,
        };
        let exec = match device {
            bm_plan::Device::Gpu(i) => Device::Gpu(i as usize),
            _ => main,
        };
        let hook = AlignDevicesHook {
            execution_device: Some(exec),
            offload,
            io_same_device: name.is_empty(),
            offload_buffers: options.offload_buffers,
            place_submodules: true,
            skip_keys: options.skip_keys.clone(),
        };
        model.add_hook(name, Arc::new(hook), false)?;
        if offload {
            order.push(m);
        }
    }
    if device_map.get("").is_none() {
        let root = AlignDevicesHook {
            execution_device: Some(main),
            io_same_device: true,
            skip_keys: options.skip_keys.clone(),
            ..AlignDevicesHook::default()
        };
        model.add_hook("", Arc::new(root), false)?;
    }
    let pos = |m: &ModuleId| tree.preorder().iter().position(|x| x == m);
    order.sort_by_key(pos);
    model.set_prefetch_depth(options.prefetch_depth);
    model.set_resident_budget(options.resident_budget);
    model.set_streaming_order(order);
    model.set_device_map(Some(device_map.clone()));
    Ok(())
}

/// Puts every slot where `map` says.
fn place(model: &Model, map: &DeviceMap, main: Device, options: &DispatchOptions) -> Result<()> {
    let tree = model.tree();
    let devices = Arc::clone(model.devices());
    let folder_index = match &options.offload_dir {
        Some(dir) if dir.join(bm_shard::offload::INDEX_FILE).is_file() => {
            Some(OffloadFolder::open(dir)?)
        }
        _ => None,
    };
    let mut written: Vec<(String, OffloadEntry)> = Vec::new();
    let mut done = vec![false; model.slot_count()];
    for t in 0..tree.tensors().len() {
        let s = model.shared.slot_of[t];
        if std::mem::replace(&mut done[s], true) {
            continue;
        }
        let tensor = tree.tensor(t);
        let target = target_of(tree, t, map, main, options.offload_buffers);
        let current = {
            let slots = model.shared.slots.read();
            match &slots[s].state {
                SlotState::Meta => None,
                SlotState::Resident(b) => Some((Arc::clone(b), None)),
                SlotState::Offloaded { bytes, tier } => Some((Arc::clone(bytes), Some(*tier))),
            }
        };
        let Some((bytes, tier)) = current else {
            continue;
        };
        let meta = model.shared.slots.read()[s].meta.clone();
        let new_state = match (target, tier) {
            (Target::Offloaded(want), Some(have)) if want == have => continue,
            (Target::Resident(d), _) => SlotState::Resident(move_bytes(
                &tensor.name,
                &bytes,
                d,
                &devices,
                model.shared.pool.as_ref(),
            )?),
            (Target::Offloaded(Tier::Cpu), _) => {
                let host = bytes.to_host()?;
                SlotState::Offloaded {
                    bytes: Arc::new(pin(&tensor.name, &host, &devices)?),
                    tier: Tier::Cpu,
                }
            }
            (Target::Offloaded(Tier::Disk), _) => {
                let dir = options
                    .offload_dir
                    .as_deref()
                    .ok_or_else(|| Error::NoOffloadFolder {
                        modules: disk_modules(map),
                    })?;
                let view = match &folder_index {
                    Some(folder) => matching_view(folder, dir, &tensor.name, &meta)?,
                    None => {
                        let host = bytes.to_host()?;
                        let entry =
                            bm_shard::offload::offload_weight(dir, &tensor.name, &meta, &host)?;
                        written.push((tensor.name.clone(), entry));
                        MmapView::open(bm_shard::offload::dat_path(dir, &tensor.name)?)
                            .map_err(|e| Error::tensor(&tensor.name, e))?
                    }
                };
                SlotState::Offloaded {
                    bytes: Arc::new(Bytes::Mmap(view)),
                    tier: Tier::Disk,
                }
            }
        };
        model.shared.slots.write()[s].state = new_state;
    }
    if let Some(dir) = &options.offload_dir {
        save_index(dir, &written)?;
    }
    Ok(())
}

/// The offload folder's copy of `name`, which must match the model.
fn matching_view(
    folder: &OffloadFolder,
    dir: &Path,
    name: &str,
    meta: &bm_tensor::TensorMeta,
) -> Result<MmapView> {
    let mismatch = |problem: String| Error::OffloadIndexMismatch {
        folder: dir.to_path_buf(),
        problem,
    };
    let found = folder
        .meta(name)
        .ok_or_else(|| mismatch(format!("its index.json has no entry for {name}")))?;
    if found.shape != meta.shape || found.dtype != meta.dtype {
        return Err(mismatch(format!(
            "{name} is {} {:?} there, the model holds {} {:?}",
            found.dtype, found.shape, meta.dtype, meta.shape
        )));
    }
    Ok(folder.view(name)?)
}

/// Accelerate's `attach_align_device_hook` with `offload=True`: an
/// offloading hook on every module with direct tensors, or on a whole
/// preload-class subtree.
fn attach_offload_hooks(model: &Model, exec: Device, options: &DispatchOptions) -> Result<()> {
    let tree = model.tree();
    let mut order = Vec::new();
    let mut skip_below: Option<ModuleId> = None;
    for &m in tree.preorder() {
        if skip_below.is_some_and(|p| tree.is_within(m, p)) {
            continue;
        }
        let module = tree.module(m);
        let preload = options.preload_module_classes.contains(&module.class);
        if preload {
            skip_below = Some(m);
        }
        if !preload && module.params.is_empty() && module.buffers.is_empty() {
            continue;
        }
        let hook = AlignDevicesHook {
            execution_device: Some(exec),
            offload: true,
            offload_buffers: options.offload_buffers,
            place_submodules: preload,
            skip_keys: options.skip_keys.clone(),
            ..AlignDevicesHook::default()
        };
        model.add_hook(&module.name, Arc::new(hook) as Arc<dyn ModelHook>, true)?;
        order.push(m);
    }
    model.set_prefetch_depth(options.prefetch_depth);
    model.set_resident_budget(options.resident_budget);
    model.set_streaming_order(order);
    Ok(())
}

fn root_io_hook(model: &Model, exec: Device, options: &DispatchOptions) -> Result<()> {
    let root = AlignDevicesHook {
        execution_device: Some(exec),
        io_same_device: true,
        skip_keys: options.skip_keys.clone(),
        ..AlignDevicesHook::default()
    };
    model.add_hook("", Arc::new(root), true)
}

/// Accelerate's `cpu_offload`: every weight stays in host RAM (page-locked
/// when `execution_device` is a GPU) and is brought to `execution_device`
/// for each forward.
pub fn cpu_offload(
    model: &Model,
    execution_device: Device,
    options: &DispatchOptions,
) -> Result<()> {
    root_io_hook(model, execution_device, options)?;
    attach_offload_hooks(model, execution_device, options)
}

/// Accelerate's `disk_offload`: the state dict goes to `offload_dir`
/// (unless it already holds an `index.json`, which must then match the
/// model) and every weight is served from there.
pub fn disk_offload(
    model: &Model,
    offload_dir: &Path,
    execution_device: Device,
    options: &DispatchOptions,
) -> Result<()> {
    let map = DeviceMap::from_entries(vec![(String::new(), bm_plan::Device::Disk)]);
    let options = DispatchOptions {
        offload_dir: Some(offload_dir.to_path_buf()),
        ..options.clone()
    };
    place(model, &map, execution_device, &options)?;
    root_io_hook(model, execution_device, &options)?;
    attach_offload_hooks(model, execution_device, &options)
}

/// Re-exported for the facade: writes a tensor to an offload folder, cast.
pub fn offload_tensor(
    folder: &Path,
    name: &str,
    src: &MmapView,
    from: bm_tensor::DType,
    to: bm_tensor::DType,
) -> Result<PathBuf> {
    write_dat(folder, name, src, from, to)
}
