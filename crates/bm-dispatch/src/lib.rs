//! Running models larger than any device: empty initialisation, loading a
//! checkpoint straight to each tensor's place, and the hooks that stream
//! offloaded weights onto the execution device around each module's forward.
//!
//! # The pieces
//!
//! * [`ModelBuilder`] records a model's modules, parameters, buffers and
//!   tied parameters without allocating a byte of tensor data (Accelerate's
//!   `init_empty_weights`); its [`bm_plan::ModuleTree`] is what the planner
//!   plans on. [`init_on_device`] allocates every tensor, zeroed, on one
//!   device instead.
//! * A [`Model`] holds one storage slot per tensor (tied names share one).
//!   A slot is on the meta device, resident on a device (a host buffer, a
//!   zero-copy view of the mapped checkpoint, or GPU memory), or offloaded:
//!   in host RAM (page-locked when a GPU will read it) or on disk (a mapped
//!   file: the checkpoint itself when no cast was needed, else Accelerate's
//!   offload folder). [`Bytes`] is where a tensor's bytes are at run time,
//!   for weights and for the activation [`Tensor`]s forward passes trade.
//! * Where each storage goes under a device map, which map entries compute
//!   where and which offload, and what a hook does to its module's storages
//!   are decided in one place (the `placement` module), which loading,
//!   dispatch and the hooks consume.
//! * [`load_checkpoint_in_model`] reads each storage once, casts it before
//!   it moves (integers never; `keep_in_fp32_modules`), and writes it
//!   straight to its place through bounded staging ([`STAGING_BYTES`]), so
//!   peak host memory is the CPU-resident part plus one staging window.
//!   Missing and unexpected keys are reported, errors under `strict`. A
//!   [`LoadTransform`] may produce some tensors' bytes instead (bm-models
//!   quantizes linear weights on load this way, one tensor at a time).
//! * Hooks ([`ModelHook`], [`SequentialHook`], [`AlignDevicesHook`],
//!   [`CpuOffload`]) run around a module's forward. [`dispatch_model`],
//!   [`cpu_offload`], [`disk_offload`] and [`cpu_offload_with_hook`] attach
//!   them as Accelerate does.
//!
//! # Running a forward pass
//!
//! A framework brackets each block with [`Model::enter`] and
//! [`Forward::exit`]:
//!
//! ```ignore
//! let mut g = model.enter("model.layers.3", inputs)?; // inputs moved, weights materialised
//! let w = g.weight("self_attn.q_proj.weight")?;       // on the execution device
//! let outputs = compute(g.take_inputs(), &w);
//! let outputs = g.exit(outputs)?;                      // weights released, outputs moved
//! ```
//!
//! Per-call state lives in the [`Forward`] guard, so many threads may run
//! one model at once; an offloaded weight is materialised once per device
//! and shared by all passes that use it at the same time.
//!
//! # The code
//!
//! `model.rs` (the [`Model`] handle, hooks, `enter`), `slots.rs` (the slot
//! table), `residency.rs` (offloaded weights materialised on execution
//! devices, the resident budget and the prefetch worker), `forward.rs` (the
//! [`Forward`] guard), `placement.rs` (the one placement decision),
//! `load.rs`, `dispatch.rs`, `hooks.rs`, `builder.rs`, `bytes.rs` (bytes,
//! activations, and the one upload path to a device).
//!
//! # Streaming
//!
//! When an offloaded block is entered, a worker thread starts loading the
//! next `prefetch_depth` offloaded blocks (default 1) onto their execution
//! device while this one computes: from page-locked memory for CPU-offloaded
//! weights, and for disk-offloaded weights reading the mapped file into the
//! pinned staging ring whose slots the copy engine drains as the next ones
//! fill. When the CPU executes, disk-offloaded weights in the right dtype
//! are used straight from the mapping, without a copy. With
//! [`Model::set_resident_budget`], offloaded weights stay on their
//! execution device across calls, least recently used evicted first.
//!
//! Differences from Accelerate are listed in docs/compat.md ("Loading and
//! dispatch").

mod builder;
mod bytes;
mod dispatch;
mod error;
mod forward;
mod hooks;
mod load;
mod model;
mod placement;
mod residency;
mod slots;
mod transfer;

pub use builder::{ModelBuilder, init_on_device};
pub use bytes::{Activations, Bytes, Tensor, Weight, tensor_to_device};
pub use dispatch::{DispatchOptions, cpu_offload, disk_offload, dispatch_model, offload_tensor};
pub use error::{Error, Result};
pub use forward::Forward;
pub use hooks::{
    AlignDevicesHook, CpuOffload, ModelHook, SequentialHook, UserCpuOffloadHook,
    cpu_offload_with_hook, flatten,
};
pub use load::{
    LoadOptions, LoadProgress, LoadReport, LoadTransform, in_modules, load_checkpoint_in_model,
};
pub use model::Model;
pub use slots::{Placement, SlotId, Tier};
pub use transfer::{DiskReads, GPU_CAST_CHUNK, STAGING_BYTES, host_staging_bytes};
