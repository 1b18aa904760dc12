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
/// The least host RAM kept back: 1 GiB.
pub const CPU_MARGIN_MIN: u64 = 1 << 30;
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

/// Bytes kept back from `available` host RAM: the larger of
/// [`CPU_MARGIN_MIN`] and [`CPU_MARGIN_PERCENT`] of it.
pub fn cpu_safety_margin(available: u64) -> u64 {
    CPU_MARGIN_MIN.max(percent_of(available, CPU_MARGIN_PERCENT))
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
            .saturating_sub(cpu_safety_margin(info.host.available)),
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
            },
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
    fn emulated_gpus_keep_no_margin() {
        let b = default_budgets(&info(GpuKind::Emulated, 1000, 1000, 100 * GIB));
        assert_eq!(b.gpus, vec![1000]);
    }
}
