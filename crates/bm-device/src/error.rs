//! The one error type of `bm-device`.

use std::path::PathBuf;

use crate::Device;
use crate::libs::{CudaLibrary, Searched};

/// Everything that can go wrong in `bm-device`. Every message names the
/// device, the request or the file involved.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub enum Error {
    /// A CUDA library (the driver, NVRTC, cuBLAS) was found nowhere, or
    /// every file found refused to load. With the driver missing this reads
    /// "no CUDA driver found: …".
    LibraryNotFound {
        /// Which library.
        library: CudaLibrary,
        /// The names and folders tried, and the files that did not load.
        searched: Searched,
    },
    /// The crate was compiled without the `cuda` feature.
    NotCompiledWithCuda,
    /// A GPU ordinal that the device set does not have.
    OrdinalOutOfRange {
        /// The ordinal asked for.
        ordinal: usize,
        /// How many GPUs the set has.
        count: usize,
    },
    /// The driver (or, for an emulated device, the host allocator) could not
    /// provide the memory.
    OutOfMemory {
        /// Where the allocation was attempted.
        device: Device,
        /// Bytes requested.
        requested: u64,
        /// Bytes the device reported free at the time of the failure.
        free: u64,
    },
    /// The allocation would take the device past its budget.
    BudgetExceeded {
        /// The device whose budget would be exceeded.
        device: Device,
        /// Bytes requested.
        requested: u64,
        /// Bytes already allocated through this set on the device.
        live: u64,
        /// The device's budget.
        budget: u64,
    },
    /// A budget larger than the device's memory.
    BudgetLargerThanDevice {
        /// The device.
        device: Device,
        /// The budget asked for.
        budget: u64,
        /// The device's total memory.
        total: u64,
    },
    /// An allocation of zero bytes: device buffers always hold bytes.
    ZeroSizedAllocation {
        /// Where the allocation was attempted.
        device: Device,
    },
    /// A buffer, stream or event used with a device it does not belong to.
    WrongDevice {
        /// What was being done.
        operation: &'static str,
        /// The device the operation runs on.
        expected: Device,
        /// The device of the object that was passed.
        found: Device,
    },
    /// A byte range outside a buffer or host region.
    OutOfBounds {
        /// What was being done.
        operation: &'static str,
        /// First byte of the range.
        offset: u64,
        /// Length of the range.
        len: u64,
        /// Size of the buffer or region.
        size: u64,
    },
    /// Source and destination of a copy differ in length.
    LengthMismatch {
        /// What was being done.
        operation: &'static str,
        /// Bytes in the source.
        source: u64,
        /// Bytes in the destination.
        destination: u64,
    },
    /// A call into the CUDA driver failed.
    Driver {
        /// The driver call or operation.
        operation: &'static str,
        /// The device, when the call concerned one.
        device: Option<Device>,
        /// The driver's error name and description.
        message: String,
    },
    /// Page-aligned host memory could not be allocated.
    HostAlloc {
        /// Bytes requested.
        bytes: u64,
    },
    /// Compute kernels were asked of a GPU that cannot run them (emulated
    /// GPUs hold bytes only; their models compute on the host).
    ComputeUnsupported {
        /// The device.
        device: Device,
    },
    /// A compute operation given sizes that do not fit together or exceed
    /// what its kernel supports.
    BadComputeArgs {
        /// The operation.
        operation: &'static str,
        /// What is wrong.
        message: String,
    },
    /// A reader pool could not read its source.
    Read {
        /// The file, `None` for mapped or in-memory bytes.
        path: Option<PathBuf>,
        /// First byte of the read.
        offset: u64,
        /// Bytes asked for.
        len: u64,
        /// What went wrong.
        reason: String,
    },
    /// A host file (cgroup limits, /proc/meminfo) could not be read or parsed.
    HostMemoryInfo {
        /// The file.
        path: PathBuf,
        /// What went wrong.
        reason: String,
    },
}

impl std::fmt::Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Error::LibraryNotFound {
                library: CudaLibrary::Driver,
                searched,
            } => write!(f, "no CUDA driver found: {searched}"),
            Error::LibraryNotFound { library, searched } => {
                write!(f, "{}, was not found: {searched}", library.description())
            }
            Error::NotCompiledWithCuda => f.write_str("built without CUDA support"),
            Error::OrdinalOutOfRange { ordinal, count } => write!(
                f,
                "GPU ordinal {ordinal} is out of range: the device set has {count} GPU(s)"
            ),
            Error::OutOfMemory {
                device,
                requested,
                free,
            } => write!(
                f,
                "out of memory on device {device}: requested {requested} bytes, {free} bytes free"
            ),
            Error::BudgetExceeded {
                device,
                requested,
                live,
                budget,
            } => write!(
                f,
                "allocating {requested} bytes on device {device} would exceed its budget: \
                 {live} of {budget} bytes already in use"
            ),
            Error::BudgetLargerThanDevice {
                device,
                budget,
                total,
            } => write!(
                f,
                "budget of {budget} bytes for device {device} is larger than its {total} bytes of memory"
            ),
            Error::ZeroSizedAllocation { device } => {
                write!(f, "zero-sized allocation on device {device}")
            }
            Error::WrongDevice {
                operation,
                expected,
                found,
            } => write!(
                f,
                "{operation}: expected an object of device {expected}, got one of device {found}"
            ),
            Error::OutOfBounds {
                operation,
                offset,
                len,
                size,
            } => write!(
                f,
                "{operation}: bytes {offset}..{} are outside the {size} bytes available",
                offset.saturating_add(*len)
            ),
            Error::LengthMismatch {
                operation,
                source,
                destination,
            } => write!(
                f,
                "{operation}: source has {source} bytes but destination has {destination}"
            ),
            Error::Driver {
                operation,
                device,
                message,
            } => match device {
                Some(d) => write!(
                    f,
                    "CUDA driver error in {operation} on device {d}: {message}"
                ),
                None => write!(f, "CUDA driver error in {operation}: {message}"),
            },
            Error::ComputeUnsupported { device } => write!(
                f,
                "compute is not supported on emulated device {device}: run the model's \
                 compute on the host"
            ),
            Error::BadComputeArgs { operation, message } => write!(f, "{operation}: {message}"),
            Error::HostAlloc { bytes } => {
                write!(f, "could not allocate {bytes} bytes of host memory")
            }
            Error::Read {
                path,
                offset,
                len,
                reason,
            } => {
                let what = path.as_ref().map_or_else(
                    || "the mapped bytes".to_string(),
                    |p| p.display().to_string(),
                );
                write!(
                    f,
                    "reading bytes {offset}..{} of {what}: {reason}",
                    offset.saturating_add(*len)
                )
            }
            Error::HostMemoryInfo { path, reason } => {
                write!(
                    f,
                    "cannot read host memory from {}: {reason}",
                    path.display()
                )
            }
        }
    }
}

impl std::error::Error for Error {}

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
