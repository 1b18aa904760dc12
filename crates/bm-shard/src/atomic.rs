//! Atomic file writes, the one way this workspace puts a file on disk.
//!
//! A file is written to a fresh temporary name in its destination folder,
//! created exclusively (`O_CREAT | O_EXCL`: a name that already exists, a
//! planted symbolic link included, is never opened, so nothing is written
//! through a link), flushed to disk, and renamed over the destination (a
//! rename replaces a link at the destination rather than following it).
//! Readers see the old file or the new one, never a partial one. Callers
//! that write several files commit their index last.
//!
//! Temporary names are `.bigmodel-tmp-<pid>-<16 hex digits>`. A process
//! killed mid-write leaves one behind; the first write of a later process
//! into that folder removes such leftovers (see [`remove_stale_temps`]).

use std::collections::HashSet;
use std::fs::File;
use std::hash::{BuildHasher, Hasher};
use std::io::{self, BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::SystemTime;

use crate::Error;

/// Prefix of every temporary file or folder this crate creates.
const TEMP_PREFIX: &str = ".bigmodel-tmp-";

/// A file being written under a temporary name; see the module docs.
/// Dropping it before [`AtomicFile::commit`] removes the temporary file.
#[derive(Debug)]
pub struct AtomicFile {
    out: BufWriter<File>,
    temp: TempPath,
}

/// A temporary file that is complete and on disk, waiting to be renamed
/// into place; dropping it removes it. Holds no file descriptor, so a writer
/// can keep thousands of them until it commits.
#[derive(Debug)]
pub struct FinishedFile {
    temp: TempPath,
}

/// A temporary name, removed on drop unless it was renamed away.
#[derive(Debug)]
struct TempPath {
    path: PathBuf,
    dest: PathBuf,
    renamed: bool,
}

impl Drop for TempPath {
    fn drop(&mut self) {
        if !self.renamed {
            // Best effort: the caller is already reporting the error that
            // stopped the write.
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// Opens a temporary file for writing (tests substitute failing ones).
pub(crate) type Opener<'a> = &'a dyn Fn(&Path) -> io::Result<File>;

impl AtomicFile {
    /// Starts writing `dest`: creates a fresh temporary file beside it.
    pub fn create(dest: &Path) -> Result<AtomicFile, Error> {
        Self::create_with(dest, &open_exclusive)
    }

    /// [`AtomicFile::create`] with the temporary file opened by `open`
    /// (tests substitute a failing device).
    pub(crate) fn create_with(dest: &Path, open: Opener<'_>) -> Result<AtomicFile, Error> {
        let folder = parent_folder(dest);
        remove_stale_temps_once(folder);
        // A clash with an existing name (a leftover or a planted link) only
        // costs another random name.
        let mut attempts = 0;
        loop {
            let path = folder.join(temp_name());
            match open(&path) {
                Ok(file) => {
                    return Ok(AtomicFile {
                        out: BufWriter::with_capacity(1 << 20, file),
                        temp: TempPath {
                            path,
                            dest: dest.to_path_buf(),
                            renamed: false,
                        },
                    });
                }
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists && attempts < 16 => {
                    attempts += 1;
                }
                Err(e) => return Err(Error::io(dest, "creating a temporary file for", e)),
            }
        }
    }

    /// The file this will become.
    pub fn dest(&self) -> &Path {
        &self.temp.dest
    }

    /// Flushes the bytes to disk and closes the file; the result still has
    /// to be renamed into place.
    pub fn finish(self) -> Result<FinishedFile, Error> {
        let AtomicFile { out, temp } = self;
        let file = out
            .into_inner()
            .map_err(|e| Error::io(&temp.dest, "writing", e.into_error()))?;
        file.sync_all()
            .map_err(|e| Error::io(&temp.dest, "flushing", e))?;
        Ok(FinishedFile { temp })
    }

    /// Finishes the file and renames it into place. The rename is durable
    /// once the folder is flushed ([`sync_folder`]); [`write_atomic`], which
    /// writers use for an index, flushes it before and after its own rename,
    /// so an index reaches the disk after the files it names.
    pub fn commit(self) -> Result<(), Error> {
        self.finish()?.rename_into_place()
    }
}

impl Write for AtomicFile {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.out.write(buf)
    }

    fn write_all(&mut self, buf: &[u8]) -> io::Result<()> {
        self.out.write_all(buf)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.out.flush()
    }
}

impl FinishedFile {
    /// The file this will become.
    pub fn dest(&self) -> &Path {
        &self.temp.dest
    }

    /// Renames the temporary file over its destination (the folder is not
    /// flushed, see [`AtomicFile::commit`]).
    pub fn rename_into_place(mut self) -> Result<(), Error> {
        std::fs::rename(&self.temp.path, &self.temp.dest)
            .map_err(|e| Error::io(&self.temp.dest, "renaming a finished file to", e))?;
        self.temp.renamed = true;
        Ok(())
    }
}

/// Creates `path` for writing only if no file, folder or link of that name
/// exists (`O_CREAT | O_EXCL`, which never follows a link).
pub(crate) fn open_exclusive(path: &Path) -> io::Result<File> {
    File::options().write(true).create_new(true).open(path)
}

/// Writes `bytes` to `dest` atomically (see the module docs) and durably:
/// the folder is flushed before the rename (so files renamed into it
/// earlier reach the disk first, which is what makes an index written last
/// safe) and after it.
pub fn write_atomic(dest: &Path, bytes: &[u8]) -> Result<(), Error> {
    let mut file = AtomicFile::create(dest)?;
    file.write_all(bytes)
        .map_err(|e| Error::io(dest, "writing", e))?;
    let finished = file.finish()?;
    let folder = parent_folder(dest);
    sync_folder(folder)?;
    finished.rename_into_place()?;
    sync_folder(folder)
}

/// Creates a fresh, empty folder with a temporary name inside `parent`
/// (never an existing one, never through a link), for callers that build a
/// whole folder and rename it into place. Its name is recognised by
/// [`remove_stale_temps`] if the process dies before the rename.
pub fn create_temp_folder(parent: &Path) -> Result<PathBuf, Error> {
    remove_stale_temps_once(parent);
    let mut attempts = 0;
    loop {
        let path = parent.join(temp_name());
        match std::fs::create_dir(&path) {
            Ok(()) => return Ok(path),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists && attempts < 16 => {
                attempts += 1;
            }
            Err(e) => return Err(Error::io(parent, "creating a temporary folder in", e)),
        }
    }
}

/// Flushes a folder's entries (the renames in it) to disk. Where the
/// platform cannot open a folder for that, this does nothing.
pub fn sync_folder(folder: &Path) -> Result<(), Error> {
    #[cfg(unix)]
    {
        let dir = File::open(folder).map_err(|e| Error::io(folder, "opening", e))?;
        dir.sync_all()
            .map_err(|e| Error::io(folder, "flushing", e))?;
    }
    #[cfg(not(unix))]
    let _ = folder;
    Ok(())
}

/// Removes the temporary files and folders that a writer of this crate
/// left in `folder` when its process died: names this crate gives
/// temporaries (and the `.<name>.tmp<pid>` / `.<name>.dat.tmp` names of
/// earlier versions), last modified before this process started writing,
/// of a process that no longer runs (where `/proc` tells), and never a
/// symbolic link. Returns what was removed; failures are skipped, since a
/// leftover costs disk space, not correctness.
pub fn remove_stale_temps(folder: &Path) -> Vec<PathBuf> {
    let Ok(listing) = std::fs::read_dir(folder) else {
        return Vec::new();
    };
    let started = process_start();
    let mut removed = Vec::new();
    for entry in listing.flatten() {
        let name = entry.file_name();
        let Some(owner) = name.to_str().and_then(temp_owner) else {
            continue;
        };
        if owner.is_some_and(|pid| pid == std::process::id() || process_alive(pid)) {
            continue;
        }
        let path = entry.path();
        // symlink_metadata: a link is reported as a link, never followed.
        let Ok(meta) = std::fs::symlink_metadata(&path) else {
            continue;
        };
        if meta.modified().map_or(true, |m| m >= started) {
            continue;
        }
        let gone = if meta.file_type().is_file() {
            std::fs::remove_file(&path).is_ok()
        } else if meta.file_type().is_dir() {
            // remove_dir_all removes links inside without following them.
            std::fs::remove_dir_all(&path).is_ok()
        } else {
            false
        };
        if gone {
            removed.push(path);
        }
    }
    removed.sort();
    removed
}

/// Runs [`remove_stale_temps`] on the first write into `folder` by this
/// process; later writes skip the listing, so writing n files stays O(n).
fn remove_stale_temps_once(folder: &Path) {
    static CLEANED: Mutex<Option<HashSet<PathBuf>>> = Mutex::new(None);
    // Keyed by the path as given: another spelling of the same folder only
    // costs one more listing.
    let first = CLEANED
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
        .get_or_insert_with(HashSet::new)
        .insert(folder.to_path_buf());
    if first {
        remove_stale_temps(folder);
    }
}

/// When a temporary name is ours: `Some(owner pid)` when the name carries
/// one, `Some(None)` for the pid-less name of earlier versions, `None` for
/// any other name.
fn temp_owner(name: &str) -> Option<Option<u32>> {
    if let Some(rest) = name.strip_prefix(TEMP_PREFIX) {
        let (pid, random) = rest.split_once('-')?;
        let hex = random.len() == 16 && random.bytes().all(|b| b.is_ascii_hexdigit());
        return hex.then(|| pid.parse().ok()).flatten().map(Some);
    }
    // Earlier versions: `.<name>.tmp<pid>`, `.<name>.tmp-<pid>` and
    // `.<name>.dat.tmp`.
    let inner = name.strip_prefix('.')?;
    if inner.ends_with(".dat.tmp") && inner.len() > ".dat.tmp".len() {
        return Some(None);
    }
    let (stem, pid) = inner.rsplit_once(".tmp")?;
    let pid = pid.strip_prefix('-').unwrap_or(pid);
    if stem.is_empty() || pid.is_empty() || !pid.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    pid.parse().ok().map(Some)
}

/// False only when the process surely no longer runs: on Linux, no
/// `/proc/<pid>`; elsewhere every process counts as alive, and the age
/// rule alone decides.
fn process_alive(pid: u32) -> bool {
    if cfg!(target_os = "linux") && Path::new("/proc/self").exists() {
        Path::new("/proc").join(pid.to_string()).exists()
    } else {
        true
    }
}

/// The moment this process first wrote through this module.
fn process_start() -> SystemTime {
    static START: OnceLock<SystemTime> = OnceLock::new();
    *START.get_or_init(SystemTime::now)
}

/// A temporary name no other writer uses: pid, then 64 random bits from the
/// standard library's randomly keyed hasher.
fn temp_name() -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    process_start();
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
    let now = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    hasher.write_u128(now);
    format!(
        "{TEMP_PREFIX}{}-{:016x}",
        std::process::id(),
        hasher.finish()
    )
}

/// The folder holding `path` (`.` for a bare file name).
fn parent_folder(path: &Path) -> &Path {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn listing(dir: &Path) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }

    #[test]
    fn writes_replace_the_destination_and_leave_no_temporary() {
        let dir = tempfile::tempdir().unwrap();
        let dest = dir.path().join("a.json");
        write_atomic(&dest, b"one").unwrap();
        write_atomic(&dest, b"two").unwrap();
        assert_eq!(std::fs::read(&dest).unwrap(), b"two");
        assert_eq!(listing(dir.path()), ["a.json"]);
    }

    #[test]
    fn a_dropped_writer_removes_its_temporary() {
        let dir = tempfile::tempdir().unwrap();
        let mut f = AtomicFile::create(&dir.path().join("x")).unwrap();
        f.write_all(b"partial").unwrap();
        let finished = f.finish().unwrap();
        assert_eq!(listing(dir.path()).len(), 1);
        drop(finished);
        assert!(listing(dir.path()).is_empty());
    }

    #[cfg(unix)]
    #[test]
    fn links_at_the_destination_are_replaced_not_followed() {
        let dir = tempfile::tempdir().unwrap();
        let outside = tempfile::tempdir().unwrap();
        let victim = outside.path().join("victim");
        std::fs::write(&victim, b"keep").unwrap();
        let dest = dir.path().join("w.dat");
        std::os::unix::fs::symlink(&victim, &dest).unwrap();
        write_atomic(&dest, b"new").unwrap();
        assert_eq!(std::fs::read(&victim).unwrap(), b"keep");
        assert!(!std::fs::symlink_metadata(&dest).unwrap().is_symlink());
        assert_eq!(std::fs::read(&dest).unwrap(), b"new");
    }

    #[test]
    fn temporary_names_are_recognised() {
        let ours = temp_name();
        assert_eq!(temp_owner(&ours), Some(Some(std::process::id())));
        assert_eq!(
            temp_owner(".model-00001-of-00002.safetensors.tmp4242"),
            Some(Some(4242))
        );
        assert_eq!(temp_owner(".out.safetensors.tmp-17"), Some(Some(17)));
        assert_eq!(temp_owner(".w.dat.tmp"), Some(None));
        for other in [
            "model.safetensors",
            ".tmp12",
            ".x.tmp",
            ".x.tmpabc",
            ".dat.tmp",
            ".bigmodel-tmp-12-xyz",
            ".bigmodel-tmp-12-0123456789abcdeg",
        ] {
            assert_eq!(temp_owner(other), None, "{other}");
        }
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn stale_temporaries_of_dead_processes_are_removed() {
        let dir = tempfile::tempdir().unwrap();
        let old = SystemTime::now() - std::time::Duration::from_secs(3600);
        // pid 0 never names a user process: /proc/0 does not exist.
        let dead = dir.path().join(format!("{TEMP_PREFIX}0-0123456789abcdef"));
        let legacy = dir.path().join(".w.dat.tmp");
        let legacy_dir = dir.path().join(".tiny-v1.tmp-0");
        let alive = dir.path().join(format!("{TEMP_PREFIX}1-0123456789abcdef"));
        let recent = dir.path().join(".y.safetensors.tmp0");
        for p in [&dead, &legacy, &alive, &recent] {
            std::fs::write(p, b"x").unwrap();
        }
        std::fs::create_dir(&legacy_dir).unwrap();
        std::fs::write(legacy_dir.join("model.safetensors"), b"x").unwrap();
        let link = dir.path().join(".z.dat.tmp");
        std::os::unix::fs::symlink(&alive, &link).unwrap();
        for p in [&dead, &legacy, &legacy_dir, &alive] {
            File::options()
                .write(true)
                .open(p)
                .or_else(|_| File::open(p))
                .unwrap()
                .set_modified(old)
                .unwrap();
        }
        // `recent` is younger than this process's first write.
        let later = SystemTime::now() + std::time::Duration::from_secs(3600);
        File::options()
            .write(true)
            .open(&recent)
            .unwrap()
            .set_modified(later)
            .unwrap();
        process_start();
        let removed = remove_stale_temps(dir.path());
        assert_eq!(removed, {
            let mut v = vec![dead, legacy, legacy_dir];
            v.sort();
            v
        });
        // pid 1 (init) runs; the link is never touched; `recent` is new.
        assert!(alive.exists() && recent.exists());
        assert!(std::fs::symlink_metadata(&link).is_ok());
    }
}
