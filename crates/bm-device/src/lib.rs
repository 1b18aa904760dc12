//! Devices for bigmodel: everything that touches an accelerator, behind
//! one small API the other crates use.
//!
//! # The model
//!
//! A [`DeviceSet`] is what a process uses: the host ([`Device::Cpu`]) plus
//! GPUs addressed by ordinal ([`Device::Gpu`]). [`DeviceSet::probe`] opens
//! every CUDA GPU the driver shows; [`DeviceSet::emulated`] instead makes
//! host-memory stand-ins with a chosen capacity, so that multi-device
//! planning, loading and dispatch run in CI without a GPU. Emulated devices
//! are never chosen unless asked for. Each [`Gpu`] has a budget, live and
//! peak byte counts, a compute [`Stream`] and a copy stream.
//!
//! # Never panicking without CUDA; finding CUDA 12 and 13
//!
//! CUDA support is the `cuda` feature (cudarc, with every library loaded
//! at run time, so building needs no toolkit). cudarc panics when a
//! library is missing, and by itself only asks the dynamic loader for a
//! few names; so [`libs`] looks for the driver, NVRTC and cuBLAS first:
//! through the loader by versioned name (`.so.13`, `.so.12`, bare `.so`),
//! then under `CUDA_HOME`/`CUDA_PATH`, `/usr/local/cuda`, the pip wheels
//! next to the `python3` on `PATH` (`nvidia/cu13/lib`, `nvidia/cublas/lib`,
//! …) and the distribution's folders, never taking a library newer than
//! the driver, and opens what it finds by full path so cudarc's later
//! lookup by name gets that very file. A library found nowhere is
//! [`Error::LibraryNotFound`], naming every name and folder tried: a
//! machine without a driver gets "no CUDA driver found: looked for …",
//! one without NVRTC or cuBLAS keeps its GPUs for memory and copies and
//! gets the error at the first kernel, and CPU work runs regardless. The
//! driver is then called under `catch_unwind` while probing, and a build
//! without the feature gets [`Error::NotCompiledWithCuda`] ("built without
//! CUDA support") from the very same API. [`DeviceSet::cuda_libraries`]
//! says which files were loaded, with their versions. The feature is
//! looked at in one place, candle's way: it chooses between the real
//! `cuda` module and a stand-in with the same API whose types cannot be
//! constructed, so every CUDA variant and code path compiles, and is
//! type-checked, in both builds.
//!
//! # Memory: budgets, accounting and the safety margin
//!
//! [`DeviceSet::memory_info`] reports, per GPU, free and total memory as
//! the driver sees it *after* the CUDA context exists (so the context's own
//! few hundred MiB are already gone), and the host RAM this process may
//! still use: the tightest of cgroup v2 `memory.max - memory.current`
//! (over the cgroup and its ancestors), cgroup v1
//! `memory.limit_in_bytes - memory.usage_in_bytes`, and `/proc/meminfo`
//! `MemAvailable`.
//!
//! [`default_budgets`] turns that into the budgets used when the user gives
//! no `--max-memory`. Accelerate hands the planner 100 % of free GPU memory,
//! a known source of out-of-memory errors at the first forward pass. We
//! keep back, **per CUDA GPU, the larger of 1 GiB and 5 % of its total
//! memory** ([`gpu_safety_margin`]) for what the planner does not model:
//! cuBLAS workspaces, activations and the KV cache of a forward pass, and
//! allocator fragmentation (mistral.rs keeps max(2 % of free, 512 MiB),
//! llama.cpp 1 GiB; on an 80 GB card our margin is 4 GiB). **Host RAM keeps
//! the larger of 10 % of what is available and a floor that scales with the
//! memory limit** ([`cpu_safety_margin`]) for the process itself and the
//! page cache: a quarter of the limit (the cgroup's, else `MemTotal`),
//! between 64 MiB and 1 GiB, so machines of 4 GiB and more keep 1 GiB and a
//! 1 GiB container 256 MiB. Emulated GPUs keep no margin: their capacity is
//! the caller's choice.
//!
//! Every allocation ([`Gpu::alloc`]) is first reserved against the GPU's
//! budget, so a request beyond it fails with [`Error::BudgetExceeded`]
//! before the driver runs out; if the driver still runs out (another
//! process took the memory) the pool's unused memory is handed back and
//! the allocation retried once, then the error is [`Error::OutOfMemory`]
//! naming the device, the request and what was free.
//!
//! Device memory comes from a stream-ordered memory pool of each GPU's own
//! (`cuMemAllocFromPoolAsync`/`cuMemFreeAsync`): an allocation is made on a
//! stream (the compute stream, or the one [`Gpu::alloc_on`] names: the
//! copy stream for an upload, so filling it never waits for compute), and
//! the pool keeps freed memory for the next allocation, so once a decode
//! step has run, the next takes nothing from the driver
//! ([`Gpu::driver_allocations`] counts what it takes;
//! [`Gpu::release_cached_memory`] hands the rest back). **Dropping a
//! [`DeviceBuffer`] never blocks the host**: its bytes return to the budget
//! at once (live and peak stay exact), and its free is enqueued on the
//! stream of its latest use, after waits for its uses on other streams.
//!
//! # Moving bytes
//!
//! Per GPU a compute stream and a copy stream. Every device buffer, pinned
//! buffer and host registration keeps, under one lock, the last [`Event`]
//! of its use on each stream, ordered by a process-wide sequence number so
//! that two threads noting uses at once never lose the later one. Work on
//! another stream first waits for those events (work on the same stream
//! needs nothing), host access waits for all of them, and staging memory is
//! refilled only once the copy that read it finished. Every memset and host
//! copy is asynchronous on the buffer's own stream (CUDA stages pageable
//! sources itself; nothing runs on the legacy stream).
//!
//! Fast host-to-device copies need page-locked memory, and pinning is
//! expensive, so it is done once. A CPU-tier weight kept in a
//! [`PinnedBuffer`] is copied straight to the device with
//! [`DeviceBuffer::copy_from_pinned`], no staging copy. A [`PinnedPool`] is
//! a ring of staging slots (portable, *not* write-combined, because
//! downloads read them back on the CPU) that [`DeviceBuffer::upload`] fills
//! while the copy engine drains the previous slot; a [`ReaderPool`] does
//! the same with min(8, cores) reader threads from a file (`O_DIRECT` where
//! the file system allows it) or a mapping, reading slot *k + 1* while slot
//! *k* is on the link. Memory that already exists (an offloaded layer, a
//! mapped checkpoint) can be page-locked in place with
//! [`DeviceSet::register_host`], in 1 GiB pieces since one huge
//! registration fails on recent drivers. When pinning or registering fails,
//! copies fall back to pageable memory: slower, still correct. Large copies
//! are cut into [`COPY_CHUNK`] pieces; copies between GPUs go peer to peer
//! where [`DeviceSet::enable_peer_access`] could enable it.
//!
//! Emulated GPUs do all of this with host memory and memcpy. Given a
//! [`SimulatedLink`] ([`DeviceSet::emulated_with_link`]) an emulated GPU's
//! copy stream runs on a copy-engine thread, each host↔device copy lasting
//! the link's latency plus its bytes at the link's bandwidth, concurrently
//! with the caller, so copy/compute overlap is measurable without a GPU.
//!
//! # Compute
//!
//! Each CUDA GPU also computes: [`Gpu::gemm`] (cuBLAS, f32 accumulation)
//! and the kernels a transformer needs (norms, rotary, softmax, fused
//! attention, activations, casts), all on the compute stream and ordered
//! after the copies that fill their buffers. NVRTC compiles the kernels to
//! machine code (CUBIN) for the GPU's own architecture, with PTX of the
//! newest architecture NVRTC knows as the fallback (PTX alone fails to
//! load when NVRTC is newer than the driver); each image is compiled once
//! per process and kept in a disk cache keyed by the SHA-256 of source,
//! options, NVRTC version and target (`$BIGMODEL_CACHE/kernels/`, else
//! `~/.cache/bigmodel/kernels/`, `XDG_CACHE_HOME` respected), written
//! atomically and checksummed, so a second start does not run NVRTC.
//! [`Gpu::kernel_module`] says what was loaded. Emulated GPUs refuse
//! compute with [`Error::ComputeUnsupported`]: models whose weights sit on
//! one compute on the host. See the `compute` module's documentation on
//! [`GemmShape`] and the methods of [`Gpu`].
//!
//! **Architecture invariant:** this is the only crate of the workspace that
//! names cudarc, and only the `cuda` module (`cuda.rs`, `cuda/compute.rs`)
//! does: the other modules reach CUDA through that module's types and
//! functions.

mod buffer;
mod compute;
// The one place the `cuda` feature is looked at: without it, `no_cuda.rs`
// stands in for the CUDA backend with the same API.
#[cfg_attr(not(feature = "cuda"), path = "no_cuda.rs")]
mod cuda;
mod device;
mod error;
mod gpu;
mod host_memory;
#[allow(
    dead_code,
    reason = "used by the CUDA backend; the no-CUDA stand-in compiles no kernels"
)]
mod kernel_cache;
mod ledger;
pub mod libs;
mod link;
mod memory;
mod pending;
mod pinned;
mod reader;
mod set;
#[allow(
    dead_code,
    reason = "used by the CUDA backend's kernel cache; the no-CUDA stand-in compiles no kernels"
)]
mod sha256;
mod stream;

pub use buffer::{COPY_CHUNK, DeviceBuffer};
pub use compute::{
    Activation, AttentionMask, AttentionScores, AttentionShape, BLayout, DeviceSlice, FourBitParts,
    GEMM_WORKSPACE_BYTES, GemmShape, Int8Parts, KernelModuleInfo, MAX_ATTENTION_KEYS,
    MAX_QUANTIZED_ROWS,
};
pub use device::{Device, ParseDeviceError};
pub use error::{Error, Result};
pub use gpu::{Gpu, GpuKind};
pub use host_memory::{HostMemory, HostMemorySource, host_memory};
pub use libs::{CudaLibrary, LibraryReport, LoadedLibrary, Searched};
pub use link::SimulatedLink;
pub use memory::{
    Budgets, CPU_MARGIN_LIMIT_PERCENT, CPU_MARGIN_MIN, CPU_MARGIN_PERCENT, CPU_MARGIN_SMALL_MIN,
    GPU_MARGIN_MIN, GPU_MARGIN_PERCENT, GpuMemory, MemoryInfo, cpu_safety_margin, default_budgets,
    gpu_safety_margin,
};
pub use pinned::{HostRegistration, PinnedBuffer, PinnedPool, PoolSlot, REGISTER_CHUNK};
pub use reader::{ReadSource, ReaderOptions, ReaderPool, SharedBytes, SourceFile};
pub use set::{CudaStatus, DeviceSet};
pub use stream::{Event, Stream, StreamRole};

/// Whether this build has CUDA support (the `cuda` feature).
pub const CUDA_COMPILED: bool = cuda::COMPILED;
