//! The `Forward` guard: one module's forward pass in progress, holding the
//! weights it materialised until it exits.

use std::sync::Arc;

use bm_device::Device;
use bm_plan::ModuleId;

use crate::bytes::{Activations, Bytes, Weight};
use crate::hooks::ModelHook;
use crate::model::Model;
use crate::slots::{SlotId, SlotState, weights};
use crate::{Error, Result};

/// One module's forward pass in progress: the guard returned by
/// [`Model::enter`], and the context hooks work on.
pub struct Forward {
    model: Model,
    module: ModuleId,
    hook: Option<Arc<dyn ModelHook>>,
    exec: Option<Device>,
    input_device: Option<Device>,
    held: Vec<(SlotId, Device, Arc<Bytes>)>,
    inputs: Option<Activations>,
    exited: bool,
}

impl std::fmt::Debug for Forward {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Forward")
            .field("module", &self.module_name())
            .field("exec", &self.exec)
            .finish()
    }
}

impl Forward {
    /// Runs the hook's `pre_forward` on `inputs` and returns the guard.
    pub(crate) fn start(
        model: Model,
        module: ModuleId,
        hook: Option<Arc<dyn ModelHook>>,
        inputs: Activations,
    ) -> Result<Forward> {
        let mut fwd = Forward {
            model,
            module,
            hook: hook.clone(),
            exec: None,
            input_device: None,
            held: Vec::new(),
            inputs: None,
            exited: false,
        };
        let inputs = match &hook {
            Some(h) => h.pre_forward(&mut fwd, inputs)?,
            None => inputs,
        };
        fwd.inputs = Some(inputs);
        Ok(fwd)
    }

    /// The model.
    pub fn model(&self) -> &Model {
        &self.model
    }

    /// The module running.
    pub fn module(&self) -> ModuleId {
        self.module
    }

    /// Its full name.
    pub fn module_name(&self) -> &str {
        self.model.tree().module(self.module).name
    }

    /// Where this forward computes (set by the hook; `None` without one).
    pub fn execution_device(&self) -> Option<Device> {
        self.exec
    }

    /// Sets the execution device (hooks do).
    pub fn set_execution_device(&mut self, device: Device) {
        self.exec = Some(device);
    }

    /// The device the inputs came from (recorded by an `io_same_device` hook).
    pub fn input_device(&self) -> Option<Device> {
        self.input_device
    }

    /// Records the device the inputs came from.
    pub fn set_input_device(&mut self, device: Option<Device>) {
        self.input_device = device;
    }

    /// The inputs as the hooks left them (on the execution device).
    pub fn inputs(&self) -> &Activations {
        self.inputs
            .as_ref()
            .expect("inputs are set by Model::enter")
    }

    /// Takes the inputs out of the guard.
    pub fn take_inputs(&mut self) -> Activations {
        self.inputs.take().unwrap_or_default()
    }

    /// Materialises the offloaded tensors of this module (the whole
    /// subtree with `subtree`; buffers only with `buffers`) on the
    /// execution device, and starts prefetching the next offloaded blocks.
    pub fn load_offloaded(&mut self, subtree: bool, buffers: bool) -> Result<()> {
        let device = self.exec.unwrap_or(Device::Cpu);
        let model = self.model.clone();
        let table = model.slots();
        let slots = table.of_module(model.tree(), self.module, subtree, weights(buffers));
        for s in slots {
            if table.is_offloaded(s) && !self.held.iter().any(|h| h.0 == s && h.1 == device) {
                self.take(s, device)?;
            }
        }
        // Only now: a prefetch started earlier could take the room this
        // block's own weights need.
        self.prefetch_next();
        Ok(())
    }

    /// Asks the prefetch worker for the offloaded weights of the next
    /// blocks after this one in execution order.
    fn prefetch_next(&self) {
        let next = self.model.residency().next_blocks(self.module);
        if next.is_empty() {
            return;
        }
        let table = self.model.slots();
        let mut job = Vec::new();
        for m in next {
            let exec = self
                .model
                .hook_of(m)
                .and_then(|h| h.execution_device())
                .unwrap_or(Device::Cpu);
            for s in table.of_module(self.model.tree(), m, true, weights(true)) {
                if table.is_offloaded(s) {
                    job.push((s, exec));
                }
            }
        }
        self.model.residency().prefetch(job);
    }

    /// Releases every weight this forward materialised.
    pub fn release(&mut self) {
        for (s, d, bytes) in self.held.drain(..) {
            drop(bytes);
            self.model.residency().release(s, d);
        }
    }

    /// Tensor `local` of this module (a dotted name below it, e.g.
    /// `self_attn.q_proj.weight`), on the execution device. Offloaded
    /// weights not loaded by a hook are loaded now and held until exit.
    pub fn weight(&mut self, local: &str) -> Result<Weight> {
        let name = if self.module_name().is_empty() {
            local.to_string()
        } else {
            format!("{}.{local}", self.module_name())
        };
        let s = self.model.slots().slot_of(self.model.tensor_id(&name)?);
        let (meta, resident) = self.model.slots().with(s, |meta, state| {
            let resident = match state {
                SlotState::Meta => return Err(Error::NotLoaded(name.clone())),
                SlotState::Resident(b) => Some(Arc::clone(b)),
                SlotState::Offloaded { .. } => None,
            };
            Ok((meta.clone(), resident))
        })?;
        let device = match (self.exec, &resident) {
            (None, Some(b)) => b.device(),
            (Some(d), _) => d,
            (None, None) => Device::Cpu,
        };
        if let Some(b) = &resident
            && b.device() == device
        {
            return Ok(Weight {
                meta,
                bytes: Arc::clone(b),
            });
        }
        if let Some(h) = self.held.iter().find(|h| h.0 == s && h.1 == device) {
            return Ok(Weight {
                meta,
                bytes: Arc::clone(&h.2),
            });
        }
        let bytes = self.take(s, device)?;
        Ok(Weight { meta, bytes })
    }

    /// Materialises offloaded slot `s` on `device` and holds it until exit.
    /// Its copy may still be in flight (the prefetch thread only enqueued
    /// it): the compute stream of `device` waits on it from here on, so
    /// every kernel this forward enqueues next sees the bytes.
    fn take(&mut self, s: SlotId, device: Device) -> Result<Arc<Bytes>> {
        let arrival = self
            .model
            .materialise(s, device, false)?
            .ok_or_else(|| Error::NotLoaded(self.model.slots().name(self.model.tree(), s)))?;
        // Held before the wait, so a failed wait still releases it.
        self.held.push((s, device, Arc::clone(&arrival.bytes)));
        arrival.wait_for_compute(&self.model.slots().name(self.model.tree(), s))?;
        Ok(arrival.bytes)
    }

    /// Ends the forward: runs the hook's `post_forward` (offloaded weights
    /// released, outputs moved back) and returns the outputs.
    pub fn exit(mut self, outputs: Activations) -> Result<Activations> {
        self.exited = true;
        let out = match self.hook.clone() {
            Some(h) => h.post_forward(&mut self, outputs),
            None => Ok(outputs),
        };
        self.release();
        out
    }
}

impl Drop for Forward {
    fn drop(&mut self) {
        if !self.exited {
            self.release();
        }
    }
}
