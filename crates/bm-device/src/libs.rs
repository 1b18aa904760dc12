//! Finding the CUDA libraries (the driver, NVRTC, cuBLAS and cuBLASLt) on
//! CUDA 12 and 13 machines, and loading them by full path before cudarc
//! asks for them by name.
//!
//! cudarc opens each library with `dlopen` of a short list of names
//! (`libnvrtc.so`, `libnvrtc.so.13`, `libnvrtc.so.12`, …) and panics when
//! none loads. Those names reach only what the dynamic loader finds
//! (`LD_LIBRARY_PATH`, `ld.so.cache`), not a toolkit under `CUDA_HOME` nor
//! the pip wheels PyTorch installs. So we look first, in this order:
//!
//! 1. the dynamic loader, by versioned name (`.so.13`, `.so.12`, then the
//!    bare `.so`; for the driver `libcuda.so.1`, `libcuda.so`);
//! 2. `CUDA_HOME` and `CUDA_PATH` (`lib64`, `lib`, `targets/<arch>-linux/lib`);
//! 3. `/usr/local/cuda` (`lib64`, `targets/<arch>-linux/lib`);
//! 4. the `nvidia/*/lib` folders of pip wheels in the site-packages of the
//!    `python3` on `PATH` (CUDA 13 wheels share `nvidia/cu13/lib`, CUDA 12
//!    wheels have one folder per library, `nvidia/cuda_nvrtc/lib`,
//!    `nvidia/cublas/lib`), found from the interpreter's path without
//!    running it, and the user site under `~/.local`;
//! 5. the distribution's folders (`/usr/lib/<arch>-linux-gnu`, `/usr/lib64`;
//!    for the driver also `/usr/local/nvidia/lib64`, where containers mount
//!    it, and WSL's `/usr/lib/wsl/lib`). Toolkit `stubs` folders are never
//!    searched: their libcuda only returns errors.
//!
//! Within a folder the newest major comes first, and no library newer than
//! the driver is taken (a CUDA 13 NVRTC writes code a CUDA 12 driver
//! cannot load). The file found is opened by full path with
//! `RTLD_NOW | RTLD_GLOBAL`; glibc then answers cudarc's later
//! `dlopen("libnvrtc.so.13")` with that object, because a name is matched
//! against the SONAME of every object already loaded. cuBLAS needs
//! cuBLASLt, and NVRTC its builtins library: those are opened first, from
//! the same folder, so the loader resolves them the same way. A library
//! found nowhere is [`Error::LibraryNotFound`], which lists every name and
//! folder tried and every file that was there but refused to load.
//!
//! cudarc is built with `cuda-13000`, whose candidate names include both
//! `.so.13` and `.so.12`, which is why only these two majors are looked for.
//! cudarc asks for the bare `libnvrtc.so` first, though, and a bare name
//! matches no SONAME: where the loader knows a `libnvrtc.so` (a toolkit's
//! development link), cudarc takes that file rather than ours. So once a
//! library answers through cudarc, [`in_use`] asks the loader which object
//! holds the symbol cudarc resolved, and [`check_major`] refuses a major
//! newer than the driver's, whichever file it came from.

use std::ffi::{CStr, CString, OsString, c_char, c_int, c_void};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use crate::{Error, Result};

/// A CUDA library bigmodel loads at run time.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CudaLibrary {
    /// The driver API, `libcuda` (installed with the NVIDIA driver).
    Driver,
    /// The run-time compiler, `libnvrtc`: compiles the compute kernels.
    Nvrtc,
    /// `libcublas`: matrix products.
    Cublas,
    /// `libcublasLt`, which cuBLAS itself loads.
    CublasLt,
}

impl CudaLibrary {
    /// Every library, in the order they are loaded.
    pub const ALL: [CudaLibrary; 4] = [
        CudaLibrary::Driver,
        CudaLibrary::Nvrtc,
        CudaLibrary::CublasLt,
        CudaLibrary::Cublas,
    ];

    /// A short key: `driver`, `nvrtc`, `cublas`, `cublaslt`.
    pub fn key(self) -> &'static str {
        match self {
            CudaLibrary::Driver => "driver",
            CudaLibrary::Nvrtc => "nvrtc",
            CudaLibrary::Cublas => "cublas",
            CudaLibrary::CublasLt => "cublaslt",
        }
    }

    /// The file name without its suffix, e.g. `libnvrtc`.
    pub fn stem(self) -> &'static str {
        match self {
            CudaLibrary::Driver => "libcuda",
            CudaLibrary::Nvrtc => "libnvrtc",
            CudaLibrary::Cublas => "libcublas",
            CudaLibrary::CublasLt => "libcublasLt",
        }
    }

    /// What the library is, for messages.
    pub fn description(self) -> &'static str {
        match self {
            CudaLibrary::Driver => "the CUDA driver (libcuda)",
            CudaLibrary::Nvrtc => "NVRTC (libnvrtc), which compiles the GPU compute kernels",
            CudaLibrary::Cublas => "cuBLAS (libcublas), which runs the GPU matrix products",
            CudaLibrary::CublasLt => "cuBLASLt (libcublasLt), which cuBLAS needs",
        }
    }

    /// The pip wheel folder of this library in CUDA 12 wheels.
    fn cuda12_wheel(self) -> Option<&'static str> {
        match self {
            CudaLibrary::Driver => None,
            CudaLibrary::Nvrtc => Some("cuda_nvrtc"),
            CudaLibrary::Cublas | CudaLibrary::CublasLt => Some("cublas"),
        }
    }
}

impl std::fmt::Display for CudaLibrary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.key())
    }
}

/// The CUDA majors whose libraries are looked for, newest first: those
/// that cudarc's `cuda-13000` candidate names reach.
const MAJORS: [u32; 2] = [13, 12];

/// The file names of `library` worth trying with a driver of CUDA major
/// `driver_major` (unknown: no limit), in order of preference.
pub fn file_names(library: CudaLibrary, driver_major: Option<u32>) -> Vec<String> {
    let stem = library.stem();
    if library == CudaLibrary::Driver {
        return vec![format!("{stem}.so.1"), format!("{stem}.so")];
    }
    MAJORS
        .iter()
        .filter(|&&m| driver_major.is_none_or(|d| m <= d))
        .map(|m| format!("{stem}.so.{m}"))
        .chain([format!("{stem}.so")])
        .collect()
}

/// What the search reads from the environment, passed in so tests need
/// no global state: the variables, and the root the fixed system folders
/// hang from (`/` outside tests).
#[derive(Clone, Debug, Default)]
pub struct SearchEnv {
    /// `CUDA_HOME`.
    pub cuda_home: Option<PathBuf>,
    /// `CUDA_PATH`.
    pub cuda_path: Option<PathBuf>,
    /// `PATH`, to find `python3`.
    pub path: Option<OsString>,
    /// `HOME`, for the user's site-packages.
    pub home: Option<PathBuf>,
    /// Prefix of `/usr/local/cuda`, `/usr/lib`, … (`/` outside tests).
    pub root: PathBuf,
}

impl SearchEnv {
    /// This process's environment.
    pub fn from_process() -> SearchEnv {
        let var = |name: &str| std::env::var_os(name).filter(|v| !v.is_empty());
        SearchEnv {
            cuda_home: var("CUDA_HOME").map(PathBuf::from),
            cuda_path: var("CUDA_PATH").map(PathBuf::from),
            path: var("PATH"),
            home: var("HOME").map(PathBuf::from),
            root: PathBuf::from("/"),
        }
    }

    fn system(&self, path: &str) -> PathBuf {
        self.root.join(path.trim_start_matches('/'))
    }
}

/// `x86_64-linux` (the toolkit's `targets` folder) and
/// `x86_64-linux-gnu` (the distribution's library folder) for this CPU.
fn arch_dirs() -> (&'static str, &'static str) {
    match std::env::consts::ARCH {
        "aarch64" => ("sbsa-linux", "aarch64-linux-gnu"),
        _ => ("x86_64-linux", "x86_64-linux-gnu"),
    }
}

/// The site-packages (and Debian dist-packages) folders of the `python3`
/// first on `PATH`, without running it: `<prefix>/lib/python3.*/…` where
/// the prefix is the folder above `bin/`, both as found on `PATH` (a
/// virtual environment) and after resolving symbolic links (the base
/// installation), then the user site under `~/.local`.
pub fn python_site_packages(env: &SearchEnv) -> Vec<PathBuf> {
    let mut prefixes = Vec::new();
    if let Some(path) = &env.path
        && let Some(python) = std::env::split_paths(path)
            .map(|dir| dir.join("python3"))
            .find(|p| p.is_file())
    {
        let prefix_of = |p: &Path| p.parent().and_then(Path::parent).map(Path::to_path_buf);
        prefixes.extend(prefix_of(&python));
        if let Ok(real) = std::fs::canonicalize(&python) {
            prefixes.extend(prefix_of(&real));
        }
    }
    if let Some(home) = &env.home {
        prefixes.push(home.join(".local"));
    }
    let mut out: Vec<PathBuf> = Vec::new();
    for prefix in prefixes {
        let mut versions: Vec<PathBuf> = std::fs::read_dir(prefix.join("lib"))
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.path())
            .filter(|p| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with("python3"))
            })
            .collect();
        // Newest Python first when a prefix holds several.
        versions.sort_by(|a, b| b.cmp(a));
        for v in versions {
            for sub in ["site-packages", "dist-packages"] {
                let dir = v.join(sub);
                if dir.is_dir() && !out.contains(&dir) {
                    out.push(dir);
                }
            }
        }
    }
    out
}

/// The folders searched for `library`, in order (the dynamic loader's
/// own search comes before them and is not listed).
pub fn search_dirs(library: CudaLibrary, env: &SearchEnv) -> Vec<PathBuf> {
    let (targets, multiarch) = arch_dirs();
    let mut dirs: Vec<PathBuf> = Vec::new();
    if library == CudaLibrary::Driver {
        for d in [
            "/usr/local/nvidia/lib64".to_string(),
            "/usr/local/nvidia/lib".to_string(),
            format!("/usr/lib/{multiarch}"),
            "/usr/lib64".to_string(),
            "/usr/lib/wsl/lib".to_string(),
        ] {
            dirs.push(env.system(&d));
        }
        return dirs;
    }
    for home in [&env.cuda_home, &env.cuda_path].into_iter().flatten() {
        for sub in [
            "lib64".to_string(),
            "lib".to_string(),
            format!("targets/{targets}/lib"),
        ] {
            dirs.push(home.join(sub));
        }
    }
    dirs.push(env.system("/usr/local/cuda/lib64"));
    dirs.push(env.system(&format!("/usr/local/cuda/targets/{targets}/lib")));
    for site in python_site_packages(env) {
        let nvidia = site.join("nvidia");
        dirs.push(nvidia.join("cu13").join("lib"));
        if let Some(own) = library.cuda12_wheel() {
            dirs.push(nvidia.join(own).join("lib"));
        }
        // Any other wheel folder, in name order.
        let mut others: Vec<PathBuf> = std::fs::read_dir(&nvidia)
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.path().join("lib"))
            .filter(|p| p.is_dir())
            .collect();
        others.sort();
        dirs.extend(others);
    }
    dirs.push(env.system(&format!("/usr/lib/{multiarch}")));
    dirs.push(env.system("/usr/lib64"));
    let mut unique = Vec::with_capacity(dirs.len());
    for d in dirs {
        if !unique.contains(&d) {
            unique.push(d);
        }
    }
    unique
}

/// The files that exist for `library` in the search folders, in the
/// order they are tried: folder by folder, newest major first.
pub fn candidate_files(
    library: CudaLibrary,
    env: &SearchEnv,
    driver_major: Option<u32>,
) -> Vec<PathBuf> {
    let names = file_names(library, driver_major);
    search_dirs(library, env)
        .iter()
        .flat_map(|dir| names.iter().map(move |n| dir.join(n)))
        .filter(|p| p.is_file())
        .collect()
}

/// What a search tried, for the error when nothing loaded.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Searched {
    /// File names asked of the dynamic loader.
    pub names: Vec<String>,
    /// Folders searched after the loader.
    pub dirs: Vec<PathBuf>,
    /// Files that were there but would not load, with the loader's reason.
    pub refused: Vec<(String, String)>,
}

impl std::fmt::Display for Searched {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "looked for {} through the dynamic loader (LD_LIBRARY_PATH, ld.so.cache) and in ",
            self.names.join(", ")
        )?;
        let dirs: Vec<String> = self.dirs.iter().map(|d| d.display().to_string()).collect();
        f.write_str(&dirs.join(", "))?;
        for (file, reason) in &self.refused {
            write!(f, "; {file} did not load: {reason}")?;
        }
        Ok(())
    }
}

/// A library loaded for the rest of the process.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LoadedLibrary {
    /// Which library.
    pub library: CudaLibrary,
    /// The file loaded.
    pub path: PathBuf,
    /// Whether the dynamic loader found it by name (else we found it in a
    /// folder and opened it by full path).
    pub by_loader: bool,
}

/// What a process knows about one CUDA library, for `bigmodel devices`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LibraryReport {
    /// Which library.
    pub library: CudaLibrary,
    /// The file loaded, when it loaded.
    pub path: Option<PathBuf>,
    /// Its version (the driver's CUDA version for the driver), when loaded.
    pub version: Option<String>,
    /// Why it is not loaded, when it is not.
    pub error: Option<String>,
}

/// How a search opens a candidate: by name through the loader, or by
/// path. Real loading uses `dlopen`; tests pass a stand-in.
pub trait Opener {
    /// Opens `name_or_path`; returns the full path of what was loaded, or
    /// the loader's reason for refusing.
    fn open(&mut self, name_or_path: &str) -> std::result::Result<PathBuf, String>;
}

/// Finds and opens `library`: the loader by name first, then every
/// candidate file in order. cuBLAS's cuBLASLt and NVRTC's builtins are
/// opened first from the folder where the library itself was found.
pub fn find_and_open(
    library: CudaLibrary,
    env: &SearchEnv,
    driver_major: Option<u32>,
    opener: &mut dyn Opener,
) -> Result<LoadedLibrary> {
    let names = file_names(library, driver_major);
    let mut searched = Searched {
        names: names.clone(),
        dirs: search_dirs(library, env),
        refused: Vec::new(),
    };
    for name in &names {
        // A failure here only means the loader does not know the name.
        if let Ok(path) = opener.open(name) {
            return Ok(LoadedLibrary {
                library,
                path,
                by_loader: true,
            });
        }
    }
    for file in candidate_files(library, env, driver_major) {
        open_companions(library, &file, opener);
        let text = file.to_string_lossy().into_owned();
        match opener.open(&text) {
            Ok(path) => {
                return Ok(LoadedLibrary {
                    library,
                    path,
                    by_loader: false,
                });
            }
            Err(reason) => searched.refused.push((text, reason)),
        }
    }
    Err(Error::LibraryNotFound { library, searched })
}

/// Opens what `file` itself loads from its own folder, so the loader finds
/// it by SONAME: cuBLASLt of the same version next to cuBLAS, NVRTC's
/// builtins next to NVRTC. A companion that fails to open is left to the
/// library's own load, which then reports it.
fn open_companions(library: CudaLibrary, file: &Path, opener: &mut dyn Opener) {
    let (Some(dir), Some(name)) = (file.parent(), file.file_name().and_then(|n| n.to_str())) else {
        return;
    };
    let suffix = name.strip_prefix(library.stem()).unwrap_or("");
    match library {
        CudaLibrary::Cublas => {
            let lt = dir.join(format!("{}{suffix}", CudaLibrary::CublasLt.stem()));
            if lt.is_file() {
                let _ = opener.open(&lt.to_string_lossy());
            }
        }
        CudaLibrary::Nvrtc => {
            // libnvrtc.so.13 loads libnvrtc-builtins.so.13.<minor>.
            let prefix = format!("libnvrtc-builtins{suffix}");
            let mut builtins: Vec<PathBuf> = std::fs::read_dir(dir)
                .into_iter()
                .flatten()
                .flatten()
                .map(|e| e.path())
                .filter(|p| {
                    p.file_name()
                        .and_then(|n| n.to_str())
                        .is_some_and(|n| n.starts_with(&prefix) && n.contains(".so"))
                })
                .collect();
            builtins.sort();
            if let Some(b) = builtins.last() {
                let _ = opener.open(&b.to_string_lossy());
            }
        }
        CudaLibrary::Driver | CudaLibrary::CublasLt => {}
    }
}

// The dynamic loader, declared here rather than through a crate: four
// functions of glibc (in libc itself since 2.34).
unsafe extern "C" {
    fn dlopen(filename: *const c_char, flags: c_int) -> *mut c_void;
    fn dlerror() -> *mut c_char;
    fn dlinfo(handle: *mut c_void, request: c_int, info: *mut c_void) -> c_int;
    fn dlsym(handle: *mut c_void, symbol: *const c_char) -> *mut c_void;
    fn dladdr(address: *const c_void, info: *mut DlInfo) -> c_int;
}

/// glibc's `Dl_info` (`<dlfcn.h>`).
#[repr(C)]
struct DlInfo {
    dli_fname: *const c_char,
    dli_fbase: *mut c_void,
    dli_sname: *const c_char,
    dli_saddr: *mut c_void,
}

/// The file of the loaded object whose mapping holds `address` (a code
/// address, taken as a number: it is only looked up), as the loader
/// recorded it.
pub fn object_holding(address: usize) -> Option<PathBuf> {
    let mut info = DlInfo {
        dli_fname: std::ptr::null(),
        dli_fbase: std::ptr::null_mut(),
        dli_sname: std::ptr::null(),
        dli_saddr: std::ptr::null_mut(),
    };
    // SAFETY: dladdr never dereferences the address: it only looks it up
    // in the loader's tables and fills `info`.
    if unsafe { dladdr(address as *const c_void, &mut info) } == 0 || info.dli_fname.is_null() {
        return None;
    }
    // SAFETY: dli_fname is a NUL-terminated path owned by the loader.
    let name = unsafe { CStr::from_ptr(info.dli_fname) };
    Some(PathBuf::from(name.to_string_lossy().into_owned()))
}

/// The library cudarc actually calls, given the address of a symbol it
/// resolved: `ours` when that is the object we loaded, else the file the
/// loader gave cudarc by name.
pub fn in_use(ours: &LoadedLibrary, cudarc_symbol: usize) -> LoadedLibrary {
    let same = |a: &Path, b: &Path| match (a.canonicalize(), b.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => a == b,
    };
    match object_holding(cudarc_symbol) {
        Some(path) if !same(&path, &ours.path) => LoadedLibrary {
            library: ours.library,
            path,
            by_loader: true,
        },
        _ => ours.clone(),
    }
}

/// Refuses a library whose CUDA major (as it reports its own version) is
/// newer than the driver's: what a newer NVRTC compiles, the driver cannot
/// load, and a newer cuBLAS does not start.
pub fn check_major(
    library: &LoadedLibrary,
    version_major: u32,
    driver_major: Option<u32>,
) -> std::result::Result<(), String> {
    match driver_major {
        Some(driver) if version_major > driver => {
            let remedy = if library.by_loader {
                format!(
                    "; the dynamic loader gave it for a bare name: take its folder off \
                     LD_LIBRARY_PATH, or install a driver of CUDA {version_major}"
                )
            } else {
                String::new()
            };
            Err(format!(
                "{} in use is {} (CUDA {version_major}), newer than the driver (CUDA {driver}){remedy}",
                library.library.stem(),
                library.path.display(),
            ))
        }
        _ => Ok(()),
    }
}

const RTLD_NOW: c_int = 2;
const RTLD_GLOBAL: c_int = 0x100;
const RTLD_DI_LINKMAP: c_int = 2;

/// The head of glibc's `struct link_map` (`<link.h>`), enough to read the
/// path of a loaded object.
#[repr(C)]
struct LinkMap {
    l_addr: usize,
    l_name: *const c_char,
}

/// The loader's last error message.
fn last_dl_error() -> String {
    // SAFETY: dlerror returns null or a NUL-terminated string owned by
    // the loader, valid until the next dl* call on this thread.
    let e = unsafe { dlerror() };
    if e.is_null() {
        "unknown error".into()
    } else {
        // SAFETY: as above.
        unsafe { CStr::from_ptr(e) }.to_string_lossy().into_owned()
    }
}

/// Opens libraries with `dlopen(RTLD_NOW | RTLD_GLOBAL)` and keeps them
/// loaded for the rest of the process.
pub struct DlOpener;

impl Opener for DlOpener {
    fn open(&mut self, name_or_path: &str) -> std::result::Result<PathBuf, String> {
        let c = CString::new(name_or_path).map_err(|_| "a NUL byte in the name".to_string())?;
        // SAFETY: `c` is a valid C string; opening a shared library runs its
        // initialisers, which is what loading a CUDA library means. The
        // handle is never closed, so the library stays for the process.
        let handle = unsafe { dlopen(c.as_ptr(), RTLD_NOW | RTLD_GLOBAL) };
        if handle.is_null() {
            return Err(last_dl_error());
        }
        let mut map: *mut LinkMap = std::ptr::null_mut();
        // SAFETY: RTLD_DI_LINKMAP writes one pointer to the object's
        // link_map, whose first two fields LinkMap mirrors.
        let path = if unsafe { dlinfo(handle, RTLD_DI_LINKMAP, (&raw mut map).cast()) } == 0
            && !map.is_null()
            // SAFETY: map points to the loader's live link_map.
            && !unsafe { (*map).l_name }.is_null()
        {
            // SAFETY: l_name is a NUL-terminated path owned by the loader.
            let name = unsafe { CStr::from_ptr((*map).l_name) };
            PathBuf::from(name.to_string_lossy().into_owned())
        } else {
            PathBuf::from(name_or_path)
        };
        Ok(path)
    }
}

impl LoadedLibrary {
    /// The address of `name` in this library, if it exports it (for a
    /// symbol cudarc's bindings do not reach, such as a driver entry point
    /// older than the bindings' CUDA version).
    pub fn symbol(&self, name: &str) -> Option<*mut c_void> {
        let path = CString::new(self.path.to_string_lossy().as_bytes()).ok()?;
        let name = CString::new(name).ok()?;
        // SAFETY: the library is loaded already, so this only takes another
        // reference to it (never released, like the first).
        let handle = unsafe { dlopen(path.as_ptr(), RTLD_NOW | RTLD_GLOBAL) };
        if handle.is_null() {
            return None;
        }
        // SAFETY: a valid handle and C string.
        let sym = unsafe { dlsym(handle, name.as_ptr()) };
        (!sym.is_null()).then_some(sym)
    }
}

type Slot = OnceLock<std::result::Result<LoadedLibrary, Error>>;

fn slot(library: CudaLibrary) -> &'static Slot {
    static SLOTS: [Slot; 4] = [
        OnceLock::new(),
        OnceLock::new(),
        OnceLock::new(),
        OnceLock::new(),
    ];
    &SLOTS[match library {
        CudaLibrary::Driver => 0,
        CudaLibrary::Nvrtc => 1,
        CudaLibrary::Cublas => 2,
        CudaLibrary::CublasLt => 3,
    }]
}

/// Finds and loads `library` once per process (later calls return the
/// first answer). Libraries newer than a driver of CUDA major
/// `driver_major` are skipped. cuBLASLt is loaded by loading cuBLAS.
pub fn load(library: CudaLibrary, driver_major: Option<u32>) -> Result<LoadedLibrary> {
    let found = slot(library).get_or_init(|| {
        let env = SearchEnv::from_process();
        let found = find_and_open(library, &env, driver_major, &mut DlOpener);
        if let (CudaLibrary::Cublas, Ok(cublas)) = (library, &found) {
            let lt = cublaslt_of(cublas);
            let _ = slot(CudaLibrary::CublasLt).set(lt);
        }
        found
    });
    found.clone()
}

/// Where the loaded cuBLAS took its cuBLASLt from: the loader knows it by
/// SONAME now, so asking by the matching name returns that object.
fn cublaslt_of(cublas: &LoadedLibrary) -> Result<LoadedLibrary> {
    let name = cublas
        .path
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or("");
    let suffix = name
        .strip_prefix(CudaLibrary::Cublas.stem())
        .unwrap_or(".so");
    let lt = format!("{}{suffix}", CudaLibrary::CublasLt.stem());
    DlOpener
        .open(&lt)
        .map(|path| LoadedLibrary {
            library: CudaLibrary::CublasLt,
            path,
            by_loader: cublas.by_loader,
        })
        .map_err(|reason| Error::LibraryNotFound {
            library: CudaLibrary::CublasLt,
            searched: Searched {
                names: vec![lt.clone()],
                dirs: Vec::new(),
                refused: vec![(lt, reason)],
            },
        })
}

/// What [`load`] answered for `library` so far, without loading anything.
pub fn loaded(library: CudaLibrary) -> Option<Result<LoadedLibrary>> {
    slot(library).get().cloned()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;
    use std::fs;

    /// Empty files with library names: enough for the search, which only
    /// looks at names; `FakeOpener` decides what "loads".
    fn touch(path: &Path) {
        fs::create_dir_all(path.parent().unwrap()).unwrap();
        fs::write(path, b"").unwrap();
    }

    /// Loads names in `by_name` (as the loader would) and files not in
    /// `broken`; records every attempt.
    #[derive(Default)]
    struct FakeOpener {
        by_name: HashSet<String>,
        broken: HashSet<PathBuf>,
        attempts: Vec<String>,
    }

    impl Opener for FakeOpener {
        fn open(&mut self, name_or_path: &str) -> std::result::Result<PathBuf, String> {
            self.attempts.push(name_or_path.to_string());
            let p = Path::new(name_or_path);
            if p.is_absolute() {
                if self.broken.contains(p) {
                    Err("invalid ELF header".into())
                } else if p.is_file() {
                    Ok(p.to_path_buf())
                } else {
                    Err("no such file".into())
                }
            } else if self.by_name.contains(name_or_path) {
                Ok(PathBuf::from("/loader").join(name_or_path))
            } else {
                Err(format!("{name_or_path}: cannot open shared object file"))
            }
        }
    }

    fn env(root: &Path) -> SearchEnv {
        SearchEnv {
            cuda_home: None,
            cuda_path: None,
            path: None,
            home: None,
            root: root.to_path_buf(),
        }
    }

    #[test]
    fn names_are_newest_major_first_and_never_newer_than_the_driver() {
        assert_eq!(
            file_names(CudaLibrary::Nvrtc, None),
            ["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"]
        );
        assert_eq!(
            file_names(CudaLibrary::Cublas, Some(12)),
            ["libcublas.so.12", "libcublas.so"]
        );
        assert_eq!(
            file_names(CudaLibrary::CublasLt, Some(13)),
            ["libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so"]
        );
        assert_eq!(
            file_names(CudaLibrary::Driver, Some(13)),
            ["libcuda.so.1", "libcuda.so"]
        );
    }

    #[test]
    fn folders_come_in_the_documented_order() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path();
        // A virtual environment whose python3 is on PATH, with CUDA 13 and
        // CUDA 12 style wheels.
        let venv = root.join("venv");
        touch(&venv.join("bin/python3"));
        let site = venv.join("lib/python3.12/site-packages");
        touch(&site.join("nvidia/cu13/lib/libnvrtc.so.13"));
        touch(&site.join("nvidia/cuda_nvrtc/lib/libnvrtc.so.12"));
        touch(&site.join("nvidia/aaa/lib/other.so"));
        let mut e = env(root);
        e.cuda_home = Some(root.join("home"));
        e.cuda_path = Some(root.join("cpath"));
        e.path = Some(std::env::join_paths([root.join("nowhere"), venv.join("bin")]).unwrap());
        e.home = Some(root.join("user"));

        let dirs = search_dirs(CudaLibrary::Nvrtc, &e);
        let (targets, multiarch) = arch_dirs();
        let expected: Vec<PathBuf> = vec![
            root.join("home/lib64"),
            root.join("home/lib"),
            root.join(format!("home/targets/{targets}/lib")),
            root.join("cpath/lib64"),
            root.join("cpath/lib"),
            root.join(format!("cpath/targets/{targets}/lib")),
            root.join("usr/local/cuda/lib64"),
            root.join(format!("usr/local/cuda/targets/{targets}/lib")),
            site.join("nvidia/cu13/lib"),
            site.join("nvidia/cuda_nvrtc/lib"),
            site.join("nvidia/aaa/lib"),
            root.join(format!("usr/lib/{multiarch}")),
            root.join("usr/lib64"),
        ];
        assert_eq!(dirs, expected);

        // The driver is never looked for in a toolkit (its libcuda is a stub).
        let driver_dirs = search_dirs(CudaLibrary::Driver, &e);
        assert_eq!(driver_dirs[0], root.join("usr/local/nvidia/lib64"));
        assert!(
            driver_dirs
                .iter()
                .all(|d| !d.starts_with(root.join("home")))
        );
    }

    #[test]
    fn the_first_folder_wins_and_within_it_the_newest_major() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path();
        touch(&root.join("usr/local/cuda/lib64/libnvrtc.so"));
        touch(&root.join("usr/local/cuda/lib64/libnvrtc.so.12"));
        touch(&root.join("usr/local/cuda/lib64/libnvrtc.so.13"));
        touch(&root.join("home/lib64/libnvrtc.so.12"));
        let mut e = env(root);
        e.cuda_home = Some(root.join("home"));
        let files = candidate_files(CudaLibrary::Nvrtc, &e, Some(13));
        assert_eq!(
            files,
            [
                root.join("home/lib64/libnvrtc.so.12"),
                root.join("usr/local/cuda/lib64/libnvrtc.so.13"),
                root.join("usr/local/cuda/lib64/libnvrtc.so.12"),
                root.join("usr/local/cuda/lib64/libnvrtc.so"),
            ]
        );
        // A CUDA 12 driver never gets a CUDA 13 library.
        let files = candidate_files(CudaLibrary::Nvrtc, &e, Some(12));
        assert!(
            !files
                .iter()
                .any(|f| f.to_string_lossy().ends_with(".so.13"))
        );
    }

    #[test]
    fn the_dynamic_loader_is_asked_first() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path();
        touch(&root.join("usr/local/cuda/lib64/libnvrtc.so.13"));
        let mut opener = FakeOpener::default();
        opener.by_name.insert("libnvrtc.so.12".into());
        let found = find_and_open(CudaLibrary::Nvrtc, &env(root), Some(13), &mut opener).unwrap();
        assert!(found.by_loader);
        assert_eq!(found.path, Path::new("/loader/libnvrtc.so.12"));
        assert_eq!(opener.attempts, ["libnvrtc.so.13", "libnvrtc.so.12"]);
    }

    #[test]
    fn a_wheel_is_found_with_its_companions_opened_first() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path();
        let venv = root.join("venv");
        touch(&venv.join("bin/python3"));
        let lib = venv.join("lib/python3.12/site-packages/nvidia/cu13/lib");
        touch(&lib.join("libcublas.so.13"));
        touch(&lib.join("libcublasLt.so.13"));
        touch(&lib.join("libnvrtc.so.13"));
        touch(&lib.join("libnvrtc-builtins.so.13.0"));
        let mut e = env(root);
        e.path = Some(venv.join("bin").into_os_string());

        let mut opener = FakeOpener::default();
        let found = find_and_open(CudaLibrary::Cublas, &e, Some(13), &mut opener).unwrap();
        assert!(!found.by_loader);
        assert_eq!(found.path, lib.join("libcublas.so.13"));
        let tail = &opener.attempts[opener.attempts.len() - 2..];
        assert_eq!(
            tail,
            [
                lib.join("libcublasLt.so.13").to_string_lossy(),
                lib.join("libcublas.so.13").to_string_lossy()
            ]
        );

        let mut opener = FakeOpener::default();
        let found = find_and_open(CudaLibrary::Nvrtc, &e, Some(13), &mut opener).unwrap();
        assert_eq!(found.path, lib.join("libnvrtc.so.13"));
        assert!(
            opener.attempts.contains(
                &lib.join("libnvrtc-builtins.so.13.0")
                    .to_string_lossy()
                    .into_owned()
            )
        );
    }

    #[test]
    fn a_broken_file_is_skipped_and_named_in_the_error() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path();
        let broken = root.join("usr/local/cuda/lib64/libcublas.so.13");
        touch(&broken);
        touch(&root.join("usr/local/cuda/lib64/libcublas.so.12"));
        let mut opener = FakeOpener::default();
        opener.broken.insert(broken.clone());
        let found = find_and_open(CudaLibrary::Cublas, &env(root), None, &mut opener).unwrap();
        assert_eq!(
            found.path,
            root.join("usr/local/cuda/lib64/libcublas.so.12")
        );

        opener.broken.insert(found.path.clone());
        let err = find_and_open(CudaLibrary::Cublas, &env(root), None, &mut opener).unwrap_err();
        let text = err.to_string();
        assert!(text.starts_with("cuBLAS (libcublas)"), "{text}");
        assert!(
            text.contains("libcublas.so.13, libcublas.so.12, libcublas.so"),
            "{text}"
        );
        assert!(text.contains("usr/local/cuda/lib64"), "{text}");
        assert!(
            text.contains(&format!(
                "{} did not load: invalid ELF header",
                broken.display()
            )),
            "{text}"
        );
    }

    #[test]
    fn nothing_anywhere_is_a_typed_error_listing_the_search() {
        let tmp = tempfile::tempdir().unwrap();
        let err = find_and_open(
            CudaLibrary::Driver,
            &env(tmp.path()),
            None,
            &mut FakeOpener::default(),
        )
        .unwrap_err();
        match &err {
            Error::LibraryNotFound { library, searched } => {
                assert_eq!(*library, CudaLibrary::Driver);
                assert_eq!(searched.names, ["libcuda.so.1", "libcuda.so"]);
                assert!(searched.refused.is_empty());
            }
            other => panic!("{other}"),
        }
        assert!(
            err.to_string()
                .starts_with("no CUDA driver found: looked for libcuda.so.1")
        );
    }

    #[test]
    fn dlopen_refuses_an_empty_file_with_a_reason() {
        let tmp = tempfile::tempdir().unwrap();
        let fake = tmp.path().join("libnvrtc.so.13");
        touch(&fake);
        let err = DlOpener.open(&fake.to_string_lossy()).unwrap_err();
        assert!(err.contains("libnvrtc.so.13"), "{err}");
        assert!(DlOpener.open("libbigmodel-no-such-library.so.13").is_err());
    }

    #[test]
    fn dlopen_reports_the_path_of_what_the_loader_found() {
        // libc is loaded in every process: the loader answers by name with
        // its full path.
        let path = DlOpener.open("libc.so.6").unwrap();
        assert!(path.is_absolute(), "{}", path.display());
        assert!(
            path.to_string_lossy().contains("libc"),
            "{}",
            path.display()
        );
    }

    #[test]
    fn the_object_holding_a_symbol_is_the_file_that_defines_it() {
        // dlopen lives in libc (glibc 2.34+) or libdl: either way a loaded
        // shared object, never our own executable.
        let address = dlopen as *const () as usize;
        let libc = object_holding(address).unwrap();
        assert!(libc.to_string_lossy().contains(".so"), "{libc:?}");
        let ours = LoadedLibrary {
            library: CudaLibrary::Nvrtc,
            path: libc.clone(),
            by_loader: false,
        };
        assert_eq!(in_use(&ours, address), ours);
        let elsewhere = LoadedLibrary {
            path: PathBuf::from("/nowhere/libnvrtc.so.13"),
            ..ours.clone()
        };
        let used = in_use(&elsewhere, address);
        assert_eq!((used.path, used.by_loader), (libc, true));
    }

    #[test]
    fn a_library_newer_than_the_driver_is_refused_naming_the_file() {
        let by_name = LoadedLibrary {
            library: CudaLibrary::Nvrtc,
            path: PathBuf::from("/usr/local/cuda-14/lib64/libnvrtc.so"),
            by_loader: true,
        };
        let e = check_major(&by_name, 14, Some(13)).unwrap_err();
        for part in [
            "libnvrtc",
            "cuda-14/lib64/libnvrtc.so",
            "CUDA 14",
            "CUDA 13",
            "LD_LIBRARY_PATH",
        ] {
            assert!(e.contains(part), "{part} missing from: {e}");
        }
        assert!(check_major(&by_name, 13, Some(13)).is_ok());
        assert!(check_major(&by_name, 12, Some(13)).is_ok());
        assert!(check_major(&by_name, 14, None).is_ok());
        let ours = LoadedLibrary {
            by_loader: false,
            ..by_name
        };
        assert!(
            !check_major(&ours, 14, Some(13))
                .unwrap_err()
                .contains("LD_LIBRARY_PATH")
        );
    }
}
