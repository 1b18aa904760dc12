//! Where a tensor's bytes are at run time (host, mapped, pinned or device
//! memory) and the tensors forward passes hand each other. How bytes move
//! between devices is `transfer.rs`.

use std::borrow::Cow;
use std::sync::Arc;

use bm_device::{Device, DeviceBuffer, DeviceSet, PinnedBuffer};
use bm_tensor::{HostBuffer, MmapView, TensorMeta};

use crate::transfer::move_bytes;
use crate::{Error, Result};

/// The bytes of one tensor at run time, wherever they are: the one answer
/// to "where is it" for weights ([`Weight`]) and activations ([`Tensor`]).
#[derive(Debug)]
pub enum Bytes {
    /// An owned aligned host buffer.
    Host(HostBuffer),
    /// A zero-copy window of a mapped checkpoint or offload file.
    Mmap(MmapView),
    /// Page-locked host memory, ready for DMA to a GPU.
    Pinned(PinnedBuffer),
    /// Memory of a GPU (CUDA or emulated).
    Device(DeviceBuffer),
}

impl Bytes {
    /// The device holding the bytes ([`Device::Cpu`] for every host kind).
    pub fn device(&self) -> Device {
        match self {
            Bytes::Device(b) => b.device(),
            _ => Device::Cpu,
        }
    }

    /// Number of bytes.
    pub fn len(&self) -> usize {
        match self {
            Bytes::Host(b) => b.len(),
            Bytes::Mmap(v) => v.len(),
            Bytes::Pinned(p) => p.len(),
            Bytes::Device(d) => d.len(),
        }
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The bytes when they are in host memory (waiting for any copy still
    /// writing pinned memory), `None` on a GPU.
    pub fn host(&self) -> Option<&[u8]> {
        match self {
            Bytes::Host(b) => Some(b.as_bytes()),
            Bytes::Mmap(v) => Some(v.as_bytes()),
            Bytes::Pinned(p) => p.as_slice().ok(),
            Bytes::Device(_) => None,
        }
    }

    /// The bytes on the host: borrowed when they are there, downloaded
    /// from a GPU otherwise (what a CPU "kernel" on an emulated device does).
    pub fn to_host(&self) -> Result<Cow<'_, [u8]>> {
        match self {
            Bytes::Device(d) => {
                let mut out = vec![0u8; d.len()];
                d.copy_to_host(0, &mut out)
                    .map_err(|e| Error::device("a download to the host", e))?;
                Ok(Cow::Owned(out))
            }
            Bytes::Pinned(p) => p
                .as_slice()
                .map(Cow::Borrowed)
                .map_err(|e| Error::device("pinned host memory", e)),
            other => Ok(Cow::Borrowed(other.host().unwrap_or(&[]))),
        }
    }

    /// True when the bytes are a zero-copy view of a mapped file.
    pub fn is_mapped(&self) -> bool {
        matches!(self, Bytes::Mmap(_))
    }
}

/// An activation: a tensor a forward pass takes or returns, with its dtype,
/// shape and bytes (none on the meta device).
#[derive(Debug)]
pub struct Tensor {
    /// Dtype and shape.
    pub meta: TensorMeta,
    /// The bytes; `None` for a tensor on the meta device.
    pub bytes: Option<Bytes>,
}

impl Tensor {
    /// A tensor with no bytes (on the meta device).
    pub fn meta(meta: TensorMeta) -> Self {
        Tensor { meta, bytes: None }
    }

    /// A tensor over `bytes`, which must hold exactly `meta`'s bytes.
    pub fn new(meta: TensorMeta, bytes: Bytes) -> Result<Self> {
        let expected = meta.checked_byte_len();
        if expected != Some(bytes.len()) {
            return Err(Error::tensor(
                format!("{} {:?}", meta.dtype, meta.shape),
                bm_tensor::Error::LengthMismatch {
                    what: "its bytes".into(),
                    expected: expected.unwrap_or(usize::MAX),
                    found: bytes.len(),
                },
            ));
        }
        Ok(Tensor {
            meta,
            bytes: Some(bytes),
        })
    }

    /// Where the bytes are; `None` on the meta device.
    pub fn device(&self) -> Option<Device> {
        self.bytes.as_ref().map(Bytes::device)
    }
}

/// A weight handed to a forward pass: its dtype and shape, and shared bytes.
#[derive(Clone, Debug)]
pub struct Weight {
    /// Dtype and shape.
    pub meta: TensorMeta,
    /// The bytes; shared between tied names and between threads.
    pub bytes: Arc<Bytes>,
}

impl Weight {
    /// Where the bytes are.
    pub fn device(&self) -> Device {
        self.bytes.device()
    }
}

/// The inputs or outputs of a module's forward: positional tensors and
/// named ones (the `**kwargs` that `skip_keys` applies to).
#[derive(Debug, Default)]
pub struct Activations {
    /// Positional tensors.
    pub args: Vec<Tensor>,
    /// Named tensors, in order.
    pub kwargs: Vec<(String, Tensor)>,
}

impl Activations {
    /// Positional tensors only.
    pub fn new(args: Vec<Tensor>) -> Self {
        Activations {
            args,
            kwargs: Vec::new(),
        }
    }

    /// Adds a named tensor.
    pub fn with_kwarg(mut self, name: impl Into<String>, t: Tensor) -> Self {
        self.kwargs.push((name.into(), t));
        self
    }

    /// Accelerate's `find_device`: the device of the first tensor that has
    /// bytes, positional first.
    pub fn device(&self) -> Option<Device> {
        self.args
            .iter()
            .chain(self.kwargs.iter().map(|(_, t)| t))
            .find_map(Tensor::device)
    }

    /// Moves every tensor to `device`, except named tensors whose name is
    /// in `skip_keys` (Accelerate's `send_to_device(..., skip_keys)`).
    pub fn to_device(
        self,
        device: Device,
        devices: &DeviceSet,
        skip_keys: &[String],
    ) -> Result<Activations> {
        let args = self
            .args
            .into_iter()
            .enumerate()
            .map(|(i, t)| tensor_to_device(&format!("input {i}"), t, device, devices))
            .collect::<Result<Vec<_>>>()?;
        let kwargs = self
            .kwargs
            .into_iter()
            .map(|(k, t)| {
                if skip_keys.contains(&k) {
                    Ok((k, t))
                } else {
                    let t = tensor_to_device(&format!("input {k:?}"), t, device, devices)?;
                    Ok((k, t))
                }
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Activations { args, kwargs })
    }
}

/// Moves an activation tensor to `device` (unchanged when already there or
/// without bytes).
pub fn tensor_to_device(
    what: &str,
    t: Tensor,
    device: Device,
    devices: &DeviceSet,
) -> Result<Tensor> {
    let Tensor {
        meta,
        bytes: Some(bytes),
    } = t
    else {
        return Ok(t);
    };
    if bytes.device() == device {
        return Tensor::new(meta, bytes);
    }
    let moved = move_bytes(what, &Arc::new(bytes), device, devices, None)?;
    let moved = Arc::try_unwrap(moved)
        .map_err(|_| Error::BadOption(format!("{what}: moved bytes are unexpectedly shared")))?;
    Tensor::new(meta, moved)
}

#[cfg(test)]
mod tests {
    use super::*;
    use bm_tensor::DType;

    #[test]
    fn a_tensor_on_an_emulated_gpu_holds_and_frees_device_bytes() {
        let set = DeviceSet::emulated(&[1024]);
        let gpu = set.gpu(0).unwrap();
        let values = [1.5f32, -2.0];
        let mut buf = gpu.alloc(8).unwrap();
        buf.copy_from_host(0, bytemuck::cast_slice(&values))
            .unwrap();
        let meta = TensorMeta::new(DType::F32, [2]);
        let t = Tensor::new(meta.clone(), Bytes::Device(buf)).unwrap();
        assert_eq!(t.device(), Some(Device::Gpu(0)));
        let bytes = t.bytes.as_ref().unwrap();
        assert_eq!(bytes.len(), 8);
        assert!(bytes.host().is_none());
        assert_eq!(
            bytemuck::cast_slice::<u8, f32>(&bytes.to_host().unwrap()),
            &values
        );
        assert_eq!(gpu.live_bytes(), 8);
        drop(t);
        assert_eq!(
            gpu.live_bytes(),
            0,
            "dropping the tensor frees the device bytes"
        );
        // The length check covers device bytes too.
        let err = Tensor::new(meta, Bytes::Device(gpu.alloc(4).unwrap())).unwrap_err();
        assert!(
            err.to_string().contains("expected 8 bytes, found 4"),
            "{err}"
        );
        assert_eq!(gpu.live_bytes(), 0);
    }

    #[test]
    fn a_tensor_checks_its_length() {
        let meta = TensorMeta::new(DType::F32, [2]);
        let err = Tensor::new(meta, Bytes::Host(HostBuffer::zeroed(4).unwrap())).unwrap_err();
        assert!(
            err.to_string().contains("expected 8 bytes, found 4"),
            "{err}"
        );
        assert_eq!(
            Tensor::meta(TensorMeta::new(DType::F32, [2])).device(),
            None
        );
    }
}
