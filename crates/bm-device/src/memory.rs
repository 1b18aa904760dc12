//! Memory figures per device and the default budgets derived from them.

use crate::host_memory::HostMemory;
use crate::{Device, GpuKind};

/// Free and total memory of one GPU.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GpuMemory {
    /// Which GPU.
    pub device: Device,
    /// CUDA or emulated.
    pub kind: GpuKind,
    /// The driver's device name.
    pub name: String,
    /// Bytes free now.
    pub free: u64,
    /// Bytes in total.
    pub total: u64,
}

/// What every device of a set has: per GPU free/total, and the host RAM
/// this process may still use.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemoryInfo {
    /// One entry per GPU, in ordinal order.
    pub gpus: Vec<GpuMemory>,
    /// Host RAM available, respecting cgroup limits.
    pub host: HostMemory,
}

/// Budgets in bytes per device, for the planner when the user gives no
/// `--max-memory`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Budgets {
    /// One budget per GPU ordinal.
    pub gpus: Vec<u64>,
    /// Host RAM.
    pub cpu: u64,
}

/// The least memory kept back on each CUDA GPU: 1 GiB.
pub const GPU_MARGIN_MIN: u64 = 1 << 30;
/// The share of a CUDA GPU's total memory kept back, in percent: 5 %.
pub const GPU_MARGIN_PERCENT: u64 = 5;
/// The least host RAM kept back on a machine (or in a cgroup) of 4 GiB
/// or more: 1 GiB. Smaller limits keep [`CPU_MARGIN_LIMIT_PERCENT`] of
/// the limit back instead, at least [`CPU_MARGIN_SMALL_MIN`].
pub const CPU_MARGIN_MIN: u64 = 1 << 30;
/// The share of the host memory limit kept back at least, in percent, up
/// to [`CPU_MARGIN_MIN`]: 25 %.
pub const CPU_MARGIN_LIMIT_PERCENT: u64 = 25;
/// The least host RAM kept back under any limit: 64 MiB (the process
/// itself: its code, threads' stacks, allocator).
pub const CPU_MARGIN_SMALL_MIN: u64 = 64 << 20;
/// The share of available host RAM kept back, in percent: 10 %.
pub const CPU_MARGIN_PERCENT: u64 = 10;

fn percent_of(bytes: u64, percent: u64) -> u64 {
    (u128::from(bytes) * u128::from(percent) / 100) as u64
}

/// Bytes kept back on a CUDA GPU of `total` bytes: the larger of
/// [`GPU_MARGIN_MIN`] and [`GPU_MARGIN_PERCENT`] of `total`.
pub fn gpu_safety_margin(total: u64) -> u64 {
    GPU_MARGIN_MIN.max(percent_of(total, GPU_MARGIN_PERCENT))
}

/// Bytes kept back from the host RAM `host` has available: the larger of
/// a floor and [`CPU_MARGIN_PERCENT`] of what is available. The floor
/// scales with the memory limit: [`CPU_MARGIN_LIMIT_PERCENT`] of it,
/// between [`CPU_MARGIN_SMALL_MIN`] and [`CPU_MARGIN_MIN`], so a machine
/// of 4 GiB or more keeps 1 GiB back, and a 1 GiB cgroup 256 MiB (a fixed
/// 1 GiB would leave it no budget at all).
pub fn cpu_safety_margin(host: &HostMemory) -> u64 {
    let floor = percent_of(host.limit, CPU_MARGIN_LIMIT_PERCENT)
        .clamp(CPU_MARGIN_SMALL_MIN, CPU_MARGIN_MIN);
    floor.max(percent_of(host.available, CPU_MARGIN_PERCENT))
}

/// Budgets used when the user gives no `--max-memory`: free memory minus
/// a safety margin (see the crate documentation). CUDA GPUs keep
/// [`gpu_safety_margin`] back, host RAM [`cpu_safety_margin`]; emulated
/// GPUs keep nothing back, since their capacity was chosen by the caller.
pub fn default_budgets(info: &MemoryInfo) -> Budgets {
    Budgets {
        gpus: info
            .gpus
            .iter()
            .map(|g| match g.kind {
                GpuKind::Cuda => g.free.saturating_sub(gpu_safety_margin(g.total)),
                GpuKind::Emulated => g.free,
            })
            .collect(),
        cpu: info
            .host
            .available
            .saturating_sub(cpu_safety_margin(&info.host)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::HostMemorySource;

    const GIB: u64 = 1 << 30;

    fn info(kind: GpuKind, free: u64, total: u64, host: u64) -> MemoryInfo {
        MemoryInfo {
            gpus: vec![GpuMemory {
                device: Device::Gpu(0),
                kind,
                name: "g".into(),
                free,
                total,
            }],
            host: HostMemory {
                available: host,
                source: HostMemorySource::MemInfo,
                limit: host.max(16 * GIB),
            },
        }
    }

    fn cgroup(available: u64, limit: u64) -> HostMemory {
        HostMemory {
            available,
            source: HostMemorySource::CgroupV2,
            limit,
        }
    }

    #[test]
    fn cuda_gpus_keep_the_larger_margin() {
        // 80 GiB card: 5 % = 4 GiB.
        let b = default_budgets(&info(GpuKind::Cuda, 79 * GIB, 80 * GIB, 100 * GIB));
        assert_eq!(b.gpus, vec![75 * GIB]);
        assert_eq!(b.cpu, 90 * GIB);
        // 8 GiB card: the 1 GiB floor wins.
        let b = default_budgets(&info(GpuKind::Cuda, 7 * GIB, 8 * GIB, 2 * GIB));
        assert_eq!(b.gpus, vec![6 * GIB]);
        assert_eq!(b.cpu, GIB);
        // Less free than the margin: nothing, not an underflow.
        let b = default_budgets(&info(GpuKind::Cuda, GIB / 2, 8 * GIB, GIB / 2));
        assert_eq!((b.gpus[0], b.cpu), (0, 0));
    }

    #[test]
    fn the_host_margin_scales_with_small_limits() {
        const MIB: u64 = 1 << 20;
        // A 1 GiB cgroup with 20 MiB in use keeps a quarter of its limit
        // back, so a small model still fits in RAM.
        let host = cgroup(GIB - 20 * MIB, GIB);
        assert_eq!(cpu_safety_margin(&host), 256 * MIB);
        let mut small = info(GpuKind::Emulated, 0, 0, 0);
        small.host = host;
        assert_eq!(default_budgets(&small).cpu, GIB - 276 * MIB);
        // 4 GiB and up: the 1 GiB floor, then 10 % of what is available.
        assert_eq!(cpu_safety_margin(&cgroup(3 * GIB, 4 * GIB)), GIB);
        assert_eq!(cpu_safety_margin(&cgroup(2 * GIB, 64 * GIB)), GIB);
        assert_eq!(cpu_safety_margin(&cgroup(50 * GIB, 64 * GIB)), 5 * GIB);
        // A tiny limit keeps the process's own 64 MiB back.
        assert_eq!(cpu_safety_margin(&cgroup(100 * MIB, 128 * MIB)), 64 * MIB);
        // Less available than the margin: nothing, not an underflow.
        small.host = cgroup(200 * MIB, GIB);
        assert_eq!(default_budgets(&small).cpu, 0);
    }

    #[test]
    fn emulated_gpus_keep_no_margin() {
        let b = default_budgets(&info(GpuKind::Emulated, 1000, 1000, 100 * GIB));
        assert_eq!(b.gpus, vec![1000]);
    }
}
