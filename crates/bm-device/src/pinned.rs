//! Page-locked host memory: standalone buffers, a reusable pool of staging
//! slots, and registration of existing host memory.
//!
//! Pinning is expensive (`cuMemHostAlloc` runs at a couple of GB/s and
//! `cuMemFreeHost` synchronises the device), so staging memory is
//! allocated once and reused; pinning per transfer is slower than not
//! pinning at all. Staging memory is portable (pinned for every context)
//! and deliberately *not* write-combined, because downloads read it back
//! on the CPU. Whenever pinning fails, everything falls back to pageable
//! memory and stays correct, only slower.

use std::alloc::Layout;
use std::ops::{Deref, DerefMut, Range};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicUsize, Ordering};

use parking_lot::{Mutex, MutexGuard};

use crate::buffer::chunks;
use crate::pending::Pending;
use crate::stream::Event;
use crate::{Device, DeviceSet, Error, Result, Stream};

/// Alignment of pageable fallback buffers: a page, like pinned memory.
const PAGE: usize = 4096;

/// Existing host memory is registered in pieces of at most this size,
/// split at addresses that are multiples of it: one huge registration
/// fails on recent drivers (r580 caps the page bookkeeping of a single
/// call), and aligned splits keep pieces from sharing a page.
pub const REGISTER_CHUNK: usize = 1 << 30;

/// Host memory for asynchronous copies: page-locked when the set has a
/// CUDA GPU and pinning succeeded, pageable otherwise. Host access waits
/// for the last copy using the buffer.
pub struct PinnedBuffer {
    ptr: NonNull<u8>,
    len: usize,
    backing: Backing,
    pending: Pending,
}

enum Backing {
    Pageable,
    Pinned(std::sync::Arc<crate::cuda::CudaGpu>),
}

// SAFETY: the buffer owns its memory exclusively, like a Vec<u8>; shared
// access only reads it.
unsafe impl Send for PinnedBuffer {}
// SAFETY: as above.
unsafe impl Sync for PinnedBuffer {}

impl std::fmt::Debug for PinnedBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "PinnedBuffer({} bytes, pinned: {})",
            self.len,
            self.is_pinned()
        )
    }
}

impl PinnedBuffer {
    /// `len` zeroed pageable bytes, page-aligned.
    fn pageable(len: usize) -> Result<Self> {
        let layout = Layout::from_size_align(len, PAGE)
            .map_err(|_| Error::HostAlloc { bytes: len as u64 })?;
        // SAFETY: callers never pass len == 0.
        let raw = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).ok_or(Error::HostAlloc { bytes: len as u64 })?;
        Ok(PinnedBuffer {
            ptr,
            len,
            backing: Backing::Pageable,
            pending: Pending::default(),
        })
    }

    /// `len` zeroed page-locked bytes.
    fn pinned(gpu: &std::sync::Arc<crate::cuda::CudaGpu>, len: usize) -> Result<Self> {
        let raw = gpu.alloc_pinned(len)?;
        let ptr = NonNull::new(raw).ok_or(Error::HostAlloc { bytes: len as u64 })?;
        // SAFETY: fresh allocation of len bytes.
        unsafe { std::ptr::write_bytes(ptr.as_ptr(), 0, len) };
        Ok(PinnedBuffer {
            ptr,
            len,
            backing: Backing::Pinned(std::sync::Arc::clone(gpu)),
            pending: Pending::default(),
        })
    }

    /// Allocates `len` bytes for the set: pinned when it has a CUDA GPU,
    /// pageable otherwise or when pinning fails.
    pub(crate) fn for_set(set: &DeviceSet, len: usize) -> Result<(Self, Option<String>)> {
        if len == 0 {
            return Err(Error::ZeroSizedAllocation {
                device: Device::Cpu,
            });
        }
        if let Some(g) = set.gpus().first().and_then(|g| g.cuda()) {
            return match Self::pinned(g, len) {
                Ok(b) => Ok((b, None)),
                Err(e) => Ok((
                    Self::pageable(len)?,
                    Some(format!("pinning failed ({e}); using pageable memory")),
                )),
            };
        }
        let reason = if set.is_emulated() {
            "emulated devices copy with memcpy; staging memory is pageable"
        } else {
            "no CUDA GPU; staging memory is pageable"
        };
        Ok((Self::pageable(len)?, Some(reason.to_string())))
    }

    /// Whether the bytes are page-locked (else the pageable fallback).
    pub fn is_pinned(&self) -> bool {
        match self.backing {
            Backing::Pageable => false,
            Backing::Pinned(_) => true,
        }
    }

    /// Size in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when the buffer holds no bytes (never: zero-sized buffers are refused).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The bytes, once the last copy using them has completed.
    pub fn as_slice(&self) -> Result<&[u8]> {
        self.wait_pending()?;
        Ok(self.bytes())
    }

    /// The bytes, mutably, once the last copy using them has completed.
    pub fn as_mut_slice(&mut self) -> Result<&mut [u8]> {
        self.wait_pending()?;
        Ok(self.bytes_mut())
    }

    /// The bytes without waiting: only for enqueuing copies, which the
    /// stream orders after the pending one.
    pub(crate) fn bytes(&self) -> &[u8] {
        // SAFETY: ptr is valid for len initialised bytes.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    pub(crate) fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: ptr is valid for len bytes, uniquely borrowed.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }

    pub(crate) fn ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }

    pub(crate) fn ptr_mut(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    fn wait_pending(&self) -> Result<()> {
        self.pending.synchronize()
    }

    /// Makes `stream` wait for copies using this buffer on other streams.
    pub(crate) fn order_before(&self, stream: &Stream) -> Result<()> {
        self.pending.order_before(stream)
    }

    /// Notes `event` (after a copy on `stream`) as that stream's last use.
    pub(crate) fn note_use(&self, stream: &Stream, event: &Event) {
        self.pending.note(stream, event)
    }
}

impl Drop for PinnedBuffer {
    fn drop(&mut self) {
        let _ = self.wait_pending();
        match &self.backing {
            Backing::Pageable => {
                // SAFETY: allocated in `pageable` with this layout.
                unsafe {
                    std::alloc::dealloc(
                        self.ptr.as_ptr(),
                        Layout::from_size_align_unchecked(self.len, PAGE),
                    )
                }
            }
            // SAFETY: allocated by alloc_pinned; no copy is in flight any more.
            Backing::Pinned(g) => unsafe { g.free_pinned(self.ptr.as_ptr()) },
        }
    }
}

/// A fixed ring of staging slots, allocated once and reused by
/// [`DeviceBuffer::upload`](crate::DeviceBuffer::upload) and
/// [`DeviceBuffer::download`](crate::DeviceBuffer::download). A slot is
/// reused only after the copy that last used it completed (its event), so
/// with two or more slots the CPU fills one while the copy engine drains
/// another. Safe to share between threads.
pub struct PinnedPool {
    slots: Vec<Mutex<PinnedBuffer>>,
    next: AtomicUsize,
    slot_bytes: usize,
    stages: bool,
    fallback_reason: Option<String>,
}

impl std::fmt::Debug for PinnedPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "PinnedPool({} slots of {} bytes, pinned: {})",
            self.slots.len(),
            self.slot_bytes,
            self.is_pinned()
        )
    }
}

/// A slot of a [`PinnedPool`], held until dropped.
pub struct PoolSlot<'a>(MutexGuard<'a, PinnedBuffer>);

impl Deref for PoolSlot<'_> {
    type Target = PinnedBuffer;
    fn deref(&self) -> &PinnedBuffer {
        &self.0
    }
}

impl DerefMut for PoolSlot<'_> {
    fn deref_mut(&mut self) -> &mut PinnedBuffer {
        &mut self.0
    }
}

impl PinnedPool {
    /// Default slot size: large enough for full-speed DMA (loaders reach
    /// the link limit from 8–16 MiB pieces), small enough to allocate fast.
    pub const DEFAULT_SLOT_BYTES: usize = 16 << 20;
    /// Default slot count: enough to keep the copy engine fed while the
    /// CPU fills the next slots.
    pub const DEFAULT_SLOTS: usize = 4;

    pub(crate) fn new(set: &DeviceSet, slot_bytes: usize, slots: usize) -> Result<Self> {
        if slots == 0 || slot_bytes == 0 {
            return Err(Error::ZeroSizedAllocation {
                device: Device::Cpu,
            });
        }
        let mut buffers = Vec::with_capacity(slots);
        let mut fallback_reason = None;
        for _ in 0..slots {
            let (b, reason) = PinnedBuffer::for_set(set, slot_bytes)?;
            fallback_reason = fallback_reason.or(reason);
            buffers.push(Mutex::new(b));
        }
        let pinned = buffers.iter().all(|b| b.lock().is_pinned());
        Ok(PinnedPool {
            slots: buffers,
            next: AtomicUsize::new(0),
            slot_bytes,
            // Emulated sets stage too, so CI runs the same slot logic as a GPU.
            stages: pinned || set.is_emulated(),
            fallback_reason,
        })
    }

    /// Whether every slot is page-locked.
    pub fn is_pinned(&self) -> bool {
        self.slots.iter().all(|s| s.lock().is_pinned())
    }

    /// Why the pool is not pinned, if it is not.
    pub fn fallback_reason(&self) -> Option<&str> {
        self.fallback_reason.as_deref()
    }

    /// Bytes per slot.
    pub fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    /// Number of slots.
    pub fn slot_count(&self) -> usize {
        self.slots.len()
    }

    /// Whether uploads go through the slots (pinned, or emulated devices);
    /// otherwise they are plain pageable copies, which need no staging.
    pub(crate) fn stages(&self) -> bool {
        self.stages
    }

    /// The next slot in ring order, blocking while another thread holds it.
    /// Its host access waits for the slot's previous copy.
    pub fn acquire(&self) -> PoolSlot<'_> {
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.slots.len();
        PoolSlot(self.slots[i].lock())
    }
}

/// Existing host memory registered (page-locked in place) for DMA, in
/// pieces of at most [`REGISTER_CHUNK`]. Borrowing the bytes keeps them
/// alive; dropping waits for every copy from them and unregisters.
pub struct HostRegistration<'a> {
    bytes: &'a [u8],
    registered: Vec<Range<usize>>,
    gpu: Option<std::sync::Arc<crate::cuda::CudaGpu>>,
    pending: Pending,
    fallback_reason: Option<String>,
}

impl std::fmt::Debug for HostRegistration<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "HostRegistration({} bytes in {} pieces, registered: {})",
            self.bytes.len(),
            self.registered.len(),
            self.is_registered()
        )
    }
}

/// `range` of memory starting at address `base`, split at addresses that
/// are multiples of `chunk`.
fn aligned_pieces(base: usize, range: Range<usize>, chunk: usize) -> Vec<Range<usize>> {
    let mut pieces = Vec::new();
    let mut start = range.start;
    while start < range.end {
        let addr = base + start;
        let next_boundary = (addr / chunk + 1) * chunk;
        let end = (start + (next_boundary - addr)).min(range.end);
        pieces.push(start..end);
        start = end;
    }
    pieces
}

impl<'a> HostRegistration<'a> {
    pub(crate) fn new(set: &DeviceSet, bytes: &'a [u8]) -> Self {
        let mut reg = HostRegistration {
            bytes,
            registered: Vec::new(),
            gpu: None,
            pending: Pending::default(),
            fallback_reason: None,
        };
        if bytes.is_empty() {
            reg.fallback_reason = Some("nothing to register".into());
            return reg;
        }
        if let Some(g) = set.gpus().first().and_then(|g| g.cuda()) {
            let pieces = aligned_pieces(bytes.as_ptr() as usize, 0..bytes.len(), REGISTER_CHUNK);
            for piece in pieces {
                // SAFETY: the piece lies within `bytes`, which outlives the
                // registration; aligned splitting keeps pieces from sharing pages.
                match unsafe { g.host_register(bytes[piece.clone()].as_ptr(), piece.len()) } {
                    Ok(()) => reg.registered.push(piece),
                    Err(e) => {
                        reg.unregister(g);
                        reg.fallback_reason =
                            Some(format!("registering failed ({e}); copies are pageable"));
                        return reg;
                    }
                }
            }
            reg.gpu = Some(std::sync::Arc::clone(g));
            return reg;
        }
        reg.fallback_reason = Some(if set.is_emulated() {
            "emulated devices copy with memcpy; nothing to register".into()
        } else {
            "no CUDA GPU; nothing to register".into()
        });
        reg
    }

    fn unregister(&mut self, g: &crate::cuda::CudaGpu) {
        for piece in self.registered.drain(..) {
            // SAFETY: registered above; no copy is in flight (drop waited).
            unsafe { g.host_unregister(self.bytes[piece].as_ptr()) };
        }
    }

    /// Whether the memory is page-locked (else copies fall back to pageable).
    pub fn is_registered(&self) -> bool {
        !self.registered.is_empty()
    }

    /// Why the memory is not registered, if it is not.
    pub fn fallback_reason(&self) -> Option<&str> {
        self.fallback_reason.as_deref()
    }

    /// Size in bytes.
    pub fn len(&self) -> usize {
        self.bytes.len()
    }

    /// True when no bytes are covered.
    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }

    pub(crate) fn bytes(&self) -> &'a [u8] {
        self.bytes
    }

    /// `range` split so no piece crosses a registration boundary nor
    /// exceeds the copy chunk.
    pub(crate) fn pieces(&self, range: Range<usize>) -> Vec<Range<usize>> {
        aligned_pieces(self.bytes.as_ptr() as usize, range, REGISTER_CHUNK)
            .into_iter()
            .flat_map(|p| chunks(p, crate::buffer::COPY_CHUNK))
            .collect()
    }

    /// Notes `event` (after a copy on `stream`) as that stream's last use.
    pub(crate) fn note_use(&self, stream: &Stream, event: &Event) {
        self.pending.note(stream, event)
    }
}

impl Drop for HostRegistration<'_> {
    fn drop(&mut self) {
        let _ = self.pending.synchronize();
        if let Some(g) = self.gpu.take() {
            self.unregister(&g);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_pieces_split_at_address_multiples() {
        // Memory at address 10 with boundaries every 8: 10..16, 16..24, 24..27.
        let p = aligned_pieces(10, 0..17, 8);
        assert_eq!(p, vec![0..6, 6..14, 14..17]);
        assert_eq!(aligned_pieces(16, 0..8, 8), vec![0..8]);
        assert!(aligned_pieces(16, 3..3, 8).is_empty());
    }
}
