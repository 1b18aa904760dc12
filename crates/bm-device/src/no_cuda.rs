//! The stand-in for the `cuda` module in builds without the `cuda` feature
//! (candle's dummy-backend pattern): the same types and functions, so the
//! rest of the crate has no `cfg` for CUDA at all. The types are empty
//! enums, so no value of them can exist: every CUDA variant elsewhere
//! (`Backend::Cuda`, `Mem::Cuda`, `StreamImpl::Cuda`, ...) is still compiled
//! and type-checked but can never be constructed, and the only entry point,
//! [`probe`], fails with [`Error::NotCompiledWithCuda`].

use std::sync::Arc;
use std::time::Duration;

use bm_tensor::DType;

use crate::compute::{GemmShape, KernelModuleInfo, LaunchShape, RawArg};
use crate::libs::{CudaLibrary, LibraryReport};
use crate::{Device, Error, Result};

/// This build has no CUDA support.
pub(crate) const COMPILED: bool = false;

/// A device address.
pub(crate) type DevicePtr = u64;

/// A CUDA GPU; none can exist in this build.
pub(crate) enum CudaGpu {}

/// A CUDA stream; none can exist in this build.
pub(crate) enum CudaStream {}

/// A CUDA event; none can exist in this build.
pub(crate) enum CudaEvent {}

/// What probing the driver found.
pub(crate) struct Probe {
    /// `cuDriverGetVersion`.
    pub driver_version: i32,
    /// Every visible GPU.
    pub gpus: Vec<CudaGpu>,
}

/// Always [`Error::NotCompiledWithCuda`].
pub(crate) fn probe() -> Result<Probe> {
    Err(Error::NotCompiledWithCuda)
}

/// Every library, none loaded: this build never loads them.
pub(crate) fn library_reports() -> Vec<LibraryReport> {
    CudaLibrary::ALL
        .into_iter()
        .map(|library| LibraryReport {
            library,
            path: None,
            version: None,
            error: Some(Error::NotCompiledWithCuda.to_string()),
        })
        .collect()
}

impl CudaGpu {
    pub(crate) fn ordinal(&self) -> usize {
        match *self {}
    }

    pub(crate) fn name(&self) -> Result<String> {
        match *self {}
    }

    pub(crate) fn mem_info(&self) -> Result<(u64, u64)> {
        match *self {}
    }

    pub(crate) fn new_stream(&self) -> Result<Arc<CudaStream>> {
        match *self {}
    }

    pub(crate) fn synchronize(&self) -> Result<()> {
        match *self {}
    }

    pub(crate) fn pool_unused(&self) -> u64 {
        match *self {}
    }

    pub(crate) fn driver_allocations(&self) -> u64 {
        match *self {}
    }

    pub(crate) fn release_cached(&self) -> Result<()> {
        match *self {}
    }

    pub(crate) fn alloc(&self, _bytes: usize, _stream: &CudaStream) -> Result<DevicePtr> {
        match *self {}
    }

    /// # Safety
    /// As the CUDA backend's `free`.
    pub(crate) unsafe fn free(&self, _ptr: DevicePtr, _stream: &CudaStream) {
        match *self {}
    }

    /// # Safety
    /// As the CUDA backend's `memset_zero_async`.
    pub(crate) unsafe fn memset_zero_async(
        &self,
        _ptr: DevicePtr,
        _bytes: usize,
        _stream: &CudaStream,
    ) -> Result<()> {
        match *self {}
    }

    /// # Safety
    /// As the CUDA backend's `htod_async`.
    pub(crate) unsafe fn htod_async(
        &self,
        _dst: DevicePtr,
        _src: *const u8,
        _len: usize,
        _stream: &CudaStream,
    ) -> Result<()> {
        match *self {}
    }

    /// # Safety
    /// As the CUDA backend's `dtoh_async`.
    pub(crate) unsafe fn dtoh_async(
        &self,
        _dst: *mut u8,
        _src: DevicePtr,
        _len: usize,
        _stream: &CudaStream,
    ) -> Result<()> {
        match *self {}
    }

    /// # Safety
    /// As the CUDA backend's `dtod_async`.
    pub(crate) unsafe fn dtod_async(
        &self,
        _dst: DevicePtr,
        _src_gpu: &CudaGpu,
        _src: DevicePtr,
        _len: usize,
        _stream: &CudaStream,
    ) -> Result<()> {
        match *self {}
    }

    pub(crate) fn kernel_info(&self) -> Option<KernelModuleInfo> {
        match *self {}
    }

    pub(crate) fn can_access_peer(&self, _other: &CudaGpu) -> Result<bool> {
        match *self {}
    }

    pub(crate) fn enable_peer_access(&self, _other: &CudaGpu) -> Result<()> {
        match *self {}
    }

    pub(crate) fn busy_wait(&self, _stream: &Arc<CudaStream>, _duration: Duration) -> Result<()> {
        match *self {}
    }

    pub(crate) fn alloc_pinned(&self, _bytes: usize) -> Result<*mut u8> {
        match *self {}
    }

    /// # Safety
    /// As the CUDA backend's `free_pinned`.
    pub(crate) unsafe fn free_pinned(&self, _ptr: *mut u8) {
        match *self {}
    }

    /// # Safety
    /// As the CUDA backend's `host_register`.
    pub(crate) unsafe fn host_register(&self, _ptr: *const u8, _len: usize) -> Result<()> {
        match *self {}
    }

    /// # Safety
    /// As the CUDA backend's `host_unregister`.
    pub(crate) unsafe fn host_unregister(&self, _ptr: *const u8) {
        match *self {}
    }

    /// # Safety
    /// As the CUDA backend's `launch`.
    pub(crate) unsafe fn launch(
        &self,
        _stream: &CudaStream,
        _name: &str,
        _shape: LaunchShape,
        _args: &[RawArg],
    ) -> Result<()> {
        match *self {}
    }

    /// # Safety
    /// As the CUDA backend's `gemm`.
    pub(crate) unsafe fn gemm(
        &self,
        _stream: &Arc<CudaStream>,
        _shape: &GemmShape,
        _input: DType,
        _output: DType,
        _ptrs: (u64, u64, u64),
    ) -> Result<()> {
        match *self {}
    }
}

pub(crate) fn record(stream: &CudaStream, _device: Device) -> Result<Arc<CudaEvent>> {
    match *stream {}
}

pub(crate) fn record_timed(stream: &CudaStream, _device: Device) -> Result<Arc<CudaEvent>> {
    match *stream {}
}

pub(crate) fn wait(stream: &CudaStream, _event: &CudaEvent, _device: Device) -> Result<()> {
    match *stream {}
}

pub(crate) fn sync_stream(stream: &CudaStream, _device: Device) -> Result<()> {
    match *stream {}
}

pub(crate) fn sync_event(event: &CudaEvent, _device: Device) -> Result<()> {
    match *event {}
}

pub(crate) fn event_done(event: &CudaEvent, _device: Device) -> Result<bool> {
    match *event {}
}

pub(crate) fn elapsed_ms(start: &CudaEvent, _end: &CudaEvent, _device: Device) -> Result<f32> {
    match *start {}
}
