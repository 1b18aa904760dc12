//! One GPU of a device set: memory, accounting, streams, allocation.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::buffer::{DeviceBuffer, Mem};
use crate::ledger::Ledger;
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
    /// A host-emulated GPU holding at most `capacity` bytes.
    pub(crate) fn emulated(ordinal: usize, capacity: u64) -> Self {
        let id = next_gpu_id();
        Gpu {
            inner: Arc::new(GpuInner {
                id,
                ordinal,
                name: format!("emulated GPU {ordinal}"),
                total: capacity,
                ledger: Ledger::new(Device::Gpu(ordinal), capacity),
                compute: Stream::new(id, ordinal, StreamRole::Compute, StreamImpl::Emulated),
                copy: Stream::new(id, ordinal, StreamRole::Copy, StreamImpl::Emulated),
                backend: Backend::Emulated,
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

    /// Free and total memory now. For CUDA this is the driver's figure
    /// (after context creation, so the context's own memory is not free);
    /// for an emulated device, capacity minus live bytes.
    pub fn memory(&self) -> Result<GpuMemory> {
        let (free, total) = match &self.inner.backend {
            Backend::Emulated => (
                self.inner.total.saturating_sub(self.inner.ledger.live()),
                self.inner.total,
            ),
            Backend::Cuda(g) => g.mem_info()?,
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

    /// Allocates `bytes` of device memory with unspecified contents.
    ///
    /// Zero bytes, or more than the budget allows, fail with a typed error
    /// before the driver is asked; a driver out-of-memory becomes
    /// [`Error::OutOfMemory`].
    pub fn alloc(&self, bytes: usize) -> Result<DeviceBuffer> {
        self.alloc_inner(bytes, false)
    }

    /// Allocates `bytes` of device memory set to zero.
    pub fn alloc_zeroed(&self, bytes: usize) -> Result<DeviceBuffer> {
        self.alloc_inner(bytes, true)
    }

    fn alloc_inner(&self, bytes: usize, zeroed: bool) -> Result<DeviceBuffer> {
        if bytes == 0 {
            return Err(Error::ZeroSizedAllocation {
                device: self.device(),
            });
        }
        let ledger = &self.inner.ledger;
        ledger.reserve(bytes as u64)?;
        let mem = match self.alloc_mem(bytes, zeroed) {
            Ok(m) => m,
            Err(e) => {
                ledger.release(bytes as u64);
                return Err(e);
            }
        };
        Ok(DeviceBuffer::new(self.clone(), bytes, mem))
    }

    fn alloc_mem(&self, bytes: usize, zeroed: bool) -> Result<Mem> {
        match &self.inner.backend {
            Backend::Emulated => {
                let mut v: Vec<u8> = Vec::new();
                v.try_reserve_exact(bytes).map_err(|_| Error::OutOfMemory {
                    device: self.device(),
                    requested: bytes as u64,
                    free: self.inner.total.saturating_sub(self.inner.ledger.live()),
                })?;
                // Emulated memory is always zeroed: uninitialised host bytes
                // would be undefined behaviour to read.
                v.resize(bytes, 0);
                Ok(Mem::Emulated(v.into_boxed_slice()))
            }
            Backend::Cuda(g) => {
                let ptr = g.alloc(bytes)?;
                if zeroed {
                    // SAFETY: ptr..ptr+bytes was just allocated on this GPU.
                    if let Err(e) = unsafe { g.memset_zero(ptr, bytes) } {
                        // SAFETY: allocated above and never handed out.
                        unsafe { g.free(ptr) };
                        return Err(e);
                    }
                }
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
