//! A quantized weight on a CUDA GPU: the packed form a dispatcher holds
//! there ([`QuantizedTensor::to_packed`]'s layout, one device buffer), read
//! in place by the GPU matmul ([`linear_quantized_on_gpu`]).

use bm_device::Gpu;

use super::format;
use super::tensor::{QuantFormat, QuantizedTensor, state_error};
use crate::{Error, SharedDeviceBuffer, Tensor};

/// A linear layer's weight (`[out_features, in_features]`) in a
/// bitsandbytes format, its packed form in one CUDA device buffer.
pub struct QuantizedOnGpu {
    pub(crate) format: QuantFormat,
    pub(crate) shape: [usize; 2],
    pub(crate) compute_dtype: Option<bm_tensor::DType>,
    pub(crate) bytes: SharedDeviceBuffer,
}

impl std::fmt::Debug for QuantizedOnGpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QuantizedOnGpu")
            .field("format", &self.format)
            .field("shape", &self.shape)
            .field("compute_dtype", &self.compute_dtype)
            .finish_non_exhaustive()
    }
}

impl QuantizedOnGpu {
    /// A `[rows, cols]` weight in `format` over `bytes`, its packed form
    /// ([`QuantFormat::byte_len`] bytes on a CUDA GPU); `name` names it in
    /// errors.
    pub fn from_packed(
        name: &str,
        format: QuantFormat,
        shape: [usize; 2],
        bytes: SharedDeviceBuffer,
    ) -> Result<QuantizedOnGpu, Error> {
        if let QuantFormat::FourBit { blocksize, .. } = format {
            format::check_four_bit_block_size(blocksize)
                .map_err(|e| state_error(name, "blocksize", e.to_string()))?;
        }
        let [rows, cols] = shape;
        let want = format.byte_len(rows, cols);
        let held = bytes.as_ref().as_ref().len();
        if rows == 0 || cols == 0 || held != want {
            return Err(state_error(
                name,
                "packed",
                format!("{held} bytes for a {shape:?} {format:?} weight, expected {want}"),
            ));
        }
        Ok(QuantizedOnGpu {
            format,
            shape,
            compute_dtype: None,
            bytes,
        })
    }

    /// The format.
    pub fn format(&self) -> QuantFormat {
        self.format
    }

    /// The logical shape, `[out_features, in_features]`.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// The GPU holding it.
    pub fn gpu(&self) -> &Gpu {
        self.bytes.as_ref().as_ref().gpu()
    }

    /// The dtype a 4-bit matmul computes in (`None`: the activations').
    pub fn compute_dtype(&self) -> Option<bm_tensor::DType> {
        self.compute_dtype
    }

    /// Sets the 4-bit compute dtype (F32, F16 or BF16; `None`: the
    /// activation's), as [`QuantizedTensor::set_compute_dtype`].
    pub fn set_compute_dtype(&mut self, dtype: Option<bm_tensor::DType>) -> Result<(), Error> {
        if let Some(d) = dtype {
            crate::ops::check_compute_dtype("4-bit compute dtype", d)?;
        }
        self.compute_dtype = dtype;
        Ok(())
    }
}

impl QuantizedTensor {
    /// The weight's packed form uploaded to `gpu` (CUDA), its compute
    /// dtype kept.
    pub fn to_gpu(&self, gpu: &Gpu) -> Result<QuantizedOnGpu, Error> {
        if gpu.kind() == bm_device::GpuKind::Emulated {
            return Err(bm_device::Error::ComputeUnsupported {
                device: gpu.device(),
            }
            .into());
        }
        let packed = self.to_packed()?;
        let mut buffer = gpu.alloc(packed.len())?;
        gpu.write_for_compute(&mut buffer, 0, packed.as_bytes())?;
        let mut q = QuantizedOnGpu::from_packed(
            "(uploaded)",
            self.format(),
            self.shape,
            std::sync::Arc::new(Owned(buffer)),
        )?;
        q.compute_dtype = self.compute_dtype;
        Ok(q)
    }
}

/// A device buffer owned by the weight it holds.
struct Owned(bm_device::DeviceBuffer);

impl AsRef<bm_device::DeviceBuffer> for Owned {
    fn as_ref(&self) -> &bm_device::DeviceBuffer {
        &self.0
    }
}

/// `x · weightᵀ + bias` with `weight` on a CUDA GPU, read packed, as
/// [`linear_quantized`](super::linear_quantized) computes on the CPU (the
/// reference the GPU tests compare with): few rows (decode) by kernels that
/// read the codes and scales in place; a 4-bit prefill dequantizes the
/// weight into a stream-ordered temporary in the compute dtype for one
/// cuBLAS GEMM and frees it (as bitsandbytes does); 8-bit always reads the
/// weight packed. Host operands are uploaded to the weight's GPU.
pub fn linear_quantized_on_gpu(
    x: &Tensor,
    weight: &QuantizedOnGpu,
    bias: Option<&Tensor>,
) -> Result<Tensor, Error> {
    let ((m, k, n), shape) = super::matmul::product_shape(x, weight.shape, bias)?;
    crate::cuda::linear_quantized(x, weight, bias, (m, k, n), &shape)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::{FourBitType, quantize};
    use bm_device::DeviceSet;
    use bm_tensor::DType;

    struct Bytes(bm_device::DeviceBuffer);

    impl AsRef<bm_device::DeviceBuffer> for Bytes {
        fn as_ref(&self) -> &bm_device::DeviceBuffer {
            &self.0
        }
    }

    #[test]
    fn packed_bytes_are_checked_and_emulated_gpus_refuse_the_matmul() {
        let set = DeviceSet::emulated(&[1 << 20]);
        let gpu = set.gpu(0).unwrap();
        let nf4 = QuantFormat::FourBit {
            kind: FourBitType::Nf4,
            blocksize: 64,
            double_quant: true,
        };
        let bytes =
            |len| -> SharedDeviceBuffer { std::sync::Arc::new(Bytes(gpu.alloc(len).unwrap())) };
        let err = QuantizedOnGpu::from_packed("w", nf4, [4, 64], bytes(10)).unwrap_err();
        assert!(err.to_string().contains("10 bytes for a [4, 64]"), "{err}");
        let bad_block = QuantFormat::FourBit {
            kind: FourBitType::Fp4,
            blocksize: 0,
            double_quant: false,
        };
        let err = QuantizedOnGpu::from_packed("w", bad_block, [4, 64], bytes(10)).unwrap_err();
        assert!(err.to_string().contains("blocksize"), "{err}");
        let len = nf4.byte_len(4, 64);
        let w = QuantizedOnGpu::from_packed("w", nf4, [4, 64], bytes(len)).unwrap();
        assert_eq!(w.shape(), [4, 64]);
        let x = Tensor::from_f32(DType::F32, &[2, 64], &[0.5; 128]).unwrap();
        let err = linear_quantized_on_gpu(&x, &w, None).unwrap_err();
        assert!(err.to_string().contains("emulated"), "{err}");
        let narrow = Tensor::from_f32(DType::F32, &[2, 63], &[0.5; 126]).unwrap();
        let err = linear_quantized_on_gpu(&narrow, &w, None).unwrap_err();
        assert!(err.to_string().contains("does not fit weight"), "{err}");
        let q = quantize(&x, nf4, "x").unwrap();
        assert!(q.to_gpu(gpu).is_err());
    }
}
