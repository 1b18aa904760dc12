//! Bytes on one GPU, and every copy into, out of and between them.

use std::alloc::Layout;
use std::ops::Range;
use std::ptr::NonNull;
use std::sync::Arc;
use std::time::Instant;

use crate::link::{Job, pace};
use crate::pending::Pending;
use crate::pinned::{HostRegistration, PinnedBuffer, PinnedPool};
use crate::stream::{Event, StreamImpl};
use crate::{Device, Error, Gpu, Result, Stream};

/// Largest single transfer enqueued at once: big tensors are cut into
/// pieces of this size so a copy never spans more than one registered host
/// chunk and the driver's per-call limits never matter.
pub const COPY_CHUNK: usize = 64 << 20;

/// Bytes on one GPU ordinal, allocated on a stream (its *home*: the
/// compute stream unless [`Gpu::alloc_on`] named another).
///
/// Every operation notes the stream it ran on and the event after it, one
/// per stream (see `pending.rs`): later work on another stream waits for
/// those events, host access waits for all of them. Dropping the buffer
/// returns its bytes to the budget at once and enqueues the free of the
/// memory after its last use, without blocking the host.
pub struct DeviceBuffer {
    gpu: Gpu,
    len: usize,
    mem: Mem,
    home: Stream,
    pending: Pending,
}

pub(crate) enum Mem {
    Emulated(Arc<EmulatedMemory>),
    Cuda {
        ptr: crate::cuda::DevicePtr,
        gpu: Arc<crate::cuda::CudaGpu>,
    },
}

/// Host memory standing in for an emulated GPU's, owned by its buffer and
/// by every copy still queued on a copy engine, so it outlives them.
pub(crate) struct EmulatedMemory {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the memory is owned like a Box<[u8]>; concurrent access is
// ordered by events, as for device memory.
unsafe impl Send for EmulatedMemory {}
// SAFETY: as above.
unsafe impl Sync for EmulatedMemory {}

const PAGE: usize = 4096;

impl EmulatedMemory {
    /// `len` zeroed bytes (never uninitialised: reading those would be
    /// undefined behaviour), or `None` when the host cannot provide them.
    pub(crate) fn zeroed(len: usize) -> Option<EmulatedMemory> {
        let layout = Layout::from_size_align(len, PAGE).ok()?;
        // SAFETY: callers never ask for zero bytes.
        let ptr = NonNull::new(unsafe { std::alloc::alloc_zeroed(layout) })?;
        Some(EmulatedMemory { ptr, len })
    }

    fn addr(&self) -> usize {
        self.ptr.as_ptr() as usize
    }
}

impl Drop for EmulatedMemory {
    fn drop(&mut self) {
        // SAFETY: allocated in `zeroed` with this layout.
        unsafe {
            std::alloc::dealloc(
                self.ptr.as_ptr(),
                Layout::from_size_align_unchecked(self.len, PAGE),
            )
        }
    }
}

/// Copies `len` bytes from address `src` to address `dst`.
///
/// # Safety
/// Both ranges are valid for `len` bytes while this runs, do not
/// overlap, and nothing else writes them meanwhile.
unsafe fn copy_bytes(src: usize, dst: usize, len: usize) {
    // SAFETY: per this function's contract.
    unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, len) }
}

impl std::fmt::Debug for DeviceBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "DeviceBuffer({} bytes on device {})",
            self.len,
            self.device()
        )
    }
}

/// Fails unless `offset..offset+len` lies within `size` bytes.
pub(crate) fn check_range(
    operation: &'static str,
    offset: usize,
    len: usize,
    size: usize,
) -> Result<()> {
    match offset.checked_add(len) {
        Some(end) if end <= size => Ok(()),
        _ => Err(Error::OutOfBounds {
            operation,
            offset: offset as u64,
            len: len as u64,
            size: size as u64,
        }),
    }
}

/// `start..end` cut into pieces of at most `chunk` bytes.
pub(crate) fn chunks(range: Range<usize>, chunk: usize) -> impl Iterator<Item = Range<usize>> {
    (range.start..range.end)
        .step_by(chunk)
        .map(move |s| s..(s + chunk).min(range.end))
}

/// Whether a copy crosses the host link (and so takes a linked emulated
/// GPU's transfer time) or stays on the device.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Route {
    HostLink,
    OnDevice,
}

impl DeviceBuffer {
    pub(crate) fn new(gpu: Gpu, len: usize, mem: Mem, home: Stream) -> Self {
        DeviceBuffer {
            gpu,
            len,
            mem,
            home,
            pending: Pending::default(),
        }
    }

    /// Size in bytes (never zero).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false: zero-sized buffers cannot be allocated.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The GPU holding the bytes.
    pub fn device(&self) -> Device {
        self.gpu.device()
    }

    /// The GPU holding the bytes.
    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    /// The stream the buffer was allocated on.
    pub fn home_stream(&self) -> &Stream {
        &self.home
    }

    /// Blocks until all work using this buffer, on every stream, has completed.
    pub fn synchronize(&self) -> Result<()> {
        self.pending.synchronize()
    }

    /// Makes `stream` wait for this buffer's uses on other streams.
    pub(crate) fn order_before(&self, stream: &Stream) -> Result<()> {
        self.pending.order_before(stream)
    }

    /// Notes `event` (recorded on `stream` after work using this buffer)
    /// as that stream's last use.
    pub(crate) fn note_use(&self, stream: &Stream, event: &Event) {
        self.pending.note(stream, event)
    }

    /// Notes work just enqueued on `stream` without an event of its own.
    pub(crate) fn note_enqueued(&self, stream: &Stream) {
        self.pending.note_enqueued(stream)
    }

    /// The device address of a CUDA buffer (`None` for an emulated one).
    pub(crate) fn cuda_ptr(&self) -> Option<crate::cuda::DevicePtr> {
        match &self.mem {
            Mem::Cuda { ptr, .. } => Some(*ptr),
            Mem::Emulated(_) => None,
        }
    }

    /// Records the end of an operation on `stream` as this buffer's use there.
    fn finish(&self, stream: &Stream) -> Result<Event> {
        let e = stream.record()?;
        self.pending.note(stream, &e);
        Ok(e)
    }

    pub(crate) fn check_stream(&self, stream: &Stream, operation: &'static str) -> Result<()> {
        stream.check_on(self.gpu.id(), self.gpu.ordinal(), operation)
    }

    /// An emulated copy of `len` bytes from address `src` to address `dst`:
    /// handed to `engine` when there is one (`keep` holds the device memory
    /// until it runs), else done now. A copy over the host link takes the
    /// GPU's simulated transfer time, if it has a link.
    ///
    /// # Safety
    /// Host memory in either range stays valid and untouched until the
    /// copy completes, which the caller orders with the event it records
    /// after this on the engine's stream.
    unsafe fn emulated_copy(
        &self,
        engine: Option<&crate::link::CopyEngine>,
        (src, dst, len): (usize, usize, usize),
        keep: Vec<Arc<EmulatedMemory>>,
        route: Route,
    ) {
        let paced = route == Route::HostLink;
        match engine {
            Some(engine) => {
                engine.push(Job::Copy {
                    work: Box::new(move || {
                        let _keep = keep;
                        // SAFETY: per this function's contract.
                        unsafe { copy_bytes(src, dst, len) }
                    }),
                    bytes: len as u64,
                    paced,
                });
            }
            None => {
                let start = Instant::now();
                // SAFETY: per this function's contract.
                unsafe { copy_bytes(src, dst, len) };
                if let (true, Some(link)) = (paced, self.gpu.link()) {
                    pace(&link, len as u64, start);
                }
            }
        }
    }

    /// Copies `src` into the buffer at `offset`, ordered after every use
    /// of the buffer, on its home stream. `src` may be pageable and has
    /// been read when this returns; the buffer's later users wait for the
    /// copy itself.
    pub fn copy_from_host(&mut self, offset: usize, src: &[u8]) -> Result<()> {
        check_range("copy from host", offset, src.len(), self.len)?;
        let home = self.home.clone();
        self.copy_pageable(offset, src, &home).map(|_| ())
    }

    /// Copies bytes `offset..offset + dst.len()` of the buffer into `dst`
    /// after every use of the buffer; returns when done.
    pub fn copy_to_host(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        check_range("copy to host", offset, dst.len(), self.len)?;
        if dst.is_empty() {
            return Ok(());
        }
        match &self.mem {
            Mem::Emulated(m) => {
                // The destination is borrowed: the copy runs here, after
                // everything using the buffer.
                self.pending.synchronize()?;
                // SAFETY: the range was checked; no use is in flight.
                unsafe {
                    self.emulated_copy(
                        None,
                        (m.addr() + offset, dst.as_mut_ptr() as usize, dst.len()),
                        Vec::new(),
                        Route::HostLink,
                    )
                }
            }
            Mem::Cuda { ptr, gpu } => {
                let home = &self.home;
                self.pending.order_before(home)?;
                // SAFETY: the range was checked against this allocation; a
                // copy into pageable memory returns once it is complete,
                // and the event below is waited for regardless.
                unsafe {
                    gpu.dtoh_async(
                        dst.as_mut_ptr(),
                        *ptr + offset as u64,
                        dst.len(),
                        stream_cuda(home)?,
                    )?
                };
                home.record()?.synchronize()?;
            }
        }
        Ok(())
    }

    /// Enqueues a copy of `src[src_range]` (page-locked, or the pageable
    /// fallback) into the buffer at `offset` on `stream`, which must belong
    /// to this buffer's GPU: a direct DMA, no staging copy. Host access to
    /// `src` waits for the copy.
    pub fn copy_from_pinned(
        &mut self,
        offset: usize,
        src: &PinnedBuffer,
        src_range: Range<usize>,
        stream: &Stream,
    ) -> Result<Event> {
        const OP: &str = "copy from pinned host memory";
        self.check_stream(stream, OP)?;
        let len = src_range.end.saturating_sub(src_range.start);
        check_range(OP, src_range.start, len, src.len())?;
        check_range(OP, offset, len, self.len)?;
        self.pending.order_before(stream)?;
        src.order_before(stream)?;
        for piece in chunks(src_range.clone(), COPY_CHUNK) {
            let dst_off = offset + (piece.start - src_range.start);
            match &self.mem {
                // SAFETY: both ranges were checked; `src` is neither freed nor
                // written by the host before the event noted below completes.
                Mem::Emulated(m) => unsafe {
                    self.emulated_copy(
                        stream.engine(),
                        (
                            src.ptr() as usize + piece.start,
                            m.addr() + dst_off,
                            piece.len(),
                        ),
                        vec![Arc::clone(m)],
                        Route::HostLink,
                    )
                },
                Mem::Cuda { ptr, gpu } => {
                    let s = stream_cuda(stream)?;
                    // SAFETY: as above.
                    unsafe {
                        gpu.htod_async(
                            *ptr + dst_off as u64,
                            src.ptr().add(piece.start),
                            piece.len(),
                            s,
                        )?
                    }
                }
            }
        }
        let e = self.finish(stream)?;
        src.note_use(stream, &e);
        Ok(e)
    }

    /// Enqueues a copy of `len` bytes at `offset` of the buffer into
    /// `dst[dst_offset..]` on `stream`. Host access to `dst` waits for it.
    pub fn copy_to_pinned(
        &self,
        offset: usize,
        dst: &mut PinnedBuffer,
        dst_offset: usize,
        len: usize,
        stream: &Stream,
    ) -> Result<Event> {
        const OP: &str = "copy to pinned host memory";
        self.check_stream(stream, OP)?;
        check_range(OP, offset, len, self.len)?;
        check_range(OP, dst_offset, len, dst.len())?;
        self.pending.order_before(stream)?;
        dst.order_before(stream)?;
        for piece in chunks(offset..offset + len, COPY_CHUNK) {
            let host_off = dst_offset + (piece.start - offset);
            match &self.mem {
                // SAFETY: both ranges were checked; the host does not touch
                // `dst` before the event noted below completes.
                Mem::Emulated(m) => unsafe {
                    self.emulated_copy(
                        stream.engine(),
                        (
                            m.addr() + piece.start,
                            dst.ptr_mut() as usize + host_off,
                            piece.len(),
                        ),
                        vec![Arc::clone(m)],
                        Route::HostLink,
                    )
                },
                Mem::Cuda { ptr, gpu } => {
                    let s = stream_cuda(stream)?;
                    // SAFETY: as above.
                    unsafe {
                        gpu.dtoh_async(
                            dst.ptr_mut().add(host_off),
                            *ptr + piece.start as u64,
                            piece.len(),
                            s,
                        )?
                    }
                }
            }
        }
        let e = self.finish(stream)?;
        dst.note_use(stream, &e);
        Ok(e)
    }

    /// Enqueues a copy of `src[src_range]`, host memory registered with
    /// [`DeviceSet::register_host`](crate::DeviceSet::register_host), into
    /// the buffer at `offset`. When registration fell back to pageable
    /// memory the copy is still correct, only not asynchronous.
    pub fn copy_from_registered(
        &mut self,
        offset: usize,
        src: &HostRegistration<'_>,
        src_range: Range<usize>,
        stream: &Stream,
    ) -> Result<Event> {
        const OP: &str = "copy from registered host memory";
        self.check_stream(stream, OP)?;
        let len = src_range.end.saturating_sub(src_range.start);
        check_range(OP, src_range.start, len, src.len())?;
        check_range(OP, offset, len, self.len)?;
        self.pending.order_before(stream)?;
        for piece in src.pieces(src_range.clone()) {
            let dst_off = offset + (piece.start - src_range.start);
            let bytes = &src.bytes()[piece];
            match &self.mem {
                // SAFETY: ranges checked; the registration's drop waits for
                // the event noted below, so the bytes outlive the copy.
                Mem::Emulated(m) => unsafe {
                    self.emulated_copy(
                        stream.engine(),
                        (bytes.as_ptr() as usize, m.addr() + dst_off, bytes.len()),
                        vec![Arc::clone(m)],
                        Route::HostLink,
                    )
                },
                Mem::Cuda { ptr, gpu } => {
                    let s = stream_cuda(stream)?;
                    // SAFETY: as above; pageable sources are consumed before
                    // the call returns.
                    unsafe {
                        gpu.htod_async(*ptr + dst_off as u64, bytes.as_ptr(), bytes.len(), s)?
                    }
                }
            }
        }
        let e = self.finish(stream)?;
        src.note_use(stream, &e);
        Ok(e)
    }

    /// Enqueues a copy of `src[src_range]` into this buffer at `offset` on
    /// `stream` (this buffer's GPU). `src` may live on another GPU of the
    /// same set: the copy then goes peer to peer when peer access is
    /// enabled, through the host otherwise.
    pub fn copy_from_device(
        &mut self,
        offset: usize,
        src: &DeviceBuffer,
        src_range: Range<usize>,
        stream: &Stream,
    ) -> Result<Event> {
        const OP: &str = "device-to-device copy";
        self.check_stream(stream, OP)?;
        let len = src_range.end.saturating_sub(src_range.start);
        check_range(OP, src_range.start, len, src.len)?;
        check_range(OP, offset, len, self.len)?;
        self.pending.order_before(stream)?;
        src.pending.order_before(stream)?;
        for piece in chunks(src_range.clone(), COPY_CHUNK) {
            let dst_off = offset + (piece.start - src_range.start);
            match (&self.mem, &src.mem) {
                // SAFETY: ranges checked against both allocations, which the
                // copy keeps alive; `&mut self` and `&src` are two buffers.
                (Mem::Emulated(d), Mem::Emulated(s)) => unsafe {
                    self.emulated_copy(
                        stream.engine(),
                        (s.addr() + piece.start, d.addr() + dst_off, piece.len()),
                        vec![Arc::clone(d), Arc::clone(s)],
                        Route::OnDevice,
                    )
                },
                (Mem::Cuda { ptr: d, gpu: dg }, Mem::Cuda { ptr: s, gpu: sg }) => {
                    let st = stream_cuda(stream)?;
                    // SAFETY: ranges checked against both allocations; both
                    // buffers order their frees after the event noted below.
                    unsafe {
                        dg.dtod_async(
                            *d + dst_off as u64,
                            sg,
                            *s + piece.start as u64,
                            piece.len(),
                            st,
                        )?
                    }
                }
                _ => {
                    return Err(Error::WrongDevice {
                        operation: "device-to-device copy between an emulated and a CUDA device",
                        expected: self.device(),
                        found: src.device(),
                    });
                }
            }
        }
        let e = self.finish(stream)?;
        src.pending.note(stream, &e);
        Ok(e)
    }

    /// Copies pageable `src` into the buffer at `offset` through the pool's
    /// page-locked staging slots: the CPU fills slot *k + 1* while the copy
    /// engine drains slot *k*. Returns once `src` has been read (so it may
    /// be reused); the returned event completes when the bytes are on the
    /// device. Without pinned memory the pool falls back to plain pageable
    /// copies.
    pub fn upload(
        &mut self,
        offset: usize,
        src: &[u8],
        pool: &PinnedPool,
        stream: &Stream,
    ) -> Result<Event> {
        const OP: &str = "upload";
        self.check_stream(stream, OP)?;
        check_range(OP, offset, src.len(), self.len)?;
        if !pool.stages() {
            return self.copy_pageable(offset, src, stream);
        }
        let mut last = None;
        for piece in chunks(0..src.len(), pool.slot_bytes()) {
            let mut slot = pool.acquire();
            slot.as_mut_slice()?[..piece.len()].copy_from_slice(&src[piece.clone()]);
            last =
                Some(self.copy_from_pinned(offset + piece.start, &slot, 0..piece.len(), stream)?);
        }
        match last {
            Some(e) => Ok(e),
            None => Ok(Event::completed(self.device())),
        }
    }

    /// Copies pageable `src` into the buffer at `offset` on `stream`, after
    /// every use of the buffer; `src` has been read on return. CUDA stages
    /// pageable memory itself; an emulated copy runs here, since `src` is
    /// only borrowed.
    fn copy_pageable(&mut self, offset: usize, src: &[u8], stream: &Stream) -> Result<Event> {
        if src.is_empty() {
            return Ok(Event::completed(self.device()));
        }
        match &self.mem {
            Mem::Emulated(m) => {
                self.pending.synchronize()?;
                // SAFETY: range checked by the caller; no use is in flight
                // and `src` is read before this returns.
                unsafe {
                    self.emulated_copy(
                        None,
                        (src.as_ptr() as usize, m.addr() + offset, src.len()),
                        Vec::new(),
                        Route::HostLink,
                    )
                };
                Ok(Event::completed(self.device()))
            }
            Mem::Cuda { ptr, gpu } => {
                self.pending.order_before(stream)?;
                let s = stream_cuda(stream)?;
                for piece in chunks(0..src.len(), COPY_CHUNK) {
                    let bytes = &src[piece.clone()];
                    // SAFETY: range checked by the caller; pageable memory is
                    // copied out by the driver before the call returns.
                    unsafe {
                        gpu.htod_async(
                            *ptr + (offset + piece.start) as u64,
                            bytes.as_ptr(),
                            bytes.len(),
                            s,
                        )?
                    }
                }
                self.finish(stream)
            }
        }
    }

    /// Copies bytes `offset..offset + dst.len()` of the buffer into `dst`
    /// through the pool's staging slots, on `stream`; returns when done.
    pub fn download(
        &self,
        offset: usize,
        dst: &mut [u8],
        pool: &PinnedPool,
        stream: &Stream,
    ) -> Result<()> {
        const OP: &str = "download";
        self.check_stream(stream, OP)?;
        check_range(OP, offset, dst.len(), self.len)?;
        if !pool.stages() {
            return self.copy_to_host(offset, dst);
        }
        for piece in chunks(0..dst.len(), pool.slot_bytes()) {
            let mut slot = pool.acquire();
            self.copy_to_pinned(offset + piece.start, &mut slot, 0, piece.len(), stream)?;
            dst[piece.clone()].copy_from_slice(&slot.as_slice()?[..piece.len()]);
        }
        Ok(())
    }

    /// Sets every byte to zero, on the home stream.
    pub(crate) fn zero(&self) -> Result<()> {
        match &self.mem {
            // Emulated memory is zeroed when allocated.
            Mem::Emulated(_) => Ok(()),
            Mem::Cuda { ptr, gpu } => {
                // SAFETY: the whole allocation, on the stream it was
                // allocated on (so after the allocation).
                unsafe { gpu.memset_zero_async(*ptr, self.len, stream_cuda(&self.home)?)? };
                self.note_enqueued(&self.home);
                Ok(())
            }
        }
    }
}

pub(crate) fn stream_cuda(stream: &Stream) -> Result<&crate::cuda::CudaStream> {
    match &stream.imp {
        StreamImpl::Cuda { stream, .. } => Ok(stream),
        StreamImpl::Emulated | StreamImpl::Engine(_) => Err(Error::WrongDevice {
            operation: "CUDA copy on an emulated device's stream",
            expected: stream.device(),
            found: stream.device(),
        }),
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        if let Mem::Cuda { ptr, gpu } = &self.mem {
            // The free goes on the stream of the latest use on this GPU,
            // after waits for the uses on other streams: enqueued, so the
            // host does not wait. Errors cannot be returned from drop.
            let uses = self.pending.take();
            let free_on = uses
                .iter()
                .filter(|u| u.stream.gpu_id == self.gpu.id())
                .max_by_key(|u| u.seq)
                .map_or_else(|| self.home.clone(), |u| u.stream.clone());
            for u in uses.iter().filter(|u| u.stream.id != free_on.id) {
                if u.event().and_then(|e| free_on.wait(&e)).is_err() {
                    // The free cannot be ordered after this use: wait for it
                    // here rather than free memory still in use.
                    let _ = u.event().and_then(|e| e.synchronize());
                }
            }
            if let Ok(s) = stream_cuda(&free_on) {
                // SAFETY: allocated by gpu.alloc for this buffer and freed
                // once, after every use (ordered above).
                unsafe { gpu.free(*ptr, s) };
            }
        }
        // Emulated memory goes when the last queued copy holding it has run.
        self.gpu.inner.ledger.release(self.len as u64);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_cover_the_range_exactly() {
        let v: Vec<_> = chunks(3..13, 4).collect();
        assert_eq!(v, vec![3..7, 7..11, 11..13]);
        assert_eq!(chunks(5..5, 4).count(), 0);
    }

    #[test]
    fn range_checks_do_not_overflow() {
        assert!(check_range("t", 2, 3, 5).is_ok());
        let e = check_range("t", 3, 3, 5).unwrap_err().to_string();
        assert!(e.contains("3..6") && e.contains("5 bytes"), "{e}");
        assert!(check_range("t", usize::MAX, 2, 5).is_err());
    }

    #[test]
    fn emulated_memory_is_zeroed_and_refuses_absurd_sizes() {
        let m = EmulatedMemory::zeroed(10_000).unwrap();
        // SAFETY: 10_000 bytes were just allocated and zeroed.
        let bytes = unsafe { std::slice::from_raw_parts(m.ptr.as_ptr(), m.len) };
        assert!(bytes.iter().all(|&b| b == 0));
        assert!(EmulatedMemory::zeroed(usize::MAX / 2 + 1).is_none());
    }
}
