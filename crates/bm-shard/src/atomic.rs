//! Atomic file writes, the one way this workspace puts a file on disk, and
//! the temporaries they leave when a process dies or is interrupted.
//!
//! A file is written to a fresh temporary name in its destination folder,
//! created exclusively (`O_CREAT | O_EXCL`: a name that already exists, a
//! planted symbolic link included, is never opened, so nothing is written
//! through a link), flushed to disk, and renamed over the destination (a
//! rename replaces a link at the destination rather than following it).
//! Readers see the old file or the new one, never a partial one. Callers
//! that write several files commit their index last.
//!
//! Liveness is told by locks, never by process ids. A process's temporaries
//! in a folder are named `.bigmodel-tmp-<writer>-<n>`, `<writer>` being 16
//! random hex digits for which the process holds an exclusive advisory lock
//! (`flock`) on `.bigmodel-tmp-<writer>.lock` in the same folder for as
//! long as one of those temporaries exists (the file is removed with the
//! last). A lock dies with its process, whatever pid namespace, container
//! or host of a shared volume the process runs in, so a temporary is stale
//! exactly when nobody holds its writer's lock: the first write of a
//! process into a folder removes such leftovers ([`remove_stale_temps`]).
//! Names that carry no lock (those of earlier versions, or any name on a
//! file system without locks) are stale only after [`STALE_AGE`].
//!
//! Every temporary that exists is also listed in this process's in-flight
//! registry, so that an interrupted command can remove them before it exits
//! ([`remove_in_flight`]). Creating and renaming a temporary happen under
//! the registry's lock, which [`remove_in_flight`] never gives back: once it
//! ran, no temporary can appear or be committed.

use std::collections::{HashMap, HashSet};
use std::fs::{File, Metadata, TryLockError};
use std::hash::{BuildHasher, Hasher};
use std::io::{self, BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{LazyLock, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, SystemTime};

use bm_tensor::MmapView;

use crate::Error;

/// Prefix of every temporary file or folder this crate creates.
pub(crate) const TEMP_PREFIX: &str = ".bigmodel-tmp-";
/// Suffix of a writer's lock file (after [`TEMP_PREFIX`] and its id).
const LOCK_SUFFIX: &str = ".lock";
/// Age after which a temporary whose writer cannot be asked (no lock: a name
/// of an earlier version, or a file system without locks) counts as stale.
pub const STALE_AGE: Duration = Duration::from_secs(6 * 3600);

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

/// A fresh folder under a temporary name (see [`create_temp_folder`]),
/// removed with its contents on drop unless it was renamed away.
#[derive(Debug)]
pub struct TempFolder {
    temp: TempPath,
}

/// A registered temporary name, removed on drop unless it was renamed away.
#[derive(Debug)]
struct TempPath {
    path: PathBuf,
    dest: PathBuf,
    /// The folder as given, the key of its writer in the registry.
    folder: PathBuf,
    renamed: bool,
}

impl Drop for TempPath {
    fn drop(&mut self) {
        if !self.renamed {
            // Best effort: the caller is already reporting the error that
            // stopped the write.
            let _ = release(&self.folder, &self.path, remove_any);
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
        let (path, file) = create_temp(folder, &|path| open(path))
            .map_err(|e| Error::io(dest, "creating a temporary file for", e))?;
        Ok(AtomicFile {
            out: BufWriter::with_capacity(1 << 20, file),
            temp: TempPath {
                path,
                dest: dest.to_path_buf(),
                folder: folder.to_path_buf(),
                renamed: false,
            },
        })
    }

    /// The file this will become.
    pub fn dest(&self) -> &Path {
        &self.temp.dest
    }

    /// Flushes the bytes to disk and closes the file; the result still has
    /// to be renamed into place.
    pub fn finish(self) -> Result<FinishedFile, Error> {
        let (_, temp) = self.flush_to_disk()?;
        Ok(FinishedFile { temp })
    }

    fn flush_to_disk(self) -> Result<(File, TempPath), Error> {
        let AtomicFile { out, temp } = self;
        let file = out
            .into_inner()
            .map_err(|e| Error::io(&temp.dest, "writing", e.into_error()))?;
        file.sync_all()
            .map_err(|e| Error::io(&temp.dest, "flushing", e))?;
        Ok((file, temp))
    }

    /// Finishes the file and renames it into place. The rename is durable
    /// once the folder is flushed ([`sync_folder`]); [`write_atomic`], which
    /// writers use for an index, flushes it before and after its own rename,
    /// so an index reaches the disk after the files it names.
    pub fn commit(self) -> Result<(), Error> {
        self.finish()?.rename_into_place()
    }

    /// [`AtomicFile::commit`], then maps the file read-only through the
    /// descriptor it was written with: the bytes mapped are the ones this
    /// process wrote, whatever another process renames over the name
    /// afterwards (mapping the name again could pick up its file).
    pub fn commit_and_map(self) -> Result<MmapView, Error> {
        let (file, temp) = self.flush_to_disk()?;
        let dest = temp.dest.clone();
        FinishedFile { temp }.rename_into_place()?;
        MmapView::map_file(&file, &dest).map_err(|e| match e {
            bm_tensor::Error::Io { source, .. } => Error::io(&dest, "mapping", source),
            other => Error::io(&dest, "mapping", io::Error::other(other.to_string())),
        })
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
        self.temp.rename_to_dest()
    }
}

impl TempPath {
    fn rename_to_dest(&mut self) -> Result<(), Error> {
        let dest = self.dest.clone();
        release(&self.folder, &self.path, |path| {
            std::fs::rename(path, &dest)
        })
        .map_err(|e| Error::io(&self.dest, "renaming a finished file to", e))?;
        self.renamed = true;
        Ok(())
    }
}

impl TempFolder {
    /// The folder.
    pub fn path(&self) -> &Path {
        &self.temp.path
    }

    /// Renames the folder to `dest` (which must not exist, or be an empty
    /// folder). On failure the temporary folder stays, and is removed on
    /// drop.
    pub fn rename_to(mut self, dest: &Path) -> Result<(), Error> {
        self.temp.dest = dest.to_path_buf();
        self.temp.rename_to_dest()
    }
}

/// Creates `path` for writing only if no file, folder or link of that name
/// exists (`O_CREAT | O_EXCL`, which never follows a link). It is opened
/// for reading too, so that what is written can be mapped through it.
pub(crate) fn open_exclusive(path: &Path) -> io::Result<File> {
    File::options()
        .read(true)
        .write(true)
        .create_new(true)
        .open(path)
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
/// whole folder and rename it into place ([`TempFolder::rename_to`]), or
/// need scratch space that an interrupt or a later writer removes.
pub fn create_temp_folder(parent: &Path) -> Result<TempFolder, Error> {
    let (path, ()) = create_temp(parent, &|path| std::fs::create_dir(path))
        .map_err(|e| Error::io(parent, "creating a temporary folder in", e))?;
    Ok(TempFolder {
        temp: TempPath {
            dest: path.clone(),
            path,
            folder: parent.to_path_buf(),
            renamed: false,
        },
    })
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

/// Removes every temporary of this process that exists (files and folders,
/// and its writers' lock files), and the lock files of the folders it holds
/// ([`crate::FolderLock`]), then keeps the registry locked for good so that
/// no temporary is created or committed after it: for a command that was
/// interrupted, which exits at once afterwards. Call it from an ordinary
/// thread (a signal handler must not take locks or allocate).
pub fn remove_in_flight() {
    let mut registry = registry();
    for (path, _) in registry.temps.drain() {
        let _ = remove_any(&path);
    }
    for (_, writer) in registry.writers.drain() {
        let _ = std::fs::remove_file(&writer.lock_path);
    }
    crate::lock::remove_held_lock_files();
    std::mem::forget(registry);
}

/// Removes the temporary files and folders that writers left in `folder`
/// when their processes died: names this crate gives temporaries whose
/// writer's lock nobody holds (the lock file is removed too), and names
/// without a lock (the `.<name>.tmp<pid>`, `.<name>.dat.tmp` and
/// `.bigmodel-tmp-<pid>-<hex>` names of earlier versions, or any name where
/// the file system has no locks) older than [`STALE_AGE`]. Never a
/// symbolic link, never a temporary of this process. Returns what was
/// removed; failures are skipped, since a leftover costs disk space, not
/// correctness.
pub fn remove_stale_temps(folder: &Path) -> Vec<PathBuf> {
    let Ok(listing) = std::fs::read_dir(folder) else {
        return Vec::new();
    };
    let mut by_writer: HashMap<String, Vec<PathBuf>> = HashMap::new();
    let mut lockless = Vec::new();
    for entry in listing.flatten() {
        let name = entry.file_name();
        match name.to_str().map(temp_kind) {
            Some(Some(TempKind::Writer(id))) => {
                by_writer.entry(id).or_default().push(entry.path());
            }
            Some(Some(TempKind::Lockless)) => lockless.push(entry.path()),
            _ => {}
        }
    }
    // Taken after the listing: a writer of this process whose temporary
    // was listed is registered by now (or gone with its temporaries).
    let ours: HashSet<String> = registry().writers.values().map(|w| w.id.clone()).collect();
    let mut removed = Vec::new();
    let mut remove = |path: PathBuf, only_if_old: bool| {
        // symlink_metadata: a link is reported as a link, never followed.
        let Ok(meta) = std::fs::symlink_metadata(&path) else {
            return;
        };
        if (!only_if_old || is_old(&meta)) && remove_entry(&path, &meta) {
            removed.push(path);
        }
    };
    for path in lockless {
        remove(path, true);
    }
    for (id, mut paths) in by_writer {
        if ours.contains(&id) {
            continue;
        }
        let lock_path = folder.join(lock_file_name(&id));
        match writer_state(&lock_path) {
            WriterState::Alive => {}
            WriterState::Unknown => paths.into_iter().for_each(|p| remove(p, true)),
            WriterState::Gone(held) => {
                // The lock file last: while it exists and is held, no other
                // cleaner takes this writer for dead at the same time.
                paths.sort_by_key(|p| *p == lock_path);
                paths.into_iter().for_each(|p| remove(p, false));
                drop(held);
            }
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
        .unwrap_or_else(PoisonError::into_inner)
        .get_or_insert_with(HashSet::new)
        .insert(folder.to_path_buf());
    if first {
        remove_stale_temps(folder);
    }
}

/// This process's temporaries and the writers they belong to.
#[derive(Default)]
struct Registry {
    /// Every temporary that exists.
    temps: HashMap<PathBuf, ()>,
    /// This process's writer in each folder (as given) where it has
    /// temporaries.
    writers: HashMap<PathBuf, Writer>,
}

/// A writer id of this process in one folder, and its held lock.
struct Writer {
    id: String,
    lock_path: PathBuf,
    /// Holds the lock; closed when the writer retires.
    _lock: File,
    /// Temporaries of this writer that exist.
    live: usize,
    /// The number of the next temporary name.
    next: u64,
}

fn registry() -> MutexGuard<'static, Registry> {
    static REGISTRY: LazyLock<Mutex<Registry>> = LazyLock::new(Mutex::default);
    REGISTRY.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Creates a fresh temporary in `folder` with `make` (which must fail with
/// `AlreadyExists` rather than open an existing name) and registers it.
fn create_temp<T>(
    folder: &Path,
    make: &dyn Fn(&Path) -> io::Result<T>,
) -> io::Result<(PathBuf, T)> {
    remove_stale_temps_once(folder);
    let mut registry = registry();
    let registry = &mut *registry;
    let key = folder.to_path_buf();
    if !registry.writers.contains_key(&key) {
        registry.writers.insert(key.clone(), Writer::start(folder)?);
    }
    let writer = registry.writers.get_mut(&key).expect("inserted above");
    // A clash with an existing name (a planted file or link) only costs
    // another name.
    for _ in 0..16 {
        let path = folder.join(format!("{TEMP_PREFIX}{}-{:x}", writer.id, writer.next));
        writer.next += 1;
        match make(&path) {
            Ok(made) => {
                writer.live += 1;
                registry.temps.insert(path.clone(), ());
                return Ok((path, made));
            }
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
            Err(e) => {
                retire_if_idle(&mut registry.writers, &key);
                return Err(e);
            }
        }
    }
    retire_if_idle(&mut registry.writers, &key);
    Err(io::Error::new(
        io::ErrorKind::AlreadyExists,
        "16 fresh temporary names were all taken",
    ))
}

/// Does `action` (a rename away, a removal) to the registered temporary
/// `path` of `folder` under the registry's lock, then forgets it; the
/// folder's writer retires with its last temporary. After
/// [`remove_in_flight`] this blocks until the process exits.
fn release(
    folder: &Path,
    path: &Path,
    action: impl FnOnce(&Path) -> io::Result<()>,
) -> io::Result<()> {
    let mut registry = registry();
    action(path)?;
    if registry.temps.remove(path).is_some() {
        let key = folder.to_path_buf();
        if let Some(writer) = registry.writers.get_mut(&key) {
            writer.live = writer.live.saturating_sub(1);
        }
        retire_if_idle(&mut registry.writers, &key);
    }
    Ok(())
}

/// Removes the writer of `folder` when it has no temporary left: its lock
/// file first, then its lock (closing the file).
fn retire_if_idle(writers: &mut HashMap<PathBuf, Writer>, folder: &Path) {
    if writers.get(folder).is_some_and(|w| w.live == 0)
        && let Some(writer) = writers.remove(folder)
    {
        let _ = std::fs::remove_file(&writer.lock_path);
    }
}

impl Writer {
    /// A fresh writer id in `folder`, its lock file created and locked.
    fn start(folder: &Path) -> io::Result<Writer> {
        for _ in 0..16 {
            let id = format!("{:016x}", random_u64());
            let lock_path = folder.join(lock_file_name(&id));
            let lock = match open_exclusive(&lock_path) {
                Ok(file) => file,
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(e),
            };
            match lock.try_lock() {
                Ok(()) => {}
                // A cleaner opened the new file and took it for a dead
                // writer's: it removes it; take another id.
                Err(TryLockError::WouldBlock) => continue,
                // No locks on this file system: temporaries still work,
                // and the age rule alone tells when they are stale.
                Err(TryLockError::Error(e)) if locks_unsupported(&e) => {}
                Err(TryLockError::Error(e)) => {
                    let _ = std::fs::remove_file(&lock_path);
                    return Err(e);
                }
            }
            // A cleaner that locked it first and then let go removed it.
            if !is_same_file(&lock, &lock_path) {
                continue;
            }
            return Ok(Writer {
                id,
                lock_path,
                _lock: lock,
                live: 0,
                next: 0,
            });
        }
        Err(io::Error::new(
            io::ErrorKind::AlreadyExists,
            "16 fresh writer lock names were all taken",
        ))
    }
}

/// What asking a writer's lock tells.
enum WriterState {
    /// Some process holds the lock.
    Alive,
    /// Nobody does (the file is held by the caller until dropped), or the
    /// lock file is gone.
    Gone(Option<File>),
    /// The lock cannot be asked (no locks here, not a file).
    Unknown,
}

fn writer_state(lock_path: &Path) -> WriterState {
    match std::fs::symlink_metadata(lock_path) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => return WriterState::Gone(None),
        Ok(meta) if meta.is_file() => {}
        _ => return WriterState::Unknown,
    }
    // Read and write: a lock emulated with fcntl (NFS) needs both.
    let Ok(file) = File::options().read(true).write(true).open(lock_path) else {
        return WriterState::Unknown;
    };
    match file.try_lock() {
        Ok(()) => WriterState::Gone(Some(file)),
        Err(TryLockError::WouldBlock) => WriterState::Alive,
        Err(TryLockError::Error(_)) => WriterState::Unknown,
    }
}

/// True when the file system does not do advisory locks.
pub(crate) fn locks_unsupported(e: &io::Error) -> bool {
    e.kind() == io::ErrorKind::Unsupported || matches!(e.raw_os_error(), Some(37 | 38 | 95))
}

/// Whether the open `file` is the one at `path` now (not a link, not
/// replaced or removed since it was opened). Always true where files carry
/// no identity.
pub(crate) fn is_same_file(file: &File, path: &Path) -> bool {
    match (file.metadata(), std::fs::symlink_metadata(path)) {
        (Ok(a), Ok(b)) => b.is_file() && file_id(&a) == file_id(&b),
        _ => false,
    }
}

/// Device and inode (Unix): what makes a file the same file.
#[cfg(unix)]
fn file_id(meta: &Metadata) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    Some((meta.dev(), meta.ino()))
}

#[cfg(not(unix))]
fn file_id(_: &Metadata) -> Option<(u64, u64)> {
    None
}

fn is_old(meta: &Metadata) -> bool {
    meta.modified()
        .ok()
        .and_then(|m| SystemTime::now().duration_since(m).ok())
        .is_some_and(|age| age >= STALE_AGE)
}

/// Removes a file or a folder (with its contents), never following a link;
/// true when it is gone.
fn remove_entry(path: &Path, meta: &Metadata) -> bool {
    if meta.file_type().is_file() {
        std::fs::remove_file(path).is_ok()
    } else if meta.file_type().is_dir() {
        // remove_dir_all removes links inside without following them.
        std::fs::remove_dir_all(path).is_ok()
    } else {
        false
    }
}

/// Removes a temporary file or folder; one already gone is fine.
fn remove_any(path: &Path) -> io::Result<()> {
    let removed = match std::fs::symlink_metadata(path) {
        Ok(meta) if meta.is_dir() => std::fs::remove_dir_all(path),
        Ok(_) => std::fs::remove_file(path),
        Err(e) => Err(e),
    };
    match removed {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

/// What a name in a folder is to the stale-temporary rule.
#[derive(Debug, PartialEq, Eq)]
enum TempKind {
    /// A temporary or the lock file of writer `id`.
    Writer(String),
    /// A temporary name that carries no lock.
    Lockless,
}

fn lock_file_name(id: &str) -> String {
    format!("{TEMP_PREFIX}{id}{LOCK_SUFFIX}")
}

/// What `name` is if it is one of ours; `None` for any other name.
fn temp_kind(name: &str) -> Option<TempKind> {
    let is_hex = |s: &str, n: std::ops::RangeInclusive<usize>| {
        n.contains(&s.len()) && s.bytes().all(|b| b.is_ascii_hexdigit())
    };
    if let Some(rest) = name.strip_prefix(TEMP_PREFIX) {
        if let Some(id) = rest.strip_suffix(LOCK_SUFFIX) {
            return is_hex(id, 16..=16).then(|| TempKind::Writer(id.to_string()));
        }
        let (first, second) = rest.split_once('-')?;
        if is_hex(first, 16..=16) && is_hex(second, 1..=16) {
            return Some(TempKind::Writer(first.to_string()));
        }
        // The previous version's `<pid>-<16 hex digits>`.
        let pid =
            !first.is_empty() && first.len() <= 10 && first.bytes().all(|b| b.is_ascii_digit());
        return (pid && is_hex(second, 16..=16)).then_some(TempKind::Lockless);
    }
    // Earlier versions: `.<name>.tmp<pid>`, `.<name>.tmp-<pid>` and
    // `.<name>.dat.tmp`.
    let inner = name.strip_prefix('.')?;
    if inner.ends_with(".dat.tmp") && inner.len() > ".dat.tmp".len() {
        return Some(TempKind::Lockless);
    }
    let (stem, pid) = inner.rsplit_once(".tmp")?;
    let pid = pid.strip_prefix('-').unwrap_or(pid);
    let digits = !pid.is_empty() && pid.bytes().all(|b| b.is_ascii_digit());
    (!stem.is_empty() && digits).then_some(TempKind::Lockless)
}

/// 64 random bits from the standard library's randomly keyed hasher.
pub(crate) fn random_u64() -> u64 {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
    let now = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    hasher.write_u128(now);
    hasher.write_u32(std::process::id());
    hasher.finish()
}

/// The folder holding `path` (`.` for a bare file name).
pub(crate) fn parent_folder(path: &Path) -> &Path {
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

    fn age(path: &Path, by: Duration) {
        File::options()
            .write(true)
            .open(path)
            .or_else(|_| File::open(path))
            .unwrap()
            .set_modified(SystemTime::now() - by)
            .unwrap();
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
    fn a_dropped_writer_removes_its_temporary_and_its_lock() {
        let dir = tempfile::tempdir().unwrap();
        let mut f = AtomicFile::create(&dir.path().join("x")).unwrap();
        f.write_all(b"partial").unwrap();
        let finished = f.finish().unwrap();
        let names = listing(dir.path());
        assert_eq!(names.len(), 2, "{names:?}");
        assert!(names.iter().all(|n| temp_kind(n).is_some()), "{names:?}");
        drop(finished);
        assert!(listing(dir.path()).is_empty());
    }

    #[test]
    fn a_committed_file_is_mapped_through_its_own_descriptor() {
        let dir = tempfile::tempdir().unwrap();
        let dest = dir.path().join("w.dat");
        let mut f = AtomicFile::create(&dest).unwrap();
        f.write_all(b"mine").unwrap();
        let view = f.commit_and_map().unwrap();
        // Another writer's bytes renamed over the name afterwards.
        write_atomic(&dest, b"them").unwrap();
        assert_eq!(view.as_bytes(), b"mine");
        assert_eq!(std::fs::read(&dest).unwrap(), b"them");
    }

    #[test]
    fn a_temporary_folder_is_removed_unless_renamed() {
        let dir = tempfile::tempdir().unwrap();
        let temp = create_temp_folder(dir.path()).unwrap();
        std::fs::write(temp.path().join("probe"), b"x").unwrap();
        drop(temp);
        assert!(listing(dir.path()).is_empty());
        let temp = create_temp_folder(dir.path()).unwrap();
        std::fs::write(temp.path().join("f"), b"x").unwrap();
        temp.rename_to(&dir.path().join("done")).unwrap();
        assert_eq!(listing(dir.path()), ["done"]);
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
        let id = "0123456789abcdef";
        let writer = || Some(TempKind::Writer(id.to_string()));
        assert_eq!(temp_kind(&format!("{TEMP_PREFIX}{id}-0")), writer());
        assert_eq!(temp_kind(&format!("{TEMP_PREFIX}{id}-1f")), writer());
        assert_eq!(temp_kind(&lock_file_name(id)), writer());
        for lockless in [
            ".bigmodel-tmp-4242-0123456789abcdef",
            ".model-00001-of-00002.safetensors.tmp4242",
            ".out.safetensors.tmp-17",
            ".w.dat.tmp",
        ] {
            assert_eq!(temp_kind(lockless), Some(TempKind::Lockless), "{lockless}");
        }
        for other in [
            "model.safetensors",
            ".tmp12",
            ".x.tmp",
            ".x.tmpabc",
            ".dat.tmp",
            ".bigmodel-tmp-12-xyz",
            ".bigmodel-tmp-12-0123456789abcdeg",
            ".bigmodel-tmp-0123456789abcdef",
            ".bigmodel-tmp-0123456789abcde.lock",
            ".bigmodel-lock",
        ] {
            assert_eq!(temp_kind(other), None, "{other}");
        }
    }

    #[test]
    fn stale_temporaries_are_those_whose_writer_holds_no_lock() {
        let dir = tempfile::tempdir().unwrap();
        let at = |name: &str| dir.path().join(name);
        let (dead, live, orphan) = ("00000000000000d0", "00000000000000a1", "00000000000000b2");
        // A killed writer: its lock file, unheld, a file and a folder.
        for name in [lock_file_name(dead), format!("{TEMP_PREFIX}{dead}-0")] {
            std::fs::write(at(&name), b"x").unwrap();
        }
        std::fs::create_dir(at(&format!("{TEMP_PREFIX}{dead}-1"))).unwrap();
        std::fs::write(at(&format!("{TEMP_PREFIX}{dead}-1/shard")), b"x").unwrap();
        // A live writer (any process, any pid namespace, any host): its
        // lock is held. Old, to show that age does not matter then.
        std::fs::write(at(&lock_file_name(live)), b"").unwrap();
        let holder = File::options()
            .read(true)
            .write(true)
            .open(at(&lock_file_name(live)))
            .unwrap();
        holder.lock().unwrap();
        std::fs::write(at(&format!("{TEMP_PREFIX}{live}-0")), b"x").unwrap();
        age(&at(&format!("{TEMP_PREFIX}{live}-0")), STALE_AGE * 2);
        // A writer whose lock file is gone.
        std::fs::write(at(&format!("{TEMP_PREFIX}{orphan}-3")), b"x").unwrap();
        // Names without a lock: removed only when old.
        let old_names = [".bigmodel-tmp-0-0123456789abcdef", ".w.dat.tmp"];
        let young_names = [".bigmodel-tmp-1-0123456789abcdef", ".y.safetensors.tmp0"];
        for name in old_names.iter().chain(&young_names) {
            std::fs::write(at(name), b"x").unwrap();
        }
        for name in old_names {
            age(&at(name), STALE_AGE + Duration::from_secs(60));
        }
        // A link is never touched, however old its name says it is.
        #[cfg(unix)]
        std::os::unix::fs::symlink(at(".w.dat.tmp"), at(".z.dat.tmp")).unwrap();

        let removed = remove_stale_temps(dir.path());
        let mut expected: Vec<PathBuf> = [
            lock_file_name(dead),
            format!("{TEMP_PREFIX}{dead}-0"),
            format!("{TEMP_PREFIX}{dead}-1"),
            format!("{TEMP_PREFIX}{orphan}-3"),
        ]
        .iter()
        .map(|n| at(n))
        .chain(old_names.iter().map(|n| at(n)))
        .collect();
        expected.sort();
        assert_eq!(removed, expected);
        let mut left = vec![lock_file_name(live), format!("{TEMP_PREFIX}{live}-0")];
        left.extend(young_names.iter().map(|n| n.to_string()));
        #[cfg(unix)]
        left.push(".z.dat.tmp".into());
        left.sort();
        assert_eq!(listing(dir.path()), left);
        drop(holder);
        remove_stale_temps(dir.path());
        let mut left: Vec<String> = young_names.iter().map(|n| n.to_string()).collect();
        #[cfg(unix)]
        left.push(".z.dat.tmp".into());
        left.sort();
        assert_eq!(
            listing(dir.path()),
            left,
            "a released lock is a dead writer"
        );
    }

    #[test]
    fn a_writer_never_removes_its_own_temporaries() {
        let dir = tempfile::tempdir().unwrap();
        let f = AtomicFile::create(&dir.path().join("x")).unwrap();
        assert!(remove_stale_temps(dir.path()).is_empty());
        f.commit().unwrap();
        assert_eq!(listing(dir.path()), ["x"]);
    }
}
