//! One GPU of a device set: memory, accounting, streams, allocation.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::buffer::{DeviceBuffer, EmulatedMemory, Mem};
use crate::ledger::Ledger;
use crate::link::{CopyEngine, SimulatedLink};
use crate::stream::{Stream, StreamImpl, StreamRole};
use crate::{Device, Error, GpuMemory, Result};

/// What backs a GPU ordinal.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GpuKind {
    /// A CUDA device.
    Cuda,
    /// Host memory standing in for a GPU (tests, CI).
    Emulated,
}

impl std::fmt::Display for GpuKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            GpuKind::Cuda => "cuda",
            GpuKind::Emulated => "emulated",
        })
    }
}

/// A handle to one GPU of a [`DeviceSet`](crate::DeviceSet). Cheap to
/// clone; buffers keep their GPU (and its CUDA context) alive.
#[derive(Clone)]
pub struct Gpu {
    pub(crate) inner: Arc<GpuInner>,
}

pub(crate) struct GpuInner {
    /// Unique per process, so objects of two sets with the same ordinal
    /// are still told apart.
    pub(crate) id: u64,
    ordinal: usize,
    name: String,
    total: u64,
    pub(crate) ledger: Ledger,
    compute: Stream,
    copy: Stream,
    pub(crate) backend: Backend,
    /// An emulated GPU's simulated host link.
    link: Option<SimulatedLink>,
    /// Host allocations of an emulated GPU (a CUDA GPU counts its own).
    emulated_allocations: AtomicU64,
}

pub(crate) enum Backend {
    Emulated,
    Cuda(Arc<crate::cuda::CudaGpu>),
}

fn next_gpu_id() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

impl std::fmt::Debug for Gpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gpu")
            .field("ordinal", &self.inner.ordinal)
            .field("kind", &self.kind())
            .field("name", &self.inner.name)
            .field("total", &self.inner.total)
            .finish()
    }
}

impl Gpu {
    /// A host-emulated GPU holding at most `capacity` bytes; with a link,
    /// its copy stream runs on a copy-engine thread at the link's speed.
    pub(crate) fn emulated(ordinal: usize, capacity: u64, link: Option<SimulatedLink>) -> Self {
        let id = next_gpu_id();
        let copy = match link {
            Some(l) => StreamImpl::Engine(Arc::new(CopyEngine::new(Device::Gpu(ordinal), l))),
            None => StreamImpl::Emulated,
        };
        Gpu {
            inner: Arc::new(GpuInner {
                id,
                ordinal,
                name: format!("emulated GPU {ordinal}"),
                total: capacity,
                ledger: Ledger::new(Device::Gpu(ordinal), capacity),
                compute: Stream::new(id, ordinal, StreamRole::Compute, StreamImpl::Emulated),
                copy: Stream::new(id, ordinal, StreamRole::Copy, copy),
                backend: Backend::Emulated,
                link,
                emulated_allocations: AtomicU64::new(0),
            }),
        }
    }

    /// A CUDA GPU; its budget starts at what is free now.
    pub(crate) fn from_cuda(gpu: crate::cuda::CudaGpu) -> Result<Self> {
        let id = next_gpu_id();
        let ordinal = gpu.ordinal();
        let gpu = Arc::new(gpu);
        let name = gpu.name()?;
        let (free, total) = gpu.mem_info()?;
        let stream = |role| -> Result<Stream> {
            Ok(Stream::new(
                id,
                ordinal,
                role,
                StreamImpl::Cuda {
                    stream: gpu.new_stream()?,
                    gpu: Arc::clone(&gpu),
                },
            ))
        };
        Ok(Gpu {
            inner: Arc::new(GpuInner {
                id,
                ordinal,
                name,
                total,
                ledger: Ledger::new(Device::Gpu(ordinal), free),
                compute: stream(StreamRole::Compute)?,
                copy: stream(StreamRole::Copy)?,
                backend: Backend::Cuda(gpu),
                link: None,
                emulated_allocations: AtomicU64::new(0),
            }),
        })
    }

    /// The ordinal within its set.
    pub fn ordinal(&self) -> usize {
        self.inner.ordinal
    }

    /// `Device::Gpu(ordinal)`.
    pub fn device(&self) -> Device {
        Device::Gpu(self.inner.ordinal)
    }

    /// The driver's device name, or "emulated GPU n".
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// CUDA or emulated.
    pub fn kind(&self) -> GpuKind {
        match self.inner.backend {
            Backend::Emulated => GpuKind::Emulated,
            Backend::Cuda(_) => GpuKind::Cuda,
        }
    }

    /// Total device memory (an emulated device's capacity).
    pub fn total_bytes(&self) -> u64 {
        self.inner.total
    }

    /// The simulated host link of an emulated GPU, if it has one.
    pub fn link(&self) -> Option<SimulatedLink> {
        self.inner.link
    }

    /// Free and total memory now. For CUDA this is the driver's figure
    /// (after context creation, so the context's own memory is not free)
    /// plus what this GPU's memory pool holds unused, ready for reuse; for
    /// an emulated device, capacity minus live bytes.
    pub fn memory(&self) -> Result<GpuMemory> {
        let (free, total) = match &self.inner.backend {
            Backend::Emulated => (
                self.inner.total.saturating_sub(self.inner.ledger.live()),
                self.inner.total,
            ),
            Backend::Cuda(g) => {
                let (free, total) = g.mem_info()?;
                (free.saturating_add(g.pool_unused()), total)
            }
        };
        Ok(GpuMemory {
            device: self.device(),
            kind: self.kind(),
            name: self.inner.name.clone(),
            free,
            total,
        })
    }

    /// The most bytes buffers of this set may hold on this GPU.
    pub fn budget(&self) -> u64 {
        self.inner.ledger.budget()
    }

    /// Sets the budget; fails when it is larger than the device. A budget
    /// below what is live only stops new allocations.
    pub fn set_budget(&self, bytes: u64) -> Result<()> {
        if bytes > self.inner.total {
            return Err(Error::BudgetLargerThanDevice {
                device: self.device(),
                budget: bytes,
                total: self.inner.total,
            });
        }
        self.inner.ledger.set_budget(bytes);
        Ok(())
    }

    /// Bytes held by live buffers.
    pub fn live_bytes(&self) -> u64 {
        self.inner.ledger.live()
    }

    /// Most bytes live at once since creation or [`Gpu::reset_peak`].
    pub fn peak_bytes(&self) -> u64 {
        self.inner.ledger.peak()
    }

    /// Restarts peak tracking from the live bytes.
    pub fn reset_peak(&self) {
        self.inner.ledger.reset_peak()
    }

    /// The stream kernels run on.
    pub fn compute_stream(&self) -> &Stream {
        &self.inner.compute
    }

    /// The stream transfers run on.
    pub fn copy_stream(&self) -> &Stream {
        &self.inner.copy
    }

    /// Blocks until all work on this GPU has completed.
    pub fn synchronize(&self) -> Result<()> {
        match &self.inner.backend {
            Backend::Emulated => Ok(()),
            Backend::Cuda(g) => g.synchronize(),
        }
    }

    /// How many times memory was taken from the driver: for a CUDA GPU,
    /// allocations that grew its memory pool (a steady state reuses what
    /// the pool holds and takes none; without pool support, every
    /// allocation); for an emulated GPU, every host allocation.
    pub fn driver_allocations(&self) -> u64 {
        match &self.inner.backend {
            Backend::Emulated => self.inner.emulated_allocations.load(Ordering::Relaxed),
            Backend::Cuda(g) => g.driver_allocations(),
        }
    }

    /// Hands the memory this GPU's pool holds unused back to the driver
    /// (after waiting for the frees in flight), e.g. before another process
    /// needs it. Emulated GPUs hold none.
    pub fn release_cached_memory(&self) -> Result<()> {
        match &self.inner.backend {
            Backend::Emulated => Ok(()),
            Backend::Cuda(g) => g.release_cached(),
        }
    }

    /// Allocates `bytes` of device memory with unspecified contents, on the
    /// compute stream (see [`Gpu::alloc_on`]).
    ///
    /// Zero bytes, or more than the budget allows, fail with a typed error
    /// before the driver is asked; a driver out-of-memory (after returning
    /// the pool's unused memory and retrying) becomes [`Error::OutOfMemory`].
    pub fn alloc(&self, bytes: usize) -> Result<DeviceBuffer> {
        self.alloc_inner(bytes, false, &self.inner.compute)
    }

    /// Allocates `bytes` on `stream`, which becomes the buffer's home: the
    /// memory is ready for work enqueued there after this call, and other
    /// streams are ordered after the allocation when they use the buffer.
    /// Allocate a buffer on the stream that fills it (the copy stream for
    /// an upload), so that filling it does not wait for the other stream.
    pub fn alloc_on(&self, bytes: usize, stream: &Stream) -> Result<DeviceBuffer> {
        self.alloc_inner(bytes, false, stream)
    }

    /// Allocates `bytes` of device memory set to zero, on the compute stream.
    pub fn alloc_zeroed(&self, bytes: usize) -> Result<DeviceBuffer> {
        self.alloc_inner(bytes, true, &self.inner.compute)
    }

    /// Allocates `bytes` set to zero on `stream` (see [`Gpu::alloc_on`]).
    pub fn alloc_zeroed_on(&self, bytes: usize, stream: &Stream) -> Result<DeviceBuffer> {
        self.alloc_inner(bytes, true, stream)
    }

    fn alloc_inner(&self, bytes: usize, zeroed: bool, stream: &Stream) -> Result<DeviceBuffer> {
        if bytes == 0 {
            return Err(Error::ZeroSizedAllocation {
                device: self.device(),
            });
        }
        stream.check_on(self.id(), self.ordinal(), "allocation")?;
        let ledger = &self.inner.ledger;
        ledger.reserve(bytes as u64)?;
        let mem = match self.alloc_mem(bytes, stream) {
            Ok(m) => m,
            Err(e) => {
                ledger.release(bytes as u64);
                return Err(e);
            }
        };
        let buffer = DeviceBuffer::new(self.clone(), bytes, mem, stream.clone());
        // The allocation is work on `stream`: others wait for it.
        buffer.note_enqueued(stream);
        if zeroed {
            // On failure the buffer's drop frees the memory and the budget.
            buffer.zero()?;
        }
        Ok(buffer)
    }

    fn alloc_mem(&self, bytes: usize, stream: &Stream) -> Result<Mem> {
        match &self.inner.backend {
            Backend::Emulated => {
                self.inner
                    .emulated_allocations
                    .fetch_add(1, Ordering::Relaxed);
                let m = EmulatedMemory::zeroed(bytes).ok_or_else(|| Error::OutOfMemory {
                    device: self.device(),
                    requested: bytes as u64,
                    free: self.inner.total.saturating_sub(self.inner.ledger.live()),
                })?;
                Ok(Mem::Emulated(Arc::new(m)))
            }
            Backend::Cuda(g) => {
                let ptr = g.alloc(bytes, crate::buffer::stream_cuda(stream)?)?;
                Ok(Mem::Cuda {
                    ptr,
                    gpu: Arc::clone(g),
                })
            }
        }
    }

    pub(crate) fn id(&self) -> u64 {
        self.inner.id
    }

    pub(crate) fn cuda(&self) -> Option<&Arc<crate::cuda::CudaGpu>> {
        match &self.inner.backend {
            Backend::Cuda(g) => Some(g),
            Backend::Emulated => None,
        }
    }
}
