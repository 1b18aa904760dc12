//! `dispatch_model`, `cpu_offload`, `disk_offload`: placing a loaded model
//! over its devices and attaching the hooks that run it there.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use bm_device::Device;
use bm_plan::DeviceMap;
use bm_shard::offload::{OffloadEntry, OffloadFolder, save_index};
use bm_shard::{FolderLock, Sharing};
use bm_tensor::MmapView;

use crate::bytes::Bytes;
use crate::hooks::{AlignDevicesHook, ModelHook};
use crate::load::write_dat;
use crate::model::Model;
use crate::placement::{MapPlacement, Target, disk_modules, main_device, offload_entries};
use crate::slots::{SlotState, Tier};
use crate::transfer::{DiskReads, move_bytes, pin};
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
    /// How disk-offloaded weights are read on their way to a GPU.
    pub disk_reads: DiskReads,
    /// How long placing weights in the offload folder waits for another
    /// process writing it, and where it says so.
    pub sharing: Sharing,
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
            disk_reads: DiskReads::Auto,
            sharing: Sharing::default(),
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
    let main = options
        .main_device
        .unwrap_or_else(|| main_device(device_map));
    let placement = MapPlacement::new(model, device_map, main, options.offload_buffers)?;
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
        // Nothing streams, but the model says what it would use.
        model.set_prefetch_depth(options.prefetch_depth);
        return Ok(());
    }
    let disk = disk_modules(device_map);
    if !disk.is_empty() && options.offload_dir.is_none() {
        return Err(Error::NoOffloadFolder {
            modules: disk,
            budgets: None,
        });
    }
    place(model, &placement, device_map, options)?;
    for entry in &placement.entries {
        let hook = AlignDevicesHook {
            execution_device: Some(entry.exec),
            offload: entry.offload,
            io_same_device: entry.name.is_empty(),
            offload_buffers: options.offload_buffers,
            place_submodules: true,
            skip_keys: options.skip_keys.clone(),
        };
        model.add_hook(&entry.name, Arc::new(hook), false)?;
    }
    if device_map.get("").is_none() {
        let root = AlignDevicesHook {
            execution_device: Some(placement.main),
            io_same_device: true,
            skip_keys: options.skip_keys.clone(),
            ..AlignDevicesHook::default()
        };
        model.add_hook("", Arc::new(root), false)?;
    }
    model.set_prefetch_depth(options.prefetch_depth);
    model.set_resident_budget(options.resident_budget);
    model.set_disk_reads(options.disk_reads);
    model.set_streaming_order(placement.streaming_order(model.tree()));
    model.set_device_map(Some(device_map.clone()));
    Ok(())
}

/// Puts every loaded slot at its target: moved to a device, page-locked in
/// host RAM, or on disk (the offload folder's copy when `offload_dir`
/// already has an index, which must match the model; else written there).
fn place(
    model: &Model,
    placement: &MapPlacement,
    map: &DeviceMap,
    options: &DispatchOptions,
) -> Result<()> {
    let tree = model.tree();
    let table = model.slots();
    let devices = Arc::clone(model.devices());
    // The slots this puts on disk that are not there yet (a load straight
    // to disk already put its own there).
    let to_disk: HashSet<String> = placement
        .slots
        .iter()
        .enumerate()
        .filter(|&(s, &target)| {
            target == Target::Offloaded(Tier::Disk)
                && table.with(s, |_, state| {
                    !matches!(
                        state,
                        SlotState::Meta
                            | SlotState::Offloaded {
                                tier: Tier::Disk,
                                ..
                            }
                    )
                })
        })
        .map(|(s, _)| table.name(tree, s))
        .collect();
    // The folder is read or written under its lock; only the entries used
    // are opened and checked.
    let (_lock, folder_index) = match &options.offload_dir {
        Some(dir) if !to_disk.is_empty() => {
            let lock = FolderLock::acquire(dir, &options.sharing)?;
            let index = if dir.join(bm_shard::offload::INDEX_FILE).is_file() {
                Some(OffloadFolder::open_some(dir, &|name| {
                    to_disk.contains(name)
                })?)
            } else {
                None
            };
            (Some(lock), index)
        }
        _ => (None, None),
    };
    let mut written: Vec<(String, OffloadEntry)> = Vec::new();
    for (s, &target) in placement.slots.iter().enumerate() {
        let name = table.name(tree, s);
        let current = table.with(s, |meta, state| match state {
            SlotState::Meta => None,
            SlotState::Resident(b) => Some((meta.clone(), Arc::clone(b), None)),
            SlotState::Offloaded { bytes, tier } => {
                Some((meta.clone(), Arc::clone(bytes), Some(*tier)))
            }
        });
        let Some((meta, bytes, tier)) = current else {
            continue;
        };
        let new_state = match (target, tier) {
            (Target::Offloaded(want), Some(have)) if want == have => continue,
            (Target::Resident(d), _) => SlotState::Resident(move_bytes(
                &name,
                &bytes,
                d,
                &devices,
                Some(model.uploader()),
            )?),
            (Target::Offloaded(Tier::Cpu), _) => {
                let host = bytes.to_host()?;
                SlotState::Offloaded {
                    bytes: Arc::new(pin(&name, &host, &devices)?),
                    tier: Tier::Cpu,
                }
            }
            (Target::Offloaded(Tier::Disk), _) => {
                let dir = options
                    .offload_dir
                    .as_deref()
                    .ok_or_else(|| Error::NoOffloadFolder {
                        modules: disk_modules(map),
                        budgets: None,
                    })?;
                let view = match &folder_index {
                    Some(folder) => matching_view(folder, dir, &name, &meta)?,
                    None => {
                        let host = bytes.to_host()?;
                        let (entry, view) =
                            bm_shard::offload::offload_weight_mapped(dir, &name, &meta, &host)?;
                        written.push((name.clone(), entry));
                        view
                    }
                };
                SlotState::Offloaded {
                    bytes: Arc::new(Bytes::Mmap(view)),
                    tier: Tier::Disk,
                }
            }
        };
        table.set(s, new_state);
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
    let entries = offload_entries(tree, &options.preload_module_classes);
    for &(m, whole) in &entries {
        let hook = AlignDevicesHook {
            execution_device: Some(exec),
            offload: true,
            offload_buffers: options.offload_buffers,
            place_submodules: whole,
            skip_keys: options.skip_keys.clone(),
            ..AlignDevicesHook::default()
        };
        model.add_hook(
            tree.module(m).name,
            Arc::new(hook) as Arc<dyn ModelHook>,
            true,
        )?;
    }
    model.set_prefetch_depth(options.prefetch_depth);
    model.set_resident_budget(options.resident_budget);
    model.set_disk_reads(options.disk_reads);
    model.set_streaming_order(entries.into_iter().map(|(m, _)| m).collect());
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
    let placement = MapPlacement::new(model, &map, execution_device, options.offload_buffers)?;
    place(model, &placement, &map, &options)?;
    root_io_hook(model, execution_device, &options)?;
    attach_offload_hooks(model, execution_device, &options)
}

/// Re-exported for the facade: writes a tensor to an offload folder, cast,
/// and maps it through the descriptor it was written with. A caller
/// writing a folder other processes may use holds its
/// [`bm_shard::FolderLock`] and updates the index under it.
pub fn offload_tensor(
    folder: &Path,
    name: &str,
    src: &MmapView,
    from: bm_tensor::DType,
    to: bm_tensor::DType,
) -> Result<MmapView> {
    write_dat(folder, name, src.as_bytes(), from, to)
}
