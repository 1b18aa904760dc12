//! The CUDA backend, compiled with the `cuda` feature (`no_cuda.rs` stands
//! in for it otherwise): with its `compute` submodule, the only code of the
//! workspace that names cudarc.
//!
//! Device memory is raw `cuMemAlloc` memory rather than cudarc's
//! `CudaSlice`: we order work with our own events, so cudarc's two events
//! per allocation would be pure overhead (thousands of weight tensors), and
//! raw pointers let one buffer type serve every dtype.

mod compute;

use std::ffi::c_void;
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
        Ok(r) => r,
        Err(payload) => {
            let message = payload
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "the driver library could not be used".into());
            Err(Error::Driver {
                operation: "loading the CUDA driver",
                device: None,
                message,
            })
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

/// One CUDA GPU: its primary context and the lazily loaded busy-wait
/// kernel, compute kernels and cuBLAS handle.
pub(crate) struct CudaGpu {
    ctx: Arc<CudaContext>,
    busy_wait: OnceLock<std::result::Result<CudaFunction, String>>,
    kernels: compute::Lazy<compute::Kernels>,
    blas: compute::Lazy<parking_lot::Mutex<cudarc::cublas::CudaBlas>>,
}

impl CudaGpu {
    fn new(ctx: Arc<CudaContext>) -> Self {
        CudaGpu {
            ctx,
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

    /// Allocates `bytes` of device memory, turning the driver's
    /// out-of-memory into [`Error::OutOfMemory`] with what was free.
    pub(crate) fn alloc(&self, bytes: usize) -> Result<sys::CUdeviceptr> {
        self.ctx
            .bind_to_thread()
            .map_err(self.err("binding the context"))?;
        // SAFETY: the memory is uninitialised bytes, which is all we claim.
        match unsafe { result::malloc_sync(bytes) } {
            Ok(ptr) => Ok(ptr),
            Err(DriverError(sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY)) => {
                let free = self.mem_info().map(|(f, _)| f).unwrap_or(0);
                Err(Error::OutOfMemory {
                    device: self.device(),
                    requested: bytes as u64,
                    free,
                })
            }
            Err(e) => Err(driver_error("cuMemAlloc", Some(self.device()), e)),
        }
    }

    /// Frees memory from [`CudaGpu::alloc`]. cuMemFree waits for work using
    /// it; errors are recorded on the context (a destructor cannot return them).
    ///
    /// # Safety
    /// `ptr` came from `alloc` on this GPU and is freed once.
    pub(crate) unsafe fn free(&self, ptr: sys::CUdeviceptr) {
        self.ctx.record_err(self.ctx.bind_to_thread());
        // SAFETY: per this function's contract.
        self.ctx.record_err(unsafe { result::free_sync(ptr) });
    }

    /// # Safety
    /// `ptr..ptr+bytes` is device memory of this GPU.
    pub(crate) unsafe fn memset_zero(&self, ptr: sys::CUdeviceptr, bytes: usize) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(self.err("binding the context"))?;
        // SAFETY: per this function's contract.
        unsafe { result::memset_d8_sync(ptr, 0, bytes) }.map_err(self.err("cuMemsetD8"))
    }

    /// Synchronous host-to-device copy (any host memory).
    ///
    /// # Safety
    /// `dst..dst+src.len()` is device memory of this GPU.
    pub(crate) unsafe fn htod_sync(&self, dst: sys::CUdeviceptr, src: &[u8]) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(self.err("binding the context"))?;
        // SAFETY: per this function's contract; the copy completes before return.
        unsafe { result::memcpy_htod_sync(dst, src) }.map_err(self.err("cuMemcpyHtoD"))
    }

    /// Synchronous device-to-host copy (any host memory).
    ///
    /// # Safety
    /// `src..src+dst.len()` is device memory of this GPU.
    pub(crate) unsafe fn dtoh_sync(&self, dst: &mut [u8], src: sys::CUdeviceptr) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(self.err("binding the context"))?;
        // SAFETY: per this function's contract; the copy completes before return.
        unsafe { result::memcpy_dtoh_sync(dst, src) }.map_err(self.err("cuMemcpyDtoH"))
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

    /// Enqueues a device-to-host copy on `stream`.
    ///
    /// # Safety
    /// The device range is this GPU's memory; `dst..dst+len` is page-locked
    /// host memory that nothing reads or writes until the copy completes.
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
