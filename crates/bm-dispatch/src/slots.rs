//! The slot table: one storage slot per tensor (tied names share one), and
//! what each slot holds between forward passes.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use bm_device::Device;
use bm_plan::{ModuleId, ModuleTree, TensorId, TensorKind};
use bm_tensor::TensorMeta;
use parking_lot::RwLock;

use crate::Result;
use crate::bytes::Bytes;
use crate::transfer::{Arrival, Uploader, move_bytes, to_device};

/// Index of a storage slot; tied tensors share one.
pub type SlotId = usize;

/// Where an offloaded tensor waits between forward passes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tier {
    /// Host RAM (page-locked when a GPU executes it).
    Cpu,
    /// A mapped file: the checkpoint itself or the offload folder.
    Disk,
}

/// Where a tensor is, as seen from outside.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Placement {
    /// No bytes (empty-initialised, never loaded).
    Meta,
    /// Resident on a device.
    Resident(Device),
    /// Offloaded; brought to the execution device around each forward.
    Offloaded(Tier),
}

/// What a slot holds.
#[derive(Debug)]
pub(crate) enum SlotState {
    /// Nothing yet.
    Meta,
    /// The tensor's bytes, used where they are.
    Resident(Arc<Bytes>),
    /// The stored copy of an offloaded tensor, brought to the execution
    /// device for each forward.
    Offloaded { bytes: Arc<Bytes>, tier: Tier },
}

impl SlotState {
    fn placement(&self) -> Placement {
        match self {
            SlotState::Meta => Placement::Meta,
            SlotState::Resident(b) => Placement::Resident(b.device()),
            SlotState::Offloaded { tier, .. } => Placement::Offloaded(*tier),
        }
    }

    /// The stored bytes, resident or offloaded.
    pub(crate) fn bytes(&self) -> Option<&Arc<Bytes>> {
        match self {
            SlotState::Meta => None,
            SlotState::Resident(b) | SlotState::Offloaded { bytes: b, .. } => Some(b),
        }
    }
}

#[derive(Debug)]
struct Slot {
    meta: TensorMeta,
    state: SlotState,
}

/// Params, and persistent buffers when `buffers`: the tensors a hook
/// offloads and streams in (non-persistent buffers never are).
pub(crate) fn weights(buffers: bool) -> impl Fn(TensorKind) -> bool {
    move |kind| match kind {
        TensorKind::Param => true,
        TensorKind::Buffer { persistent } => buffers && persistent,
    }
}

/// Every slot of a model, and which slot each tensor uses.
#[derive(Debug)]
pub(crate) struct SlotTable {
    /// The slot of each tensor of the tree, by tensor id.
    slot_of: Vec<SlotId>,
    slots: RwLock<Vec<Slot>>,
}

impl SlotTable {
    /// One meta slot per tensor of `tree`, one per tied group.
    pub(crate) fn new(tree: &ModuleTree) -> SlotTable {
        let mut slot_of = Vec::with_capacity(tree.tensors().len());
        let mut slots = Vec::with_capacity(tree.tensors().len());
        let mut group_slot: HashMap<usize, SlotId> = HashMap::new();
        for tensor in tree.tensors() {
            let mut new_slot = || {
                slots.push(Slot {
                    meta: tensor.meta.clone(),
                    state: SlotState::Meta,
                });
                slots.len() - 1
            };
            let slot = match tensor.tie_group {
                Some(g) => *group_slot.entry(g).or_insert_with(new_slot),
                None => new_slot(),
            };
            slot_of.push(slot);
        }
        SlotTable {
            slot_of,
            slots: RwLock::new(slots),
        }
    }

    /// Number of slots.
    pub(crate) fn len(&self) -> usize {
        self.slots.read().len()
    }

    /// The slot of tensor `t`.
    pub(crate) fn slot_of(&self, t: TensorId) -> SlotId {
        self.slot_of[t]
    }

    /// The first tensor (in tree order) that uses slot `s`.
    pub(crate) fn first_tensor(&self, s: SlotId) -> Option<TensorId> {
        self.slot_of.iter().position(|&x| x == s)
    }

    /// The name of slot `s` for messages: its first tensor's.
    pub(crate) fn name(&self, tree: &ModuleTree, s: SlotId) -> String {
        self.first_tensor(s)
            .map(|t| tree.tensor(t).name.to_string())
            .unwrap_or_else(|| format!("slot {s}"))
    }

    /// Where slot `s` is.
    pub(crate) fn placement(&self, s: SlotId) -> Placement {
        self.slots.read()[s].state.placement()
    }

    /// The declared (or loaded) dtype and shape of slot `s`.
    pub(crate) fn meta(&self, s: SlotId) -> TensorMeta {
        self.slots.read()[s].meta.clone()
    }

    /// Reads slot `s`'s meta and state under the lock.
    pub(crate) fn with<R>(&self, s: SlotId, f: impl FnOnce(&TensorMeta, &SlotState) -> R) -> R {
        let slots = self.slots.read();
        f(&slots[s].meta, &slots[s].state)
    }

    /// True when slot `s` holds an offloaded tensor.
    pub(crate) fn is_offloaded(&self, s: SlotId) -> bool {
        matches!(self.slots.read()[s].state, SlotState::Offloaded { .. })
    }

    /// Bytes of the tensors offloaded to `tier`.
    pub(crate) fn offloaded_bytes(&self, tier: Tier) -> u64 {
        self.slots
            .read()
            .iter()
            .filter_map(|s| match &s.state {
                SlotState::Offloaded { bytes, tier: t } if *t == tier => Some(bytes.len() as u64),
                _ => None,
            })
            .sum()
    }

    /// True when any slot holds an offloaded tensor.
    pub(crate) fn any_offloaded(&self) -> bool {
        self.slots
            .read()
            .iter()
            .any(|s| matches!(s.state, SlotState::Offloaded { .. }))
    }

    /// Puts `state` in slot `s`.
    pub(crate) fn set(&self, s: SlotId, state: SlotState) {
        self.slots.write()[s].state = state;
    }

    /// Puts every `(slot, meta, state)` in place at once (a load commits
    /// only after every tensor was read).
    pub(crate) fn commit(&self, staged: Vec<(SlotId, TensorMeta, SlotState)>) {
        let mut slots = self.slots.write();
        for (s, meta, state) in staged {
            slots[s] = Slot { meta, state };
        }
    }

    /// Replaces the state of each of `slots` by `change(slot, state)` when
    /// it returns one, under one write lock; stops at the first error.
    pub(crate) fn update(
        &self,
        slots: &[SlotId],
        mut change: impl FnMut(SlotId, &SlotState) -> Result<Option<SlotState>>,
    ) -> Result<()> {
        let mut table = self.slots.write();
        for &s in slots {
            if let Some(state) = change(s, &table[s].state)? {
                table[s].state = state;
            }
        }
        Ok(())
    }

    /// Moves the resident ones of `slots` to `device`.
    pub(crate) fn move_resident(
        &self,
        tree: &ModuleTree,
        slots: &[SlotId],
        device: Device,
        uploader: &Uploader,
    ) -> Result<()> {
        self.update(slots, |s, state| match state {
            SlotState::Resident(b) => {
                let moved = move_bytes(
                    &self.name(tree, s),
                    b,
                    device,
                    uploader.devices(),
                    Some(uploader),
                )?;
                Ok(Some(SlotState::Resident(moved)))
            }
            _ => Ok(None),
        })
    }

    /// The bytes of slot `s` on `device`: the stored bytes themselves when
    /// they are there already (a mapped file used in place on the CPU), a
    /// copy otherwise, possibly still in flight (see [`Arrival`]).
    pub(crate) fn copy_to(
        &self,
        tree: &ModuleTree,
        s: SlotId,
        device: Device,
        uploader: &Uploader,
    ) -> Result<Arrival> {
        let source = self
            .with(s, |_, state| state.bytes().cloned())
            .ok_or_else(|| crate::Error::NotLoaded(self.name(tree, s)))?;
        to_device(
            &self.name(tree, s),
            &source,
            device,
            uploader.devices(),
            Some(uploader),
        )
    }

    /// The slots of module `m`'s tensors (its direct ones, or its whole
    /// subtree's) that `keep` accepts by kind, each once, in tree order.
    pub(crate) fn of_module(
        &self,
        tree: &ModuleTree,
        m: ModuleId,
        subtree: bool,
        keep: impl Fn(TensorKind) -> bool,
    ) -> Vec<SlotId> {
        let modules = if subtree { tree.subtree(m) } else { &[m][..] };
        let mut out: Vec<SlotId> = Vec::new();
        // Tied tensors share a slot; a set keeps a large subtree linear.
        let mut seen = HashSet::new();
        for &x in modules {
            let module = tree.module(x);
            for &t in module.params.iter().chain(module.buffers) {
                let s = self.slot_of[t];
                if keep(tree.tensor(t).kind) && seen.insert(s) {
                    out.push(s);
                }
            }
        }
        out
    }
}
