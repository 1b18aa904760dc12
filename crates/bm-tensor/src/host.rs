//! Owned, aligned host memory, and typed views of bytes.

use std::alloc::{self, Layout};
use std::borrow::Cow;

use bytemuck::Pod;

use crate::Error;

/// Alignment of [`HostBuffer`]s: a cache line, enough for any SIMD load and
/// for every element type.
pub const HOST_ALIGN: usize = 64;

/// An owned, zero-initialised, 64-byte-aligned host buffer.
pub struct HostBuffer {
    ptr: std::ptr::NonNull<u8>,
    len: usize,
}

// SAFETY: HostBuffer owns its allocation exclusively, like a Vec<u8>.
unsafe impl Send for HostBuffer {}
// SAFETY: shared access only hands out &[u8].
unsafe impl Sync for HostBuffer {}

impl HostBuffer {
    /// Allocates `len` zeroed bytes.
    pub fn zeroed(len: usize) -> Result<Self, Error> {
        if len == 0 {
            return Ok(HostBuffer {
                ptr: std::ptr::NonNull::<u8>::dangling(),
                len: 0,
            });
        }
        let layout =
            Layout::from_size_align(len, HOST_ALIGN).map_err(|_| Error::Alloc { bytes: len })?;
        // SAFETY: layout has a non-zero size.
        let raw = unsafe { alloc::alloc_zeroed(layout) };
        let ptr = std::ptr::NonNull::new(raw).ok_or(Error::Alloc { bytes: len })?;
        Ok(HostBuffer { ptr, len })
    }

    /// Copies `bytes` into a new aligned buffer.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, Error> {
        let mut buf = HostBuffer::zeroed(bytes.len())?;
        buf.as_mut_bytes().copy_from_slice(bytes);
        Ok(buf)
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when the buffer holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The bytes.
    pub fn as_bytes(&self) -> &[u8] {
        // SAFETY: ptr is valid for len bytes (or dangling with len 0).
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    /// The bytes, mutably.
    pub fn as_mut_bytes(&mut self) -> &mut [u8] {
        // SAFETY: ptr is valid for len bytes and uniquely owned.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for HostBuffer {
    fn drop(&mut self) {
        if self.len != 0 {
            // SAFETY: allocated in `zeroed` with this exact layout.
            unsafe {
                alloc::dealloc(
                    self.ptr.as_ptr(),
                    Layout::from_size_align_unchecked(self.len, HOST_ALIGN),
                )
            }
        }
    }
}

impl std::fmt::Debug for HostBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HostBuffer({} bytes)", self.len)
    }
}

/// Views `bytes` as a slice of `T`: borrowed when aligned, copied otherwise.
///
/// Fails when the length is not a multiple of `size_of::<T>()`.
pub fn typed_slice<T: Pod>(bytes: &[u8]) -> Result<Cow<'_, [T]>, Error> {
    let size = std::mem::size_of::<T>();
    if size == 0 || !bytes.len().is_multiple_of(size) {
        return Err(Error::LengthMismatch {
            what: format!("slice of {}", std::any::type_name::<T>()),
            expected: bytes.len() / size.max(1) * size,
            found: bytes.len(),
        });
    }
    match bytemuck::try_cast_slice(bytes) {
        Ok(s) => Ok(Cow::Borrowed(s)),
        Err(_) => Ok(Cow::Owned(bytemuck::pod_collect_to_vec(bytes))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_buffer_is_aligned_and_zeroed() {
        let b = HostBuffer::zeroed(1000).unwrap();
        assert_eq!(b.as_bytes().as_ptr() as usize % HOST_ALIGN, 0);
        assert!(b.as_bytes().iter().all(|&x| x == 0));
        assert!(HostBuffer::zeroed(0).unwrap().is_empty());
    }

    #[test]
    fn typed_slice_borrows_when_aligned_and_copies_otherwise() {
        let values = [1.0f32, 2.0, 3.0];
        let mut bytes = [0u8; 13];
        bytes[1..].copy_from_slice(bytemuck::cast_slice(&values));
        let aligned = HostBuffer::from_bytes(&bytes[1..]).unwrap();
        assert!(matches!(
            typed_slice::<f32>(aligned.as_bytes()).unwrap(),
            Cow::Borrowed(_)
        ));
        let misaligned = typed_slice::<f32>(&bytes[1..]).unwrap();
        assert_eq!(&*misaligned, &values);
        assert!(typed_slice::<f32>(&bytes[..5]).is_err());
    }
}
