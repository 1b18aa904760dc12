//! The budgets a strategy plans with when the caller gives none, and where
//! a plan's budgets came from: the refusals that follow from them (modules
//! sent to disk without an offload folder, a model that does not fit) say
//! so, since "cpu 0 B" reads as a bug unless it says it is a 1 GiB
//! container's limit less its safety margin.

use std::fmt;
use std::path::Path;

use bm_device::{Budgets, DeviceSet, GpuKind, GpuMemory, HostMemory, MemoryInfo};
use bm_plan::{Compat, DeviceMap, MaxMemory, human_bytes};

use crate::Error;

/// Where the budgets of a plan came from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BudgetOrigin {
    /// Given by the caller (`max_memory`; the CLI's `--max-memory`).
    Given(MaxMemory),
    /// Measured on this machine by [`default_max_memory_with_origin`].
    Measured {
        /// The budgets.
        max_memory: MaxMemory,
        /// Each GPU as measured: free and total memory.
        gpus: Vec<GpuMemory>,
        /// Host RAM as measured: what is available, from which limit.
        host: HostMemory,
        /// Bytes of `host.available` kept back (none in Accelerate's mode).
        cpu_margin: u64,
    },
}

impl BudgetOrigin {
    /// The budgets themselves.
    pub fn max_memory(&self) -> &MaxMemory {
        match self {
            BudgetOrigin::Given(m) | BudgetOrigin::Measured { max_memory: m, .. } => m,
        }
    }

    /// Whether the caller gave them.
    pub fn is_given(&self) -> bool {
        matches!(self, BudgetOrigin::Given(_))
    }

    /// `error` with these budgets' origin added where it follows from them:
    /// a plan that does not fit, or that sends modules to disk without an
    /// offload folder. Other errors are returned as they are.
    pub fn explain(&self, error: Error) -> Error {
        match error {
            Error::Plan(bm_plan::Error::DoesNotFit(msg)) => {
                Error::Plan(bm_plan::Error::DoesNotFit(format!("{msg}\n{self}")))
            }
            Error::Dispatch(bm_dispatch::Error::NoOffloadFolder {
                modules,
                budgets: None,
            }) => Error::Dispatch(bm_dispatch::Error::NoOffloadFolder {
                modules,
                budgets: Some(self.to_string()),
            }),
            other => other,
        }
    }
}

/// "cpu 740.00 MiB, 0 66.00 GiB": a budget per device.
fn list(max_memory: &MaxMemory) -> String {
    max_memory
        .iter()
        .map(|(d, b)| format!("{d} {}", human_bytes(b)))
        .collect::<Vec<_>>()
        .join(", ")
}

impl fmt::Display for BudgetOrigin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BudgetOrigin::Given(m) => {
                write!(f, "budgets given by max_memory (--max-memory): {}", list(m))
            }
            BudgetOrigin::Measured {
                max_memory,
                gpus,
                host,
                cpu_margin,
            } => {
                write!(f, "budgets measured on this machine: {}", list(max_memory))?;
                for g in gpus {
                    match g.kind {
                        GpuKind::Cuda => write!(
                            f,
                            "; GPU {}: {} free of {}",
                            g.device,
                            human_bytes(g.free),
                            human_bytes(g.total)
                        )?,
                        GpuKind::Emulated => write!(f, "; GPU {}: emulated", g.device)?,
                    }
                }
                write!(
                    f,
                    "; host RAM: {} available ({}; limit {})",
                    human_bytes(host.available),
                    host.source,
                    human_bytes(host.limit)
                )?;
                if *cpu_margin > 0 {
                    write!(f, " less a {} safety margin", human_bytes(*cpu_margin))?;
                }
                f.write_str("; max_memory (--max-memory) sets them")
            }
        }
    }
}

/// The budgets a strategy plans with when the user gives no `max_memory`,
/// for the facade and the CLI alike. With [`Compat::Accelerate`] they are
/// Accelerate's `get_max_memory()`: 100 % of each CUDA GPU's free memory
/// and the available host RAM. bigmodel's planner ([`Compat::Auto`]) keeps
/// bm-device's safety margins back ([`bm_device::default_budgets`]).
/// Emulated GPUs get the budget they were given in either mode: their
/// capacity is the caller's choice.
pub fn default_max_memory(devices: &DeviceSet, compat: Compat) -> Result<MaxMemory, Error> {
    let (max_memory, _) = default_max_memory_with_origin(devices, compat)?;
    Ok(max_memory)
}

/// [`default_max_memory`] and the figures it came from, for messages.
pub fn default_max_memory_with_origin(
    devices: &DeviceSet,
    compat: Compat,
) -> Result<(MaxMemory, BudgetOrigin), Error> {
    let info = devices.memory_info().map_err(Error::Memory)?;
    let mut budgets = budgets_from(&info, compat);
    for (budget, gpu) in budgets.gpus.iter_mut().zip(devices.gpus()) {
        if gpu.kind() == GpuKind::Emulated {
            *budget = gpu.budget();
        }
    }
    let pairs = budgets
        .gpus
        .iter()
        .enumerate()
        .map(|(i, &b)| (bm_plan::Device::Gpu(i as u32), b))
        .chain([(bm_plan::Device::Cpu, budgets.cpu)]);
    let max_memory = MaxMemory::new(pairs)?;
    let origin = BudgetOrigin::Measured {
        max_memory: max_memory.clone(),
        gpus: info.gpus,
        host: info.host,
        cpu_margin: info.host.available.saturating_sub(budgets.cpu),
    };
    Ok((max_memory, origin))
}

/// Refuses a planned `map` that sends modules to disk when there is no
/// `offload_folder`, before anything is loaded: Accelerate's message,
/// naming the modules (or "the whole model") and where `budgets` came from.
pub fn check_offload_folder(
    map: &DeviceMap,
    offload_folder: Option<&Path>,
    budgets: &BudgetOrigin,
) -> Result<(), Error> {
    let modules: Vec<String> = map
        .iter()
        .filter(|(_, d)| *d == bm_plan::Device::Disk)
        .map(|(n, _)| n.to_string())
        .collect();
    if modules.is_empty() || offload_folder.is_some() {
        return Ok(());
    }
    Err(Error::Dispatch(bm_dispatch::Error::NoOffloadFolder {
        modules,
        budgets: Some(budgets.to_string()),
    }))
}

/// Default budgets from memory figures: Accelerate's (everything free) or
/// bigmodel's (free minus the safety margins).
pub(crate) fn budgets_from(info: &MemoryInfo, compat: Compat) -> Budgets {
    match compat {
        Compat::Accelerate => Budgets {
            gpus: info.gpus.iter().map(|g| g.free).collect(),
            cpu: info.host.available,
        },
        Compat::Auto => bm_device::default_budgets(info),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bm_device::{Device, GpuMemory, HostMemorySource};

    const MIB: u64 = 1 << 20;
    const GIB: u64 = 1 << 30;

    fn machine() -> MemoryInfo {
        MemoryInfo {
            gpus: vec![GpuMemory {
                device: Device::Gpu(0),
                kind: GpuKind::Cuda,
                name: "test GPU".into(),
                free: 70 * GIB,
                total: 80 * GIB,
            }],
            host: HostMemory {
                available: 100 * GIB,
                source: HostMemorySource::MemInfo,
                limit: 128 * GIB,
            },
        }
    }

    #[test]
    fn compat_defaults_are_accelerates_get_max_memory() {
        let b = budgets_from(&machine(), Compat::Accelerate);
        assert_eq!(b.gpus, [70 * GIB]);
        assert_eq!(b.cpu, 100 * GIB);
    }

    #[test]
    fn auto_defaults_keep_the_safety_margins() {
        let b = budgets_from(&machine(), Compat::Auto);
        // 5 % of 80 GiB = 4 GiB on the GPU, 10 % of 100 GiB on the host.
        assert_eq!(b.gpus, [66 * GIB]);
        assert_eq!(b.cpu, 90 * GIB);
    }

    #[test]
    fn emulated_gpus_plan_with_their_budget_in_both_modes() {
        let devices = DeviceSet::emulated(&[1000, 2000]);
        devices.gpu(1).unwrap().set_budget(1500).unwrap();
        for compat in [Compat::Accelerate, Compat::Auto] {
            let m = default_max_memory(&devices, compat).unwrap();
            assert_eq!(m.get(bm_plan::Device::Gpu(0)), Some(1000), "{compat:?}");
            assert_eq!(m.get(bm_plan::Device::Gpu(1)), Some(1500), "{compat:?}");
            assert!(m.get(bm_plan::Device::Cpu).is_some(), "{compat:?}");
        }
    }

    #[test]
    fn a_one_gib_container_plans_a_small_model_in_ram() {
        // 1000 MiB left under a 1 GiB cgroup limit, no GPU. A fixed 1 GiB
        // margin left a CPU budget of 0 B: the whole model went to disk.
        let info = MemoryInfo {
            gpus: Vec::new(),
            host: HostMemory {
                available: 1000 * MIB,
                source: HostMemorySource::CgroupV2,
                limit: GIB,
            },
        };
        let budgets = budgets_from(&info, Compat::Auto);
        assert_eq!(budgets.cpu, 1000 * MIB - 256 * MIB);
        let mut b = bm_plan::ModuleTreeBuilder::new("Model");
        let m = b.add_module(0, "linear", "Linear").unwrap();
        b.add_param(
            m,
            "weight",
            bm_tensor::TensorMeta::new(bm_tensor::DType::F32, [512, 512]),
        )
        .unwrap();
        let tree = b.finish().unwrap();
        let options = bm_plan::PlanOptions {
            max_memory: MaxMemory::new([(bm_plan::Device::Cpu, budgets.cpu)]).unwrap(),
            ..bm_plan::PlanOptions::default()
        };
        let plan = bm_plan::plan_with(&tree, &options, Compat::Auto).unwrap();
        assert!(
            plan.device_map
                .iter()
                .all(|(_, d)| d == bm_plan::Device::Cpu),
            "{:?}",
            plan.device_map
        );
    }

    /// A 1 GiB container whose default CPU budget is `cpu`.
    fn container(cpu: u64) -> BudgetOrigin {
        BudgetOrigin::Measured {
            max_memory: MaxMemory::new([(bm_plan::Device::Cpu, cpu)]).unwrap(),
            gpus: Vec::new(),
            host: HostMemory {
                available: 1000 * MIB,
                source: HostMemorySource::CgroupV2,
                limit: GIB,
            },
            cpu_margin: 1000 * MIB - cpu,
        }
    }

    #[test]
    fn the_offload_folder_refusal_says_what_goes_to_disk_and_why() {
        let whole = DeviceMap::from_entries(vec![(String::new(), bm_plan::Device::Disk)]);
        let err = check_offload_folder(&whole, None, &container(0))
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with("At least one of the model submodule will be offloaded to disk"),
            "{err}"
        );
        for part in [
            "modules on disk: the whole model;",
            "budgets measured on this machine: cpu 0 B;",
            "1000.00 MiB available (cgroup v2 memory.max - memory.current; limit 1.00 GiB)",
            "less a 1000.00 MiB safety margin",
            "--max-memory",
        ] {
            assert!(err.contains(part), "{part:?} not in {err}");
        }
        let some = DeviceMap::from_entries(vec![
            ("a".into(), bm_plan::Device::Cpu),
            ("b".into(), bm_plan::Device::Disk),
        ]);
        let given = BudgetOrigin::Given(MaxMemory::parse("cpu=1MiB").unwrap());
        let err = check_offload_folder(&some, None, &given)
            .unwrap_err()
            .to_string();
        assert!(
            err.ends_with(
                "(modules on disk: b; budgets given by max_memory (--max-memory): cpu 1.00 MiB)"
            ),
            "{err}"
        );
        // A folder, or nothing on disk: no refusal.
        check_offload_folder(&some, Some(Path::new("off")), &given).unwrap();
        let none = DeviceMap::from_entries(vec![(String::new(), bm_plan::Device::Cpu)]);
        check_offload_folder(&none, None, &given).unwrap();
    }

    #[test]
    fn a_plan_that_does_not_fit_says_where_its_budgets_came_from() {
        let err = container(740 * MIB).explain(Error::Plan(bm_plan::Error::DoesNotFit(
            "the model does not fit".into(),
        )));
        assert!(
            err.to_string().starts_with(
                "the model does not fit\nbudgets measured on this machine: cpu 740.00 MiB"
            ),
            "{err}"
        );
        // GPUs say what they had free.
        let gpu = BudgetOrigin::Measured {
            max_memory: MaxMemory::parse("0=66GiB,cpu=90GiB").unwrap(),
            gpus: machine().gpus,
            host: machine().host,
            cpu_margin: 10 * GIB,
        };
        assert_eq!(
            gpu.to_string(),
            "budgets measured on this machine: 0 66.00 GiB, cpu 90.00 GiB; GPU 0: 70.00 GiB free \
             of 80.00 GiB; host RAM: 100.00 GiB available (/proc/meminfo MemAvailable; limit \
             128.00 GiB) less a 10.00 GiB safety margin; max_memory (--max-memory) sets them"
        );
        // Other errors pass unchanged.
        let other = container(0).explain(Error::ExpertsWithoutMap).to_string();
        assert_eq!(other, Error::ExpertsWithoutMap.to_string());
    }
}
