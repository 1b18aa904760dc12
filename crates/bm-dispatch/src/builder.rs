//! Empty initialisation: describe a model without allocating its tensors.

use std::sync::Arc;

use bm_device::{Device, DeviceSet};
use bm_plan::{ModuleId, ModuleTree, ModuleTreeBuilder};
use bm_tensor::{DType, HostBuffer, TensorMeta};

use crate::bytes::Bytes;
use crate::model::Model;
use crate::slots::SlotState;
use crate::{Error, Result};

/// Records a model's modules (with class names), parameters, buffers and
/// tied parameters, allocating nothing for the tensors: Accelerate's
/// `init_empty_weights`. [`ModelBuilder::build`] gives the
/// [`ModuleTree`] the planner consumes; [`Model::empty`] or
/// [`init_on_device`] turn it into a model.
#[derive(Debug)]
pub struct ModelBuilder {
    tree: ModuleTreeBuilder,
}

impl ModelBuilder {
    /// The root module.
    pub const ROOT: ModuleId = ModuleTreeBuilder::ROOT;

    /// A model whose root module has class `root_class`.
    pub fn new(root_class: impl Into<String>) -> Self {
        ModelBuilder {
            tree: ModuleTreeBuilder::new(root_class),
        }
    }

    /// Adds child module `local` of class `class` under `parent`.
    pub fn module(&mut self, parent: ModuleId, local: &str, class: &str) -> Result<ModuleId> {
        Ok(self.tree.add_module(parent, local, class)?)
    }

    /// Adds parameter `local` to `module`.
    pub fn param(
        &mut self,
        module: ModuleId,
        local: &str,
        dtype: DType,
        shape: &[usize],
    ) -> Result<&mut Self> {
        self.tree
            .add_param(module, local, TensorMeta::new(dtype, shape))?;
        Ok(self)
    }

    /// Adds buffer `local` to `module`; a non-persistent buffer is not in
    /// the state dict (nor in checkpoints).
    pub fn buffer(
        &mut self,
        module: ModuleId,
        local: &str,
        dtype: DType,
        shape: &[usize],
        persistent: bool,
    ) -> Result<&mut Self> {
        self.tree
            .add_buffer(module, local, TensorMeta::new(dtype, shape), persistent)?;
        Ok(self)
    }

    /// `nn.Linear(in_features, out_features, bias)` as child `local`.
    pub fn linear(
        &mut self,
        parent: ModuleId,
        local: &str,
        in_features: usize,
        out_features: usize,
        bias: bool,
        dtype: DType,
    ) -> Result<ModuleId> {
        let m = self.module(parent, local, "Linear")?;
        self.param(m, "weight", dtype, &[out_features, in_features])?;
        if bias {
            self.param(m, "bias", dtype, &[out_features])?;
        }
        Ok(m)
    }

    /// Declares that the named parameters share one storage.
    pub fn tie(&mut self, names: &[&str]) -> &mut Self {
        self.tree.tie(names);
        self
    }

    /// The module tree (validates ties).
    pub fn build(self) -> Result<ModuleTree> {
        Ok(self.tree.finish()?)
    }
}

/// Accelerate's `init_on_device(device, include_buffers=True)`: a model
/// whose every tensor is allocated, zeroed, on `device`.
pub fn init_on_device(tree: ModuleTree, device: Device, devices: Arc<DeviceSet>) -> Result<Model> {
    let model = Model::empty(tree, devices)?;
    for s in 0..model.slot_count() {
        let len =
            model.slots().meta(s).checked_byte_len().ok_or_else(|| {
                Error::BadOption(format!("slot {s}: tensor too large to allocate"))
            })?;
        let bytes = match device {
            Device::Cpu => Bytes::Host(
                HostBuffer::zeroed(len).map_err(|e| Error::tensor(format!("slot {s}"), e))?,
            ),
            Device::Gpu(i) => {
                let gpu = model.devices().gpu(i).map_err(|_| Error::NoSuchDevice {
                    what: "init_on_device".into(),
                    device,
                })?;
                Bytes::Device(
                    gpu.alloc_zeroed(len.max(1))
                        .map_err(|e| Error::device(format!("slot {s}"), e))?,
                )
            }
        };
        model.slots().set(s, SlotState::Resident(Arc::new(bytes)));
    }
    Ok(model)
}
