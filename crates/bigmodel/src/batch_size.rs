//! Accelerate's `find_executable_batch_size`: run a job with a batch size,
//! and when a device runs out of memory, halve the size and run it again.

use crate::Error;

/// An error that can tell whether a device ran out of memory: the
/// driver's out-of-memory, or an allocation that would exceed the budget
/// bigmodel keeps for the device (emulated GPUs have only the budget).
/// Only these errors make [`find_executable_batch_size`] try a smaller
/// batch; every other error is returned as it is.
pub trait OutOfMemory {
    /// True when this error is a device out of memory.
    fn is_out_of_memory(&self) -> bool;
}

impl OutOfMemory for bm_device::Error {
    fn is_out_of_memory(&self) -> bool {
        matches!(
            self,
            bm_device::Error::OutOfMemory { .. } | bm_device::Error::BudgetExceeded { .. }
        )
    }
}

impl OutOfMemory for bm_dispatch::Error {
    fn is_out_of_memory(&self) -> bool {
        self.is_out_of_device_memory()
    }
}

impl OutOfMemory for Error {
    fn is_out_of_memory(&self) -> bool {
        match self {
            Error::Memory(e) => e.is_out_of_memory(),
            Error::Dispatch(e) => e.is_out_of_memory(),
            _ => false,
        }
    }
}

/// Runs `job(batch_size)` from `starting_batch_size`; while it fails with
/// an out-of-memory error ([`OutOfMemory`]), halves the batch size and
/// runs it again, as Accelerate's `@find_executable_batch_size` decorator
/// does (its `reduce_batch_size_fn` default was halving until Accelerate
/// 1.x, which multiplies by 0.9; see docs/compat.md). Any other error, and
/// the first success, is returned at once. Reaching a batch size of 0 is
/// [`Error::NoExecutableBatchSize`] (Accelerate's "No executable batch size
/// found, reached zero."), carrying the last out-of-memory message.
///
/// `job` must leave nothing allocated when it fails (Rust's drops see to
/// that), so each try starts from the same free memory.
pub fn find_executable_batch_size<T, E>(
    starting_batch_size: usize,
    mut job: impl FnMut(usize) -> Result<T, E>,
) -> Result<T, E>
where
    E: OutOfMemory + From<Error> + std::fmt::Display,
{
    let mut batch_size = starting_batch_size;
    let mut last_error = None;
    while batch_size > 0 {
        match job(batch_size) {
            Err(e) if e.is_out_of_memory() => {
                last_error = Some(e.to_string());
                batch_size /= 2;
            }
            done => return done,
        }
    }
    Err(Error::NoExecutableBatchSize {
        starting_batch_size,
        last_error,
    }
    .into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use bm_device::{Device, DeviceSet};

    /// A job that needs `per_item` bytes of emulated GPU 0 per batch item,
    /// and records the sizes it was tried with.
    fn job_on(
        devices: &DeviceSet,
        per_item: usize,
        tried: &mut Vec<usize>,
    ) -> impl FnMut(usize) -> Result<usize, Error> {
        move |batch_size| {
            tried.push(batch_size);
            let gpu = devices.gpu(0).map_err(Error::Memory)?;
            let _activations = gpu.alloc(batch_size * per_item).map_err(Error::Memory)?;
            Ok(batch_size)
        }
    }

    #[test]
    fn halves_until_the_batch_fits_the_budget() {
        let devices = DeviceSet::emulated(&[1000]);
        let mut tried = Vec::new();
        let fitted = find_executable_batch_size(64, job_on(&devices, 100, &mut tried)).unwrap();
        assert_eq!(fitted, 8);
        assert_eq!(tried, [64, 32, 16, 8]);
        // Nothing stays allocated from the failed tries.
        assert_eq!(devices.gpu(0).unwrap().live_bytes(), 0);
    }

    #[test]
    fn reaching_zero_is_accelerates_error_with_the_last_out_of_memory() {
        let devices = DeviceSet::emulated(&[1000]);
        let mut tried = Vec::new();
        let err = find_executable_batch_size(4, job_on(&devices, 2000, &mut tried)).unwrap_err();
        assert_eq!(tried, [4, 2, 1]);
        let text = err.to_string();
        assert!(
            text.starts_with("No executable batch size found, reached zero"),
            "{text}"
        );
        assert!(
            text.contains("started at 4") && text.contains("budget"),
            "{text}"
        );
        let mut never = Vec::new();
        let err = find_executable_batch_size(0, job_on(&devices, 1, &mut never)).unwrap_err();
        assert!(never.is_empty(), "{never:?}");
        assert!(matches!(
            err,
            Error::NoExecutableBatchSize {
                starting_batch_size: 0,
                last_error: None
            }
        ));
    }

    #[test]
    fn other_errors_are_not_retried() {
        let mut tried = Vec::new();
        let err = find_executable_batch_size(16, |batch_size| -> Result<(), Error> {
            tried.push(batch_size);
            Err(Error::Memory(bm_device::Error::ZeroSizedAllocation {
                device: Device::Gpu(0),
            }))
        })
        .unwrap_err();
        assert_eq!(tried, [16]);
        assert!(!err.is_out_of_memory());
        assert!(err.to_string().contains("zero"), "{err}");
    }

    #[test]
    fn device_out_of_memory_errors_are_recognised() {
        let budget = bm_device::Error::BudgetExceeded {
            device: Device::Gpu(1),
            requested: 10,
            live: 5,
            budget: 12,
        };
        assert!(budget.is_out_of_memory());
        let driver = bm_device::Error::OutOfMemory {
            device: Device::Gpu(0),
            requested: 10,
            free: 1,
        };
        assert!(Error::Memory(driver).is_out_of_memory());
        assert!(!bm_device::Error::NotCompiledWithCuda.is_out_of_memory());
        assert!(!Error::UnknownStrategy("x".into()).is_out_of_memory());
    }
}
