//! Read-only memory maps of checkpoint and offload files, shared by
//! reference counting so a tensor's bytes stay valid as long as a view of
//! them lives.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::Error;

/// A read-only memory-mapped file, shared by every [`MmapView`] cut from it.
#[derive(Debug)]
struct MappedFile {
    path: PathBuf,
    // None for an empty file, which cannot be mapped.
    map: Option<memmap2::Mmap>,
}

/// A zero-copy window into a memory-mapped file. Cloning is cheap; the
/// mapping is unmapped when the last view is dropped.
#[derive(Clone, Debug)]
pub struct MmapView {
    file: Arc<MappedFile>,
    start: usize,
    end: usize,
}

impl MmapView {
    /// Maps the whole of `path` read-only.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, Error> {
        let path = path.as_ref();
        let io = |source| Error::Io {
            path: path.to_path_buf(),
            source,
        };
        let file = File::open(path).map_err(io)?;
        let len = file.metadata().map_err(io)?.len() as usize;
        let map = if len == 0 {
            None
        } else {
            // SAFETY: the mapping is read-only. Like every mmap-based loader we
            // rely on checkpoint files not being truncated while mapped.
            Some(unsafe { memmap2::Mmap::map(&file) }.map_err(io)?)
        };
        Ok(MmapView {
            file: Arc::new(MappedFile {
                path: path.to_path_buf(),
                map,
            }),
            start: 0,
            end: len,
        })
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
}
