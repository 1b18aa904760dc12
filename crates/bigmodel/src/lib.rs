//! bigmodel: load and run models larger than any one device.
//!
//! A model too large for the GPU still runs, with the same outputs, as
//! fast as the links allow. The path is the one Hugging Face Accelerate's
//! "Big Model Inference" takes, with the same formats and semantics:
//!
//! 1. **Describe the model without allocating it.** A
//!    [`dispatch::ModelBuilder`] records modules (with class names),
//!    parameters, buffers and tied parameters; a 100-billion-parameter model
//!    costs a few MB of bookkeeping.
//! 2. **Plan.** The planner ([`plan`]) turns the tree and the memory of the
//!    machine into a device map: which module lives on which GPU, in host
//!    RAM, or on disk.
//! 3. **Load.** Each tensor of the checkpoint ([`shard`]: safetensors, or
//!    PyTorch `.bin` files read without running their pickle) is read once, converted to its dtype before it moves, and written
//!    straight to its place: GPU memory through page-locked staging, host
//!    RAM (zero-copy from the mapped file when it runs on the CPU), or disk
//!    (the checkpoint itself when nothing needs converting, Accelerate's
//!    offload folder otherwise).
//! 4. **Dispatch.** Hooks around each module move inputs to its execution
//!    device and bring offloaded weights there for the forward pass,
//!    prefetching the next block while this one computes.
//!
//! [`load_checkpoint_and_dispatch`] does all four from a builder's tree and
//! a checkpoint path. [`find_executable_batch_size`] runs a job with the
//! largest batch that fits, halving it on out-of-memory errors. A framework then runs each block between
//! [`dispatch::Model::enter`] and [`dispatch::Forward::exit`], reading the
//! block's weights with [`dispatch::Forward::weight`].
//!
//! ```
//! use std::sync::Arc;
//! use bigmodel::{DeviceMapSpec, Options, load_checkpoint_and_dispatch};
//! use bigmodel::dispatch::{Activations, ModelBuilder};
//! use bigmodel::tensor::DType;
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! // A checkpoint with one 2x2 linear layer, written to a temporary folder.
//! let dir = std::env::temp_dir().join(format!("bigmodel-doc-{}", std::process::id()));
//! std::fs::create_dir_all(&dir)?;
//! let header = r#"{"0.weight":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]}}"#;
//! let mut file = (header.len() as u64).to_le_bytes().to_vec();
//! file.extend_from_slice(header.as_bytes());
//! for v in [1.0f32, 2.0, 3.0, 4.0] {
//!     file.extend_from_slice(&v.to_le_bytes());
//! }
//! std::fs::write(dir.join("model.safetensors"), file)?;
//!
//! // The model, described without allocating its weights.
//! let mut builder = ModelBuilder::new("Sequential");
//! builder.linear(ModelBuilder::ROOT, "0", 2, 2, false, DType::F32)?;
//!
//! // Everything on disk, served from the checkpoint's own mapping.
//! let options = Options {
//!     device_map: Some(DeviceMapSpec::Map(bigmodel::plan::DeviceMap::from_json(
//!         &serde_json::json!({"": "disk"}),
//!     )?)),
//!     offload_folder: Some(dir.join("offload")),
//!     ..Options::default()
//! };
//! let devices = Arc::new(bigmodel::device::DeviceSet::cpu_only());
//! let model = load_checkpoint_and_dispatch(builder.build()?, &dir, devices, &options)?;
//!
//! let mut block = model.enter("0", Activations::default())?;
//! let weight = block.weight("weight")?;
//! assert_eq!(weight.meta.shape, [2, 2]);
//! assert!(weight.bytes.is_mapped());
//! block.exit(Activations::default())?;
//! # std::fs::remove_dir_all(&dir)?;
//! # Ok(())
//! # }
//! ```

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

pub use bm_device as device;
pub use bm_dispatch as dispatch;
pub use bm_plan as plan;
pub use bm_shard as shard;
pub use bm_tensor as tensor;

mod batch_size;
mod budgets;
mod error;
/// docs/guide.md, whose Rust examples run as doc tests.
#[cfg(doctest)]
mod guide;

pub use batch_size::{OutOfMemory, find_executable_batch_size};
pub use budgets::{
    BudgetOrigin, check_offload_folder, default_max_memory, default_max_memory_with_origin,
};
pub use error::Error;

use bm_device::{DeviceSet, GpuKind};
use bm_dispatch::{DispatchOptions, LoadOptions, Model};
use bm_plan::{Compat, DeviceMap, LedgerItem, MaxMemory, Mode, ModuleTree, PlanOptions};
use bm_tensor::DType;

/// Accelerate's `device_map=` argument: a strategy or an explicit map.
#[derive(Clone, Debug)]
pub enum DeviceMapSpec {
    /// `"auto"`, `"balanced"`, `"balanced_low_0"` or `"sequential"`.
    Strategy(Mode),
    /// An explicit map.
    Map(DeviceMap),
}

impl DeviceMapSpec {
    /// Parses a strategy name, with Accelerate's message for others.
    pub fn parse(text: &str) -> Result<Self, Error> {
        Mode::parse(text)
            .map(DeviceMapSpec::Strategy)
            .ok_or_else(|| Error::UnknownStrategy(text.to_string()))
    }
}

/// The options of [`load_checkpoint_and_dispatch`], as Accelerate names them.
#[derive(Clone, Debug, Default)]
pub struct Options {
    /// Where modules go; `None` loads everything on the CPU without hooks.
    pub device_map: Option<DeviceMapSpec>,
    /// Budgets for a strategy; default: [`default_max_memory`] for the
    /// chosen `planner`.
    pub max_memory: Option<MaxMemory>,
    /// Classes never split across devices.
    pub no_split_module_classes: Vec<String>,
    /// Dtype floats are loaded in.
    pub dtype: Option<DType>,
    /// Folder for disk-offloaded weights.
    pub offload_folder: Option<PathBuf>,
    /// Buffers of offloaded modules are offloaded too.
    pub offload_buffers: bool,
    /// Accepted for compatibility; loading never needs it.
    pub offload_state_dict: Option<bool>,
    /// Named inputs hooks leave in place.
    pub skip_keys: Vec<String>,
    /// Classes loaded as a whole.
    pub preload_module_classes: Vec<String>,
    /// Hooks even on a single-device map.
    pub force_hooks: bool,
    /// Missing or unexpected keys are errors.
    pub strict: bool,
    /// Modules kept in F32 when `dtype` is a half type.
    pub keep_in_fp32_modules: Vec<String>,
    /// Which planner answers a strategy (bigmodel's by default).
    pub planner: Compat,
    /// Offloaded blocks loaded ahead of the running one; `None` is
    /// bm-dispatch's default (1). The planner keeps room for them.
    pub prefetch_depth: Option<usize>,
    /// Told how far loading has got (bytes loaded, bytes in all).
    pub load_progress: Option<bm_dispatch::LoadProgress>,
    /// Produces some tensors' bytes while loading (quantize-on-load); the
    /// tree declares them in their produced form.
    pub load_transform: Option<Arc<dyn bm_dispatch::LoadTransform>>,
    /// Mixture-of-experts models: experts placed on their own, the ones
    /// not kept on a fast device on this one (the CPU or disk); compute
    /// then fetches only the offloaded experts its router picks. With a
    /// strategy, bigmodel's planner places the rest of every layer first
    /// and refills the room left with experts ([`PlanOptions::experts_on`]);
    /// with a map (or Accelerate's planner) every experts list moves here
    /// ([`bm_plan::place_experts`]). Needs a `device_map`.
    pub experts_on: Option<bm_plan::Device>,
    /// How long writing `offload_folder` waits for another process writing
    /// it (the folder's [`bm_shard::FolderLock`]), and where it says so;
    /// the default waits as long as that takes, silently.
    pub offload_sharing: bm_shard::Sharing,
}

impl Options {
    /// The prefetch depth in effect.
    pub fn prefetch_depth(&self) -> usize {
        self.prefetch_depth
            .unwrap_or(DispatchOptions::default().prefetch_depth)
    }
}

/// The float tensors of `tree` that `keep_in_fp32_modules` keeps in F32
/// when loading in a half `dtype`, as loading stores them: the planner's
/// `special_dtypes` (transformers plans them so). The one decision of what
/// a plan sizes in F32, for [`load_checkpoint_and_dispatch`] and for
/// anything that plans what it will load (the CLI's `plan` and
/// `run --verify`).
pub fn kept_in_f32(
    tree: &ModuleTree,
    dtype: Option<DType>,
    keep_in_fp32_modules: &[String],
) -> HashMap<String, DType> {
    if !matches!(dtype, Some(DType::F16 | DType::BF16)) {
        return HashMap::new();
    }
    tree.tensors()
        .filter(|t| {
            t.meta.dtype.is_float() && bm_dispatch::in_modules(t.name, keep_in_fp32_modules)
        })
        .map(|t| (t.name.to_string(), DType::F32))
        .collect()
}

/// Accelerate's `load_checkpoint_and_dispatch`: plans (for a strategy),
/// loads the checkpoint at `checkpoint` (file, index or folder) straight to
/// each tensor's place, and dispatches the model with its hooks.
pub fn load_checkpoint_and_dispatch(
    tree: ModuleTree,
    checkpoint: impl AsRef<Path>,
    devices: Arc<DeviceSet>,
    options: &Options,
) -> Result<Model, Error> {
    let mut prefetch_depth = options.prefetch_depth();
    let map = match &options.device_map {
        None => None,
        Some(DeviceMapSpec::Map(m)) => Some(m.clone()),
        Some(DeviceMapSpec::Strategy(mode)) => {
            let (max_memory, budgets) = match &options.max_memory {
                Some(m) => (m.clone(), BudgetOrigin::Given(m.clone())),
                None => default_max_memory_with_origin(&devices, options.planner)?,
            };
            let plan_options = PlanOptions {
                max_memory,
                max_memory_from_user: budgets.is_given(),
                no_split: options.no_split_module_classes.clone(),
                dtype: options.dtype,
                special_dtypes: kept_in_f32(&tree, options.dtype, &options.keep_in_fp32_modules),
                mode: *mode,
                offload_buffers: options.offload_buffers,
                prefetch_depth: options.prefetch_depth(),
                experts_on: options.experts_on,
                ..PlanOptions::default()
            };
            let plan = bm_plan::plan_with(&tree, &plan_options, options.planner)
                .map_err(|e| budgets.explain(e.into()))?;
            check_offload_folder(
                &plan.device_map,
                options.offload_folder.as_deref(),
                &budgets,
            )?;
            // Stream no more than the plan made room for.
            prefetch_depth = plan.prefetch_depth;
            Some(plan.device_map)
        }
    };
    let map = match (&options.device_map, map, options.experts_on) {
        (Some(DeviceMapSpec::Map(_)), Some(map), Some(device)) => {
            Some(bm_plan::place_experts(&tree, &map, device)?)
        }
        (_, None, Some(_)) => return Err(Error::ExpertsWithoutMap),
        (_, map, _) => map,
    };
    let model = Model::empty(tree, devices)?;
    let checkpoint = bm_shard::Checkpoint::open(checkpoint)?;
    if let Some(folder) = &options.offload_folder
        && let Some(file) = checkpoint.file_in_folder(folder)
    {
        return Err(Error::OffloadIntoCheckpoint {
            folder: folder.clone(),
            file: file.to_path_buf(),
        });
    }
    let load = LoadOptions {
        dtype: options.dtype,
        offload_folder: options.offload_folder.clone(),
        offload_buffers: options.offload_buffers,
        offload_state_dict: options.offload_state_dict.unwrap_or(false),
        keep_in_fp32_modules: options.keep_in_fp32_modules.clone(),
        strict: options.strict,
        progress: options.load_progress.clone(),
        transform: options.load_transform.clone(),
        sharing: options.offload_sharing.clone(),
    };
    bm_dispatch::load_checkpoint_in_model(&model, &checkpoint, map.as_ref(), &load)?;
    if let Some(map) = map {
        let dispatch = DispatchOptions {
            offload_dir: options.offload_folder.clone(),
            offload_buffers: options.offload_buffers,
            skip_keys: options.skip_keys.clone(),
            preload_module_classes: options.preload_module_classes.clone(),
            force_hooks: options.force_hooks,
            prefetch_depth,
            sharing: options.offload_sharing.clone(),
            ..DispatchOptions::default()
        };
        bm_dispatch::dispatch_model(&model, &map, &dispatch)?;
    }
    Ok(model)
}

/// The module tree of a checkpoint (a `.safetensors` or PyTorch `.bin`
/// file, an index or a folder), from its headers alone: modules are the
/// dotted prefixes of the tensor names, and names a PyTorch file stores over
/// one storage are tied (see [`bm_plan::checkpoint::tree_from_tied_tensors`]).
pub fn tree_from_checkpoint(path: impl AsRef<Path>) -> Result<ModuleTree, Error> {
    let checkpoint = bm_shard::Checkpoint::open(path)?;
    Ok(bm_plan::checkpoint::tree_from_tied_tensors(
        checkpoint.tensors(),
        &checkpoint.ties(),
    )?)
}

/// The fixed per-device costs of running a plan with `max_memory`, for the
/// ledger ([`PlanOptions::overheads`]): the host staging of a model that
/// loads onto or streams to GPUs ([`bm_dispatch::host_staging_bytes`]: its
/// reader pool's slots and a host cast's chunk) whenever a GPU has a
/// budget (and the CPU one to take it from), and the cuBLAS workspace
/// ([`bm_device::GEMM_WORKSPACE_BYTES`]) on each of `cuda_gpus` (the
/// ordinals of the CUDA GPUs the plan is for, as probed or calibrated: a
/// plan for GPUs this machine does not have, or for emulated ones, which
/// run no cuBLAS, charges none) that has a budget.
///
/// The CPU is charged no GEMM workspace: its kernels read F32 weights in
/// place, and their scratch (the `gemm` crate's per-thread packing buffers,
/// the f32 copy of a half-precision weight block of at most 256 KiB per
/// thread) is a few MiB at most, inside the host's safety margin.
pub fn overheads(
    max_memory: &MaxMemory,
    cuda_gpus: &[u32],
) -> Vec<(bm_plan::Device, LedgerItem, u64)> {
    let mut out = Vec::new();
    if max_memory.gpus().any(|(_, b)| b > 0) && max_memory.get(bm_plan::Device::Cpu).is_some() {
        out.push((
            bm_plan::Device::Cpu,
            LedgerItem::Staging,
            bm_dispatch::host_staging_bytes(),
        ));
    }
    for (gpu, _) in max_memory
        .gpus()
        .filter(|(i, b)| *b > 0 && cuda_gpus.contains(i))
    {
        out.push((
            bm_plan::Device::Gpu(gpu),
            LedgerItem::GemmWorkspace,
            bm_device::GEMM_WORKSPACE_BYTES as u64,
        ));
    }
    out
}

/// The ordinals of `devices`' CUDA GPUs, for [`overheads`].
pub fn cuda_gpus(devices: &DeviceSet) -> Vec<u32> {
    devices
        .gpus()
        .iter()
        .filter(|g| g.kind() == GpuKind::Cuda)
        .map(|g| g.ordinal() as u32)
        .collect()
}

/// [`overheads`] plus what a calibration measured on each GPU the budgets
/// name: its CUDA context, charged only when the budgets came from the user
/// (measured default budgets are free memory, which the context has
/// already taken).
pub fn overheads_calibrated(
    max_memory: &MaxMemory,
    budgets_from_user: bool,
    calibration: &bm_plan::Calibration,
) -> Vec<(bm_plan::Device, LedgerItem, u64)> {
    let calibrated: Vec<u32> = calibration.gpus.iter().map(|g| g.ordinal).collect();
    let mut out = overheads(max_memory, &calibrated);
    if budgets_from_user {
        for gpu in &calibration.gpus {
            let device = bm_plan::Device::Gpu(gpu.ordinal);
            if max_memory.get(device).is_some() {
                out.push((device, LedgerItem::CudaContext, gpu.context_bytes));
            }
        }
    }
    out
}

/// The dry run: allocates each item of `ledger` on every GPU it lists (as
/// separate buffers, as a run allocates them) and frees them again, and
/// compares the host's items with the memory the machine has available
/// (allocating host memory would only reserve address space). Returns the
/// devices that are short; a GPU the ledger names that `devices` lacks is
/// an error.
pub fn verify_ledger(
    ledger: &bm_plan::Ledger,
    devices: &DeviceSet,
) -> Result<Vec<bm_plan::Shortfall>, Error> {
    let mut short = Vec::new();
    for device in ledger.devices() {
        let needed = ledger.total(device);
        let available = match device {
            bm_plan::Device::Gpu(i) => {
                let gpu = devices.gpu(i as usize).map_err(Error::Memory)?;
                let free = gpu.memory().map_err(Error::Memory)?.free;
                let available = free.min(gpu.budget().saturating_sub(gpu.live_bytes()));
                let mut held = Vec::new();
                let mut allocated = 0u64;
                let mut fits = true;
                for &(_, bytes) in ledger.items(device) {
                    match usize::try_from(bytes).map(|b| gpu.alloc(b)) {
                        Ok(Ok(buffer)) => {
                            held.push(buffer);
                            allocated += bytes;
                        }
                        _ => {
                            fits = false;
                            break;
                        }
                    }
                }
                drop(held);
                if fits {
                    continue;
                }
                // Less than the free memory said (fragmentation, another
                // process): what was allocated is what is known to fit.
                if available >= needed {
                    allocated
                } else {
                    available
                }
            }
            bm_plan::Device::Cpu => devices.memory_info().map_err(Error::Memory)?.host.available,
            bm_plan::Device::Disk => continue,
        };
        if needed > available {
            short.push(bm_plan::Shortfall {
                device,
                needed,
                budget: available,
            });
        }
    }
    Ok(short)
}
