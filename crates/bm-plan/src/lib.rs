//! Module size trees and the device-map solver. Pure: it never touches a
//! device or a file.
//!
//! The first question of every big-model user is *what goes where*. This
//! crate answers it from a description of the model alone:
//!
//! * A [`ModuleTree`] lists modules (with class names), their parameters and
//!   buffers (shape, dtype, persistence) in registration order, and the
//!   groups of tied parameters. It comes from a `bigmodel-module-tree/1`
//!   document ([`ModuleTree::from_json`], exported from PyTorch by
//!   `tools/export_module_tree.py`), from a checkpoint's headers
//!   ([`checkpoint::tree_from_tensors`]), or from a Hugging Face
//!   `config.json` ([`hf::tree_from_config`] on a [`config::HfConfig`], the
//!   one config reader, which bm-models uses too) for the families of
//!   [`config::Family`], with transformers' names and classes.
//! * [`quant::quantize_tree`] replaces the linear weights of a tree by their
//!   bitsandbytes-packed form ([`quant::QuantScheme`]), so what follows
//!   sizes and places them at their packed bytes.
//! * [`ModuleSizes`] sizes every tensor and subtree in one linear pass,
//!   either with Accelerate's rule (a dtype only ever shrinks) or with the
//!   sizes a load really allocates.
//! * Two planners turn a tree and budgets ([`MaxMemory`]) into a [`Plan`]:
//!   [`accelerate::plan`] reproduces Accelerate's `get_balanced_memory` +
//!   `infer_auto_device_map` decision for decision (its documented bugs
//!   fixed, see docs/compat.md), and [`auto::plan`] is bigmodel's own:
//!   it reserves streaming room only when something is offloaded, back-fills
//!   faster devices before offloading, honours a disk budget and runtime
//!   reserves, and explains itself.
//!
//! Both planners run in time linear in the size of the tree: sizes and
//! per-subtree layer maxima are computed once, and the traversal queue is a
//! stack with running maxima instead of a list rescanned after every split.
//!
//! Architecture invariant: nothing here opens a file, allocates device
//! memory or asks a device anything; checkpoint headers and default budgets
//! are the caller's business (`bigmodel::tree_from_checkpoint`,
//! `bigmodel::default_max_memory`).

mod error;
mod size;
#[cfg(test)]
mod testing;

pub mod accelerate;
pub mod auto;
pub mod checkpoint;
pub mod config;
pub mod device;
pub mod experts;
pub mod hf;
pub mod ledger;
pub mod plan;
pub mod predict;
pub mod quant;
pub mod sizes;
pub mod speed;
pub mod tree;

pub use device::{Device, MaxMemory};
pub use error::Error;
pub use experts::{expert_lists, place_experts};
pub use ledger::{Ledger, LedgerItem, ModelShape, Shortfall, Workload};
pub use plan::{
    Compat, DeviceLookup, DeviceMap, Mode, Plan, PlanOptions, ResolvedMap, check_device_map,
};
pub use predict::{Calibration, Prediction, predict};
pub use size::{
    MAX_BUDGET, convert_file_size_to_int, human_bytes, parse_size_text, parse_size_value,
};
pub use sizes::{ModuleSizes, SizeOptions, SizeRule};
pub use speed::{Fastest, fastest};
pub use tree::{
    Module, ModuleId, ModuleTree, ModuleTreeBuilder, Node, Tensor, TensorId, TensorKind,
};

/// Plans `tree` with the chosen planner. With `experts_on`, bigmodel's
/// planner places the experts itself (refilling the room they leave);
/// Accelerate's plans whole layers and the experts are moved afterwards.
pub fn plan_with(tree: &ModuleTree, options: &PlanOptions, compat: Compat) -> Result<Plan, Error> {
    match (compat, options.experts_on) {
        (Compat::Accelerate, Some(device)) => {
            let mut plan = accelerate::plan(tree, options)?;
            plan.device_map = place_experts(tree, &plan.device_map, device)?;
            let sizes = options.sizes(tree, SizeRule::Accelerate);
            plan.device_bytes = plan.device_map.bytes_per_device(tree, &sizes);
            Ok(plan)
        }
        (Compat::Accelerate, None) => accelerate::plan(tree, options),
        (Compat::Auto, _) => auto::plan(tree, options),
    }
}
