//! The compute tensor: dtype, shape, and bytes on one backend.

use std::borrow::Cow;
use std::sync::Arc;

use bm_tensor::{DType, HostBuffer, MmapView, TensorMeta, typed_slice};
use half::{bf16, f16};

use crate::Error;

/// Where a computation runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Backend {
    /// Host memory and CPU threads.
    Cpu,
    /// CUDA GPU `n` of a `bm_device::DeviceSet`: bytes in a
    /// `DeviceBuffer`, ops through bm-device's compute (cuBLAS and NVRTC
    /// kernels). Emulated GPUs never hold compute tensors.
    Cuda(usize),
}

/// Host bytes: owned and aligned, a zero-copy window of a mapped file, or
/// bytes another owner shares by reference count.
pub enum HostBytes {
    /// An owned, 64-byte-aligned buffer.
    Owned(HostBuffer),
    /// A window of a memory-mapped checkpoint or offload file.
    Mapped(MmapView),
    /// Bytes kept alive by someone else's `Arc`, e.g. a dispatched model's
    /// weight (resident or materialised for this forward pass): no copy.
    Shared(Arc<dyn AsRef<[u8]> + Send + Sync>),
}

impl std::fmt::Debug for HostBytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            HostBytes::Owned(b) => f.debug_tuple("Owned").field(b).finish(),
            HostBytes::Mapped(v) => f.debug_tuple("Mapped").field(v).finish(),
            HostBytes::Shared(s) => write!(f, "Shared({} bytes)", (**s).as_ref().len()),
        }
    }
}

impl HostBytes {
    /// The bytes.
    pub fn as_bytes(&self) -> &[u8] {
        match self {
            HostBytes::Owned(b) => b.as_bytes(),
            HostBytes::Mapped(v) => v.as_bytes(),
            HostBytes::Shared(s) => (**s).as_ref(),
        }
    }
}

#[derive(Debug)]
enum Data {
    Cpu(HostBytes),
    Cuda(DeviceBytes),
}

/// A device buffer that someone else owns and keeps alive by `Arc` (a
/// dispatched model's GPU-resident weight), seen as a `DeviceBuffer`.
pub type SharedDeviceBuffer = std::sync::Arc<dyn AsRef<bm_device::DeviceBuffer> + Send + Sync>;

/// The bytes of a GPU tensor: its own buffer (every op's output), or a
/// shared one (weights used in place).
enum DeviceBytes {
    Owned(bm_device::DeviceBuffer),
    Shared(SharedDeviceBuffer),
}

impl DeviceBytes {
    fn buffer(&self) -> &bm_device::DeviceBuffer {
        match self {
            DeviceBytes::Owned(b) => b,
            DeviceBytes::Shared(b) => (**b).as_ref(),
        }
    }
}

impl std::fmt::Debug for DeviceBytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.buffer().fmt(f)
    }
}

/// A dense row-major tensor with a float dtype the ops compute in
/// (F32, F16 or BF16), on one [`Backend`].
#[derive(Debug)]
pub struct Tensor {
    dtype: DType,
    shape: Vec<usize>,
    data: Data,
}

/// True for the dtypes the ops compute in.
pub fn is_compute_dtype(dtype: DType) -> bool {
    matches!(dtype, DType::F32 | DType::F16 | DType::BF16)
}

impl Tensor {
    /// A host tensor over `bytes`; checks that the length fits the shape and
    /// that the dtype is one the ops compute in. `name` is used in errors.
    pub fn from_host(meta: TensorMeta, bytes: HostBytes, name: &str) -> Result<Tensor, Error> {
        if !is_compute_dtype(meta.dtype) {
            return Err(Error::UnsupportedDType {
                what: name.to_string(),
                dtype: meta.dtype,
            });
        }
        let found = bytes.as_bytes().len();
        if meta.checked_byte_len() != Some(found) {
            return Err(Error::Tensor(bm_tensor::Error::LengthMismatch {
                what: format!("tensor {name} ({} {:?})", meta.dtype, meta.shape),
                expected: meta.byte_len(),
                found,
            }));
        }
        Ok(Tensor {
            dtype: meta.dtype,
            shape: meta.shape,
            data: Data::Cpu(bytes),
        })
    }

    /// A host tensor holding `values` rounded to `dtype` (as PyTorch rounds).
    pub fn from_f32(dtype: DType, shape: &[usize], values: &[f32]) -> Result<Tensor, Error> {
        let numel: usize = shape.iter().product();
        if numel != values.len() {
            return Err(Error::BadOperands {
                op: "from_f32",
                message: format!("{} values do not fill shape {shape:?}", values.len()),
            });
        }
        Tensor::build(dtype, shape, |out| out.copy_from_slice(values))
    }

    /// A host tensor of `shape` whose f32 values `fill` writes; they are
    /// rounded to `dtype` afterwards. F32 is written in place, with no copy.
    pub(crate) fn build(
        dtype: DType,
        shape: &[usize],
        fill: impl FnOnce(&mut [f32]),
    ) -> Result<Tensor, Error> {
        let numel: usize = shape.iter().product();
        let mut buf = HostBuffer::zeroed(numel * dtype.size_in_bytes())?;
        match dtype {
            // An empty buffer's pointer need not be aligned for f32.
            DType::F32 if numel == 0 => fill(&mut []),
            DType::F32 => fill(bytemuck::cast_slice_mut(buf.as_mut_bytes())),
            DType::F16 | DType::BF16 => {
                let mut wide = vec![0f32; numel];
                fill(&mut wide);
                bm_tensor::cast_into(
                    bytemuck::cast_slice(&wide),
                    DType::F32,
                    buf.as_mut_bytes(),
                    dtype,
                )?;
            }
            other => {
                return Err(Error::UnsupportedDType {
                    what: "tensor".into(),
                    dtype: other,
                });
            }
        }
        Ok(Tensor {
            dtype,
            shape: shape.to_vec(),
            data: Data::Cpu(HostBytes::Owned(buf)),
        })
    }

    /// Element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Dimensions, outermost first.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Where the bytes are.
    pub fn backend(&self) -> Backend {
        match &self.data {
            Data::Cpu(_) => Backend::Cpu,
            Data::Cuda(b) => Backend::Cuda(b.buffer().gpu().ordinal()),
        }
    }

    /// The raw little-endian bytes of a host tensor.
    ///
    /// # Panics
    /// On a GPU tensor, whose bytes are not in host memory: call
    /// [`Tensor::to_host`] first (as with every host accessor below).
    pub fn host_bytes(&self) -> &[u8] {
        match &self.data {
            Data::Cpu(b) => b.as_bytes(),
            Data::Cuda(b) => panic!(
                "host bytes of a tensor on GPU {}: call to_host() first",
                b.buffer().device()
            ),
        }
    }

    /// A GPU tensor over `buffer`, which holds `shape` elements of `dtype`.
    pub(crate) fn from_device(
        dtype: DType,
        shape: &[usize],
        buffer: bm_device::DeviceBuffer,
    ) -> Tensor {
        Tensor {
            dtype,
            shape: shape.to_vec(),
            data: Data::Cuda(DeviceBytes::Owned(buffer)),
        }
    }

    /// A GPU tensor over a buffer another owner keeps (a dispatched model's
    /// GPU-resident weight), used in place. Checks the dtype, that the
    /// buffer holds `meta`'s bytes and that it is on a CUDA GPU (emulated
    /// GPUs do not compute: use their bytes from the host). `name` is used
    /// in errors.
    pub fn from_shared_device(
        meta: TensorMeta,
        buffer: SharedDeviceBuffer,
        name: &str,
    ) -> Result<Tensor, Error> {
        if !is_compute_dtype(meta.dtype) {
            return Err(Error::UnsupportedDType {
                what: name.to_string(),
                dtype: meta.dtype,
            });
        }
        let b = (*buffer).as_ref();
        if b.gpu().kind() != bm_device::GpuKind::Cuda {
            return Err(bm_device::Error::ComputeUnsupported { device: b.device() }.into());
        }
        if meta.checked_byte_len().is_none_or(|n| n.max(1) != b.len()) {
            return Err(Error::Tensor(bm_tensor::Error::LengthMismatch {
                what: format!("tensor {name} ({} {:?})", meta.dtype, meta.shape),
                expected: meta.byte_len(),
                found: b.len(),
            }));
        }
        Ok(Tensor {
            dtype: meta.dtype,
            shape: meta.shape,
            data: Data::Cuda(DeviceBytes::Shared(buffer)),
        })
    }

    /// The device buffer of a GPU tensor.
    pub(crate) fn device_buffer(&self) -> Option<&bm_device::DeviceBuffer> {
        match &self.data {
            Data::Cpu(_) => None,
            Data::Cuda(b) => Some(b.buffer()),
        }
    }

    /// The device buffer of a GPU tensor, for writing (only the tensors ops
    /// create own theirs).
    pub(crate) fn device_buffer_mut(&mut self) -> Option<&mut bm_device::DeviceBuffer> {
        match &mut self.data {
            Data::Cuda(DeviceBytes::Owned(b)) => Some(b),
            _ => None,
        }
    }

    /// A copy of this tensor in host memory (a download for a GPU tensor).
    pub fn to_host(&self) -> Result<Tensor, Error> {
        let buf = match &self.data {
            Data::Cuda(b) => {
                let mut buf = HostBuffer::zeroed(self.numel() * self.dtype.size_in_bytes())?;
                b.buffer().copy_to_host(0, buf.as_mut_bytes())?;
                buf
            }
            _ => HostBuffer::from_bytes(self.host_bytes())?,
        };
        Ok(Tensor {
            dtype: self.dtype,
            shape: self.shape.clone(),
            data: Data::Cpu(HostBytes::Owned(buf)),
        })
    }

    /// A copy of this tensor on `gpu` (a CUDA GPU; emulated GPUs do not
    /// compute), enqueued on its compute stream.
    pub fn to_gpu(&self, gpu: &bm_device::Gpu) -> Result<Tensor, Error> {
        crate::cuda::to_gpu(self, gpu)
    }

    /// The values widened to f32: borrowed for an aligned F32 tensor,
    /// converted otherwise.
    pub fn f32_values(&self) -> Cow<'_, [f32]> {
        widen(self.dtype, self.host_bytes())
    }

    /// Rows `start..end` of the outermost dimension widened to f32 (no
    /// copy for aligned F32). Used to stream a weight matrix block by block.
    pub(crate) fn f32_rows(&self, start: usize, end: usize) -> Cow<'_, [f32]> {
        let row = self.shape[1..].iter().product::<usize>();
        self.f32_range(start * row, end * row)
    }

    /// Elements `start..end` of the flattened tensor widened to f32 (no
    /// copy for aligned F32).
    pub(crate) fn f32_range(&self, start: usize, end: usize) -> Cow<'_, [f32]> {
        let size = self.dtype.size_in_bytes();
        widen(self.dtype, &self.host_bytes()[start * size..end * size])
    }

    /// Elements `start..start + out.len()` (flat, row-major) widened to f32
    /// into `out`: a window of a matrix row without widening the whole row.
    pub(crate) fn widen_range_into(&self, start: usize, out: &mut [f32]) {
        use half::slice::HalfFloatSliceExt;
        let size = self.dtype.size_in_bytes();
        let bytes = &self.host_bytes()[start * size..(start + out.len()) * size];
        // Lengths were checked at construction, so typed_slice cannot fail.
        match self.dtype {
            DType::F32 => {
                out.copy_from_slice(&typed_slice::<f32>(bytes).expect("F32 tensor bytes"))
            }
            DType::F16 => typed_slice::<f16>(bytes)
                .expect("F16 tensor bytes")
                .convert_to_f32_slice(out),
            DType::BF16 => typed_slice::<bf16>(bytes)
                .expect("BF16 tensor bytes")
                .convert_to_f32_slice(out),
            other => unreachable!("tensor of non-compute dtype {other}"),
        }
    }

    /// The same elements seen with another shape of the same element
    /// count (no copy, on any backend): `[seq, heads * head_dim]` as
    /// `[seq * heads, head_dim]` for a per-head norm.
    pub fn reshape(self, shape: &[usize]) -> Result<Tensor, Error> {
        if shape.iter().product::<usize>() != self.numel() {
            return Err(Error::BadOperands {
                op: "reshape",
                message: format!("shape {:?} cannot be seen as {shape:?}", self.shape),
            });
        }
        Ok(Tensor {
            shape: shape.to_vec(),
            ..self
        })
    }

    /// The values as a new f32 vector.
    pub fn to_f32_vec(&self) -> Vec<f32> {
        self.f32_values().into_owned()
    }

    /// The same values in `dtype` (PyTorch's rounding); a copy, on the
    /// same backend.
    pub fn to_dtype(&self, dtype: DType) -> Result<Tensor, Error> {
        if let Data::Cuda(b) = &self.data {
            return crate::cuda::cast(self, b.buffer().gpu(), dtype);
        }
        let values = self.f32_values();
        Tensor::build(dtype, &self.shape, |out| out.copy_from_slice(&values))
    }

    /// Rows `start..end` of a 2-D tensor, as a new tensor of the same dtype.
    pub fn rows(&self, start: usize, end: usize) -> Result<Tensor, Error> {
        if self.shape.len() != 2 || start > end || end > self.shape[0] {
            return Err(Error::BadOperands {
                op: "rows",
                message: format!("rows {start}..{end} of a tensor of shape {:?}", self.shape),
            });
        }
        let row_bytes = self.shape[1] * self.dtype.size_in_bytes();
        if let Data::Cuda(b) = &self.data {
            return crate::cuda::rows(b.buffer(), self.dtype, self.shape[1], start, end);
        }
        let buf = HostBuffer::from_bytes(&self.host_bytes()[start * row_bytes..end * row_bytes])?;
        Ok(Tensor {
            dtype: self.dtype,
            shape: vec![end - start, self.shape[1]],
            data: Data::Cpu(HostBytes::Owned(buf)),
        })
    }
}

/// `bytes` of `dtype` as f32. Half types go through `half`'s slice
/// conversions, which use the CPU's F16C/SIMD paths when it has them.
fn widen(dtype: DType, bytes: &[u8]) -> Cow<'_, [f32]> {
    use half::slice::HalfFloatSliceExt;
    // Lengths were checked at construction, so typed_slice cannot fail.
    match dtype {
        DType::F32 => typed_slice::<f32>(bytes).expect("F32 tensor bytes"),
        DType::F16 => {
            let halves = typed_slice::<f16>(bytes).expect("F16 tensor bytes");
            let mut out = vec![0f32; halves.len()];
            halves.convert_to_f32_slice(&mut out);
            Cow::Owned(out)
        }
        DType::BF16 => {
            let halves = typed_slice::<bf16>(bytes).expect("BF16 tensor bytes");
            let mut out = vec![0f32; halves.len()];
            halves.convert_to_f32_slice(&mut out);
            Cow::Owned(out)
        }
        other => unreachable!("tensor of non-compute dtype {other}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn half_tensors_round_like_pytorch_and_widen_exactly() {
        let t = Tensor::from_f32(DType::BF16, &[2], &[1.0 + 1.0 / 256.0, 3.0]).unwrap();
        assert_eq!(t.to_f32_vec(), [1.0, 3.0]);
        let h = Tensor::from_f32(DType::F16, &[1], &[0.1]).unwrap();
        assert_eq!(h.to_f32_vec(), [f16::from_f32(0.1).to_f32()]);
        assert_eq!(h.to_dtype(DType::F32).unwrap().host_bytes().len(), 4);
    }

    #[test]
    fn construction_checks_length_and_dtype() {
        let bytes = HostBytes::Owned(HostBuffer::zeroed(6).unwrap());
        let err = Tensor::from_host(TensorMeta::new(DType::F32, [2]), bytes, "w").unwrap_err();
        assert!(err.to_string().contains("tensor w"), "{err}");
        let bytes = HostBytes::Owned(HostBuffer::zeroed(8).unwrap());
        let err = Tensor::from_host(TensorMeta::new(DType::I64, [1]), bytes, "ids").unwrap_err();
        assert!(err.to_string().contains("ids: dtype I64"), "{err}");
        assert!(Tensor::from_f32(DType::F32, &[3], &[1.0]).is_err());
    }

    #[test]
    fn emulated_gpus_hold_no_compute_tensors() {
        let set = bm_device::DeviceSet::emulated(&[1 << 20]);
        let t = Tensor::from_f32(DType::F32, &[2], &[1.0, 2.0]).unwrap();
        let err = t.to_gpu(set.gpu(0).unwrap()).unwrap_err();
        assert!(
            err.to_string()
                .contains("compute is not supported on emulated device 0"),
            "{err}"
        );
        struct Held(bm_device::DeviceBuffer);
        impl AsRef<bm_device::DeviceBuffer> for Held {
            fn as_ref(&self) -> &bm_device::DeviceBuffer {
                &self.0
            }
        }
        let shared = std::sync::Arc::new(Held(set.gpu(0).unwrap().alloc(8).unwrap()));
        let err =
            Tensor::from_shared_device(TensorMeta::new(DType::F32, [2]), shared, "w").unwrap_err();
        assert!(err.to_string().contains("emulated device 0"), "{err}");
        // A host tensor's to_host is a copy of the same values.
        assert_eq!(t.to_host().unwrap().to_f32_vec(), [1.0, 2.0]);
    }

    #[test]
    fn reshape_keeps_the_elements_and_checks_the_count() {
        let t = Tensor::from_f32(DType::BF16, &[2, 3], &[0., 1., 2., 3., 4., 5.]).unwrap();
        let r = t.reshape(&[3, 2]).unwrap();
        assert_eq!(
            (r.shape(), r.to_f32_vec()),
            (&[3, 2][..], vec![0., 1., 2., 3., 4., 5.])
        );
        let mut window = [0f32; 2];
        r.widen_range_into(3, &mut window);
        assert_eq!(window, [3., 4.]);
        let err = r.reshape(&[4]).unwrap_err();
        assert_eq!(
            err.to_string(),
            "reshape: shape [3, 2] cannot be seen as [4]"
        );
    }

    #[test]
    fn rows_slices_the_outer_dimension() {
        let t = Tensor::from_f32(DType::F32, &[3, 2], &[0., 1., 2., 3., 4., 5.]).unwrap();
        assert_eq!(t.rows(1, 3).unwrap().to_f32_vec(), [2., 3., 4., 5.]);
        assert_eq!(t.f32_rows(2, 3).as_ref(), &[4., 5.]);
        assert!(t.rows(2, 4).is_err());
    }
}
