//! The on-disk cache of compiled GPU kernels, so a second start does not
//! run NVRTC again.
//!
//! An entry is named by the SHA-256 of everything that decides its bytes
//! (the kind of image, the kernel source, the compiler options, the NVRTC
//! version and the target architecture), so a changed input is a new
//! entry and never a stale hit. It lives in `$BIGMODEL_CACHE/kernels/`, or
//! `$XDG_CACHE_HOME/bigmodel/kernels/`, or `~/.cache/bigmodel/kernels/`.
//! Entries are written to an exclusive temporary file and renamed into
//! place, so a reader sees a whole entry or none; each carries a checksum
//! of its payload, so a truncated or corrupted entry is ignored (and
//! rewritten by the next compile). The cache is an optimisation: when it
//! cannot be read or written, kernels are compiled as if it were empty.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use crate::sha256::{Sha256, hex, sha256};

/// What a kernel image holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum ImageKind {
    /// Machine code for one architecture (`sm_XY`).
    Cubin,
    /// PTX for a virtual architecture (`compute_XY`), compiled by the
    /// driver when loaded.
    Ptx,
}

impl ImageKind {
    fn tag(self) -> u8 {
        match self {
            ImageKind::Cubin => 1,
            ImageKind::Ptx => 2,
        }
    }

    fn extension(self) -> &'static str {
        match self {
            ImageKind::Cubin => "cubin",
            ImageKind::Ptx => "ptx",
        }
    }
}

/// A compiled kernel module.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct KernelImage {
    pub kind: ImageKind,
    pub bytes: Vec<u8>,
}

/// Where an image came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Origin {
    /// Read from the disk cache.
    Cache,
    /// Compiled in this process.
    Compiled,
}

/// The environment variables that place the cache, passed in so tests
/// need no global state.
#[derive(Clone, Debug, Default)]
pub(crate) struct CacheEnv {
    /// `BIGMODEL_CACHE`: bigmodel's cache folder; kernels go in `kernels/`.
    pub bigmodel_cache: Option<PathBuf>,
    /// `XDG_CACHE_HOME`.
    pub xdg_cache_home: Option<PathBuf>,
    /// `HOME`.
    pub home: Option<PathBuf>,
}

impl CacheEnv {
    pub(crate) fn from_process() -> CacheEnv {
        let var = |name: &str| {
            std::env::var_os(name)
                .filter(|v| !v.is_empty())
                .map(PathBuf::from)
        };
        CacheEnv {
            bigmodel_cache: var("BIGMODEL_CACHE"),
            xdg_cache_home: var("XDG_CACHE_HOME"),
            home: var("HOME"),
        }
    }

    /// The kernel cache folder, `None` when no variable names a place.
    pub(crate) fn kernel_dir(&self) -> Option<PathBuf> {
        if let Some(dir) = &self.bigmodel_cache {
            return Some(dir.join("kernels"));
        }
        let cache = match (&self.xdg_cache_home, &self.home) {
            // XDG says a relative XDG_CACHE_HOME is to be ignored.
            (Some(xdg), _) if xdg.is_absolute() => xdg.clone(),
            (_, Some(home)) => home.join(".cache"),
            _ => return None,
        };
        Some(cache.join("bigmodel").join("kernels"))
    }
}

/// The cache key of an image: SHA-256 over its kind and every input,
/// each length-prefixed so no two different lists hash alike.
pub(crate) fn key(kind: ImageKind, inputs: &[&[u8]]) -> String {
    let mut h = Sha256::new();
    h.update(&[kind.tag()]);
    for input in inputs {
        h.update(&(input.len() as u64).to_le_bytes());
        h.update(input);
    }
    hex(&h.finish())
}

const MAGIC: &[u8; 8] = b"BMKERN01";
/// Magic, kind and reserved bytes, payload length, payload checksum.
const HEADER: usize = 8 + 8 + 8 + 32;

/// A folder of cached kernel images.
#[derive(Clone, Debug)]
pub(crate) struct KernelCache {
    dir: PathBuf,
}

impl KernelCache {
    pub(crate) fn new(dir: PathBuf) -> KernelCache {
        KernelCache { dir }
    }

    fn path(&self, kind: ImageKind, key: &str) -> PathBuf {
        self.dir.join(format!("{key}.{}", kind.extension()))
    }

    /// The entry `key`, when it is there and whole.
    pub(crate) fn read(&self, kind: ImageKind, key: &str) -> Option<KernelImage> {
        let data = fs::read(self.path(kind, key)).ok()?;
        let (header, payload) = data.split_at_checked(HEADER)?;
        let len = u64::from_le_bytes(header[16..24].try_into().ok()?);
        let whole = &header[..8] == MAGIC
            && header[8] == kind.tag()
            && len == payload.len() as u64
            && header[24..56] == sha256(payload);
        whole.then(|| KernelImage {
            kind,
            bytes: payload.to_vec(),
        })
    }

    /// Writes `image` as entry `key`: to an exclusive temporary file in the
    /// cache folder, then renamed over the entry.
    pub(crate) fn write(&self, key: &str, image: &KernelImage) -> std::io::Result<()> {
        fs::create_dir_all(&self.dir)?;
        let target = self.path(image.kind, key);
        let (tmp, mut file) = exclusive_temp(&self.dir, key)?;
        let written = (|| {
            let mut header = Vec::with_capacity(HEADER);
            header.extend_from_slice(MAGIC);
            header.extend_from_slice(&[image.kind.tag(), 0, 0, 0, 0, 0, 0, 0]);
            header.extend_from_slice(&(image.bytes.len() as u64).to_le_bytes());
            header.extend_from_slice(&sha256(&image.bytes));
            file.write_all(&header)?;
            file.write_all(&image.bytes)?;
            file.sync_all()?;
            drop(file);
            fs::rename(&tmp, &target)
        })();
        if written.is_err() {
            let _ = fs::remove_file(&tmp);
        }
        written
    }

    /// The entry `key`, or `compile`'s image, which is then written to the
    /// cache (a write that fails only costs a recompile next time).
    pub(crate) fn get_or_compile(
        &self,
        kind: ImageKind,
        key: &str,
        compile: impl FnOnce() -> Result<KernelImage, String>,
    ) -> Result<(KernelImage, Origin), String> {
        if let Some(image) = self.read(kind, key) {
            return Ok((image, Origin::Cache));
        }
        let image = compile()?;
        let _ = self.write(key, &image);
        Ok((image, Origin::Compiled))
    }
}

/// A new file `.<key>.<pid>.<n>.tmp` in `dir`, created exclusively so two
/// writers (threads or processes) never share one.
fn exclusive_temp(dir: &Path, key: &str) -> std::io::Result<(PathBuf, fs::File)> {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    loop {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let path = dir.join(format!(".{key}.{}.{n}.tmp", std::process::id()));
        match fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&path)
        {
            Ok(f) => return Ok((path, f)),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    fn image(kind: ImageKind, text: &str) -> KernelImage {
        KernelImage {
            kind,
            bytes: text.as_bytes().to_vec(),
        }
    }

    #[test]
    fn the_folder_follows_the_environment() {
        let env = |b: Option<&str>, x: Option<&str>, h: Option<&str>| CacheEnv {
            bigmodel_cache: b.map(PathBuf::from),
            xdg_cache_home: x.map(PathBuf::from),
            home: h.map(PathBuf::from),
        };
        let dir = |e: CacheEnv| e.kernel_dir().map(|p| p.display().to_string());
        assert_eq!(
            dir(env(Some("/c"), Some("/x"), Some("/h"))).as_deref(),
            Some("/c/kernels")
        );
        assert_eq!(
            dir(env(None, Some("/x"), Some("/h"))).as_deref(),
            Some("/x/bigmodel/kernels")
        );
        assert_eq!(
            dir(env(None, Some("relative"), Some("/h"))).as_deref(),
            Some("/h/.cache/bigmodel/kernels")
        );
        assert_eq!(
            dir(env(None, None, Some("/h"))).as_deref(),
            Some("/h/.cache/bigmodel/kernels")
        );
        assert_eq!(dir(env(None, None, None)), None);
    }

    #[test]
    fn every_input_changes_the_key() {
        let base: [&[u8]; 4] = [b"src", b"--fmad=false", b"13.0", b"sm_90"];
        let k = key(ImageKind::Cubin, &base);
        assert_eq!(k.len(), 64);
        assert_eq!(k, key(ImageKind::Cubin, &base), "deterministic");
        assert_ne!(k, key(ImageKind::Ptx, &base));
        for i in 0..base.len() {
            let mut changed = base;
            changed[i] = b"other";
            assert_ne!(k, key(ImageKind::Cubin, &changed), "input {i}");
        }
        // Length prefixes: moving a byte between inputs is another key.
        assert_ne!(
            key(ImageKind::Cubin, &[b"ab", b"c"]),
            key(ImageKind::Cubin, &[b"a", b"bc"])
        );
    }

    #[test]
    fn a_second_start_reads_what_the_first_compiled() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("kernels");
        let compiles = Cell::new(0);
        let compile = || {
            compiles.set(compiles.get() + 1);
            Ok(image(ImageKind::Cubin, "machine code"))
        };
        let k = key(ImageKind::Cubin, &[b"x"]);
        let (a, origin) = KernelCache::new(dir.clone())
            .get_or_compile(ImageKind::Cubin, &k, compile)
            .unwrap();
        assert_eq!(origin, Origin::Compiled);
        // Another process: a new cache value over the same folder.
        let (b, origin) = KernelCache::new(dir.clone())
            .get_or_compile(ImageKind::Cubin, &k, compile)
            .unwrap();
        assert_eq!(origin, Origin::Cache);
        assert_eq!((a, compiles.get()), (b, 1));
        // Only the entry is left: no temporary file.
        let names: Vec<String> = fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names, [format!("{k}.cubin")]);
    }

    #[test]
    fn a_damaged_entry_is_ignored_and_rewritten() {
        let tmp = tempfile::tempdir().unwrap();
        let cache = KernelCache::new(tmp.path().to_path_buf());
        let k = key(ImageKind::Ptx, &[b"y"]);
        let good = image(ImageKind::Ptx, ".version 8.0 ...");
        cache.write(&k, &good).unwrap();
        let path = cache.path(ImageKind::Ptx, &k);
        let whole = fs::read(&path).unwrap();
        assert_eq!(cache.read(ImageKind::Ptx, &k), Some(good.clone()));
        // The other kind under the same key is not this entry.
        assert_eq!(cache.read(ImageKind::Cubin, &k), None);

        let mut flipped = whole.clone();
        *flipped.last_mut().unwrap() ^= 1;
        let mut wrong_magic = whole.clone();
        wrong_magic[0] = b'X';
        let mut wrong_kind = whole.clone();
        wrong_kind[8] = ImageKind::Cubin.tag();
        for damaged in [
            flipped,
            wrong_magic,
            wrong_kind,
            whole[..whole.len() - 1].to_vec(),
            whole[..HEADER - 1].to_vec(),
            Vec::new(),
        ] {
            fs::write(&path, &damaged).unwrap();
            assert_eq!(cache.read(ImageKind::Ptx, &k), None);
            let (got, origin) = cache
                .get_or_compile(ImageKind::Ptx, &k, || Ok(good.clone()))
                .unwrap();
            assert_eq!((got, origin), (good.clone(), Origin::Compiled));
            assert_eq!(fs::read(&path).unwrap(), whole, "rewritten whole");
        }
    }

    #[test]
    fn an_unusable_folder_only_costs_a_compile() {
        let tmp = tempfile::tempdir().unwrap();
        // A file where the folder should be: nothing can be created in it.
        let blocker = tmp.path().join("kernels");
        fs::write(&blocker, b"not a folder").unwrap();
        let cache = KernelCache::new(blocker.clone());
        let k = key(ImageKind::Cubin, &[b"z"]);
        assert!(cache.write(&k, &image(ImageKind::Cubin, "c")).is_err());
        let (got, origin) = cache
            .get_or_compile(ImageKind::Cubin, &k, || Ok(image(ImageKind::Cubin, "c")))
            .unwrap();
        assert_eq!(
            (got.bytes.as_slice(), origin),
            (&b"c"[..], Origin::Compiled)
        );
        // A compile error is the caller's, unchanged.
        let err = cache
            .get_or_compile(ImageKind::Cubin, &k, || Err("nvrtc said no".into()))
            .unwrap_err();
        assert_eq!(err, "nvrtc said no");
        assert_eq!(fs::read(&blocker).unwrap(), b"not a folder");
    }

    #[test]
    fn concurrent_writers_leave_one_whole_entry() {
        let tmp = tempfile::tempdir().unwrap();
        let cache = KernelCache::new(tmp.path().to_path_buf());
        let k = key(ImageKind::Cubin, &[b"w"]);
        let img = image(ImageKind::Cubin, &"x".repeat(100_000));
        std::thread::scope(|s| {
            for _ in 0..8 {
                s.spawn(|| cache.write(&k, &img).unwrap());
            }
        });
        assert_eq!(cache.read(ImageKind::Cubin, &k), Some(img));
        assert_eq!(fs::read_dir(tmp.path()).unwrap().count(), 1);
    }
}
