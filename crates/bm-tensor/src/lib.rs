//! Tensors without a framework: what a tensor is (dtype and shape), and
//! host bytes.
//!
//! A loader for models larger than any device spends its life describing
//! tensors it has not read yet and moving bytes it does not interpret. This
//! crate gives both a small vocabulary:
//!
//! * [`DType`] is the safetensors element type, with the byte sizes the file
//!   format and Accelerate's planner use.
//! * [`TensorMeta`] is a dtype plus a shape: enough to size, plan and check a
//!   tensor with no bytes at all.
//! * [`HostBuffer`] is owned, aligned host memory, and [`MmapView`] a
//!   zero-copy window of a memory-mapped file that keeps the mapping alive
//!   by reference counting: the two ways bytes sit in host memory.
//! * [`cast`] converts between F64, F32, F16 and BF16 on the CPU, bit for bit
//!   as PyTorch's scalar conversions do (round to nearest even, Inf kept, NaN
//!   kept as PyTorch's canonical quiet NaN).
//!
//! Typed access goes through [`typed_slice`], which borrows when the bytes
//! are aligned for the element type and copies when they are not (a
//! safetensors header may leave data at any offset).
//!
//! This crate is a leaf of the workspace (half, memmap2 and bytemuck only):
//! it never touches a device, never opens a checkpoint (that is `bm-shard`)
//! and never decides where a tensor goes (that is `bm-plan`); where a
//! tensor's bytes are at run time, GPUs included, is `bm-dispatch`'s `Bytes`.

mod cast;
mod dtype;
mod error;
mod host;
mod mmap;

pub use cast::{cast, cast_into};
pub use dtype::DType;
pub use error::Error;
pub use host::{HostBuffer, typed_slice};
pub use mmap::{ChangedFile, MmapView, changed_mapped_files};

/// A tensor's dtype and shape: everything but its bytes.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct TensorMeta {
    /// Element type.
    pub dtype: DType,
    /// Dimensions, outermost first; empty for a scalar.
    pub shape: Vec<usize>,
}

impl TensorMeta {
    /// A new description.
    pub fn new(dtype: DType, shape: impl Into<Vec<usize>>) -> Self {
        TensorMeta {
            dtype,
            shape: shape.into(),
        }
    }

    /// Number of elements (1 for a scalar), or `None` on overflow.
    pub fn checked_numel(&self) -> Option<usize> {
        self.shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d))
    }

    /// Number of elements (1 for a scalar). Saturates instead of overflowing.
    pub fn numel(&self) -> usize {
        self.checked_numel().unwrap_or(usize::MAX)
    }

    /// Bytes the tensor occupies in memory, or `None` on overflow.
    pub fn checked_byte_len(&self) -> Option<usize> {
        self.checked_numel()?
            .checked_mul(self.dtype.size_in_bytes())
    }

    /// Bytes the tensor occupies in memory. Saturates instead of overflowing.
    pub fn byte_len(&self) -> usize {
        self.checked_byte_len().unwrap_or(usize::MAX)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scalar_has_one_element() {
        let m = TensorMeta::new(DType::BF16, []);
        assert_eq!(m.numel(), 1);
        assert_eq!(m.byte_len(), 2);
    }

    #[test]
    fn overflow_is_detected() {
        let m = TensorMeta::new(DType::F64, [usize::MAX / 2, 4]);
        assert_eq!(m.checked_byte_len(), None);
    }
}
