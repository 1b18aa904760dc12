//! Hooks around a module's forward pass: Accelerate's `ModelHook` family.

use std::any::Any;
use std::sync::Arc;

use bm_device::Device;
use bm_plan::ModuleId;

use crate::bytes::{Activations, pin};
use crate::model::{Forward, Model, SlotState, Tier};
use crate::{Error, Result};

/// What runs around a module's forward (Accelerate's `ModelHook`).
///
/// `init` runs when the hook is added, `detach` when it is removed;
/// `pre_forward` and `post_forward` run in [`Model::enter`] and
/// [`Forward::exit`]. Per-call state lives in the [`Forward`], so one hook
/// serves concurrent passes.
pub trait ModelHook: Send + Sync + std::fmt::Debug {
    /// Called when the hook is attached to module `module`.
    fn init(&self, model: &Model, module: ModuleId) -> Result<()> {
        let _ = (model, module);
        Ok(())
    }

    /// Called before the forward; returns the inputs to use.
    fn pre_forward(&self, fwd: &mut Forward, inputs: Activations) -> Result<Activations> {
        let _ = fwd;
        Ok(inputs)
    }

    /// Called after the forward; returns the outputs to hand back.
    fn post_forward(&self, fwd: &mut Forward, outputs: Activations) -> Result<Activations> {
        let _ = fwd;
        Ok(outputs)
    }

    /// Called when the hook is removed.
    fn detach(&self, model: &Model, module: ModuleId) -> Result<()> {
        let _ = (model, module);
        Ok(())
    }

    /// For inspection (`downcast_ref`).
    fn as_any(&self) -> &dyn Any;
}

/// Several hooks run in order for every event (Accelerate's `SequentialHook`).
#[derive(Debug, Default)]
pub struct SequentialHook {
    /// The hooks, first to run first.
    pub hooks: Vec<Arc<dyn ModelHook>>,
}

impl ModelHook for SequentialHook {
    fn init(&self, model: &Model, module: ModuleId) -> Result<()> {
        self.hooks.iter().try_for_each(|h| h.init(model, module))
    }

    fn pre_forward(&self, fwd: &mut Forward, mut inputs: Activations) -> Result<Activations> {
        for h in &self.hooks {
            inputs = h.pre_forward(fwd, inputs)?;
        }
        Ok(inputs)
    }

    fn post_forward(&self, fwd: &mut Forward, mut outputs: Activations) -> Result<Activations> {
        for h in &self.hooks {
            outputs = h.post_forward(fwd, outputs)?;
        }
        Ok(outputs)
    }

    fn detach(&self, model: &Model, module: ModuleId) -> Result<()> {
        self.hooks.iter().try_for_each(|h| h.detach(model, module))
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// The hooks inside `hook` (itself unless it is a [`SequentialHook`]).
pub fn flatten(hook: &Arc<dyn ModelHook>) -> Vec<Arc<dyn ModelHook>> {
    match hook.as_any().downcast_ref::<SequentialHook>() {
        Some(seq) => seq.hooks.iter().flat_map(flatten).collect(),
        None => vec![Arc::clone(hook)],
    }
}

/// The execution device of the first [`AlignDevicesHook`] in `hook`.
pub fn execution_device(hook: &Arc<dyn ModelHook>) -> Option<Device> {
    flatten(hook).iter().find_map(|h| {
        h.as_any()
            .downcast_ref::<AlignDevicesHook>()
            .and_then(|a| a.execution_device)
    })
}

/// Accelerate's `AlignDevicesHook`: inputs go to the execution device,
/// offloaded weights are materialised there before the forward and released
/// after, and (with `io_same_device`) outputs go back where the inputs came
/// from.
#[derive(Clone, Debug, Default)]
pub struct AlignDevicesHook {
    /// Where the module computes.
    pub execution_device: Option<Device>,
    /// The module's weights are offloaded and streamed in for each forward.
    pub offload: bool,
    /// Outputs return to the device of the inputs (the root hook).
    pub io_same_device: bool,
    /// Persistent buffers are offloaded too (otherwise they stay on the
    /// execution device).
    pub offload_buffers: bool,
    /// The hook places (and loads) the whole subtree, not just the module's
    /// direct tensors.
    pub place_submodules: bool,
    /// Named inputs left where they are (e.g. `past_key_values`).
    pub skip_keys: Vec<String>,
}

impl ModelHook for AlignDevicesHook {
    fn init(&self, model: &Model, module: ModuleId) -> Result<()> {
        let Some(exec) = self.execution_device else {
            return Ok(());
        };
        if !self.offload {
            let slots = model.module_slots(module, self.place_submodules, true);
            let nonpersistent = nonpersistent_slots(model, module, self.place_submodules);
            return model.move_slots(&[slots, nonpersistent].concat(), exec);
        }
        // Offload: resident weights become the offloaded copy (pinned when a
        // GPU executes them); buffers not offloaded go to the execution device.
        let weights = model.module_slots(module, self.place_submodules, self.offload_buffers);
        let tied: Vec<usize> = model
            .tree()
            .tensors()
            .iter()
            .enumerate()
            .filter(|(_, t)| t.tie_group.is_some())
            .map(|(i, _)| model.shared.slot_of[i])
            .collect();
        {
            let mut slots = model.shared.slots.write();
            for s in weights {
                if let SlotState::Resident(b) = &slots[s].state {
                    // A tied storage kept on a GPU by another module's entry
                    // stays there: one copy, on the faster device.
                    if b.device() != Device::Cpu && tied.contains(&s) {
                        continue;
                    }
                    let what = format!("slot {s}");
                    let bytes = match (exec, b.host()) {
                        (Device::Gpu(_), Some(host)) => {
                            Arc::new(pin(&what, host, &model.shared.devices)?)
                        }
                        (Device::Cpu, Some(_)) => Arc::clone(b),
                        (_, None) => crate::bytes::move_bytes(
                            &what,
                            b,
                            Device::Cpu,
                            &model.shared.devices,
                            None,
                        )?,
                    };
                    slots[s].state = SlotState::Offloaded {
                        bytes,
                        tier: Tier::Cpu,
                    };
                }
            }
        }
        let all_buffers = buffer_slots(model, module, self.place_submodules);
        let kept: Vec<_> = if self.offload_buffers {
            nonpersistent_slots(model, module, self.place_submodules)
        } else {
            all_buffers
        };
        model.move_slots(&kept, exec)
    }

    fn pre_forward(&self, fwd: &mut Forward, inputs: Activations) -> Result<Activations> {
        if self.io_same_device {
            fwd.set_input_device(inputs.device());
        }
        let Some(exec) = self.execution_device else {
            return Ok(inputs);
        };
        fwd.set_execution_device(exec);
        if self.offload {
            fwd.load_offloaded(self.place_submodules, self.offload_buffers)?;
        }
        let devices = Arc::clone(fwd.model().devices());
        inputs.to_device(exec, &devices, &self.skip_keys)
    }

    fn post_forward(&self, fwd: &mut Forward, outputs: Activations) -> Result<Activations> {
        if self.offload {
            fwd.release();
        }
        match (self.io_same_device, fwd.input_device()) {
            (true, Some(device)) => {
                let devices = Arc::clone(fwd.model().devices());
                outputs.to_device(device, &devices, &self.skip_keys)
            }
            _ => Ok(outputs),
        }
    }

    fn detach(&self, model: &Model, module: ModuleId) -> Result<()> {
        if !self.offload {
            return Ok(());
        }
        // The offloaded copy becomes the module's tensor again, on the CPU.
        let weights = model.module_slots(module, self.place_submodules, self.offload_buffers);
        let mut slots = model.shared.slots.write();
        for s in weights {
            if let SlotState::Offloaded { bytes, .. } = &slots[s].state {
                slots[s].state = SlotState::Resident(Arc::clone(bytes));
            }
        }
        Ok(())
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

fn buffer_slots(model: &Model, module: ModuleId, subtree: bool) -> Vec<usize> {
    tensors_where(model, module, subtree, |k| {
        matches!(k, bm_plan::TensorKind::Buffer { .. })
    })
}

fn nonpersistent_slots(model: &Model, module: ModuleId, subtree: bool) -> Vec<usize> {
    tensors_where(model, module, subtree, |k| {
        k == bm_plan::TensorKind::Buffer { persistent: false }
    })
}

fn tensors_where(
    model: &Model,
    module: ModuleId,
    subtree: bool,
    keep: impl Fn(bm_plan::TensorKind) -> bool,
) -> Vec<usize> {
    let tree = model.tree();
    tree.tensors()
        .iter()
        .enumerate()
        .filter(|(_, t)| {
            keep(t.kind)
                && if subtree {
                    tree.is_within(t.module, module)
                } else {
                    t.module == module
                }
        })
        .map(|(i, _)| model.shared.slot_of[i])
        .collect()
}

/// Accelerate's `CpuOffload`: the whole model lives on the CPU and moves to
/// the execution device at its first forward, where it stays until
/// [`UserCpuOffloadHook::offload`]; a previous model in a chain is sent
/// back to the CPU first.
#[derive(Debug)]
pub struct CpuOffload {
    /// Where the model computes.
    pub execution_device: Device,
    /// The previous model of a chain, offloaded when this one starts.
    pub prev_module_hook: Option<UserCpuOffloadHook>,
}

impl ModelHook for CpuOffload {
    fn init(&self, model: &Model, _module: ModuleId) -> Result<()> {
        model.to(Device::Cpu)
    }

    fn pre_forward(&self, fwd: &mut Forward, inputs: Activations) -> Result<Activations> {
        if let Some(prev) = &self.prev_module_hook {
            if prev.model.first_param_device() != Some(Device::Cpu) {
                prev.offload()?;
            }
        }
        fwd.set_execution_device(self.execution_device);
        if fwd.model().first_param_device() != Some(self.execution_device) {
            fwd.model().to(self.execution_device)?;
        }
        let devices = Arc::clone(fwd.model().devices());
        inputs.to_device(self.execution_device, &devices, &[])
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// The handle `cpu_offload_with_hook` returns: sends its model back to the
/// CPU on demand.
#[derive(Clone, Debug)]
pub struct UserCpuOffloadHook {
    /// The model the hook is attached to.
    pub model: Arc<Model>,
    /// The hook.
    pub hook: Arc<CpuOffload>,
}

impl UserCpuOffloadHook {
    /// Moves the model back to the CPU.
    pub fn offload(&self) -> Result<()> {
        self.hook.init(&self.model, 0)
    }

    /// Removes the hook from the model's root.
    pub fn remove(&self) -> Result<()> {
        self.model.remove_hook("", false)
    }
}

/// Accelerate's `cpu_offload_with_hook`: appends a [`CpuOffload`] hook to
/// `model`'s root and returns the handle that offloads it again; pass the
/// previous model's handle to chain them.
pub fn cpu_offload_with_hook(
    model: Arc<Model>,
    execution_device: Device,
    prev_module_hook: Option<UserCpuOffloadHook>,
) -> Result<UserCpuOffloadHook> {
    let hook = Arc::new(CpuOffload {
        execution_device,
        prev_module_hook,
    });
    model.add_hook("", Arc::clone(&hook) as Arc<dyn ModelHook>, true)?;
    if model.first_param_device().is_none() && model.slot_count() > 0 {
        return Err(Error::BadOption(
            "cpu_offload_with_hook needs a loaded model (its parameters are on meta)".into(),
        ));
    }
    Ok(UserCpuOffloadHook { model, hook })
}
