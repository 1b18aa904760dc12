//! Hooks around a module's forward pass: Accelerate's `ModelHook` family.

use std::sync::Arc;

use bm_device::Device;
use bm_plan::ModuleId;

use crate::bytes::Activations;
use crate::forward::Forward;
use crate::model::Model;
use crate::placement::{self, HookRule};
use crate::{Error, Result};

/// What runs around a module's forward (Accelerate's `ModelHook`).
///
/// `init` runs when the hook is added, `detach` when it is removed;
/// `pre_forward` and `post_forward` run in [`Model::enter`] and
/// [`Forward::exit`]. Per-call state lives in the [`Forward`], so one hook
/// serves concurrent passes. What the model needs to know of a hook it
/// asks through [`ModelHook::execution_device`], [`ModelHook::offloads`]
/// and [`ModelHook::children`].
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

    /// Where the module computes under this hook, when the hook decides it
    /// (a [`SequentialHook`] answers through its children).
    fn execution_device(&self) -> Option<Device> {
        None
    }

    /// True when the hook streams the module's offloaded weights in for
    /// each forward.
    fn offloads(&self) -> bool {
        false
    }

    /// The hooks this one runs in order, first to run first: `Some` for a
    /// [`SequentialHook`], `None` for a single hook.
    fn children(&self) -> Option<&[Arc<dyn ModelHook>]> {
        None
    }
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

    fn execution_device(&self) -> Option<Device> {
        self.hooks.iter().find_map(|h| h.execution_device())
    }

    fn offloads(&self) -> bool {
        self.hooks.iter().any(|h| h.offloads())
    }

    fn children(&self) -> Option<&[Arc<dyn ModelHook>]> {
        Some(&self.hooks)
    }
}

/// The single hooks inside `hook` (itself unless it is a [`SequentialHook`]),
/// in the order they run.
pub fn flatten(hook: &Arc<dyn ModelHook>) -> Vec<Arc<dyn ModelHook>> {
    match hook.children() {
        Some(children) => children.iter().flat_map(flatten).collect(),
        None => vec![Arc::clone(hook)],
    }
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

impl AlignDevicesHook {
    /// How this hook places its module, when it has an execution device.
    fn rule(&self) -> Option<HookRule> {
        Some(HookRule {
            exec: self.execution_device?,
            offload: self.offload,
            subtree: self.place_submodules,
            offload_buffers: self.offload_buffers,
        })
    }
}

impl ModelHook for AlignDevicesHook {
    fn init(&self, model: &Model, module: ModuleId) -> Result<()> {
        match self.rule() {
            Some(rule) => placement::attach(model, module, rule),
            None => Ok(()),
        }
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
        placement::detach(model, module, self.place_submodules, self.offload_buffers)
    }

    fn execution_device(&self) -> Option<Device> {
        self.execution_device
    }

    fn offloads(&self) -> bool {
        self.offload
    }
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
        if let Some(prev) = &self.prev_module_hook
            && prev.model.first_param_device() != Some(Device::Cpu)
        {
            prev.offload()?;
        }
        fwd.set_execution_device(self.execution_device);
        if fwd.model().first_param_device() != Some(self.execution_device) {
            fwd.model().to(self.execution_device)?;
        }
        let devices = Arc::clone(fwd.model().devices());
        inputs.to_device(self.execution_device, &devices, &[])
    }

    fn execution_device(&self) -> Option<Device> {
        Some(self.execution_device)
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
