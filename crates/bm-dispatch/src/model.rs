//! The loaded model: its module tree, the slot table holding every
//! tensor's bytes, the hooks on its modules, and the entry point of a
//! forward pass ([`Model::enter`]).

use std::sync::Arc;

use bm_device::{Device, DeviceSet};
use bm_plan::{DeviceMap, ModuleId, ModuleTree, Node, TensorId, TensorKind};
use parking_lot::RwLock;

use crate::bytes::{Activations, Weight};
use crate::forward::Forward;
use crate::hooks::{ModelHook, SequentialHook, flatten};
use crate::residency::{Prefetch, Residency};
use crate::slots::{Placement, SlotId, SlotState, SlotTable, Tier};
use crate::transfer::{Arrival, DiskReads, Uploader};
use crate::{Error, Result};

pub(crate) struct Shared {
    tree: ModuleTree,
    slots: SlotTable,
    hooks: RwLock<Vec<Option<Arc<dyn ModelHook>>>>,
    devices: Arc<DeviceSet>,
    uploader: Uploader,
    device_map: RwLock<Option<DeviceMap>>,
    residency: Residency,
}

impl Shared {
    /// The bytes of slot `slot` on `device`, loaded once and shared (see
    /// [`Residency::materialise`]).
    fn materialise(&self, slot: SlotId, device: Device, prefetch: bool) -> Result<Option<Arrival>> {
        self.residency.materialise(slot, device, prefetch, || {
            self.slots.copy_to(&self.tree, slot, device, &self.uploader)
        })
    }
}

impl Prefetch for Shared {
    fn prefetch(&self, slot: SlotId, device: Device) -> Result<()> {
        self.materialise(slot, device, true).map(drop)
    }
}

/// A model: its module tree, the bytes of every tensor wherever they are,
/// and the hooks that run around each module's forward.
///
/// `Model` is `Sync`: several threads may run forward passes at once; the
/// weights an offloaded block needs are materialised once per device and
/// shared by every pass that needs them at the same time. It is also a
/// handle: clones are cheap and refer to the same model, which is what
/// lets a [`Forward`] own its model and outlive the borrow it came from.
#[derive(Clone)]
pub struct Model {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for Model {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Model")
            .field("modules", &self.shared.tree.modules().len())
            .field("tensors", &self.shared.tree.tensors().len())
            .field("slots", &self.shared.slots.len())
            .finish()
    }
}

// Threads share one model, and a forward may end on another thread than
// the one it started on (bm-models keeps open blocks in a shared table).
const _: fn() = || {
    fn send_sync<T: Send + Sync>() {}
    fn send<T: Send>() {}
    send_sync::<Model>();
    send::<Forward>();
};

impl Model {
    /// A model over `tree` with every tensor on the meta device: nothing
    /// is allocated but the bookkeeping (Accelerate's `init_empty_weights`).
    pub fn empty(tree: ModuleTree, devices: Arc<DeviceSet>) -> Result<Model> {
        let modules = tree.modules().len();
        Ok(Model {
            shared: Arc::new(Shared {
                slots: SlotTable::new(&tree),
                tree,
                hooks: RwLock::new(vec![None; modules]),
                uploader: Uploader::new(Arc::clone(&devices)),
                devices,
                device_map: RwLock::new(None),
                residency: Residency::new(),
            }),
        })
    }

    /// The module tree.
    pub fn tree(&self) -> &ModuleTree {
        &self.shared.tree
    }

    /// The devices the model may use.
    pub fn devices(&self) -> &Arc<DeviceSet> {
        &self.shared.devices
    }

    /// Number of distinct storages (tied tensors share one).
    pub fn slot_count(&self) -> usize {
        self.shared.slots.len()
    }

    pub(crate) fn slots(&self) -> &SlotTable {
        &self.shared.slots
    }

    pub(crate) fn residency(&self) -> &Residency {
        &self.shared.residency
    }

    /// What uploads to GPUs go through.
    pub(crate) fn uploader(&self) -> &Uploader {
        &self.shared.uploader
    }

    pub(crate) fn materialise(
        &self,
        slot: SlotId,
        device: Device,
        prefetch: bool,
    ) -> Result<Option<Arrival>> {
        self.shared.materialise(slot, device, prefetch)
    }

    pub(crate) fn tensor_id(&self, name: &str) -> Result<TensorId> {
        match self.shared.tree.find(name) {
            Some(Node::Tensor(t)) => Ok(t),
            _ => Err(Error::UnknownName(name.to_string())),
        }
    }

    pub(crate) fn module_id(&self, name: &str) -> Result<ModuleId> {
        match self.shared.tree.find(name) {
            Some(Node::Module(m)) => Ok(m),
            _ => Err(Error::UnknownName(name.to_string())),
        }
    }

    /// True when two tensor names share one storage (tied).
    pub fn shares_storage(&self, a: &str, b: &str) -> Result<bool> {
        let slots = &self.shared.slots;
        Ok(slots.slot_of(self.tensor_id(a)?) == slots.slot_of(self.tensor_id(b)?))
    }

    /// Where tensor `name` is.
    pub fn placement(&self, name: &str) -> Result<Placement> {
        let slots = &self.shared.slots;
        Ok(slots.placement(slots.slot_of(self.tensor_id(name)?)))
    }

    /// The stored value of tensor `name` outside any forward pass: resident
    /// bytes, or the offloaded copy (host RAM or the mapped file).
    pub fn weight(&self, name: &str) -> Result<Weight> {
        let slots = &self.shared.slots;
        let s = slots.slot_of(self.tensor_id(name)?);
        slots.with(s, |meta, state| match state.bytes() {
            None => Err(Error::NotLoaded(name.to_string())),
            Some(b) => Ok(Weight {
                meta: meta.clone(),
                bytes: Arc::clone(b),
            }),
        })
    }

    /// The device map the model was dispatched with (`hf_device_map`).
    pub fn hf_device_map(&self) -> Option<DeviceMap> {
        self.shared.device_map.read().clone()
    }

    pub(crate) fn set_device_map(&self, map: Option<DeviceMap>) {
        *self.shared.device_map.write() = map;
    }

    /// How many offloaded blocks ahead are fetched while one computes
    /// (default 1; 0 turns prefetching off).
    pub fn set_prefetch_depth(&self, depth: usize) {
        self.shared.residency.set_depth(depth);
    }

    /// The prefetch depth in effect ([`Model::set_prefetch_depth`]).
    pub fn prefetch_depth(&self) -> usize {
        self.shared.residency.depth()
    }

    /// How disk-offloaded weights are read on their way to a GPU (default
    /// [`DiskReads::Auto`], decided now from the weights offloaded to disk
    /// so far and the host memory available).
    pub fn set_disk_reads(&self, reads: DiskReads) {
        let direct = match reads {
            DiskReads::Direct => true,
            DiskReads::Cached => false,
            DiskReads::Auto => {
                let on_disk = self.shared.slots.offloaded_bytes(Tier::Disk);
                bm_device::host_memory().is_ok_and(|m| on_disk > m.available)
            }
        };
        self.shared.uploader.set_direct(direct);
    }

    /// Bytes of offloaded weights that may stay on their execution device
    /// between forward passes (default 0: released after each block, as
    /// Accelerate does). Least recently used weights go first.
    pub fn set_resident_budget(&self, bytes: u64) {
        self.shared.residency.set_resident_budget(bytes);
    }

    /// Offloaded weights currently materialised on execution devices
    /// (in use, prefetched or kept by the resident budget): count and bytes.
    pub fn materialised(&self) -> (usize, u64) {
        self.shared.residency.materialised()
    }

    /// Sets the execution order of the offloaded blocks, which the
    /// prefetch worker follows.
    pub(crate) fn set_streaming_order(&self, order: Vec<ModuleId>) {
        let owner: std::sync::Weak<Shared> = Arc::downgrade(&self.shared);
        self.shared.residency.set_order(order, owner);
    }

    // ---- hooks ----

    /// The hook of module `name`, if any.
    pub fn hook(&self, name: &str) -> Result<Option<Arc<dyn ModelHook>>> {
        Ok(self.hook_of(self.module_id(name)?))
    }

    pub(crate) fn hook_of(&self, m: ModuleId) -> Option<Arc<dyn ModelHook>> {
        self.shared.hooks.read()[m].clone()
    }

    /// Accelerate's `add_hook_to_module`: runs `hook.init`, then installs it
    /// on module `name`. With `append`, an existing hook is kept and both
    /// run in order (a [`SequentialHook`]); otherwise it is replaced (and
    /// detached).
    pub fn add_hook(&self, name: &str, hook: Arc<dyn ModelHook>, append: bool) -> Result<()> {
        let m = self.module_id(name)?;
        let old = self.shared.hooks.write()[m].take();
        let hook: Arc<dyn ModelHook> = match old {
            Some(old) if append => {
                hook.init(self, m)?;
                let mut hooks = match old.children() {
                    Some(children) => children.to_vec(),
                    None => vec![old],
                };
                hooks.push(hook);
                Arc::new(SequentialHook { hooks })
            }
            Some(old) => {
                old.detach(self, m)?;
                hook.init(self, m)?;
                hook
            }
            None => {
                hook.init(self, m)?;
                hook
            }
        };
        self.shared.hooks.write()[m] = Some(hook);
        Ok(())
    }

    /// Accelerate's `remove_hook_from_module`: detaches and removes the
    /// hook of `name` (and of every submodule with `recurse`).
    pub fn remove_hook(&self, name: &str, recurse: bool) -> Result<()> {
        let root = self.module_id(name)?;
        let tree = &self.shared.tree;
        let modules = if recurse {
            tree.subtree(root)
        } else {
            &[root][..]
        };
        for &m in modules {
            let hook = self.shared.hooks.write()[m].take();
            if let Some(h) = hook {
                h.detach(self, m)?;
            }
        }
        if recurse && root == 0 {
            self.set_device_map(None);
            self.shared.residency.clear();
        }
        Ok(())
    }

    /// True when any module has an offloading hook or any tensor is
    /// offloaded.
    pub fn has_offloaded_parts(&self) -> bool {
        self.shared.slots.any_offloaded()
            || self
                .shared
                .hooks
                .read()
                .iter()
                .flatten()
                .any(|h| flatten(h).iter().any(|h| h.offloads()))
    }

    /// Moves every tensor to `device` (`model.to(device)`). A model with
    /// offloaded parts cannot move: Accelerate's error.
    pub fn to(&self, device: Device) -> Result<()> {
        if self.has_offloaded_parts() {
            return Err(Error::MoveOffloaded);
        }
        let all: Vec<SlotId> = (0..self.slot_count()).collect();
        self.shared
            .slots
            .move_resident(&self.shared.tree, &all, device, self.uploader())
    }

    /// The device of the first parameter (as `next(model.parameters()).device`).
    pub fn first_param_device(&self) -> Option<Device> {
        let t = self
            .shared
            .tree
            .tensors()
            .position(|t| t.kind == TensorKind::Param)?;
        let slots = &self.shared.slots;
        slots.with(slots.slot_of(t), |_, state| match state {
            SlotState::Resident(b) => Some(b.device()),
            _ => None,
        })
    }

    // ---- execution ----

    /// Starts the forward pass of module `name` with `inputs`: runs its
    /// hook's `pre_forward` (inputs to the execution device, offloaded
    /// weights materialised) and returns the guard through which the
    /// caller reads the moved inputs and the weights, then calls
    /// [`Forward::exit`] with the outputs.
    pub fn enter(&self, name: &str, inputs: Activations) -> Result<Forward> {
        let module = self.module_id(name)?;
        Forward::start(self.clone(), module, self.hook_of(module), inputs)
    }
}
