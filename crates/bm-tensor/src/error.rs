//! The one error type of the crate.

use std::fmt;
use std::path::PathBuf;

use crate::DType;

/// Everything that can go wrong in `bm-tensor`.
#[derive(Debug)]
#[non_exhaustive]
pub enum Error {
    /// A dtype name that is none of the safetensors, PyTorch or short spellings.
    UnknownDType(String),
    /// A cast between two dtypes this crate does not convert.
    UnsupportedCast {
        /// Source dtype.
        from: DType,
        /// Requested dtype.
        to: DType,
    },
    /// A byte buffer whose length does not fit the dtype or shape it was given.
    LengthMismatch {
        /// What the buffer holds.
        what: String,
        /// Bytes expected.
        expected: usize,
        /// Bytes found.
        found: usize,
    },
    /// A byte range outside the mapped file.
    OutOfBounds {
        /// The mapped file.
        path: PathBuf,
        /// First byte asked for.
        start: usize,
        /// One past the last byte asked for.
        end: usize,
        /// Length of the file.
        len: usize,
    },
    /// A host allocation that could not be made.
    Alloc {
        /// Bytes requested.
        bytes: usize,
    },
    /// Opening or mapping a file failed.
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// A mapped file that shrank after it was mapped (another program
    /// rewrote or truncated it): its lost bytes cannot be read.
    Truncated {
        /// The mapped file.
        path: PathBuf,
        /// Bytes the mapping needs.
        needed: u64,
        /// Bytes the file holds now.
        len: u64,
    },
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::UnknownDType(s) => write!(
                f,
                "unknown dtype {s:?}: expected one of F64 F32 F16 BF16 I64 I32 I16 I8 U8 BOOL F8_E4M3 F8_E5M2"
            ),
            Error::UnsupportedCast { from, to } => write!(
                f,
                "cannot cast {from} to {to}: only F64, F32, F16 and BF16 convert into each other"
            ),
            Error::LengthMismatch {
                what,
                expected,
                found,
            } => write!(f, "{what}: expected {expected} bytes, found {found}"),
            Error::OutOfBounds {
                path,
                start,
                end,
                len,
            } => write!(
                f,
                "{}: bytes {start}..{end} lie outside the file ({len} bytes)",
                path.display()
            ),
            Error::Alloc { bytes } => write!(f, "could not allocate {bytes} bytes of host memory"),
            Error::Io { path, source } => write!(f, "{}: {source}", path.display()),
            Error::Truncated { path, needed, len } => write!(
                f,
                "{}: the file shrank to {len} bytes while mapped (another program rewrote or truncated it); reading it needs {needed}: do not change checkpoint or offload files while they are in use",
                path.display()
            ),
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Error::Io { source, .. } => Some(source),
            _ => None,
        }
    }
}
