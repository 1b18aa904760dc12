//! A pool of reader threads that fill page-locked staging slots from a
//! file or a mapped region, while the copy stream drains the slots already
//! filled: disk or page cache → pinned memory → GPU, with the read of slot
//! *k + 1* overlapping the DMA of slot *k*, and one copy per byte per hop.
//!
//! One thread reading a mapping runs at one core's page-fault and memcpy
//! speed, far below a PCIe 5 link; several threads reading large slices
//! reach it (fast loaders use 8–32 threads and 2–16 MiB pieces). Files can
//! be read with `O_DIRECT` (no page cache: a cold read at the disk's
//! sequential speed, and no pollution of the cache by a model larger than
//! RAM) where the file system allows it; elsewhere, or when a direct read
//! is refused, reads are buffered. The kernel is told the access is
//! sequential and wanted soon (`madvise`/`posix_fadvise`), so readahead
//! keeps ahead of the readers.
//!
//! With emulated GPUs the slots are pageable and the "DMA" is a memcpy (on
//! the copy engine of a linked GPU), so the same code runs in CI.

use std::collections::VecDeque;
use std::ffi::{c_int, c_void};
use std::fs::File;
use std::ops::Range;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, mpsc};
use std::thread::JoinHandle;

use parking_lot::{Condvar, Mutex};

use crate::pinned::PinnedBuffer;
use crate::stream::Event;
use crate::{DeviceBuffer, DeviceSet, Error, Result, Stream};

/// Reads and DMA sources are aligned to this (what `O_DIRECT` needs).
const ALIGN: u64 = 4096;

// Advice to the kernel, declared here rather than through a crate.
unsafe extern "C" {
    fn madvise(addr: *mut c_void, len: usize, advice: c_int) -> c_int;
    fn posix_fadvise(fd: c_int, offset: i64, len: i64, advice: c_int) -> c_int;
}
const MADV_SEQUENTIAL: c_int = 2;
const MADV_WILLNEED: c_int = 3;
const POSIX_FADV_SEQUENTIAL: c_int = 2;
const POSIX_FADV_WILLNEED: c_int = 3;
/// `EINVAL`: what a file system without `O_DIRECT` support answers.
const EINVAL: i32 = 22;

/// `O_DIRECT` for this CPU (the value differs on Arm).
fn o_direct() -> c_int {
    match std::env::consts::ARCH {
        "aarch64" | "arm" => 0o200000,
        _ => 0o40000,
    }
}

/// How a [`ReaderPool`] is sized.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReaderOptions {
    /// Reader threads.
    pub threads: usize,
    /// Bytes per staging slot (rounded up to 4 KiB).
    pub slot_bytes: usize,
    /// Staging slots: more than threads, so readers keep reading while
    /// filled slots wait for their DMA.
    pub slots: usize,
}

impl Default for ReaderOptions {
    /// min(8, cores) threads, two slots more than threads, 16 MiB each.
    fn default() -> Self {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let threads = cores.clamp(1, 8);
        ReaderOptions {
            threads,
            slot_bytes: 16 << 20,
            slots: threads + 2,
        }
    }
}

impl ReaderOptions {
    /// Bytes per slot as allocated: rounded up to the alignment direct
    /// reads need.
    fn aligned_slot_bytes(&self) -> usize {
        self.slot_bytes.div_ceil(ALIGN as usize) * ALIGN as usize
    }

    /// The host memory a pool of these options holds for its life: its
    /// staging slots.
    pub fn staging_bytes(&self) -> u64 {
        (self.slots as u64).saturating_mul(self.aligned_slot_bytes() as u64)
    }
}

/// A file opened for a [`ReaderPool`], with an `O_DIRECT` descriptor
/// beside the buffered one when asked for and the file system allows it.
pub struct SourceFile {
    path: PathBuf,
    buffered: File,
    direct: Option<File>,
    /// Cleared when the file system refuses a direct read after all.
    direct_ok: AtomicBool,
    len: u64,
}

impl std::fmt::Debug for SourceFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "SourceFile({}, {} bytes, direct: {})",
            self.path.display(),
            self.len,
            self.is_direct()
        )
    }
}

impl SourceFile {
    /// Opens `path`; with `direct`, also with `O_DIRECT`, which is used
    /// when the file system allows it.
    pub fn open(path: &Path, direct: bool) -> Result<Arc<SourceFile>> {
        let read_error = |e: std::io::Error| Error::Read {
            path: Some(path.to_path_buf()),
            offset: 0,
            len: 0,
            reason: e.to_string(),
        };
        let buffered = File::open(path).map_err(read_error)?;
        let len = buffered.metadata().map_err(read_error)?.len();
        let direct = direct
            .then(|| {
                std::fs::OpenOptions::new()
                    .read(true)
                    .custom_flags(o_direct())
                    .open(path)
                    .ok()
            })
            .flatten();
        Ok(Arc::new(SourceFile {
            path: path.to_path_buf(),
            buffered,
            direct_ok: AtomicBool::new(direct.is_some()),
            direct,
            len,
        }))
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// True when `check` accepts the metadata of each descriptor held:
    /// both were opened by path, so a file renamed over the path between
    /// a caller's check and the opens shows here.
    pub fn every_descriptor(&self, check: impl Fn(&std::fs::Metadata) -> bool) -> bool {
        std::iter::once(&self.buffered)
            .chain(self.direct.as_ref())
            .all(|f| f.metadata().is_ok_and(|m| check(&m)))
    }

    /// Its size when opened.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the file is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether reads bypass the page cache (`O_DIRECT` works here).
    pub fn is_direct(&self) -> bool {
        self.direct.is_some() && self.direct_ok.load(Ordering::Relaxed)
    }

    fn error(&self, read: &Range<u64>, reason: impl std::fmt::Display) -> Error {
        Error::Read {
            path: Some(self.path.clone()),
            offset: read.start,
            len: read.end - read.start,
            reason: reason.to_string(),
        }
    }

    /// Reads file bytes `read` into `slot[..len]`: aligned and direct when
    /// possible (then the wanted bytes start `skip` in), else buffered.
    /// Returns `skip`.
    fn read_into(&self, wanted: &Range<u64>, slot: &mut [u8]) -> Result<usize> {
        if self.is_direct() {
            let start = wanted.start / ALIGN * ALIGN;
            let end = wanted.end.div_ceil(ALIGN) * ALIGN;
            let skip = (wanted.start - start) as usize;
            let need = skip + (wanted.end - wanted.start) as usize;
            let direct = self.direct.as_ref().expect("is_direct checked it");
            match read_at_least(direct, &mut slot[..(end - start) as usize], start, need) {
                Ok(()) => return Ok(skip),
                // The file system refuses direct reads after all: buffered
                // from now on.
                Err(e) if e.raw_os_error() == Some(EINVAL) => {
                    self.direct_ok.store(false, Ordering::Relaxed);
                }
                Err(e) => return Err(self.error(wanted, e)),
            }
        }
        let len = (wanted.end - wanted.start) as usize;
        read_at_least(&self.buffered, &mut slot[..len], wanted.start, len)
            .map_err(|e| self.error(wanted, e))?;
        Ok(0)
    }
}

/// Reads from `offset` into `buf` until at least `need` bytes are in
/// (a direct read may stop short at the end of the file).
fn read_at_least(file: &File, buf: &mut [u8], offset: u64, need: usize) -> std::io::Result<()> {
    let mut done = 0;
    while done < need {
        match file.read_at(&mut buf[done..], offset + done as u64) {
            Ok(0) => {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    format!("the file ends {done} bytes into a read of {need}"),
                ));
            }
            Ok(n) => done += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Bytes shared with the reader threads: a mapping kept alive by
/// reference counting (`bm_tensor::MmapView`, an `Arc<Vec<u8>>`, …).
pub type SharedBytes = Arc<dyn AsRef<[u8]> + Send + Sync>;

/// What a [`ReaderPool`] reads from.
#[derive(Clone)]
pub enum ReadSource {
    /// A file, read with `pread` (direct or buffered).
    File(Arc<SourceFile>),
    /// Mapped or in-memory bytes, copied with memcpy.
    Bytes(SharedBytes),
}

impl std::fmt::Debug for ReadSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ReadSource::File(file) => write!(f, "ReadSource::File({file:?})"),
            ReadSource::Bytes(b) => write!(f, "ReadSource::Bytes({} bytes)", (**b).as_ref().len()),
        }
    }
}

impl ReadSource {
    fn len(&self) -> u64 {
        match self {
            ReadSource::File(file) => file.len,
            ReadSource::Bytes(b) => (**b).as_ref().len() as u64,
        }
    }

    /// Tells the kernel `range` is read sequentially and soon: readahead
    /// of the whole range starts now. Advice only: failures are ignored.
    fn advise(&self, range: &Range<u64>) {
        match self {
            ReadSource::File(file) => {
                let (offset, len) = (range.start as i64, (range.end - range.start) as i64);
                let fd = file.buffered.as_raw_fd();
                for advice in [POSIX_FADV_SEQUENTIAL, POSIX_FADV_WILLNEED] {
                    // SAFETY: advice on an open descriptor; no memory is touched.
                    let _ = unsafe { posix_fadvise(fd, offset, len, advice) };
                }
            }
            ReadSource::Bytes(b) => {
                let bytes = (**b).as_ref();
                let start = bytes.as_ptr() as usize + range.start as usize;
                let aligned = start / ALIGN as usize * ALIGN as usize;
                let len = (range.end - range.start) as usize + (start - aligned);
                for advice in [MADV_SEQUENTIAL, MADV_WILLNEED] {
                    // SAFETY: advice that changes no contents, over pages of
                    // memory this process maps; non-mapped memory is refused
                    // with an error, which is ignored.
                    let _ = unsafe { madvise(aligned as *mut c_void, len, advice) };
                }
            }
        }
    }

    /// Reads `wanted` into `slot`; returns where in it the bytes start.
    fn read_into(&self, wanted: &Range<u64>, slot: &mut [u8]) -> Result<usize> {
        match self {
            ReadSource::File(file) => file.read_into(wanted, slot),
            ReadSource::Bytes(b) => {
                let src = &(**b).as_ref()[wanted.start as usize..wanted.end as usize];
                slot[..src.len()].copy_from_slice(src);
                Ok(0)
            }
        }
    }
}

/// One piece of an upload: the source bytes `wanted`, going to
/// `dst_offset` of the destination.
struct Task {
    source: ReadSource,
    wanted: Range<u64>,
    dst_offset: usize,
    cancelled: Arc<AtomicBool>,
    reply: mpsc::Sender<Filled>,
}

/// A piece read into a slot (or why not).
struct Filled {
    result: Result<(usize, usize)>,
    dst_offset: usize,
    len: usize,
}

struct Queue {
    tasks: VecDeque<Task>,
    closed: bool,
}

struct Shared {
    queue: Mutex<Queue>,
    more: Condvar,
    slots: Vec<Mutex<PinnedBuffer>>,
    free: Mutex<Vec<usize>>,
    freed: Condvar,
}

impl Shared {
    fn take_slot(&self) -> usize {
        let mut free = self.free.lock();
        loop {
            if let Some(i) = free.pop() {
                return i;
            }
            self.freed.wait(&mut free);
        }
    }

    fn give_slot(&self, i: usize) {
        self.free.lock().push(i);
        self.freed.notify_one();
    }
}

/// Reader threads and pinned staging slots for uploads from files and
/// mappings (see the module documentation). Safe to share between
/// threads; uploads from several threads interleave their pieces.
pub struct ReaderPool {
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
    slot_bytes: usize,
    pinned: bool,
}

impl std::fmt::Debug for ReaderPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "ReaderPool({} threads, {} slots of {} bytes, pinned: {})",
            self.threads.len(),
            self.shared.slots.len(),
            self.slot_bytes,
            self.pinned
        )
    }
}

impl ReaderPool {
    pub(crate) fn new(set: &DeviceSet, options: ReaderOptions) -> Result<ReaderPool> {
        if options.threads == 0 || options.slots == 0 || options.slot_bytes == 0 {
            return Err(Error::ZeroSizedAllocation {
                device: crate::Device::Cpu,
            });
        }
        let slot_bytes = options.aligned_slot_bytes();
        let mut slots = Vec::with_capacity(options.slots);
        for _ in 0..options.slots {
            slots.push(Mutex::new(PinnedBuffer::for_set(set, slot_bytes)?.0));
        }
        let pinned = slots.iter().all(|s| s.lock().is_pinned());
        let shared = Arc::new(Shared {
            queue: Mutex::new(Queue {
                tasks: VecDeque::new(),
                closed: false,
            }),
            more: Condvar::new(),
            free: Mutex::new((0..slots.len()).rev().collect()),
            slots,
            freed: Condvar::new(),
        });
        let mut threads = Vec::with_capacity(options.threads);
        for n in 0..options.threads {
            let worker = Arc::clone(&shared);
            let spawned = std::thread::Builder::new()
                .name(format!("bm-reader-{n}"))
                .spawn(move || read_loop(&worker));
            match spawned {
                Ok(t) => threads.push(t),
                // Fewer threads than asked is slower, not wrong.
                Err(_) if !threads.is_empty() => break,
                Err(e) => {
                    return Err(Error::Read {
                        path: None,
                        offset: 0,
                        len: 0,
                        reason: format!("starting a reader thread: {e}"),
                    });
                }
            }
        }
        Ok(ReaderPool {
            shared,
            threads,
            slot_bytes,
            pinned,
        })
    }

    /// Reader threads.
    pub fn threads(&self) -> usize {
        self.threads.len()
    }

    /// Bytes per staging slot.
    pub fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    /// Whether the staging slots are page-locked (else pageable: emulated
    /// devices, or pinning failed).
    pub fn is_pinned(&self) -> bool {
        self.pinned
    }

    /// Copies `range` of `file` into `dst` from `dst_offset`, on `stream`
    /// (see [`ReaderPool::upload`]).
    pub fn upload_from_file(
        &self,
        file: &Arc<SourceFile>,
        range: Range<u64>,
        dst: &mut DeviceBuffer,
        dst_offset: usize,
        stream: &Stream,
    ) -> Result<Event> {
        self.upload(
            &ReadSource::File(Arc::clone(file)),
            range,
            dst,
            dst_offset,
            stream,
        )
    }

    /// Copies `range` of `source` into `dst` from `dst_offset`: the reader
    /// threads fill staging slots while this thread enqueues each filled
    /// slot's DMA on `stream` (a stream of `dst`'s GPU), so reading and
    /// copying overlap. Returns once everything is read and enqueued; the
    /// event completes when the bytes are on the device. On an error the
    /// rest of the upload is abandoned and the error names the source and
    /// byte range.
    pub fn upload(
        &self,
        source: &ReadSource,
        range: Range<u64>,
        dst: &mut DeviceBuffer,
        dst_offset: usize,
        stream: &Stream,
    ) -> Result<Event> {
        const OP: &str = "upload from a reader pool";
        dst.check_stream(stream, OP)?;
        let len = range.end.saturating_sub(range.start);
        crate::buffer::check_range(
            OP,
            range.start as usize,
            len as usize,
            source.len() as usize,
        )?;
        crate::buffer::check_range(OP, dst_offset, len as usize, dst.len())?;
        if len == 0 {
            return Ok(Event::completed(dst.device()));
        }
        source.advise(&range);
        // Pieces on slot-size boundaries of the file, so direct reads of a
        // piece stay within its slot.
        let slot = self.slot_bytes as u64;
        let first = range.start / slot * slot;
        let (reply, filled) = mpsc::channel();
        let cancelled = Arc::new(AtomicBool::new(false));
        let mut pieces = 0;
        {
            let mut queue = self.shared.queue.lock();
            let mut at = first;
            while at < range.end {
                let wanted = at.max(range.start)..(at + slot).min(range.end);
                queue.tasks.push_back(Task {
                    source: source.clone(),
                    dst_offset: dst_offset + (wanted.start - range.start) as usize,
                    wanted,
                    cancelled: Arc::clone(&cancelled),
                    reply: reply.clone(),
                });
                pieces += 1;
                at += slot;
            }
        }
        self.shared.more.notify_all();
        drop(reply);
        let mut last = None;
        let mut first_error = None;
        // Every piece answers (cancelled ones too), so every slot is back
        // in the pool when this returns.
        for _ in 0..pieces {
            let Ok(piece) = filled.recv() else {
                break;
            };
            match piece.result {
                Ok((index, skip)) => {
                    if first_error.is_none() {
                        let slot = self.shared.slots[index].lock();
                        match dst.copy_from_pinned(
                            piece.dst_offset,
                            &slot,
                            skip..skip + piece.len,
                            stream,
                        ) {
                            Ok(e) => last = Some(e),
                            Err(e) => {
                                cancelled.store(true, Ordering::Relaxed);
                                first_error = Some(e);
                            }
                        }
                    }
                    self.shared.give_slot(index);
                }
                Err(e) => {
                    cancelled.store(true, Ordering::Relaxed);
                    first_error.get_or_insert(e);
                }
            }
        }
        match (first_error, last) {
            (Some(e), _) => Err(e),
            (None, Some(e)) => Ok(e),
            (None, None) => Err(Error::Read {
                path: None,
                offset: range.start,
                len,
                reason: "the reader threads stopped".into(),
            }),
        }
    }
}

/// A reader thread: takes pieces, fills a free slot with each.
fn read_loop(shared: &Shared) {
    loop {
        let task = {
            let mut queue = shared.queue.lock();
            loop {
                if let Some(t) = queue.tasks.pop_front() {
                    break t;
                }
                if queue.closed {
                    return;
                }
                shared.more.wait(&mut queue);
            }
        };
        let len = (task.wanted.end - task.wanted.start) as usize;
        let result = if task.cancelled.load(Ordering::Relaxed) {
            Err(Error::Read {
                path: None,
                offset: task.wanted.start,
                len: len as u64,
                reason: "cancelled".into(),
            })
        } else {
            let index = shared.take_slot();
            let read = {
                let mut slot = shared.slots[index].lock();
                // Waits for the slot's previous DMA.
                slot.as_mut_slice()
                    .and_then(|bytes| task.source.read_into(&task.wanted, bytes))
            };
            match read {
                Ok(skip) => Ok((index, skip)),
                Err(e) => {
                    shared.give_slot(index);
                    Err(e)
                }
            }
        };
        let _ = task.reply.send(Filled {
            result,
            dst_offset: task.dst_offset,
            len,
        });
    }
}

impl Drop for ReaderPool {
    fn drop(&mut self) {
        self.shared.queue.lock().closed = true;
        self.shared.more.notify_all();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_follow_the_machine() {
        let o = ReaderOptions::default();
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        assert_eq!(o.threads, cores.clamp(1, 8));
        assert!(o.slots > o.threads);
        assert_eq!(o.slot_bytes % ALIGN as usize, 0);
    }

    #[test]
    fn direct_and_buffered_reads_give_the_same_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("data.bin");
        let data: Vec<u8> = (0..3 * ALIGN as usize + 123)
            .map(|i| (i % 251) as u8)
            .collect();
        std::fs::write(&path, &data).unwrap();
        for direct in [false, true] {
            let f = SourceFile::open(&path, direct).unwrap();
            if !direct {
                assert!(!f.is_direct());
            }
            let mut slot = vec![0u8; 4 * ALIGN as usize];
            for wanted in [0..10, 5000..9000, 100..data.len() as u64] {
                let skip = f.read_into(&wanted, &mut slot).unwrap();
                let n = (wanted.end - wanted.start) as usize;
                assert_eq!(
                    &slot[skip..skip + n],
                    &data[wanted.start as usize..wanted.end as usize],
                    "direct {direct} ({}), {wanted:?}",
                    f.is_direct()
                );
            }
        }
    }

    #[test]
    fn a_short_file_is_an_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("short.bin");
        std::fs::write(&path, [1u8; 100]).unwrap();
        let f = SourceFile::open(&path, false).unwrap();
        let mut slot = vec![0u8; 4096];
        let err = f.read_into(&(50..200), &mut slot).unwrap_err().to_string();
        assert!(
            err.contains("short.bin") && err.contains("50..200"),
            "{err}"
        );
        let err = SourceFile::open(&dir.path().join("missing"), false).unwrap_err();
        assert!(err.to_string().contains("missing"), "{err}");
    }
}
