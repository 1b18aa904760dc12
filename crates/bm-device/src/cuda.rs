//! The CUDA backend, compiled with the `cuda` feature (`no_cuda.rs` stands
//! in for it otherwise): with its `compute` submodule, the only code of the
//! workspace that names cudarc.
//!
//! Device memory is raw memory from a stream-ordered pool of our own per
//! GPU (`cuMemAllocFromPoolAsync` / `cuMemFreeAsync`) rather than cudarc's
//! `CudaSlice`: we order work with our own events, so cudarc's two events
//! per allocation would be pure overhead (thousands of weight tensors), and
//! raw pointers let one buffer type serve every dtype. The pool keeps what
//! is freed (its release threshold is unlimited) for the next allocation,
//! so a steady state takes nothing from the driver, and does not let the
//! driver insert waits between streams behind our back (internal
//! dependencies off): reuse across streams follows our events or the
//! completion of the free.

mod compute;

use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use cudarc::driver::{
    CudaContext, CudaFunction, DriverError, LaunchConfig, PushKernelArg, result, sys,
};

use crate::libs::{self, CudaLibrary, LibraryReport};
use crate::{Device, Error, Result};

pub(crate) use cudarc::driver::{CudaEvent, CudaStream};

/// This build has CUDA support.
pub(crate) const COMPILED: bool = true;

/// A device address.
pub(crate) type DevicePtr = sys::CUdeviceptr;

/// Wraps a driver error with what was being done and where.
fn driver_error(operation: &'static str, device: Option<Device>, e: DriverError) -> Error {
    let name = e
        .error_name()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|_| format!("{:?}", e.0));
    let text = e
        .error_string()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    Error::Driver {
        operation,
        device,
        message: if text.is_empty() {
            name
        } else {
            format!("{name}: {text}")
        },
    }
}

/// What probing the driver found.
pub(crate) struct Probe {
    /// `cuDriverGetVersion`, e.g. 13000 for CUDA 13.0.
    pub driver_version: i32,
    /// Every visible GPU (its primary context), in ordinal order.
    pub gpus: Vec<CudaGpu>,
}

/// The driver's CUDA major, once [`probe`] has read it: NVRTC and cuBLAS
/// newer than the driver are not loaded.
fn driver_major() -> Option<u32> {
    DRIVER_VERSION.get().map(|v| (*v / 1000) as u32)
}

static DRIVER_VERSION: OnceLock<i32> = OnceLock::new();

/// Loads the driver and opens every GPU. Never panics: cudarc panics when
/// libcuda or one of its symbols is missing, so the library is found and
/// loaded by [`libs`] first, and the rest runs under `catch_unwind`.
pub(crate) fn probe() -> Result<Probe> {
    let driver = libs::load(CudaLibrary::Driver, None)?;
    // SAFETY: only opens the library by name, which now finds the object
    // loaded above (its SONAME is one of cudarc's names).
    if !unsafe { sys::is_culib_present() } {
        return Err(Error::Driver {
            operation: "loading the CUDA driver",
            device: None,
            message: format!(
                "{} is loaded but cudarc could not open it by name",
                driver.path.display()
            ),
        });
    }
    // cudarc asks for the bare `libcuda.so` first, which the loader may
    // answer with another file (a toolkit's stub on LD_LIBRARY_PATH):
    // failures then name the file cudarc calls.
    // SAFETY: cudarc's library is open (checked above); a symbol lookup.
    let in_use = unsafe { sys::culib().get::<unsafe extern "C" fn()>(b"cuDriverGetVersion") }
        .ok()
        .map_or_else(|| driver.clone(), |s| libs::in_use(&driver, *s as usize));
    let other_file = |e: Error| match e {
        Error::Driver {
            operation,
            device,
            message,
        } if in_use.path != driver.path => Error::Driver {
            operation,
            device,
            message: format!(
                "{message} (cudarc calls {}, which the loader gave for the bare name \
                 libcuda.so, not {})",
                in_use.path.display(),
                driver.path.display()
            ),
        },
        e => e,
    };
    let attempt = std::panic::catch_unwind(|| -> Result<Probe> {
        let mut driver_version = 0;
        // SAFETY: writes one int.
        unsafe { sys::cuDriverGetVersion(&mut driver_version) }
            .result()
            .map_err(|e| driver_error("cuDriverGetVersion", None, e))?;
        let _ = DRIVER_VERSION.set(driver_version);
        match result::init() {
            Ok(()) => {}
            // A driver without GPUs (or with none visible) is not an error.
            Err(DriverError(sys::CUresult::CUDA_ERROR_NO_DEVICE)) => {
                return Ok(Probe {
                    driver_version,
                    gpus: Vec::new(),
                });
            }
            Err(e) => return Err(driver_error("cuInit", None, e)),
        }
        let count =
            result::device::get_count().map_err(|e| driver_error("cuDeviceGetCount", None, e))?;
        let gpus = (0..count.max(0) as usize)
            .map(|n| {
                CudaContext::new(n)
                    .map(CudaGpu::new)
                    .map_err(|e| driver_error("creating the context", Some(Device::Gpu(n)), e))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Probe {
            driver_version,
            gpus,
        })
    });
    match attempt {
        Ok(r) => r.map_err(other_file),
        Err(payload) => {
            let message = payload
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "the driver library could not be used".into());
            Err(other_file(Error::Driver {
                operation: "loading the CUDA driver",
                device: None,
                message,
            }))
        }
    }
}

/// PTX for the busy-wait kernel: each thread spins on the global
/// nanosecond timer. PTX (not a cubin) so the driver JIT-compiles it for
/// whatever GPU is present; needs no NVRTC.
const BUSY_WAIT_PTX: &str = r#"
.version 6.0
.target sm_50
.address_size 64

.visible .entry bm_busy_wait(.param .u64 bm_busy_wait_ns)
{
    .reg .pred %p<2>;
    .reg .b64 %rd<5>;
    ld.param.u64 %rd1, [bm_busy_wait_ns];
    mov.u64 %rd2, %globaltimer;
    add.s64 %rd3, %rd2, %rd1;
BM_SPIN:
    mov.u64 %rd4, %globaltimer;
    setp.lt.u64 %p1, %rd4, %rd3;
    @%p1 bra BM_SPIN;
    ret;
}
"#;

/// One CUDA GPU: its primary context, its memory pool, and the lazily
/// loaded busy-wait kernel, compute kernels and cuBLAS handle.
pub(crate) struct CudaGpu {
    ctx: Arc<CudaContext>,
    /// `None` when the GPU has no memory pools (then plain `cuMemAlloc`).
    pool: Option<sys::CUmemoryPool>,
    /// The most memory the pool has held, and how often it grew.
    pool_high: parking_lot::Mutex<u64>,
    driver_allocations: AtomicU64,
    busy_wait: OnceLock<std::result::Result<CudaFunction, String>>,
    kernels: compute::Lazy<compute::Kernels>,
    blas: compute::Lazy<parking_lot::Mutex<compute::Blas>>,
}

// SAFETY: the pool handle is a driver object that every driver call
// accepts from any thread; everything else is Send and Sync already.
unsafe impl Send for CudaGpu {}
// SAFETY: as above.
unsafe impl Sync for CudaGpu {}

/// A memory pool on `ctx`'s device that keeps freed memory for reuse and
/// never makes one stream wait for another by itself.
fn create_pool(ctx: &CudaContext) -> std::result::Result<sys::CUmemoryPool, DriverError> {
    ctx.bind_to_thread()?;
    // SAFETY: an all-zero CUmemPoolProps is the documented default (no
    // handle types, no size limit); the fields set make it device memory.
    let mut props: sys::CUmemPoolProps = unsafe { std::mem::zeroed() };
    props.allocType = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    props.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
    props.location.id = ctx.cu_device();
    let mut pool = std::ptr::null_mut();
    // SAFETY: valid properties, one handle written.
    unsafe { sys::cuMemPoolCreate(&mut pool, &props) }.result()?;
    let mut keep_all: u64 = u64::MAX;
    let mut no_internal_waits: i32 = 0;
    // SAFETY: each attribute takes the type passed (cuuint64_t, int).
    let set = unsafe {
        sys::cuMemPoolSetAttribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            (&raw mut keep_all).cast(),
        )
        .result()
        .and_then(|()| {
            sys::cuMemPoolSetAttribute(
                pool,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES,
                (&raw mut no_internal_waits).cast(),
            )
            .result()
        })
    };
    if let Err(e) = set {
        // SAFETY: created above, never used.
        let _ = unsafe { sys::cuMemPoolDestroy(pool) };
        return Err(e);
    }
    Ok(pool)
}

impl CudaGpu {
    fn new(ctx: Arc<CudaContext>) -> Self {
        // A GPU without pools (or whose pool cannot be made) allocates
        // with cuMemAlloc instead.
        let pool = if ctx.has_async_alloc() {
            create_pool(&ctx).ok()
        } else {
            None
        };
        CudaGpu {
            ctx,
            pool,
            pool_high: parking_lot::Mutex::new(0),
            driver_allocations: AtomicU64::new(0),
            busy_wait: OnceLock::new(),
            kernels: OnceLock::new(),
            blas: OnceLock::new(),
        }
    }

    /// The GPU's ordinal.
    pub(crate) fn ordinal(&self) -> usize {
        self.ctx.ordinal()
    }

    fn device(&self) -> Device {
        Device::Gpu(self.ctx.ordinal())
    }

    fn err(&self, operation: &'static str) -> impl FnOnce(DriverError) -> Error + '_ {
        move |e| driver_error(operation, Some(self.device()), e)
    }

    pub(crate) fn name(&self) -> Result<String> {
        self.ctx.name().map_err(self.err("cuDeviceGetName"))
    }

    /// (free, total) bytes, as the driver reports them now.
    pub(crate) fn mem_info(&self) -> Result<(u64, u64)> {
        let (free, total) = self.ctx.mem_get_info().map_err(self.err("cuMemGetInfo"))?;
        Ok((free as u64, total as u64))
    }

    pub(crate) fn new_stream(&self) -> Result<Arc<CudaStream>> {
        self.ctx.new_stream().map_err(self.err("cuStreamCreate"))
    }

    pub(crate) fn synchronize(&self) -> Result<()> {
        self.ctx.synchronize().map_err(self.err("cuCtxSynchronize"))
    }

    fn pool_attribute(&self, attr: sys::CUmemPool_attribute) -> Result<u64> {
        let Some(pool) = self.pool else {
            return Ok(0);
        };
        let mut value: u64 = 0;
        // SAFETY: the memory attributes asked for here are cuuint64_t.
        unsafe { sys::cuMemPoolGetAttribute(pool, attr, (&raw mut value).cast()) }
            .result()
            .map_err(self.err("cuMemPoolGetAttribute"))?;
        Ok(value)
    }

    /// Bytes the pool holds that no allocation uses.
    pub(crate) fn pool_unused(&self) -> u64 {
        let reserved =
            self.pool_attribute(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT);
        let used = self.pool_attribute(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_CURRENT);
        match (reserved, used) {
            (Ok(r), Ok(u)) => r.saturating_sub(u),
            _ => 0,
        }
    }

    /// Allocations that took memory from the driver (see
    /// [`Gpu::driver_allocations`](crate::Gpu::driver_allocations)).
    pub(crate) fn driver_allocations(&self) -> u64 {
        self.driver_allocations.load(Ordering::Relaxed)
    }

    /// Waits for every free in flight and hands the pool's unused memory
    /// back to the driver.
    pub(crate) fn release_cached(&self) -> Result<()> {
        self.synchronize()?;
        if let Some(pool) = self.pool {
            // SAFETY: a live pool.
            unsafe { sys::cuMemPoolTrimTo(pool, 0) }
                .result()
                .map_err(self.err("cuMemPoolTrimTo"))?;
        }
        Ok(())
    }

    /// Allocates `bytes` of device memory, usable by work enqueued on
    /// `stream` after this call. An out-of-memory is retried once after
    /// [`CudaGpu::release_cached`], then becomes [`Error::OutOfMemory`]
    /// with what was free.
    pub(crate) fn alloc(&self, bytes: usize, stream: &CudaStream) -> Result<sys::CUdeviceptr> {
        self.ctx
            .bind_to_thread()
            .map_err(self.err("binding the context"))?;
        let attempt = || -> std::result::Result<sys::CUdeviceptr, DriverError> {
            let mut ptr: sys::CUdeviceptr = 0;
            match self.pool {
                // SAFETY: a live pool and stream; the memory is
                // uninitialised bytes, which is all we claim.
                Some(pool) => unsafe {
                    sys::cuMemAllocFromPoolAsync(&mut ptr, bytes, pool, stream.cu_stream())
                }
                .result()?,
                // SAFETY: as above.
                None => ptr = unsafe { result::malloc_sync(bytes) }?,
            }
            Ok(ptr)
        };
        let oom = |e: &DriverError| e.0 == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY;
        let ptr = match attempt() {
            Err(e) if oom(&e) => {
                self.release_cached()?;
                attempt()
            }
            other => other,
        };
        let ptr = match ptr {
            Ok(ptr) => ptr,
            Err(e) if oom(&e) => {
                let free = self.mem_info().map(|(f, _)| f).unwrap_or(0);
                return Err(Error::OutOfMemory {
                    device: self.device(),
                    requested: bytes as u64,
                    free,
                });
            }
            Err(e) => {
                return Err(driver_error(
                    "cuMemAllocFromPoolAsync",
                    Some(self.device()),
                    e,
                ));
            }
        };
        self.count_driver_allocation();
        Ok(ptr)
    }

    /// Counts an allocation that took memory from the driver: every one
    /// without a pool, one that grew the pool's reservation with it.
    fn count_driver_allocation(&self) {
        if self.pool.is_none() {
            self.driver_allocations.fetch_add(1, Ordering::Relaxed);
            return;
        }
        let Ok(reserved) =
            self.pool_attribute(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT)
        else {
            return;
        };
        let mut high = self.pool_high.lock();
        if reserved > *high {
            *high = reserved;
            self.driver_allocations.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Frees memory from [`CudaGpu::alloc`] after the work enqueued on
    /// `stream` so far, without blocking the host (with a pool; without
    /// one, cuMemFree waits). Errors are recorded on the context: a
    /// destructor cannot return them.
    ///
    /// # Safety
    /// `ptr` came from `alloc` on this GPU and is freed once; every use of
    /// it is ordered before the work enqueued on `stream` so far.
    pub(crate) unsafe fn free(&self, ptr: sys::CUdeviceptr, stream: &CudaStream) {
        self.ctx.record_err(self.ctx.bind_to_thread());
        match self.pool {
            // SAFETY: per this function's contract.
            Some(_) => self
                .ctx
                .record_err(unsafe { sys::cuMemFreeAsync(ptr, stream.cu_stream()) }.result()),
            None => {
                // cuMemFree does not order itself after other streams.
                self.ctx.record_err(stream.synchronize());
                // SAFETY: per this function's contract; the stream has drained.
                self.ctx.record_err(unsafe { result::free_sync(ptr) });
            }
        }
    }

    /// Enqueues setting `bytes` bytes from `ptr` to zero on `stream`.
    ///
    /// # Safety
    /// `ptr..ptr+bytes` is device memory of this GPU, usable on `stream`.
    pub(crate) unsafe fn memset_zero_async(
        &self,
        ptr: sys::CUdeviceptr,
        bytes: usize,
        stream: &CudaStream,
    ) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(self.err("binding the context"))?;
        // SAFETY: per this function's contract.
        unsafe { sys::cuMemsetD8Async(ptr, 0, bytes, stream.cu_stream()) }
            .result()
            .map_err(self.err("cuMemsetD8Async"))
    }

    /// Enqueues a host-to-device copy on `stream`.
    ///
    /// # Safety
    /// The device range is this GPU's memory; `src..src+len` stays valid and
    /// unchanged until the copy completes (page-locked memory), or is
    /// pageable, in which case the driver has consumed it on return.
    pub(crate) unsafe fn htod_async(
        &self,
        dst: sys::CUdeviceptr,
        src: *const u8,
        len: usize,
        stream: &CudaStream,
    ) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(self.err("binding the context"))?;
        // SAFETY: per this function's contract.
        unsafe { sys::cuMemcpyHtoDAsync_v2(dst, src as *const c_void, len, stream.cu_stream()) }
            .result()
            .map_err(self.err("cuMemcpyHtoDAsync"))
    }

    /// Enqueues a device-to-host copy on `stream`. Into pageable memory the
    /// driver returns only once the copy is complete.
    ///
    /// # Safety
    /// The device range is this GPU's memory; `dst..dst+len` is host memory
    /// that nothing reads or writes until the copy completes.
    pub(crate) unsafe fn dtoh_async(
        &self,
        dst: *mut u8,
        src: sys::CUdeviceptr,
        len: usize,
        stream: &CudaStream,
    ) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(self.err("binding the context"))?;
        // SAFETY: per this function's contract.
        unsafe { sys::cuMemcpyDtoHAsync_v2(dst as *mut c_void, src, len, stream.cu_stream()) }
            .result()
            .map_err(self.err("cuMemcpyDtoHAsync"))
    }

    /// Enqueues a device-to-device copy on `stream` (this GPU's), from
    /// memory of `src_gpu`: a plain copy on the same GPU, a peer copy
    /// otherwise (the driver stages it when peer access is off).
    ///
    /// # Safety
    /// Both ranges are valid device memory of their GPUs.
    pub(crate) unsafe fn dtod_async(
        &self,
        dst: sys::CUdeviceptr,
        src_gpu: &CudaGpu,
        src: sys::CUdeviceptr,
        len: usize,
        stream: &CudaStream,
    ) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(self.err("binding the context"))?;
        if Arc::ptr_eq(&self.ctx, &src_gpu.ctx) {
            // SAFETY: per this function's contract.
            unsafe { result::memcpy_dtod_async(dst, src, len, stream.cu_stream()) }
                .map_err(self.err("cuMemcpyDtoDAsync"))
        } else {
            // SAFETY: per this function's contract.
            unsafe {
                result::memcpy_peer_async(
                    self.ctx.cu_ctx(),
                    dst,
                    src_gpu.ctx.cu_ctx(),
                    src,
                    len,
                    stream.cu_stream(),
                )
            }
            .map_err(self.err("cuMemcpyPeerAsync"))
        }
    }

    /// Whether this GPU can read and write `other`'s memory directly.
    pub(crate) fn can_access_peer(&self, other: &CudaGpu) -> Result<bool> {
        let mut can = 0;
        // SAFETY: writes one int; both devices are valid.
        unsafe {
            sys::cuDeviceCanAccessPeer(&mut can, self.ctx.cu_device(), other.ctx.cu_device())
        }
        .result()
        .map_err(self.err("cuDeviceCanAccessPeer"))?;
        Ok(can != 0)
    }

    /// Lets this GPU's context access `other`'s memory (idempotent).
    pub(crate) fn enable_peer_access(&self, other: &CudaGpu) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(self.err("binding the context"))?;
        // SAFETY: both contexts are alive.
        match unsafe { sys::cuCtxEnablePeerAccess(other.ctx.cu_ctx(), 0) }.result() {
            Ok(()) | Err(DriverError(sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED)) => {
                Ok(())
            }
            Err(e) => Err(driver_error(
                "cuCtxEnablePeerAccess",
                Some(self.device()),
                e,
            )),
        }
    }

    /// Enqueues a kernel that keeps every SM busy for about `duration`.
    pub(crate) fn busy_wait(&self, stream: &Arc<CudaStream>, duration: Duration) -> Result<()> {
        let func = self
            .busy_wait
            .get_or_init(|| {
                let module = self
                    .ctx
                    .load_module(cudarc::nvrtc::Ptx::from_src(BUSY_WAIT_PTX))
                    .map_err(|e| {
                        driver_error("cuModuleLoadData", Some(self.device()), e).to_string()
                    })?;
                module.load_function("bm_busy_wait").map_err(|e| {
                    driver_error("cuModuleGetFunction", Some(self.device()), e).to_string()
                })
            })
            .as_ref()
            .map_err(|message| Error::Driver {
                operation: "loading the busy-wait kernel",
                device: Some(self.device()),
                message: message.clone(),
            })?;
        let sms = self
            .ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(self.err("cuDeviceGetAttribute"))?;
        let ns = u64::try_from(duration.as_nanos()).unwrap_or(u64::MAX);
        let mut launch = stream.launch_builder(func);
        launch.arg(&ns);
        let cfg = LaunchConfig {
            grid_dim: (sms.max(1) as u32, 1, 1),
            block_dim: (32, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the kernel takes exactly one u64 and touches no memory.
        unsafe { launch.launch(cfg) }
            .map(|_| ())
            .map_err(self.err("cuLaunchKernel"))
    }

    /// Page-locked host memory, portable to every context and not
    /// write-combined (the CPU reads staging buffers back).
    pub(crate) fn alloc_pinned(&self, bytes: usize) -> Result<*mut u8> {
        self.ctx
            .bind_to_thread()
            .map_err(self.err("binding the context"))?;
        // SAFETY: returns uninitialised host memory; callers zero it.
        unsafe { result::malloc_host(bytes, sys::CU_MEMHOSTALLOC_PORTABLE) }
            .map(|p| p as *mut u8)
            .map_err(self.err("cuMemHostAlloc"))
    }

    /// # Safety
    /// `ptr` came from [`CudaGpu::alloc_pinned`] and is freed once, after
    /// every copy using it completed.
    pub(crate) unsafe fn free_pinned(&self, ptr: *mut u8) {
        self.ctx.record_err(self.ctx.bind_to_thread());
        // SAFETY: per this function's contract.
        self.ctx
            .record_err(unsafe { result::free_host(ptr as *mut c_void) });
    }

    /// Page-locks existing host memory for every context. Tries read-only
    /// registration first (needed for read-only mappings such as a
    /// checkpoint's mmap), then plain.
    ///
    /// # Safety
    /// `ptr..ptr+len` is mapped for as long as it stays registered, and no
    /// page of it is already registered.
    pub(crate) unsafe fn host_register(&self, ptr: *const u8, len: usize) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(self.err("binding the context"))?;
        let p = ptr as *mut c_void;
        let read_only = sys::CU_MEMHOSTREGISTER_PORTABLE | sys::CU_MEMHOSTREGISTER_READ_ONLY;
        // SAFETY: per this function's contract.
        match unsafe { sys::cuMemHostRegister_v2(p, len, read_only) }.result() {
            Ok(()) => Ok(()),
            Err(_) => {
                // SAFETY: per this function's contract.
                unsafe { sys::cuMemHostRegister_v2(p, len, sys::CU_MEMHOSTREGISTER_PORTABLE) }
                    .result()
                    .map_err(self.err("cuMemHostRegister"))
            }
        }
    }

    /// # Safety
    /// `ptr` was registered with [`CudaGpu::host_register`] and no copy
    /// from it is in flight.
    pub(crate) unsafe fn host_unregister(&self, ptr: *const u8) {
        self.ctx.record_err(self.ctx.bind_to_thread());
        // SAFETY: per this function's contract.
        self.ctx
            .record_err(unsafe { sys::cuMemHostUnregister(ptr as *mut c_void) }.result());
    }
}

impl Drop for CudaGpu {
    fn drop(&mut self) {
        if let Some(pool) = self.pool {
            // Every buffer (which holds this GPU) is gone; its free may still
            // be queued, so the pool goes once the device is idle.
            self.ctx.record_err(self.ctx.synchronize());
            // SAFETY: no allocation of the pool is live any more.
            self.ctx
                .record_err(unsafe { sys::cuMemPoolDestroy(pool) }.result());
        }
    }
}

/// Records an event on `stream`.
pub(crate) fn record(stream: &CudaStream, device: Device) -> Result<Arc<CudaEvent>> {
    stream
        .record_event(None)
        .map(Arc::new)
        .map_err(|e| driver_error("cuEventRecord", Some(device), e))
}

/// Makes `stream` wait for `event`, which may belong to another GPU.
pub(crate) fn wait(stream: &CudaStream, event: &CudaEvent, device: Device) -> Result<()> {
    stream
        .context()
        .bind_to_thread()
        .map_err(|e| driver_error("binding the context", Some(device), e))?;
    // SAFETY: both handles are alive; cross-context waits are allowed.
    unsafe {
        result::stream::wait_event(
            stream.cu_stream(),
            event.cu_event(),
            sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
        )
    }
    .map_err(|e| driver_error("cuStreamWaitEvent", Some(device), e))
}

pub(crate) fn sync_event(event: &CudaEvent, device: Device) -> Result<()> {
    event
        .synchronize()
        .map_err(|e| driver_error("cuEventSynchronize", Some(device), e))
}

pub(crate) fn event_done(event: &CudaEvent, device: Device) -> Result<bool> {
    // cuEventQuery needs a current context on this thread.
    event
        .context()
        .bind_to_thread()
        .map_err(|e| driver_error("binding the context", Some(device), e))?;
    event
        .try_is_complete()
        .map_err(|e| driver_error("cuEventQuery", Some(device), e))
}

pub(crate) fn sync_stream(stream: &CudaStream, device: Device) -> Result<()> {
    stream
        .synchronize()
        .map_err(|e| driver_error("cuStreamSynchronize", Some(device), e))
}

/// `cuEventElapsedTime`'s signature.
type ElapsedTime = unsafe extern "C" fn(*mut f32, sys::CUevent, sys::CUevent) -> sys::CUresult;

/// Milliseconds between two events recorded with timing on.
///
/// Called through the driver's own symbol rather than cudarc: with the
/// `cuda-13000` bindings cudarc calls `cuEventElapsedTime_v2`, which
/// drivers before CUDA 12.8 lack, so we take `_v2` where the driver has it
/// and the original (same arguments) otherwise.
pub(crate) fn elapsed_ms(start: &CudaEvent, end: &CudaEvent, device: Device) -> Result<f32> {
    static ELAPSED: OnceLock<Option<ElapsedTime>> = OnceLock::new();
    let elapsed = ELAPSED.get_or_init(|| {
        let driver = libs::loaded(CudaLibrary::Driver)?.ok()?;
        let sym = driver
            .symbol("cuEventElapsedTime_v2")
            .or_else(|| driver.symbol("cuEventElapsedTime"))?;
        // SAFETY: both driver entry points have exactly this signature.
        Some(unsafe { std::mem::transmute::<*mut c_void, ElapsedTime>(sym) })
    });
    let Some(elapsed) = elapsed else {
        return Err(Error::Driver {
            operation: "cuEventElapsedTime",
            device: Some(device),
            message: "the driver exports no cuEventElapsedTime".into(),
        });
    };
    start
        .context()
        .bind_to_thread()
        .map_err(|e| driver_error("binding the context", Some(device), e))?;
    let mut ms = 0f32;
    // SAFETY: both events are alive and were recorded with timing enabled.
    unsafe { elapsed(&mut ms, start.cu_event(), end.cu_event()) }
        .result()
        .map_err(|e| driver_error("cuEventElapsedTime", Some(device), e))?;
    Ok(ms)
}

/// Every CUDA library: the driver as probing loaded it, NVRTC and cuBLAS
/// (with cuBLASLt) loaded now if they were not yet, with their versions.
pub(crate) fn library_reports() -> Vec<LibraryReport> {
    let report =
        |library, found: std::result::Result<libs::LoadedLibrary, String>, version| match found {
            Ok(l) => LibraryReport {
                library,
                path: Some(l.path),
                version,
                error: None,
            },
            Err(error) => LibraryReport {
                library,
                path: None,
                version: None,
                error: Some(error),
            },
        };
    let driver = match libs::loaded(CudaLibrary::Driver) {
        Some(found) => found.map_err(|e| e.to_string()),
        None => Err("not loaded: CUDA was not probed".into()),
    };
    let Some(driver_version) = DRIVER_VERSION.get() else {
        let why = match &driver {
            Ok(_) => "not loaded: the CUDA driver did not answer",
            Err(_) => "not loaded: no CUDA driver",
        };
        return std::iter::once(report(CudaLibrary::Driver, driver, None))
            .chain(
                [
                    CudaLibrary::Nvrtc,
                    CudaLibrary::CublasLt,
                    CudaLibrary::Cublas,
                ]
                .into_iter()
                .map(|library| report(library, Err(why.into()), None)),
            )
            .collect();
    };
    let driver_version = format!("{}.{}", driver_version / 1000, driver_version % 1000 / 10);
    let nvrtc = compute::nvrtc();
    let cublas = compute::cublas();
    let cublas_version = cublas.as_ref().ok().map(|c| c.version.clone());
    let cublaslt = match (&cublas, libs::loaded(CudaLibrary::CublasLt)) {
        (_, Some(lt)) => lt.map_err(|e| e.to_string()),
        (Err(e), None) => Err(format!("not loaded, as cuBLAS was not: {e}")),
        (Ok(_), None) => Err("cuBLAS loaded without reporting its cuBLASLt".into()),
    };
    vec![
        report(CudaLibrary::Driver, driver, Some(driver_version)),
        report(
            CudaLibrary::Nvrtc,
            nvrtc
                .as_ref()
                .map(|n| n.library.clone())
                .map_err(Clone::clone),
            nvrtc
                .as_ref()
                .ok()
                .map(|n| format!("{}.{}", n.version.0, n.version.1)),
        ),
        report(CudaLibrary::CublasLt, cublaslt, cublas_version.clone()),
        report(
            CudaLibrary::Cublas,
            cublas.map(|c| c.library).map_err(|e| e.clone()),
            cublas_version,
        ),
    ]
}

/// Records a timing-enabled event on `stream`.
pub(crate) fn record_timed(stream: &CudaStream, device: Device) -> Result<Arc<CudaEvent>> {
    stream
        .record_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
        .map(Arc::new)
        .map_err(|e| driver_error("cuEventRecord", Some(device), e))
}
