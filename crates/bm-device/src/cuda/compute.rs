//! The CUDA half of [`compute`](crate::compute): NVRTC-compiled kernels and
//! cuBLAS GEMMs on raw device pointers. With its parent `cuda`, the only
//! code of the workspace that names cudarc.
//!
//! The kernel source (`kernels.cu`) is compiled by NVRTC to machine code
//! (CUBIN) for the GPU's own architecture, `sm_XY`, so the driver loads it
//! as it is: PTX handed to the driver fails to load when NVRTC is newer
//! than the driver (`CUDA_ERROR_UNSUPPORTED_PTX_VERSION`). When NVRTC
//! cannot make CUBIN for the GPU (a GPU newer than NVRTC), or the driver
//! refuses the CUBIN, PTX for the newest virtual architecture NVRTC knows
//! up to the GPU's (`compute_XY`) is the fallback. Each image is compiled
//! once per process and kept in the on-disk cache (`kernel_cache.rs`), so
//! a second start loads it without NVRTC; each GPU loads its module on
//! first use. NVRTC and cuBLAS are found and loaded at run time by
//! [`libs`]; a machine without them gets an error naming what was
//! searched, never a panic.

use std::collections::HashMap;
use std::ffi::{CString, c_char, c_int, c_void};
use std::sync::{Arc, OnceLock};

use cudarc::cublas::{CudaBlas, result as blas, sys as blas_sys};
use cudarc::driver::{
    CudaFunction, CudaModule, CudaSlice, CudaStream, DevicePtr, LaunchConfig, PushKernelArg,
};
use cudarc::nvrtc::{Ptx, result as nvrtc_result, sys as nvrtc_sys};
use parking_lot::Mutex;

use super::{CudaGpu, driver_error, driver_major};
use bm_tensor::DType;

use crate::compute::{BLayout, GemmShape, KernelModuleInfo, LaunchShape, RawArg};
use crate::kernel_cache::{self, CacheEnv, ImageKind, KernelCache, KernelImage, Origin};
use crate::libs::{self, CudaLibrary, LoadedLibrary};
use crate::{Device, Error, Result};

/// The kernels' CUDA C++ source.
const SOURCE: &str = include_str!("kernels.cu");

/// One GPU's loaded kernel module, with functions looked up once by name.
pub(crate) struct Kernels {
    module: Arc<CudaModule>,
    functions: Mutex<HashMap<String, CudaFunction>>,
    info: KernelModuleInfo,
}

/// A loaded library (kernels or cuBLAS), or why it could not be loaded.
pub(crate) type Lazy<T> = OnceLock<std::result::Result<T, String>>;

/// Runs `f`, turning a panic (cudarc panics when a library or symbol is
/// missing) into an error message.
fn no_panic<T>(
    what: &str,
    f: impl FnOnce() -> std::result::Result<T, String>,
) -> Result<T, String> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(payload) => Err(payload
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| format!("{what} failed"))),
    }
}

/// NVRTC, loaded, and its version.
#[derive(Clone)]
pub(crate) struct Nvrtc {
    pub library: LoadedLibrary,
    pub version: (i32, i32),
}

/// Finds and loads NVRTC once per process (see [`libs`]).
pub(crate) fn nvrtc() -> std::result::Result<Nvrtc, String> {
    static NVRTC: Lazy<Nvrtc> = OnceLock::new();
    NVRTC
        .get_or_init(|| {
            let library =
                libs::load(CudaLibrary::Nvrtc, driver_major()).map_err(|e| e.to_string())?;
            no_panic("NVRTC", || {
                // SAFETY: opens the library by name, which finds the one
                // loaded above.
                if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
                    return Err(format!(
                        "{} is loaded but cudarc could not open it by name",
                        library.path.display()
                    ));
                }
                let (mut major, mut minor) = (0, 0);
                // SAFETY: writes two ints.
                unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) }
                    .result()
                    .map_err(|e| format!("nvrtcVersion: {e:?}"))?;
                // SAFETY: cudarc's library is open (nvrtcVersion went
                // through it); this only looks a symbol up.
                let symbol =
                    unsafe { nvrtc_sys::culib().get::<unsafe extern "C" fn()>(b"nvrtcVersion") }
                        .ok()
                        .map(|s| *s as usize);
                let library = symbol.map_or_else(|| library.clone(), |s| libs::in_use(&library, s));
                libs::check_major(&library, major.max(0) as u32, driver_major())?;
                Ok(Nvrtc {
                    library,
                    version: (major, minor),
                })
            })
        })
        .clone()
}

/// cuBLAS, loaded, and its version.
#[derive(Clone)]
pub(crate) struct Cublas {
    pub library: LoadedLibrary,
    pub version: String,
}

/// Finds and loads cuBLAS (and cuBLASLt) once per process.
pub(crate) fn cublas() -> std::result::Result<Cublas, String> {
    static CUBLAS: Lazy<Cublas> = OnceLock::new();
    CUBLAS
        .get_or_init(|| {
            let library =
                libs::load(CudaLibrary::Cublas, driver_major()).map_err(|e| e.to_string())?;
            no_panic("cuBLAS", || {
                // SAFETY: as for NVRTC.
                if !unsafe { blas_sys::is_culib_present() } {
                    return Err(format!(
                        "{} is loaded but cudarc could not open it by name",
                        library.path.display()
                    ));
                }
                let mut parts = [0; 3];
                for (part, property) in parts.iter_mut().zip([
                    blas_sys::libraryPropertyType::MAJOR_VERSION,
                    blas_sys::libraryPropertyType::MINOR_VERSION,
                    blas_sys::libraryPropertyType::PATCH_LEVEL,
                ]) {
                    // SAFETY: writes one int.
                    unsafe { blas_sys::cublasGetProperty(property, part) }
                        .result()
                        .map_err(|e| format!("cublasGetProperty: {e}"))?;
                }
                // SAFETY: as for NVRTC: a symbol lookup in cudarc's open library.
                let symbol = unsafe {
                    blas_sys::culib().get::<unsafe extern "C" fn()>(b"cublasGetProperty")
                }
                .ok()
                .map(|s| *s as usize);
                let library = symbol.map_or_else(|| library.clone(), |s| libs::in_use(&library, s));
                libs::check_major(&library, parts[0].max(0) as u32, driver_major())?;
                Ok(Cublas {
                    library,
                    version: format!("{}.{}.{}", parts[0], parts[1], parts[2]),
                })
            })
        })
        .clone()
}

/// Options every compile uses besides the target architecture.
const OPTIONS: [&str; 1] = [
    // No FMA contraction: results then match the CPU kernels' separate
    // multiply and add.
    "--fmad=false",
];

/// The architectures NVRTC can compile for, as `10 * major + minor`.
fn supported_archs() -> std::result::Result<Vec<i32>, String> {
    let mut n: c_int = 0;
    // SAFETY: writes one int.
    unsafe { nvrtc_sys::nvrtcGetNumSupportedArchs(&mut n) }
        .result()
        .map_err(|e| format!("nvrtcGetNumSupportedArchs: {e:?}"))?;
    let mut archs = vec![0 as c_int; n.max(0) as usize];
    // SAFETY: writes `n` ints into a buffer of `n`.
    unsafe { nvrtc_sys::nvrtcGetSupportedArchs(archs.as_mut_ptr()) }
        .result()
        .map_err(|e| format!("nvrtcGetSupportedArchs: {e:?}"))?;
    Ok(archs)
}

/// The target an image of `kind` is compiled for on a GPU of compute
/// capability `arch`: `sm_XY` for CUBIN; for PTX, `compute_XY` of the
/// newest architecture NVRTC supports that the GPU can run.
fn target(kind: ImageKind, (major, minor): (i32, i32)) -> std::result::Result<String, String> {
    let own = major * 10 + minor;
    match kind {
        ImageKind::Cubin => Ok(format!("sm_{own}")),
        ImageKind::Ptx => {
            let best = supported_archs()?
                .into_iter()
                .filter(|&a| a <= own)
                .max()
                .ok_or_else(|| format!("NVRTC supports no architecture up to sm_{own}"))?;
            Ok(format!("compute_{best}"))
        }
    }
}

/// Compiles the kernels to an image of `kind` for `target` with NVRTC.
fn compile(kind: ImageKind, target: &str) -> std::result::Result<KernelImage, String> {
    let src = CString::new(SOURCE).map_err(|_| "the kernel source holds a NUL byte")?;
    let mut options = vec![format!("--gpu-architecture={target}")];
    options.extend(OPTIONS.iter().map(|o| o.to_string()));
    no_panic("NVRTC", || {
        let prog = nvrtc_result::create_program(&src, Some(c"bm_kernels.cu"))
            .map_err(|e| format!("nvrtcCreateProgram: {e:?}"))?;
        // SAFETY: `prog` is a fresh program, destroyed once below.
        let compiled = unsafe { nvrtc_result::compile_program(prog, &options) };
        let image = match compiled {
            // SAFETY: the program compiled.
            Ok(()) => unsafe { image_of(prog, kind) },
            Err(e) => {
                // SAFETY: as above.
                let log = unsafe { nvrtc_result::get_program_log(prog) }
                    .map(|l| c_text(&l))
                    .unwrap_or_default();
                Err(format!("compiling for {target}: {e:?}: {log}"))
            }
        };
        // SAFETY: created above and not used after this.
        let _ = unsafe { nvrtc_result::destroy_program(prog) };
        image
    })
}

/// The compiled image of `prog`.
///
/// # Safety
/// `prog` is a successfully compiled program.
unsafe fn image_of(
    prog: nvrtc_sys::nvrtcProgram,
    kind: ImageKind,
) -> std::result::Result<KernelImage, String> {
    let bytes = match kind {
        ImageKind::Cubin => {
            let mut size = 0usize;
            // SAFETY: writes one size; per this function's contract.
            unsafe { nvrtc_sys::nvrtcGetCUBINSize(prog, &mut size) }
                .result()
                .map_err(|e| format!("nvrtcGetCUBINSize: {e:?}"))?;
            let mut bytes = vec![0u8; size];
            // SAFETY: writes `size` bytes into a buffer of `size`.
            unsafe { nvrtc_sys::nvrtcGetCUBIN(prog, bytes.as_mut_ptr().cast::<c_char>()) }
                .result()
                .map_err(|e| format!("nvrtcGetCUBIN: {e:?}"))?;
            bytes
        }
        // PTX comes NUL-terminated, which cuModuleLoadData needs.
        // SAFETY: per this function's contract `prog` compiled, so it holds PTX.
        ImageKind::Ptx => unsafe { nvrtc_result::get_ptx(prog) }
            .map_err(|e| format!("nvrtcGetPTX: {e:?}"))?
            .into_iter()
            .map(|c| c as u8)
            .collect(),
    };
    if bytes.is_empty() {
        return Err(format!("NVRTC returned an empty {kind:?} image"));
    }
    Ok(KernelImage { kind, bytes })
}

fn c_text(chars: &[c_char]) -> String {
    let bytes: Vec<u8> = chars
        .iter()
        .map(|&c| c as u8)
        .take_while(|&b| b != 0)
        .collect();
    String::from_utf8_lossy(&bytes).trim().to_string()
}

/// One compiled image, with where it came from.
struct Compiled {
    image: KernelImage,
    target: String,
    origin: Origin,
}

/// The kernels as an image of `kind` for compute capability `arch`:
/// compiled at most once per process, read from the disk cache when an
/// earlier process compiled them.
fn kernel_image(kind: ImageKind, arch: (i32, i32)) -> std::result::Result<Arc<Compiled>, String> {
    type Entry = Arc<OnceLock<std::result::Result<Arc<Compiled>, String>>>;
    type Images = Mutex<HashMap<(ImageKind, (i32, i32)), Entry>>;
    static IMAGES: OnceLock<Images> = OnceLock::new();
    let entry = Arc::clone(
        IMAGES
            .get_or_init(Default::default)
            .lock()
            .entry((kind, arch))
            .or_default(),
    );
    entry
        .get_or_init(|| {
            let nvrtc = nvrtc()?;
            let target = target(kind, arch)?;
            let version = format!("{}.{}", nvrtc.version.0, nvrtc.version.1);
            let key = kernel_cache::key(
                kind,
                &[
                    SOURCE.as_bytes(),
                    OPTIONS.join(" ").as_bytes(),
                    version.as_bytes(),
                    target.as_bytes(),
                ],
            );
            let compile = || compile(kind, &target);
            let (image, origin) = match CacheEnv::from_process().kernel_dir() {
                Some(dir) => KernelCache::new(dir).get_or_compile(kind, &key, compile)?,
                None => (compile()?, Origin::Compiled),
            };
            Ok(Arc::new(Compiled {
                image,
                target,
                origin,
            }))
        })
        .clone()
}

impl CudaGpu {
    fn compute_error(&self, operation: &'static str, message: String) -> Error {
        Error::Driver {
            operation,
            device: Some(Device::Gpu(self.ctx.ordinal())),
            message,
        }
    }

    /// This GPU's kernel module, loaded on first use: CUBIN for its
    /// architecture, PTX when that cannot be had or loaded.
    fn kernels(&self) -> Result<&Kernels> {
        self.kernels
            .get_or_init(|| {
                let arch = self
                    .ctx
                    .compute_capability()
                    .map_err(|e| driver_error("cuDeviceGetAttribute", None, e).to_string())?;
                let load = |kind| -> std::result::Result<Kernels, String> {
                    let compiled = kernel_image(kind, arch)?;
                    let module = self
                        .ctx
                        .load_module(Ptx::from_binary(compiled.image.bytes.clone()))
                        .map_err(|e| {
                            format!(
                                "loading the {} module: {}",
                                compiled.target,
                                driver_error("cuModuleLoadData", None, e)
                            )
                        })?;
                    Ok(Kernels {
                        module,
                        functions: Mutex::new(HashMap::new()),
                        info: KernelModuleInfo {
                            target: compiled.target.clone(),
                            from_cache: compiled.origin == Origin::Cache,
                        },
                    })
                };
                load(ImageKind::Cubin).or_else(|cubin| {
                    load(ImageKind::Ptx).map_err(|ptx| {
                        let versions = match (nvrtc(), super::DRIVER_VERSION.get()) {
                            (Ok(n), Some(d)) => format!(
                                " (NVRTC {}.{}, driver CUDA {}.{}: PTX newer than the driver \
                                 does not load)",
                                n.version.0,
                                n.version.1,
                                d / 1000,
                                d % 1000 / 10
                            ),
                            _ => String::new(),
                        };
                        format!("CUBIN: {cubin}; PTX fallback: {ptx}{versions}")
                    })
                })
            })
            .as_ref()
            .map_err(|m| self.compute_error("loading the compute kernels", m.clone()))
    }

    /// What this GPU's kernel module was made from, once loaded.
    pub(crate) fn kernel_info(&self) -> Option<KernelModuleInfo> {
        self.kernels.get()?.as_ref().ok().map(|k| k.info.clone())
    }

    /// Enqueues kernel `name` on `stream`.
    ///
    /// # Safety
    /// `args` match the kernel's parameters in number and type, and every
    /// pointer is device memory of this GPU large enough for what the
    /// kernel reads or writes under `shape`.
    pub(crate) unsafe fn launch(
        &self,
        stream: &CudaStream,
        name: &str,
        shape: LaunchShape,
        args: &[RawArg],
    ) -> Result<()> {
        let kernels = self.kernels()?;
        let func = {
            let mut functions = kernels.functions.lock();
            match functions.get(name) {
                Some(f) => f.clone(),
                None => {
                    let f = kernels
                        .module
                        .load_function(name)
                        .map_err(self.err_for("cuModuleGetFunction"))?;
                    functions.insert(name.to_string(), f.clone());
                    f
                }
            }
        };
        let mut launch = stream.launch_builder(&func);
        for arg in args {
            match arg {
                RawArg::Ptr(v) | RawArg::U64(v) => launch.arg(v),
                RawArg::U32(v) => launch.arg(v),
                RawArg::F32(v) => launch.arg(v),
            };
        }
        let cfg = LaunchConfig {
            grid_dim: shape.grid,
            block_dim: (shape.block, 1, 1),
            shared_mem_bytes: shape.shared_bytes,
        };
        // SAFETY: per this function's contract.
        unsafe { launch.launch(cfg) }
            .map(|_| ())
            .map_err(self.err_for("cuLaunchKernel"))
    }

    fn err_for(
        &self,
        operation: &'static str,
    ) -> impl FnOnce(cudarc::driver::DriverError) -> Error {
        let device = Device::Gpu(self.ctx.ordinal());
        move |e| driver_error(operation, Some(device), e)
    }

    /// This GPU's cuBLAS handle, bound to `stream` (the compute stream) and
    /// given its workspace on first use.
    fn blas(&self, stream: &Arc<CudaStream>) -> Result<&Mutex<Blas>> {
        self.blas
            .get_or_init(|| {
                cublas()?;
                no_panic("cuBLAS", || Blas::new(stream).map(Mutex::new))
            })
            .as_ref()
            .map_err(|m| self.compute_error("creating the cuBLAS handle", m.clone()))
    }

    /// Enqueues `C = A · Bᵀ` (row-major, see [`GemmShape`]) on `stream`,
    /// accumulating in f32.
    ///
    /// # Safety
    /// `a`, `b` and `c` are device memory of this GPU holding the matrices
    /// `shape` describes (every batch), in the given types.
    pub(crate) unsafe fn gemm(
        &self,
        stream: &Arc<CudaStream>,
        shape: &GemmShape,
        input: DType,
        output: DType,
        (a, b, c): (u64, u64, u64),
    ) -> Result<()> {
        let blas_handle = self.blas(stream)?.lock();
        self.ctx
            .bind_to_thread()
            .map_err(self.err_for("binding the context"))?;
        let to_int = |v: usize| {
            i32::try_from(v).map_err(|_| Error::BadComputeArgs {
                operation: "gemm",
                message: format!("dimension {v} is beyond cuBLAS's 32-bit limit"),
            })
        };
        let (m, n, k) = (to_int(shape.m)?, to_int(shape.n)?, to_int(shape.k)?);
        let in_type = data_type(input)?;
        let out_type = data_type(output)?;
        let (alpha, beta) = (1.0f32, 0.0f32);
        let alpha = &alpha as *const f32 as *const c_void;
        let beta = &beta as *const f32 as *const c_void;
        // cuBLAS is column-major: row-major C[m, n] = A[m, k] · B[n, k]ᵀ is
        // column-major Cᵀ (n×m, ld n) = Bᵀ-as-stored transposed · A-as-stored:
        // B's bytes read column-major are k×n (ld k), transposed to n×k; A's
        // are k×m (ld k), used as they are.
        // With B stored [k, n] (row-major C[m, n] = A[m, k] · B[k, n]),
        // Cᵀ (n×m, ld n) = Bᵀ · Aᵀ: B's bytes read column-major are already
        // n×k (ld n), used as they are; A's as above.
        let op_t = blas_sys::cublasOperation_t::CUBLAS_OP_T;
        let op_n = blas_sys::cublasOperation_t::CUBLAS_OP_N;
        let (op_b, ld_b) = match shape.b_layout {
            BLayout::OutIn => (op_t, k),
            BLayout::InOut => (op_n, n),
        };
        let compute = blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F;
        let algo = blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT;
        let handle = *blas_handle.handle.handle();
        let status = if shape.batch == 1 {
            // SAFETY: per this function's contract; alpha/beta are host f32
            // as CUBLAS_COMPUTE_32F with the default pointer mode expects.
            unsafe {
                blas::gemm_ex(
                    handle,
                    op_b,
                    op_n,
                    n,
                    m,
                    k,
                    alpha,
                    b as *const c_void,
                    in_type,
                    ld_b,
                    a as *const c_void,
                    in_type,
                    k,
                    beta,
                    c as *mut c_void,
                    out_type,
                    n,
                    compute,
                    algo,
                )
            }
        } else {
            let stride = |v: usize| {
                i64::try_from(v).map_err(|_| Error::BadComputeArgs {
                    operation: "gemm",
                    message: format!("stride {v} does not fit 64 bits"),
                })
            };
            // SAFETY: as above, for every batch.
            unsafe {
                blas::gemm_strided_batched_ex(
                    handle,
                    op_b,
                    op_n,
                    n,
                    m,
                    k,
                    alpha,
                    b as *const c_void,
                    in_type,
                    ld_b,
                    stride(shape.stride_b)?,
                    a as *const c_void,
                    in_type,
                    k,
                    stride(shape.stride_a)?,
                    beta,
                    c as *mut c_void,
                    out_type,
                    n,
                    stride(shape.stride_c)?,
                    to_int(shape.batch)?,
                    compute,
                    algo,
                )
            }
        };
        status.map_err(|e| self.compute_error("cublasGemmEx", e.to_string()))
    }
}

/// A cuBLAS handle and the workspace it was given.
pub(crate) struct Blas {
    handle: CudaBlas,
    /// Lives as long as the handle (declared after it, so dropped after
    /// it): every GEMM on the handle may use it.
    _workspace: CudaSlice<u8>,
}

impl Blas {
    /// A handle on `stream` with a workspace of
    /// [`crate::GEMM_WORKSPACE_BYTES`] of our own, so what cuBLAS holds on
    /// the GPU is what the ledger charges (cuBLAS otherwise sizes its own
    /// pool by version and architecture).
    fn new(stream: &Arc<CudaStream>) -> std::result::Result<Blas, String> {
        let handle = CudaBlas::new(Arc::clone(stream)).map_err(|e| e.to_string())?;
        let bytes = crate::GEMM_WORKSPACE_BYTES;
        let workspace = stream
            .alloc_zeros::<u8>(bytes)
            .map_err(|e| format!("allocating the {bytes}-byte cuBLAS workspace: {e}"))?;
        {
            let (pointer, _synced) = workspace.device_ptr(stream);
            // SAFETY: the handle is live; the workspace is device memory of
            // this context, `bytes` long and 256-byte aligned (driver
            // allocations are), and outlives the handle (field order).
            // Set after CudaBlas::new's cublasSetStream, which would reset
            // it to cuBLAS's own pool.
            unsafe {
                blas_sys::cublasSetWorkspace_v2(*handle.handle(), pointer as *mut c_void, bytes)
            }
            .result()
            .map_err(|e| format!("cublasSetWorkspace: {e}"))?;
        }
        Ok(Blas {
            handle,
            _workspace: workspace,
        })
    }
}

/// cuBLAS's name for element type `t`.
fn data_type(t: DType) -> Result<blas_sys::cudaDataType> {
    match t {
        DType::F32 => Ok(blas_sys::cudaDataType::CUDA_R_32F),
        DType::F16 => Ok(blas_sys::cudaDataType::CUDA_R_16F),
        DType::BF16 => Ok(blas_sys::cudaDataType::CUDA_R_16BF),
        other => Err(Error::BadComputeArgs {
            operation: "gemm",
            message: format!("{other} has no GEMM (only F32, F16 and BF16 compute)"),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// NVRTC needs no GPU: where one is found (a toolkit, or the
    /// `nvidia-cuda-nvrtc` wheel next to the `python3` on `PATH`, which
    /// `cargo xtask test` installs and then requires through
    /// `BM_REQUIRE_NVRTC`), the kernel source must compile for Hopper
    /// (H100/H200) and Ampere, as CUBIN and as the PTX fallback.
    #[test]
    fn the_kernels_compile_with_the_nvrtc_found_here() {
        let required = std::env::var_os("BM_REQUIRE_NVRTC").is_some();
        match nvrtc() {
            Ok(n) => eprintln!(
                "NVRTC {}.{} from {}",
                n.version.0,
                n.version.1,
                n.library.path.display()
            ),
            Err(e) if required => panic!("BM_REQUIRE_NVRTC is set, but: {e}"),
            Err(e) => {
                eprintln!("skipped: no NVRTC ({e})");
                return;
            }
        }
        for (kind, target) in [
            (ImageKind::Cubin, "sm_90"),
            (ImageKind::Cubin, "sm_80"),
            (ImageKind::Ptx, "compute_90"),
        ] {
            if let Err(e) = compile(kind, target) {
                panic!("{e}");
            }
        }
    }
}
