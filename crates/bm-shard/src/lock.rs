//! Exclusive advisory locks on the folders this workspace writes: a
//! `shard`/`convert` output folder, an offload folder.
//!
//! A writer holds [`FolderLock`] for its whole write and commit: an
//! exclusive `flock` on `FOLDER/.bigmodel-lock`, into which it writes
//! `pid N on HOST` for others to report. A second writer waits for it (as
//! long as [`Sharing::wait`] allows, saying once what it waits for through
//! [`Sharing::notice`]) or fails with "FOLDER is being written by pid N on
//! HOST". Nothing can deadlock on it: the lock is advisory and dies with
//! its process (a killed holder releases it), and a holder never waits for
//! anything while it holds it but its own writes.
//!
//! The lock file is removed when the lock is released (before the lock
//! itself), so finished folders hold no trace of it; a process that opened
//! the file just before it was removed notices, after locking it, that the
//! name no longer leads to its file, and starts again.
//!
//! A folder this process cannot create a file in (read-only, or not its
//! own) is not locked: the process cannot write there either, and reading
//! it (an existing offload folder) goes on as without locks.
//!
//! Within one process the lock is re-entrant: a writer that holds it can
//! call library functions that take it themselves (locking the same file
//! again from one process would wait for itself). Threads of one process
//! are not kept apart by it.
//!
//! Readers do not lock. A reader that finds a folder without weights asks
//! [`writer_of`], so that it can say the folder is being written instead of
//! "no weights".

use std::collections::HashMap;
use std::fs::{File, TryLockError};
use std::io::{self, Read, Seek, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, LazyLock, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use crate::Error;
use crate::atomic::{is_same_file, locks_unsupported, open_exclusive};

/// Name of the lock file a writer holds in the folder it writes.
pub const LOCK_FILE: &str = ".bigmodel-lock";

/// How often a waiting writer tries the lock again.
const RETRY: Duration = Duration::from_millis(50);

/// Receives the messages of [`Sharing`] (one line each, no newline).
pub type Notice = Arc<dyn Fn(&str) + Send + Sync>;

/// How a writer shares a folder with other processes: how long it waits
/// for another writer's lock, and where it says what it waits for or what
/// it repaired. The default waits as long as the other writer takes and
/// says nothing.
#[derive(Clone, Default)]
pub struct Sharing {
    /// The longest wait for another writer's lock; `None` waits as long as
    /// it takes, `Some(ZERO)` fails at once.
    pub wait: Option<Duration>,
    /// Told, once per wait, who holds the lock; and what stale state a
    /// writer removed (stale offload-index entries).
    pub notice: Option<Notice>,
}

impl std::fmt::Debug for Sharing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sharing")
            .field("wait", &self.wait)
            .field("notice", &self.notice.as_ref().map(|_| "set"))
            .finish()
    }
}

impl Sharing {
    /// Hands `text` to [`Sharing::notice`], if any.
    pub fn notify(&self, text: &str) {
        if let Some(notice) = &self.notice {
            notice(text);
        }
    }
}

/// The exclusive lock on a folder, held until dropped; see the module docs.
#[derive(Debug)]
#[must_use = "the folder is unlocked when this is dropped"]
pub struct FolderLock {
    key: PathBuf,
}

/// A lock this process holds.
struct Held {
    /// Holders in this process (the lock is re-entrant).
    count: usize,
    path: PathBuf,
    /// Holds the lock; closed after the name is removed.
    file: File,
}

/// The folder locks this process holds, by canonical folder path.
fn held() -> MutexGuard<'static, HashMap<PathBuf, Held>> {
    static HELD: LazyLock<Mutex<HashMap<PathBuf, Held>>> = LazyLock::new(Mutex::default);
    HELD.lock().unwrap_or_else(PoisonError::into_inner)
}

impl FolderLock {
    /// Takes the lock on `folder` (created if needed), waiting for another
    /// writer as `sharing` says. Fails with [`Error::Locked`] when the wait
    /// ends first.
    pub fn acquire(folder: &Path, sharing: &Sharing) -> Result<FolderLock, Error> {
        std::fs::create_dir_all(folder).map_err(|e| Error::io(folder, "creating folder", e))?;
        let key = folder
            .canonicalize()
            .map_err(|e| Error::io(folder, "resolving", e))?;
        if let Some(held) = held().get_mut(&key) {
            held.count += 1;
            return Ok(FolderLock { key });
        }
        let path = folder.join(LOCK_FILE);
        let started = Instant::now();
        let mut told = false;
        loop {
            match try_take(&path)? {
                Attempt::Taken(file) => {
                    held().insert(
                        key.clone(),
                        Held {
                            count: 1,
                            path,
                            file,
                        },
                    );
                    return Ok(FolderLock { key });
                }
                Attempt::Again => continue,
                // Nothing to exclude: this process cannot write there.
                Attempt::ReadOnly => {
                    return Ok(FolderLock {
                        key: PathBuf::new(),
                    });
                }
                Attempt::Busy(holder) => {
                    let waited = started.elapsed();
                    if let Some(limit) = sharing.wait
                        && waited >= limit
                    {
                        return Err(Error::Locked {
                            folder: folder.to_path_buf(),
                            holder,
                            waited: Some(limit),
                        });
                    }
                    if !told {
                        told = true;
                        let how_long = match sharing.wait {
                            Some(limit) => format!(" (at most {} s)", limit.as_secs()),
                            None => String::new(),
                        };
                        sharing.notify(&format!(
                            "{} is being written by {holder}; waiting for it to finish{how_long}",
                            folder.display()
                        ));
                    }
                    let left = sharing.wait.map_or(RETRY, |limit| limit - waited);
                    std::thread::sleep(left.min(RETRY));
                }
            }
        }
    }
}

impl Drop for FolderLock {
    fn drop(&mut self) {
        let mut held = held();
        let Some(entry) = held.get_mut(&self.key) else {
            return;
        };
        entry.count -= 1;
        if entry.count == 0
            && let Some(entry) = held.remove(&self.key)
        {
            // The name first: a writer that opens it after this creates a
            // fresh file, one that opened it before sees it was removed.
            if is_same_file(&entry.file, &entry.path) {
                let _ = std::fs::remove_file(&entry.path);
            }
            drop(entry.file);
        }
    }
}

/// What one try at the lock gave.
enum Attempt {
    Taken(File),
    /// Held by `pid N on HOST` (or "another process" until it says).
    Busy(String),
    /// The file was removed or replaced under us: try again at once.
    Again,
    /// No file can be created in the folder (read-only, no permission).
    ReadOnly,
}

fn try_take(path: &Path) -> Result<Attempt, Error> {
    let io = |e| Error::io(path, "locking", e);
    match std::fs::symlink_metadata(path) {
        Ok(meta) if !meta.is_file() => {
            return Err(Error::checkpoint(
                path,
                "is not a regular file (a link or a folder); bigmodel locks its folder through this name: remove it",
            ));
        }
        _ => {}
    }
    let read_only = |e: &io::Error| {
        matches!(
            e.kind(),
            io::ErrorKind::PermissionDenied | io::ErrorKind::ReadOnlyFilesystem
        )
    };
    let mut file = match open_exclusive(path) {
        Ok(file) => file,
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
            match File::options().read(true).write(true).open(path) {
                Ok(file) => file,
                Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Attempt::Again),
                Err(e) if read_only(&e) => return Ok(Attempt::ReadOnly),
                Err(e) => return Err(io(e)),
            }
        }
        Err(e) if read_only(&e) => return Ok(Attempt::ReadOnly),
        Err(e) => return Err(io(e)),
    };
    match file.try_lock() {
        Ok(()) => {}
        Err(TryLockError::WouldBlock) => return Ok(Attempt::Busy(holder_of(&mut file))),
        // No locks on this file system: write without them, as before.
        Err(TryLockError::Error(e)) if locks_unsupported(&e) => return Ok(Attempt::Taken(file)),
        Err(TryLockError::Error(e)) => return Err(io(e)),
    }
    if !is_same_file(&file, path) {
        return Ok(Attempt::Again);
    }
    // Best effort (a full disk has no room for it): others then report
    // "another process".
    let me = format!("pid {} on {}", std::process::id(), host_name());
    let _ = file
        .set_len(0)
        .and_then(|()| file.rewind())
        .and_then(|()| file.write_all(me.as_bytes()));
    Ok(Attempt::Taken(file))
}

/// Who holds the lock, as the holder wrote it.
fn holder_of(file: &mut File) -> String {
    let mut text = String::new();
    let _ = file
        .rewind()
        .and_then(|()| file.take(200).read_to_string(&mut text));
    let text = text.trim();
    if text.is_empty() {
        "another process".into()
    } else {
        text.to_string()
    }
}

/// Who is writing `folder` (`pid N on HOST`), when another process holds
/// its lock; `None` when nobody does or this process does. For readers that
/// find a folder without weights.
pub fn writer_of(folder: &Path) -> Option<String> {
    if let Ok(key) = folder.canonicalize()
        && held().contains_key(&key)
    {
        // Opening our own lock file again could release the lock where
        // locks are emulated per process (NFS).
        return None;
    }
    let path = folder.join(LOCK_FILE);
    if !std::fs::symlink_metadata(&path).is_ok_and(|m| m.is_file()) {
        return None;
    }
    let mut file = File::open(&path).ok()?;
    match file.try_lock_shared() {
        Err(TryLockError::WouldBlock) => Some(holder_of(&mut file)),
        _ => None,
    }
}

/// Removes the lock files of every lock this process holds and keeps the
/// table locked for good (the process is about to exit, which releases the
/// locks): see [`crate::remove_in_flight`].
pub(crate) fn remove_held_lock_files() {
    let held = held();
    for entry in held.values() {
        if is_same_file(&entry.file, &entry.path) {
            let _ = std::fs::remove_file(&entry.path);
        }
    }
    std::mem::forget(held);
}

/// This machine's name for messages (its UTS name, as `hostname` prints).
fn host_name() -> String {
    let from_kernel = std::fs::read_to_string("/proc/sys/kernel/hostname").ok();
    from_kernel
        .or_else(|| std::env::var("HOSTNAME").ok())
        .map(|name| name.trim().to_string())
        .filter(|name| !name.is_empty())
        .unwrap_or_else(|| "an unknown host".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_lock_is_reentrant_and_leaves_no_file() {
        let dir = tempfile::tempdir().unwrap();
        let outer = FolderLock::acquire(dir.path(), &Sharing::default()).unwrap();
        let inner = FolderLock::acquire(dir.path(), &Sharing::default()).unwrap();
        assert!(dir.path().join(LOCK_FILE).is_file());
        drop(inner);
        assert!(dir.path().join(LOCK_FILE).is_file(), "the outer holds it");
        assert_eq!(
            writer_of(dir.path()),
            None,
            "this process is no other writer"
        );
        drop(outer);
        assert!(!dir.path().join(LOCK_FILE).exists());
    }

    #[test]
    fn a_held_lock_names_its_holder() {
        let dir = tempfile::tempdir().unwrap();
        // Another holder: a file description of its own, as another
        // process would have.
        let path = dir.path().join(LOCK_FILE);
        std::fs::write(&path, "pid 4242 on elsewhere").unwrap();
        let other = File::options().read(true).write(true).open(&path).unwrap();
        other.lock().unwrap();
        assert_eq!(
            writer_of(dir.path()).as_deref(),
            Some("pid 4242 on elsewhere")
        );
        let told = Arc::new(Mutex::new(Vec::new()));
        let sink = Arc::clone(&told);
        let sharing = Sharing {
            wait: Some(Duration::from_millis(120)),
            notice: Some(Arc::new(move |m: &str| {
                sink.lock().unwrap().push(m.to_string())
            })),
        };
        let e = FolderLock::acquire(dir.path(), &sharing)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(&format!(
                "{} is being written by pid 4242 on elsewhere",
                dir.path().display()
            )),
            "{e}"
        );
        assert_eq!(told.lock().unwrap().len(), 1, "told once");
        // A holder that goes away (as a killed process's lock does) lets
        // the next writer in.
        drop(other);
        let lock = FolderLock::acquire(dir.path(), &sharing).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(
            text.starts_with(&format!("pid {} on ", std::process::id())),
            "{text}"
        );
        drop(lock);
        assert!(!path.exists());
    }

    #[cfg(unix)]
    #[test]
    fn a_link_at_the_lock_name_is_refused_not_followed() {
        let dir = tempfile::tempdir().unwrap();
        let victim = dir.path().join("victim");
        std::fs::write(&victim, b"keep").unwrap();
        let out = dir.path().join("out");
        std::fs::create_dir(&out).unwrap();
        std::os::unix::fs::symlink(&victim, out.join(LOCK_FILE)).unwrap();
        let e = FolderLock::acquire(&out, &Sharing::default())
            .unwrap_err()
            .to_string();
        assert!(e.contains("is not a regular file"), "{e}");
        assert_eq!(std::fs::read(&victim).unwrap(), b"keep");
    }
}
