//! Devices for bigmodel.
//!
//! Everything that touches an accelerator lives here, behind one small API
//! the other crates use: probing for CUDA without panicking, memory queries,
//! allocation with accounting, streams and pinned staging. Only this crate
//! names cudarc.

/// Everything that can go wrong in `bm-device`.
#[derive(Debug)]
#[non_exhaustive]
pub enum Error {
    /// The crate was compiled without the `cuda` feature.
    NotCompiledWithCuda,
}

impl std::fmt::Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Error::NotCompiledWithCuda => f.write_str("built without CUDA support"),
        }
    }
}

impl std::error::Error for Error {}
