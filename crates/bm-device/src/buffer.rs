//! Bytes on one GPU, and every copy into, out of and between them.

use std::ops::Range;

use parking_lot::Mutex;

use crate::pinned::{HostRegistration, PinnedBuffer, PinnedPool};
use crate::stream::Event;
use crate::{Device, Error, Gpu, Result, Stream};

/// Largest single transfer enqueued at once: big tensors are cut into
/// pieces of this size so a copy never spans more than one registered host
/// chunk and the driver's per-call limits never matter.
pub const COPY_CHUNK: usize = 64 << 20;

/// Bytes on one GPU ordinal. The bytes are returned to the device, and to
/// its budget, on drop (after any copy still using them completes).
///
/// Asynchronous copies return an [`Event`]; the buffer also remembers the
/// last one, so later operations on any stream are ordered after it and
/// the buffer is never freed under a copy in flight.
pub struct DeviceBuffer {
    gpu: Gpu,
    len: usize,
    mem: Mem,
    pending: Mutex<Option<Event>>,
}

pub(crate) enum Mem {
    Emulated(Box<[u8]>),
    Cuda {
        ptr: crate::cuda::DevicePtr,
        gpu: std::sync::Arc<crate::cuda::CudaGpu>,
    },
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

impl DeviceBuffer {
    pub(crate) fn new(gpu: Gpu, len: usize, mem: Mem) -> Self {
        DeviceBuffer {
            gpu,
            len,
            mem,
            pending: Mutex::new(None),
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

    /// Blocks until the last asynchronous copy involving this buffer has completed.
    pub fn synchronize(&self) -> Result<()> {
        let pending = self.pending.lock().clone();
        match pending {
            Some(e) => e.synchronize(),
            None => Ok(()),
        }
    }

    /// Orders `stream` after the last copy involving this buffer.
    pub(crate) fn order_after_pending(&self, stream: &Stream) -> Result<()> {
        let pending = self.pending.lock().clone();
        match pending {
            Some(e) => stream.wait(&e),
            None => Ok(()),
        }
    }

    /// Makes `event` (the end of a kernel or copy using this buffer) the
    /// last use that later work and the drop wait for.
    pub(crate) fn set_pending(&self, event: Event) {
        *self.pending.lock() = Some(event);
    }

    /// The device address of a CUDA buffer (`None` for an emulated one).
    pub(crate) fn cuda_ptr(&self) -> Option<crate::cuda::DevicePtr> {
        match &self.mem {
            Mem::Cuda { ptr, .. } => Some(*ptr),
            Mem::Emulated(_) => None,
        }
    }

    /// Records the end of an operation on `stream` as this buffer's last use.
    fn finish(&self, stream: &Stream) -> Result<Event> {
        let e = stream.record()?;
        *self.pending.lock() = Some(e.clone());
        Ok(e)
    }

    fn check_stream(&self, stream: &Stream, operation: &'static str) -> Result<()> {
        stream.check_on(self.gpu.id(), self.gpu.ordinal(), operation)
    }

    /// Copies `src` into the buffer at `offset`; returns when done. The
    /// host memory may be pageable.
    pub fn copy_from_host(&mut self, offset: usize, src: &[u8]) -> Result<()> {
        check_range("copy from host", offset, src.len(), self.len)?;
        self.synchronize()?;
        match &mut self.mem {
            Mem::Emulated(b) => b[offset..offset + src.len()].copy_from_slice(src),
            // SAFETY: the range was checked against this allocation.
            Mem::Cuda { ptr, gpu } => unsafe { gpu.htod_sync(*ptr + offset as u64, src)? },
        }
        Ok(())
    }

    /// Copies bytes `offset..offset + dst.len()` of the buffer into `dst`;
    /// returns when done.
    pub fn copy_to_host(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        check_range("copy to host", offset, dst.len(), self.len)?;
        self.synchronize()?;
        match &self.mem {
            Mem::Emulated(b) => dst.copy_from_slice(&b[offset..offset + dst.len()]),
            // SAFETY: the range was checked against this allocation.
            Mem::Cuda { ptr, gpu } => unsafe { gpu.dtoh_sync(dst, *ptr + offset as u64)? },
        }
        Ok(())
    }

    /// Enqueues a copy of `src[src_range]` (page-locked, or the pageable
    /// fallback) into the buffer at `offset` on `stream`, which must belong
    /// to this buffer's GPU. Host access to `src` waits for the copy.
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
        self.order_after_pending(stream)?;
        src.order_after_pending(stream)?;
        for piece in chunks(src_range.clone(), COPY_CHUNK) {
            let dst_off = offset + (piece.start - src_range.start);
            match &mut self.mem {
                Mem::Emulated(b) => {
                    b[dst_off..dst_off + piece.len()].copy_from_slice(&src.bytes()[piece.clone()])
                }
                Mem::Cuda { ptr, gpu } => {
                    let s = stream_cuda(stream)?;
                    // SAFETY: both ranges were checked; `src` is not freed or
                    // written by the host before its pending event (below) completes.
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
        src.set_pending(e.clone());
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
        self.order_after_pending(stream)?;
        dst.order_after_pending(stream)?;
        for piece in chunks(offset..offset + len, COPY_CHUNK) {
            let host_off = dst_offset + (piece.start - offset);
            match &self.mem {
                Mem::Emulated(b) => {
                    dst.bytes_mut()[host_off..host_off + piece.len()].copy_from_slice(&b[piece])
                }
                Mem::Cuda { ptr, gpu } => {
                    let s = stream_cuda(stream)?;
                    // SAFETY: both ranges were checked; the host does not
                    // touch `dst` before its pending event (below) completes.
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
        dst.set_pending(e.clone());
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
        self.order_after_pending(stream)?;
        for piece in src.pieces(src_range.clone()) {
            let dst_off = offset + (piece.start - src_range.start);
            let bytes = &src.bytes()[piece];
            match &mut self.mem {
                Mem::Emulated(b) => b[dst_off..dst_off + bytes.len()].copy_from_slice(bytes),
                Mem::Cuda { ptr, gpu } => {
                    let s = stream_cuda(stream)?;
                    // SAFETY: ranges checked; the registration outlives the
                    // copy because its drop waits for the event recorded below,
                    // and pageable sources are consumed before the call returns.
                    unsafe {
                        gpu.htod_async(*ptr + dst_off as u64, bytes.as_ptr(), bytes.len(), s)?
                    }
                }
            }
        }
        let e = self.finish(stream)?;
        src.add_pending(e.clone());
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
        self.order_after_pending(stream)?;
        src.order_after_pending(stream)?;
        for piece in chunks(src_range.clone(), COPY_CHUNK) {
            let dst_off = offset + (piece.start - src_range.start);
            match (&mut self.mem, &src.mem) {
                (Mem::Emulated(d), Mem::Emulated(s)) => {
                    d[dst_off..dst_off + piece.len()].copy_from_slice(&s[piece])
                }
                (Mem::Cuda { ptr: d, gpu: dg }, Mem::Cuda { ptr: s, gpu: sg }) => {
                    let st = stream_cuda(stream)?;
                    // SAFETY: ranges checked against both allocations; both
                    // buffers wait for the event recorded below before freeing.
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
        *src.pending.lock() = Some(e.clone());
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
            return self.copy_pageable_async(offset, src, stream);
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

    /// Pageable host-to-device copies enqueued on `stream`: the driver
    /// stages pageable memory itself and has consumed `src` on return.
    fn copy_pageable_async(&mut self, offset: usize, src: &[u8], stream: &Stream) -> Result<Event> {
        self.order_after_pending(stream)?;
        for piece in chunks(0..src.len(), COPY_CHUNK) {
            let bytes = &src[piece.clone()];
            match &mut self.mem {
                Mem::Emulated(b) => {
                    b[offset + piece.start..offset + piece.end].copy_from_slice(bytes)
                }
                Mem::Cuda { ptr, gpu } => {
                    let s = stream_cuda(stream)?;
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
            }
        }
        self.finish(stream)
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
}

pub(crate) fn stream_cuda(stream: &Stream) -> Result<&crate::cuda::CudaStream> {
    match &stream.imp {
        crate::stream::StreamImpl::Cuda { stream, .. } => Ok(stream),
        crate::stream::StreamImpl::Emulated => Err(Error::WrongDevice {
            operation: "CUDA copy on an emulated device's stream",
            expected: stream.device(),
            found: stream.device(),
        }),
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        // A copy may still read or write the bytes: wait for it first.
        // Errors cannot be returned from drop; the driver keeps them.
        let _ = self.synchronize();
        match &self.mem {
            Mem::Emulated(_) => {}
            // SAFETY: allocated by gpu.alloc for this buffer, freed once here.
            Mem::Cuda { ptr, gpu } => unsafe { gpu.free(*ptr) },
        }
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
}
