//! The devices a process uses.

use crate::pinned::{HostRegistration, PinnedPool};
use crate::{
    Budgets, Error, Gpu, GpuKind, MemoryInfo, Result, SimulatedLink, default_budgets, host_memory,
};

/// What is known about CUDA in this process.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CudaStatus {
    /// Whether the crate was built with the `cuda` feature.
    pub compiled: bool,
    /// Whether a CUDA driver library was found and loaded.
    pub driver_found: bool,
    /// The driver's CUDA version as (major, minor), when found.
    pub driver_version: Option<(i32, i32)>,
    /// Why CUDA GPUs are not available, when they are not.
    pub error: Option<String>,
}

/// The GPUs a process uses (CUDA, or host-emulated when asked for) plus
/// the host. GPU ordinals are `0..gpu_count()`.
pub struct DeviceSet {
    gpus: Vec<Gpu>,
    emulated: bool,
    cuda: CudaStatus,
}

impl std::fmt::Debug for DeviceSet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceSet")
            .field("gpus", &self.gpus)
            .field("cuda", &self.cuda)
            .finish()
    }
}

impl DeviceSet {
    /// CPU plus every CUDA GPU the driver shows. Never fails and never
    /// panics: without the `cuda` feature or a driver the set has no GPUs
    /// and [`DeviceSet::cuda_status`] says why.
    pub fn probe() -> DeviceSet {
        match probe_cuda() {
            Ok((gpus, version)) => DeviceSet {
                gpus,
                emulated: false,
                cuda: CudaStatus {
                    compiled: true,
                    driver_found: true,
                    driver_version: Some(version),
                    error: None,
                },
            },
            Err((driver_found, driver_version, e)) => DeviceSet {
                gpus: Vec::new(),
                emulated: false,
                cuda: CudaStatus {
                    compiled: crate::CUDA_COMPILED,
                    driver_found,
                    driver_version,
                    error: Some(e.to_string()),
                },
            },
        }
    }

    /// Like [`DeviceSet::probe`], but fails when CUDA is not usable:
    /// [`Error::NotCompiledWithCuda`], [`Error::LibraryNotFound`] or the driver's
    /// error.
    pub fn cuda() -> Result<DeviceSet> {
        let (gpus, version) = probe_cuda().map_err(|(_, _, e)| e)?;
        Ok(DeviceSet {
            gpus,
            emulated: false,
            cuda: CudaStatus {
                compiled: true,
                driver_found: true,
                driver_version: Some(version),
                error: None,
            },
        })
    }

    /// The host alone, no GPUs.
    pub fn cpu_only() -> DeviceSet {
        DeviceSet {
            gpus: Vec::new(),
            emulated: false,
            cuda: CudaStatus {
                compiled: crate::CUDA_COMPILED,
                driver_found: false,
                driver_version: None,
                error: Some("CUDA not probed: CPU-only device set".into()),
            },
        }
    }

    /// Host-emulated GPUs, one per entry of `capacities` (bytes): host
    /// memory with its own budget and accounting, addressed as GPU
    /// ordinals and copied with real memcpys, so multi-device code runs
    /// without a GPU. Never chosen unless asked for.
    pub fn emulated(capacities: &[u64]) -> DeviceSet {
        Self::emulated_gpus(capacities, None)
    }

    /// Like [`DeviceSet::emulated`], each GPU behind a [`SimulatedLink`]:
    /// its copy stream runs on a copy-engine thread, concurrently with the
    /// caller, and every host↔device copy takes the link's transfer time.
    /// Compute stays host compute; with it, copy/compute overlap can be
    /// measured without a GPU.
    pub fn emulated_with_link(capacities: &[u64], link: SimulatedLink) -> DeviceSet {
        Self::emulated_gpus(capacities, Some(link))
    }

    fn emulated_gpus(capacities: &[u64], link: Option<SimulatedLink>) -> DeviceSet {
        DeviceSet {
            gpus: capacities
                .iter()
                .enumerate()
                .map(|(n, &c)| Gpu::emulated(n, c, link))
                .collect(),
            emulated: true,
            cuda: CudaStatus {
                compiled: crate::CUDA_COMPILED,
                driver_found: false,
                driver_version: None,
                error: Some("CUDA not probed: emulated device set".into()),
            },
        }
    }

    /// Number of GPUs.
    pub fn gpu_count(&self) -> usize {
        self.gpus.len()
    }

    /// GPU `ordinal`, or [`Error::OrdinalOutOfRange`].
    pub fn gpu(&self, ordinal: usize) -> Result<&Gpu> {
        self.gpus.get(ordinal).ok_or(Error::OrdinalOutOfRange {
            ordinal,
            count: self.gpus.len(),
        })
    }

    /// Every GPU, in ordinal order.
    pub fn gpus(&self) -> &[Gpu] {
        &self.gpus
    }

    /// Whether the GPUs are host-emulated.
    pub fn is_emulated(&self) -> bool {
        self.emulated
    }

    /// Whether CUDA support is compiled in and a driver was found.
    pub fn cuda_status(&self) -> &CudaStatus {
        &self.cuda
    }

    /// Free/total per GPU now, and the host RAM available.
    pub fn memory_info(&self) -> Result<MemoryInfo> {
        Ok(MemoryInfo {
            gpus: self.gpus.iter().map(Gpu::memory).collect::<Result<_>>()?,
            host: host_memory()?,
        })
    }

    /// [`default_budgets`] of [`DeviceSet::memory_info`].
    pub fn default_budgets(&self) -> Result<Budgets> {
        Ok(default_budgets(&self.memory_info()?))
    }

    /// Enables direct access between every pair of CUDA GPUs the driver
    /// allows; returns the (from, to) pairs enabled. Copies between other
    /// pairs still work, staged through the host by the driver.
    pub fn enable_peer_access(&self) -> Result<Vec<(usize, usize)>> {
        let mut enabled = Vec::new();
        for a in &self.gpus {
            for b in &self.gpus {
                if let (Some(ca), Some(cb)) = (a.cuda(), b.cuda())
                    && a.ordinal() != b.ordinal()
                    && ca.can_access_peer(cb)?
                {
                    ca.enable_peer_access(cb)?;
                    enabled.push((a.ordinal(), b.ordinal()));
                }
            }
        }
        Ok(enabled)
    }

    /// A pool of `slots` staging buffers of `slot_bytes` each (see
    /// [`PinnedPool`]): page-locked when the set has a CUDA GPU, pageable
    /// otherwise or when pinning fails.
    pub fn pinned_pool(&self, slot_bytes: usize, slots: usize) -> Result<PinnedPool> {
        PinnedPool::new(self, slot_bytes, slots)
    }

    /// A pool of reader threads with page-locked staging slots, for uploads
    /// from files and mappings that overlap reading with DMA (see
    /// [`ReaderPool`](crate::ReaderPool)); slots are pageable when the set
    /// cannot pin.
    pub fn reader_pool(&self, options: crate::ReaderOptions) -> Result<crate::ReaderPool> {
        crate::ReaderPool::new(self, options)
    }

    /// A standalone page-locked host buffer of `len` bytes (pageable when
    /// pinning is impossible), for asynchronous copies to and from devices.
    pub fn alloc_pinned(&self, len: usize) -> Result<crate::PinnedBuffer> {
        crate::PinnedBuffer::for_set(self, len).map(|(b, _)| b)
    }

    /// Page-locks `bytes` in place (in pieces) so copies from it run
    /// asynchronously at full speed; falls back to pageable copies when
    /// registration fails or the set has no CUDA GPU.
    pub fn register_host<'a>(&self, bytes: &'a [u8]) -> HostRegistration<'a> {
        HostRegistration::new(self, bytes)
    }

    /// The CUDA libraries this process uses: the driver (as probing loaded
    /// it), NVRTC and cuBLAS with cuBLASLt, each with the file loaded and
    /// its version, or why it is not available. Loads NVRTC and cuBLAS if
    /// nothing has yet (a fraction of a second); loads nothing when CUDA
    /// was not probed or is not compiled in.
    pub fn cuda_libraries(&self) -> Vec<crate::LibraryReport> {
        crate::cuda::library_reports()
    }

    /// The kind of this set's GPUs, `None` when it has none.
    pub fn gpu_kind(&self) -> Option<GpuKind> {
        self.gpus.first().map(Gpu::kind)
    }
}

/// The failure of a CUDA probe: whether a driver was found, its version,
/// and the error.
type ProbeFailure = (bool, Option<(i32, i32)>, Error);

fn probe_cuda() -> std::result::Result<(Vec<Gpu>, (i32, i32)), ProbeFailure> {
    let probe = crate::cuda::probe().map_err(|e| {
        let driver_found = !matches!(
            e,
            Error::LibraryNotFound {
                library: crate::CudaLibrary::Driver,
                ..
            } | Error::NotCompiledWithCuda
        );
        (driver_found, None, e)
    })?;
    let version = (
        probe.driver_version / 1000,
        probe.driver_version % 1000 / 10,
    );
    let gpus = probe
        .gpus
        .into_iter()
        .map(Gpu::from_cuda)
        .collect::<Result<Vec<_>>>()
        .map_err(|e| (true, Some(version), e))?;
    Ok((gpus, version))
}

impl DeviceSet {
    /// The CUDA devices for a GPU test: the set when CUDA shows at least one
    /// GPU, else `None` after writing `skipped: no CUDA device (why)` to
    /// stderr (straight to the handle, which libtest does not capture). With
    /// `BM_GPU_TESTS=1`, as the GPU bundle runs its tests, a missing GPU
    /// panics instead, so the bundle cannot pass by skipping.
    pub fn cuda_for_gpu_tests() -> Option<DeviceSet> {
        let why = match DeviceSet::cuda() {
            Ok(set) if set.gpu_count() > 0 => return Some(set),
            Ok(_) => "the driver shows no GPU".to_string(),
            Err(e) => e.to_string(),
        };
        if std::env::var_os("BM_GPU_TESTS").is_some_and(|v| v == "1") {
            panic!("BM_GPU_TESTS=1 but no CUDA device: {why}");
        }
        let _ = std::io::Write::write_fmt(
            &mut std::io::stderr(),
            format_args!("skipped: no CUDA device ({why})\n"),
        );
        None
    }
}
