//! Read-only memory maps of checkpoint and offload files, shared by
//! reference counting so a tensor's bytes stay valid as long as a view of
//! them lives.
//!
//! Every mapping is also listed (weakly: the list keeps nothing alive) with
//! the size and modification time its file had when it was mapped, so that
//! [`changed_mapped_files`] can say, once a job is done, which files were
//! written in place while it read them: their pages changed under the map,
//! and what was computed may mix old and new bytes.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, Weak};
use std::time::SystemTime;

use crate::Error;

/// A read-only memory-mapped file, shared by every [`MmapView`] cut from it.
#[derive(Debug)]
struct MappedFile {
    path: PathBuf,
    // None for an empty file, which cannot be mapped.
    map: Option<memmap2::Mmap>,
    /// Device and inode of the file mapped (Unix), to tell it from another
    /// file put at the same path later.
    id: Option<(u64, u64)>,
    /// Its size when mapped.
    len: u64,
    /// Its modification time when mapped, where the system keeps one.
    modified: Option<SystemTime>,
}

/// Every live mapping, for [`changed_mapped_files`].
static MAPPED: Mutex<Vec<Weak<MappedFile>>> = Mutex::new(Vec::new());

/// Lists `file` among the live mappings, dropping the dead ones now and
/// then (when the list doubles) so it stays as long as what is mapped.
fn register(file: &Arc<MappedFile>) {
    let mut mapped = MAPPED.lock().unwrap_or_else(|e| e.into_inner());
    if mapped.len().is_power_of_two() {
        mapped.retain(|m| m.strong_count() > 0);
    }
    mapped.push(Arc::downgrade(file));
}

/// A mapped file written in place since it was mapped.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChangedFile {
    /// The file.
    pub path: PathBuf,
    /// Its size when mapped and now.
    pub len: (u64, u64),
}

impl std::fmt::Display for ChangedFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} was changed in place while in use (",
            self.path.display()
        )?;
        match self.len {
            (then, now) if then != now => write!(f, "{then} bytes when mapped, {now} now")?,
            _ => f.write_str("modified since it was mapped")?,
        }
        f.write_str(
            "): what was computed may mix its old and new bytes; do not change checkpoint or \
             offload files while they are in use (write a new file and rename it over the old one)",
        )
    }
}

/// The files mapped now whose size or modification time changed since they
/// were mapped, the same file still at the path (written in place). A file
/// removed, or replaced by a rename, is not listed: the mapping keeps the
/// bytes it had.
pub fn changed_mapped_files() -> Vec<ChangedFile> {
    let live: Vec<Arc<MappedFile>> = MAPPED
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
        .filter_map(Weak::upgrade)
        .collect();
    let mut changed: Vec<ChangedFile> = live.iter().filter_map(|f| f.changed()).collect();
    changed.sort_by(|a, b| a.path.cmp(&b.path));
    changed.dedup();
    changed
}

impl MappedFile {
    /// How the file at the path differs from what was mapped, if it is the
    /// same file and was written since.
    fn changed(&self) -> Option<ChangedFile> {
        let meta = std::fs::metadata(&self.path).ok()?;
        let same = self.id.is_some() && file_id(&meta) == self.id;
        let len = meta.len();
        (same && (len != self.len || meta.modified().ok() != self.modified)).then(|| ChangedFile {
            path: self.path.clone(),
            len: (self.len, len),
        })
    }
}

/// A zero-copy window into a memory-mapped file. Cloning is cheap; the
/// mapping is unmapped when the last view is dropped.
///
/// A mapped file that another program truncates makes reading the lost
/// pages fault (SIGBUS). [`MmapView::check_intact`] turns that case into an
/// error before bytes are read; the CLI also installs a handler that names
/// the file if a fault happens anyway.
#[derive(Clone, Debug)]
pub struct MmapView {
    file: Arc<MappedFile>,
    start: usize,
    end: usize,
}

impl MmapView {
    /// Maps the whole of `path` read-only. Anything but a regular file (a
    /// FIFO, socket or device) is refused before it is opened.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, Error> {
        let path = path.as_ref();
        let io = |source| Error::Io {
            path: path.to_path_buf(),
            source,
        };
        let meta = std::fs::metadata(path).map_err(io)?;
        if !meta.is_file() {
            return Err(io(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "not a regular file; refusing to map it",
            )));
        }
        let file = File::open(path).map_err(io)?;
        Self::map_file(&file, path)
    }

    /// Maps the whole of an open regular file read-only; `path` names it in
    /// errors and checks.
    pub fn map_file(file: &File, path: &Path) -> Result<Self, Error> {
        let io = |source| Error::Io {
            path: path.to_path_buf(),
            source,
        };
        let meta = file.metadata().map_err(io)?;
        if !meta.is_file() {
            return Err(io(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "not a regular file; refusing to map it",
            )));
        }
        let len = usize::try_from(meta.len()).map_err(|_| {
            io(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "larger than the address space",
            ))
        })?;
        let map = if len == 0 {
            None
        } else {
            // SAFETY: the mapping is read-only and never handed out as
            // mutable. A file truncated by another process while mapped
            // makes reads of the lost pages fault: check_intact reports it
            // before reads, and the CLI's SIGBUS handler names the file.
            Some(unsafe { memmap2::Mmap::map(file) }.map_err(io)?)
        };
        let file = Arc::new(MappedFile {
            path: path.to_path_buf(),
            map,
            id: file_id(&meta),
            len: meta.len(),
            modified: meta.modified().ok(),
        });
        register(&file);
        Ok(MmapView {
            file,
            start: 0,
            end: len,
        })
    }

    /// Checks that the file behind this view still holds its bytes: an
    /// error names the file when it has shrunk below the end of the view
    /// since it was mapped (reading the lost bytes would fault). A file
    /// replaced by a new one at the same path (a rename) is fine: the
    /// mapping keeps the old one alive.
    pub fn check_intact(&self) -> Result<(), Error> {
        let Ok(meta) = std::fs::metadata(&self.file.path) else {
            return Ok(()); // removed: the mapping keeps the bytes alive
        };
        if file_id(&meta) == self.file.id && meta.len() < self.end as u64 {
            return Err(Error::Truncated {
                path: self.file.path.clone(),
                needed: self.end as u64,
                len: meta.len(),
            });
        }
        Ok(())
    }

    /// The file behind this view written in place since it was mapped
    /// (another size or modification time, same file), if it was: see
    /// [`changed_mapped_files`].
    pub fn check_unchanged(&self) -> Option<ChangedFile> {
        self.file.changed()
    }

    /// Whether `meta` describes the file this view maps (same device and
    /// inode): a file reopened by path for other reads (`O_DIRECT`) must
    /// be this one, not another put at the same path since.
    pub fn is_backed_by(&self, meta: &std::fs::Metadata) -> bool {
        self.file.id.is_some() && file_id(meta) == self.file.id
    }

    /// The file this view maps.
    pub fn path(&self) -> &Path {
        &self.file.path
    }

    /// A sub-window, `range` relative to this view.
    pub fn slice(&self, range: std::ops::Range<usize>) -> Result<Self, Error> {
        let len = self.len();
        if range.start > range.end || range.end > len {
            return Err(Error::OutOfBounds {
                path: self.file.path.clone(),
                start: self.start + range.start,
                end: self.start + range.end,
                len: self.file.map.as_ref().map_or(0, |m| m.len()),
            });
        }
        Ok(MmapView {
            file: Arc::clone(&self.file),
            start: self.start + range.start,
            end: self.start + range.end,
        })
    }

    /// Offset of this view from the start of the file.
    pub fn file_offset(&self) -> usize {
        self.start
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.end - self.start
    }

    /// True when the view holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.start == self.end
    }

    /// The bytes, read through the page cache on first touch.
    pub fn as_bytes(&self) -> &[u8] {
        match &self.file.map {
            Some(m) => &m[self.start..self.end],
            None => &[],
        }
    }
}

#[cfg(unix)]
fn file_id(meta: &std::fs::Metadata) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    Some((meta.dev(), meta.ino()))
}

#[cfg(not(unix))]
fn file_id(_: &std::fs::Metadata) -> Option<(u64, u64)> {
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn mmap_view_outlives_its_parent_and_checks_bounds() {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        f.write_all(&[0, 1, 2, 3, 4, 5, 6, 7]).unwrap();
        let sub = {
            let whole = MmapView::open(f.path()).unwrap();
            whole.slice(2..6).unwrap()
        };
        assert_eq!(sub.as_bytes(), &[2, 3, 4, 5]);
        assert_eq!(sub.slice(1..3).unwrap().as_bytes(), &[3, 4]);
        let err = sub.slice(2..9).unwrap_err().to_string();
        assert!(err.contains("outside the file"), "{err}");
    }

    #[test]
    fn empty_file_maps_to_empty_view() {
        let f = tempfile::NamedTempFile::new().unwrap();
        let v = MmapView::open(f.path()).unwrap();
        assert!(v.is_empty());
    }

    #[test]
    fn truncation_is_reported_before_reading() {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        f.write_all(&[7; 64]).unwrap();
        let view = MmapView::open(f.path()).unwrap().slice(8..40).unwrap();
        view.check_intact().unwrap();
        f.as_file().set_len(16).unwrap();
        let err = view.check_intact().unwrap_err().to_string();
        assert!(
            err.contains(&f.path().display().to_string())
                && err.contains("shrank to 16 bytes")
                && err.contains("needs 40"),
            "{err}"
        );
    }

    #[test]
    fn files_written_in_place_while_mapped_are_listed() {
        let dir = tempfile::tempdir().unwrap();
        let (grown, touched, renamed) = (
            dir.path().join("grown"),
            dir.path().join("touched"),
            dir.path().join("renamed"),
        );
        for p in [&grown, &touched, &renamed] {
            std::fs::write(p, [1u8; 32]).unwrap();
        }
        let views: Vec<MmapView> = [&grown, &touched, &renamed]
            .iter()
            .map(|p| MmapView::open(p).unwrap())
            .collect();
        assert!(views.iter().all(|v| v.check_unchanged().is_none()));
        let mine = |changed: Vec<ChangedFile>| -> Vec<ChangedFile> {
            changed
                .into_iter()
                .filter(|c| c.path.starts_with(dir.path()))
                .collect()
        };
        assert_eq!(mine(changed_mapped_files()), []);
        // Written in place: longer, and the same size with a later mtime.
        std::fs::OpenOptions::new()
            .append(true)
            .open(&grown)
            .unwrap()
            .write_all(&[2; 8])
            .unwrap();
        let file = std::fs::OpenOptions::new()
            .write(true)
            .open(&touched)
            .unwrap();
        file.set_modified(SystemTime::now() + std::time::Duration::from_secs(5))
            .unwrap();
        // Replaced by a rename: the mapping keeps the old bytes.
        let new = dir.path().join("new");
        std::fs::write(&new, [3u8; 16]).unwrap();
        std::fs::rename(&new, &renamed).unwrap();
        let changed = mine(changed_mapped_files());
        assert_eq!(
            changed,
            [
                ChangedFile {
                    path: grown.clone(),
                    len: (32, 40)
                },
                ChangedFile {
                    path: touched.clone(),
                    len: (32, 32)
                },
            ]
        );
        assert!(
            changed[0]
                .to_string()
                .contains("32 bytes when mapped, 40 now")
                && changed[1]
                    .to_string()
                    .contains("modified since it was mapped"),
            "{}",
            changed[1]
        );
        assert!(views[2].check_unchanged().is_none());
        // Unmapped files are no longer watched.
        drop(views);
        assert_eq!(mine(changed_mapped_files()), []);
    }

    #[cfg(unix)]
    #[test]
    fn fifos_are_not_opened() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("w.dat");
        let made = std::process::Command::new("mkfifo").arg(&fifo).status();
        if !made.is_ok_and(|s| s.success()) {
            eprintln!("skipped: no mkfifo");
            return;
        }
        // Opening would block until a writer appears.
        let err = MmapView::open(&fifo).unwrap_err().to_string();
        assert!(err.contains("not a regular file"), "{err}");
    }
}
