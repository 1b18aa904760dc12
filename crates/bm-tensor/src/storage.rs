//! Where a tensor's bytes live.

use std::alloc::{self, Layout};
use std::borrow::Cow;

use bytemuck::Pod;

use crate::{Error, MmapView, TensorMeta};

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

/// Where a tensor's bytes are.
#[derive(Debug)]
pub enum Storage {
    /// No bytes: the tensor only has a dtype and a shape.
    Meta,
    /// An owned aligned host buffer.
    Host(HostBuffer),
    /// A zero-copy view of a mapped checkpoint or offload file.
    Mmap(MmapView),
    /// Bytes on a GPU (CUDA, or an emulated device in tests), accounted
    /// against that device's budget until dropped.
    Device(bm_device::DeviceBuffer),
}

impl Storage {
    /// The bytes of a host-readable storage, `None` for [`Storage::Meta`].
    pub fn host_bytes(&self) -> Option<&[u8]> {
        match self {
            Storage::Meta => None,
            Storage::Host(b) => Some(b.as_bytes()),
            Storage::Mmap(v) => Some(v.as_bytes()),
            Storage::Device(_) => None,
        }
    }

    /// Bytes held, wherever they are; `None` for [`Storage::Meta`].
    pub fn byte_len(&self) -> Option<usize> {
        match self {
            Storage::Meta => None,
            Storage::Host(b) => Some(b.len()),
            Storage::Mmap(v) => Some(v.len()),
            Storage::Device(b) => Some(b.len()),
        }
    }

    /// Where the bytes are: the host, a GPU ordinal, or `None` for
    /// [`Storage::Meta`].
    pub fn device(&self) -> Option<bm_device::Device> {
        match self {
            Storage::Meta => None,
            Storage::Host(_) | Storage::Mmap(_) => Some(bm_device::Device::Cpu),
            Storage::Device(b) => Some(b.device()),
        }
    }
}

/// A tensor: metadata plus where its bytes are.
#[derive(Debug)]
pub struct Tensor {
    /// Dtype and shape.
    pub meta: TensorMeta,
    /// The bytes, if any.
    pub storage: Storage,
}

impl Tensor {
    /// A tensor with no bytes.
    pub fn meta(meta: TensorMeta) -> Self {
        Tensor {
            meta,
            storage: Storage::Meta,
        }
    }

    /// A tensor over `storage`, checking that its length fits `meta`.
    pub fn new(meta: TensorMeta, storage: Storage) -> Result<Self, Error> {
        if let Some(found) = storage.byte_len() {
            let expected = meta
                .checked_byte_len()
                .ok_or_else(|| Error::LengthMismatch {
                    what: format!("{:?} tensor of shape {:?}", meta.dtype, meta.shape),
                    expected: usize::MAX,
                    found,
                })?;
            if expected != found {
                return Err(Error::LengthMismatch {
                    what: format!("{} tensor of shape {:?}", meta.dtype, meta.shape),
                    expected,
                    found,
                });
            }
        }
        Ok(Tensor { meta, storage })
    }
}

/// Views `bytes` as a slice of `T`: borrowed when aligned, copied otherwise.
///
/// Fails when the length is not a multiple of `size_of::<T>()`.
pub fn typed_slice<T: Pod>(bytes: &[u8]) -> Result<Cow<'_, [T]>, Error> {
    let size = std::mem::size_of::<T>();
    if size == 0 || bytes.len() % size != 0 {
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

    #[test]
    fn device_storage_on_an_emulated_gpu() {
        let set = bm_device::DeviceSet::emulated(&[1024]);
        let gpu = set.gpu(0).unwrap();
        let values = [1.5f32, -2.0];
        let mut buf = gpu.alloc(8).unwrap();
        buf.copy_from_host(0, bytemuck::cast_slice(&values))
            .unwrap();
        let meta = TensorMeta::new(crate::DType::F32, [2]);
        let t = Tensor::new(meta.clone(), Storage::Device(buf)).unwrap();
        assert_eq!(t.storage.device(), Some(bm_device::Device::Gpu(0)));
        assert_eq!(t.storage.byte_len(), Some(8));
        assert!(t.storage.host_bytes().is_none());
        let Storage::Device(b) = &t.storage else {
            unreachable!()
        };
        let mut back = [0u8; 8];
        b.copy_to_host(0, &mut back).unwrap();
        assert_eq!(bytemuck::cast_slice::<u8, f32>(&back), &values);
        assert_eq!(gpu.live_bytes(), 8);
        drop(t);
        assert_eq!(
            gpu.live_bytes(),
            0,
            "dropping the tensor frees the device bytes"
        );
        // The length check covers device storage too.
        let err = Tensor::new(meta, Storage::Device(gpu.alloc(4).unwrap())).unwrap_err();
        assert!(
            err.to_string().contains("expected 8 bytes, found 4"),
            "{err}"
        );
        assert_eq!(gpu.live_bytes(), 0);
    }

    #[test]
    fn tensor_checks_length() {
        let meta = TensorMeta::new(crate::DType::F32, [2]);
        let err = Tensor::new(meta, Storage::Host(HostBuffer::zeroed(4).unwrap())).unwrap_err();
        assert!(
            err.to_string().contains("expected 8 bytes, found 4"),
            "{err}"
        );
    }
}
