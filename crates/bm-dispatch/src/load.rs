//! `load_checkpoint_in_model`: every tensor read once, cast before it
//! moves, and written straight to its place.

use std::collections::HashSet;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use bm_device::{Device, DeviceSet};
use bm_plan::{DeviceMap, Node, TensorKind};
use bm_shard::offload::{OffloadEntry, dat_path, prepare_index, save_index};
use bm_shard::{Checkpoint, FolderLock, Format, Sharing, TensorBytes, cast_target};
use bm_tensor::{DType, HostBuffer, MmapView, TensorMeta};

use crate::bytes::Bytes;
use crate::model::Model;
use crate::placement::{MapPlacement, Target, disk_modules, main_device};
use crate::slots::{SlotState, Tier};
use crate::transfer::{GpuLoad, cast_chunks};
use crate::{Error, Result};

/// Options of [`load_checkpoint_in_model`] (Accelerate's keyword arguments).
#[derive(Clone, Debug, Default)]
pub struct LoadOptions {
    /// Float tensors are loaded in this dtype (integers and bool never are).
    /// `None` loads each tensor in the dtype the model declares.
    pub dtype: Option<DType>,
    /// Where disk-mapped tensors that must be rewritten go (Accelerate's
    /// offload-folder format).
    pub offload_folder: Option<PathBuf>,
    /// Buffers of offloaded modules are offloaded too.
    pub offload_buffers: bool,
    /// Accepted for compatibility: loading never holds more than one
    /// staging window besides the CPU-resident part, so there is nothing to
    /// spill.
    pub offload_state_dict: bool,
    /// Modules (dotted names) kept in F32 when `dtype` is a half type.
    pub keep_in_fp32_modules: Vec<String>,
    /// Missing or unexpected keys are errors.
    pub strict: bool,
    /// Told how far loading has got, for a progress bar.
    pub progress: Option<LoadProgress>,
    /// Produces the bytes of the tensors it claims instead of the
    /// checkpoint's (quantize-on-load).
    pub transform: Option<Arc<dyn LoadTransform>>,
    /// How long a load that writes the offload folder waits for another
    /// process writing it, and where it says so (and which stale index
    /// entries it removed).
    pub sharing: Sharing,
}

/// Turns what a checkpoint stores for some tensors into the bytes the
/// model holds for them, one tensor at a time while loading: bm-models
/// quantizes linear weights this way, so the model is never whole in full
/// precision in memory. The model declares such a tensor in its held form
/// (a packed weight is `U8` of its packed length); the loader places the
/// bytes returned like any tensor's (resident, offloaded to pinned memory
/// or written to the offload folder), never casting them.
pub trait LoadTransform: Send + Sync + std::fmt::Debug {
    /// True when this transform produces tensor `name`.
    fn claims(&self, name: &str) -> bool;

    /// True when checkpoint entry `name` is read by the transform (a part
    /// of a claimed tensor), so it is not an unexpected key.
    fn reads(&self, name: &str) -> bool;

    /// The bytes of claimed tensor `name`, exactly `declared.byte_len()`
    /// long, read from `checkpoint`; `dtype` is what its stored values
    /// load in (the load's dtype, F32 for `keep_in_fp32_modules`, else as
    /// stored).
    fn produce(
        &self,
        name: &str,
        declared: &TensorMeta,
        checkpoint: &Checkpoint,
        dtype: DType,
    ) -> std::result::Result<HostBuffer, Box<dyn std::error::Error + Send + Sync>>;
}

/// A callback told, after each tensor, the checkpoint bytes loaded so far
/// and the bytes to load in all.
#[derive(Clone)]
pub struct LoadProgress(pub Arc<dyn Fn(u64, u64) + Send + Sync>);

impl std::fmt::Debug for LoadProgress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("LoadProgress")
    }
}

/// What a load did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LoadReport {
    /// State-dict tensors the checkpoint lacks (left on meta).
    pub missing: Vec<String>,
    /// Checkpoint tensors the model lacks (skipped).
    pub unexpected: Vec<String>,
    /// Tensors written to the offload folder (cast, so rewritten).
    pub written_to_folder: Vec<String>,
    /// Disk-mapped tensors served from the checkpoint file itself.
    pub mapped_in_place: Vec<String>,
    /// Entries of the offload index that disagreed with their files and
    /// were removed (what killed runs or deleted checkpoints leave).
    pub stale_in_folder: Vec<String>,
}

/// The dtype tensor `name` (declared `declared`, stored `stored`) is loaded in.
fn load_dtype(name: &str, declared: DType, stored: DType, options: &LoadOptions) -> DType {
    let Some(requested) = options.dtype else {
        return cast_target(stored, declared);
    };
    let half = matches!(requested, DType::F16 | DType::BF16);
    let keep = half && stored.is_float() && in_modules(name, &options.keep_in_fp32_modules);
    cast_target(stored, if keep { DType::F32 } else { requested })
}

/// True when tensor `name` belongs to one of `modules` (a dotted module
/// name, or the last parts of one: `wo` names every `….wo.weight`), the
/// way a `keep_in_fp32_modules` list is matched.
pub fn in_modules(name: &str, modules: &[String]) -> bool {
    modules.iter().any(|k| {
        name == k || name.starts_with(&format!("{k}.")) || name.contains(&format!(".{k}."))
    })
}

/// Accelerate's `load_checkpoint_in_model`. Without a map everything goes
/// to the CPU. Each storage is read once (tied names share it), converted
/// to its dtype (integers never) and written straight to its place:
///
/// * a GPU: the stored bytes uploaded on its copy stream, then cast on the
///   GPU when the dtype changes (on the host, [`crate::STAGING_BYTES`] at a
///   time, for emulated GPUs); the load returns once every copy landed;
/// * the CPU, computing there: a zero-copy view of the checkpoint when the
///   dtype matches, else a cast copy;
/// * the CPU, offloaded for a GPU: page-locked memory, cast in place;
/// * disk: the checkpoint itself when the dtype matches (indexed in the
///   offload folder with transformers' `safetensors_file` entries), else a
///   `.dat` file of the folder written [`crate::STAGING_BYTES`] at a time.
///
/// Buffers of disk-mapped modules get their checkpoint values. On any error
/// nothing is committed: device memory taken so far is released and no
/// offload index is written.
///
/// A load that maps tensors to disk holds the offload folder's
/// [`FolderLock`] from before its first write until its index is written.
/// Under it, the index entries of the tensors it maps to disk are removed
/// before any `.dat` is rewritten and entries that disagree with their
/// files are pruned ([`prepare_index`], reported in
/// [`LoadReport::stale_in_folder`] and told to [`LoadOptions::sharing`]),
/// so a process killed mid-write never leaves an index describing bytes it
/// no longer holds; each `.dat` written is mapped through the descriptor it
/// was written with, so this process computes with its own bytes whatever
/// another one writes there later.
pub fn load_checkpoint_in_model(
    model: &Model,
    checkpoint: &Checkpoint,
    device_map: Option<&DeviceMap>,
    options: &LoadOptions,
) -> Result<LoadReport> {
    let tree = model.tree();
    let devices = Arc::clone(model.devices());
    let default_map = DeviceMap::from_entries(vec![(String::new(), bm_plan::Device::Cpu)]);
    let map = device_map.unwrap_or(&default_map);
    let placement = MapPlacement::new(model, map, main_device(map), options.offload_buffers)?;
    let disk = disk_modules(map);
    if !disk.is_empty() && options.offload_folder.is_none() {
        return Err(Error::NoOffloadFolder {
            modules: disk,
            budgets: None,
        });
    }

    let mut report = LoadReport::default();
    let transform = options.transform.as_deref();
    for (name, _) in checkpoint.tensors() {
        if !matches!(tree.find(name), Some(Node::Tensor(_)))
            && !transform.is_some_and(|t| t.reads(name))
        {
            report.unexpected.push(name.to_string());
        }
    }
    for t in tree.state_dict() {
        let name = &tree.tensor(t).name;
        let group_present = match tree.tensor(t).tie_group {
            Some(g) => tree.tied_groups()[g]
                .iter()
                .any(|&o| checkpoint.meta(tree.tensor(o).name).is_some()),
            None => checkpoint.meta(name).is_some(),
        };
        if !group_present {
            report.missing.push(name.to_string());
        }
    }
    if options.strict && (!report.missing.is_empty() || !report.unexpected.is_empty()) {
        return Err(Error::KeysMismatch {
            checkpoint: checkpoint.path().to_path_buf(),
            missing: report.missing,
            unexpected: report.unexpected,
        });
    }

    // One representative tensor per storage: the first name of a tied
    // group present in the checkpoint (else its first name).
    let slot_count = model.slot_count();
    let mut rep: Vec<Option<usize>> = vec![None; slot_count];
    for (t, tensor) in tree.tensors().enumerate() {
        let s = model.slots().slot_of(t);
        let better = match rep[s] {
            None => true,
            Some(r) => {
                checkpoint.meta(tree.tensor(r).name).is_none()
                    && checkpoint.meta(tensor.name).is_some()
            }
        };
        if better {
            rep[s] = Some(t);
        }
    }

    let on_disk = |s: usize| placement.slots[s] == Target::Offloaded(Tier::Disk);
    let folder_lock = match options.offload_folder.as_deref() {
        Some(folder) if (0..placement.slots.len()).any(on_disk) => {
            Some((folder, FolderLock::acquire(folder, &options.sharing)?))
        }
        _ => None,
    };
    if let Some((folder, _)) = &folder_lock {
        let rewriting: HashSet<&str> = rep
            .iter()
            .enumerate()
            .filter(|&(s, _)| on_disk(s))
            .filter_map(|(_, r)| r.map(|t| tree.tensor(t).name))
            .collect();
        report.stale_in_folder = prepare_index(folder, &|name| rewriting.contains(name))?;
        if !report.stale_in_folder.is_empty() {
            options.sharing.notify(&format!(
                "warning: offload folder {}: removed {} index entr{} that disagreed with their files ({}); a run writing it was interrupted, or a checkpoint it pointed into was removed",
                folder.display(),
                report.stale_in_folder.len(),
                if report.stale_in_folder.len() == 1 { "y" } else { "ies" },
                shortened_list(&report.stale_in_folder),
            ));
        }
    }
    let stored_bytes = |t: usize| {
        checkpoint
            .meta(tree.tensor(t).name)
            .map_or(0, |m| m.byte_len() as u64)
    };
    let to_load: u64 = rep.iter().flatten().map(|&t| stored_bytes(t)).sum();
    let mut loaded = 0u64;
    let mut staged: Vec<(usize, TensorMeta, SlotState)> = Vec::new();
    let mut index: Vec<(String, OffloadEntry)> = Vec::new();
    let mut gpu_load = GpuLoad::new(model.uploader());
    for (s, r) in rep.iter().enumerate() {
        let Some(t) = *r else { continue };
        if let Some(LoadProgress(report)) = &options.progress {
            report(loaded, to_load);
        }
        loaded += stored_bytes(t);
        let tensor = tree.tensor(t);
        let target = placement.slots[s];
        let Some(stored) = checkpoint.meta(tensor.name) else {
            if tensor.kind == (TensorKind::Buffer { persistent: false }) {
                let state = zeroed(tensor.name, tensor.meta, target, &devices)?;
                staged.push((s, tensor.meta.clone(), state));
            }
            continue;
        };
        let (data, stored, dtype) = match transform.filter(|t| t.claims(tensor.name)) {
            Some(t) => {
                let dtype = load_dtype(tensor.name, stored.dtype, stored.dtype, options);
                let bytes = t
                    .produce(tensor.name, tensor.meta, checkpoint, dtype)
                    .map_err(|source| Error::Transform {
                        name: tensor.name.to_string(),
                        source,
                    })?;
                if bytes.len() != tensor.meta.byte_len() {
                    return Err(Error::Transform {
                        name: tensor.name.to_string(),
                        source: format!(
                            "produced {} bytes, the model declares {} ({} {:?})",
                            bytes.len(),
                            tensor.meta.byte_len(),
                            tensor.meta.dtype,
                            tensor.meta.shape
                        )
                        .into(),
                    });
                }
                (
                    TensorBytes::Gathered(bytes),
                    tensor.meta.clone(),
                    tensor.meta.dtype,
                )
            }
            None => {
                if stored.shape != tensor.meta.shape {
                    return Err(Error::ShapeMismatch {
                        name: tensor.name.to_string(),
                        found: stored.shape.clone(),
                        expected: tensor.meta.shape.clone(),
                    });
                }
                let dtype = load_dtype(tensor.name, tensor.meta.dtype, stored.dtype, options);
                // Zero-copy from the mapping, except a strided view in a
                // PyTorch file, which is gathered.
                (checkpoint.bytes(tensor.name)?, stored.clone(), dtype)
            }
        };
        let stored = &stored;
        let meta = TensorMeta::new(dtype, stored.shape.clone());
        let state = match target {
            Target::Resident(Device::Cpu) => {
                let bytes = match data {
                    _ if dtype != stored.dtype => {
                        Bytes::Host(checkpoint.read_as(tensor.name, dtype)?)
                    }
                    TensorBytes::Mapped(view) => Bytes::Mmap(view),
                    TensorBytes::Gathered(buf) => Bytes::Host(buf),
                };
                SlotState::Resident(Arc::new(bytes))
            }
            Target::Resident(device) => {
                let stored_bytes = Arc::new(match data {
                    TensorBytes::Mapped(view) => Bytes::Mmap(view),
                    TensorBytes::Gathered(buf) => Bytes::Host(buf),
                });
                let bytes =
                    gpu_load.write(tensor.name, &stored_bytes, stored.dtype, dtype, device)?;
                SlotState::Resident(Arc::new(bytes))
            }
            Target::Offloaded(Tier::Cpu) => {
                let mut pinned = devices
                    .alloc_pinned(meta.byte_len().max(1))
                    .map_err(|e| Error::device(tensor.name, e))?;
                let dst = pinned
                    .as_mut_slice()
                    .map_err(|e| Error::device(tensor.name, e))?;
                cast_chunks(
                    tensor.name,
                    data.as_bytes(),
                    stored.dtype,
                    dtype,
                    &mut |off, c| {
                        dst[off..off + c.len()].copy_from_slice(c);
                        Ok(())
                    },
                )?;
                SlotState::Offloaded {
                    bytes: Arc::new(Bytes::Pinned(pinned)),
                    tier: Tier::Cpu,
                }
            }
            Target::Offloaded(Tier::Disk) => {
                let folder =
                    options
                        .offload_folder
                        .as_deref()
                        .ok_or_else(|| Error::NoOffloadFolder {
                            modules: disk.clone(),
                            budgets: None,
                        })?;
                // Accelerate's offload index can point into a safetensors
                // file; anything else is written to the folder.
                let in_place = match &data {
                    TensorBytes::Mapped(view)
                        if dtype == stored.dtype
                            && checkpoint.format_of(tensor.name) == Some(Format::Safetensors) =>
                    {
                        Some(view.clone())
                    }
                    _ => None,
                };
                let bytes = if let Some(view) = in_place {
                    let file = checkpoint
                        .file_of(tensor.name)
                        .map(|p| std::fs::canonicalize(p).unwrap_or_else(|_| p.to_path_buf()))
                        .unwrap_or_default();
                    index.push((
                        tensor.name.to_string(),
                        OffloadEntry::Safetensors {
                            file,
                            weight_name: tensor.name.to_string(),
                            dtype: None,
                        },
                    ));
                    report.mapped_in_place.push(tensor.name.to_string());
                    Bytes::Mmap(view)
                } else {
                    let view =
                        write_dat(folder, tensor.name, data.as_bytes(), stored.dtype, dtype)?;
                    index.push((tensor.name.to_string(), OffloadEntry::Dat(meta.clone())));
                    report.written_to_folder.push(tensor.name.to_string());
                    Bytes::Mmap(view)
                };
                SlotState::Offloaded {
                    bytes: Arc::new(bytes),
                    tier: Tier::Disk,
                }
            }
        };
        staged.push((s, meta, state));
    }
    gpu_load.finish()?;
    if let Some((folder, lock)) = folder_lock {
        save_index(folder, &index)?;
        drop(lock);
    }
    if let Some(LoadProgress(report)) = &options.progress {
        report(to_load, to_load);
    }
    model.slots().commit(staged);
    Ok(report)
}

/// Zeroed storage for a tensor the checkpoint does not hold (a
/// non-persistent buffer).
fn zeroed(name: &str, meta: &TensorMeta, target: Target, devices: &DeviceSet) -> Result<SlotState> {
    let len = meta.byte_len();
    let host = || -> Result<Arc<Bytes>> {
        Ok(Arc::new(Bytes::Host(
            HostBuffer::zeroed(len).map_err(|e| Error::tensor(name, e))?,
        )))
    };
    Ok(match target {
        Target::Resident(Device::Gpu(i)) => {
            let gpu = devices.gpu(i).map_err(|_| Error::NoSuchDevice {
                what: name.to_string(),
                device: Device::Gpu(i),
            })?;
            SlotState::Resident(Arc::new(Bytes::Device(
                gpu.alloc_zeroed(len.max(1))
                    .map_err(|e| Error::device(name, e))?,
            )))
        }
        Target::Resident(Device::Cpu) => SlotState::Resident(host()?),
        Target::Offloaded(tier) => SlotState::Offloaded {
            bytes: host()?,
            tier,
        },
    })
}

/// The first names of `names`, for a message.
fn shortened_list(names: &[String]) -> String {
    const SHOWN: usize = 5;
    let mut text = names[..names.len().min(SHOWN)].join(", ");
    if names.len() > SHOWN {
        text += &format!(" and {} more", names.len() - SHOWN);
    }
    text
}

/// Writes `name` converted to `to` as `<folder>/<name>.dat` with
/// bm-shard's atomic writer, [`crate::STAGING_BYTES`] at a time, and maps
/// it through the descriptor it was written with.
pub(crate) fn write_dat(
    folder: &Path,
    name: &str,
    src: &[u8],
    from: DType,
    to: DType,
) -> Result<MmapView> {
    let path = dat_path(folder, name)?;
    std::fs::create_dir_all(folder).map_err(|e| Error::Io {
        path: folder.to_path_buf(),
        source: e,
    })?;
    let mut file = bm_shard::AtomicFile::create(&path)?;
    cast_chunks(name, src, from, to, &mut |_, chunk| {
        file.write_all(chunk).map_err(|e| Error::Io {
            path: path.clone(),
            source: e,
        })
    })?;
    Ok(file.commit_and_map()?)
}
