//! The loaded model: one slot per tensor storage, hooks per module, and
//! the execution protocol (`enter` → `weight` → `exit`).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Sender, channel};
use std::sync::{Arc, Weak};

use bm_device::{Device, DeviceSet, PinnedPool};
use bm_plan::{DeviceMap, ModuleId, ModuleTree, Node, TensorId, TensorKind};
use bm_tensor::TensorMeta;
use parking_lot::{Condvar, Mutex, RwLock};

use crate::bytes::{Activations, Bytes, Weight, move_bytes, upload};
use crate::hooks::{AlignDevicesHook, ModelHook, SequentialHook};
use crate::{Error, Result};

/// Index of a storage slot; tied tensors share one.
pub type SlotId = usize;

/// Slots to load ahead, each on its execution device.
type PrefetchJob = Vec<(SlotId, Device)>;

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

#[derive(Debug)]
pub(crate) enum SlotState {
    Meta,
    Resident(Arc<Bytes>),
    Offloaded { bytes: Arc<Bytes>, tier: Tier },
}

#[derive(Debug)]
pub(crate) struct Slot {
    pub(crate) meta: TensorMeta,
    pub(crate) state: SlotState,
}

#[derive(Debug)]
enum LiveState {
    Loading,
    Ready(Arc<Bytes>),
}

#[derive(Debug)]
struct LiveEntry {
    state: LiveState,
    users: usize,
    last_used: u64,
    prefetched: bool,
}

/// Streaming settings (see [`Model::set_prefetch_depth`]).
#[derive(Debug)]
struct Streaming {
    order: Vec<ModuleId>,
    depth: usize,
    resident_budget: u64,
}

pub(crate) struct Shared {
    pub(crate) tree: ModuleTree,
    pub(crate) slot_of: Vec<SlotId>,
    pub(crate) slots: RwLock<Vec<Slot>>,
    pub(crate) hooks: RwLock<Vec<Option<Arc<dyn ModelHook>>>>,
    pub(crate) devices: Arc<DeviceSet>,
    pub(crate) pool: Option<PinnedPool>,
    pub(crate) device_map: RwLock<Option<DeviceMap>>,
    live: Mutex<HashMap<(SlotId, Device), LiveEntry>>,
    live_changed: Condvar,
    streaming: RwLock<Streaming>,
    clock: AtomicU64,
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
    pub(crate) shared: Arc<Shared>,
    prefetch: Arc<Mutex<Option<Sender<PrefetchJob>>>>,
}

impl std::fmt::Debug for Model {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Model")
            .field("modules", &self.shared.tree.modules().len())
            .field("tensors", &self.shared.tree.tensors().len())
            .field("slots", &self.shared.slots.read().len())
            .finish()
    }
}

/// Default bytes of a pinned staging slot used for GPU uploads.
const STAGING_SLOT: usize = 8 << 20;

impl Model {
    /// A model over `tree` with every tensor on the meta device: nothing
    /// is allocated but the bookkeeping (Accelerate's `init_empty_weights`).
    pub fn empty(tree: ModuleTree, devices: Arc<DeviceSet>) -> Result<Model> {
        let mut slot_of = vec![usize::MAX; tree.tensors().len()];
        let mut slots = Vec::with_capacity(tree.tensors().len());
        let mut group_slot: HashMap<usize, SlotId> = HashMap::new();
        for (t, tensor) in tree.tensors().iter().enumerate() {
            let slot = match tensor.tie_group {
                Some(g) => *group_slot.entry(g).or_insert_with(|| {
                    slots.push(Slot {
                        meta: tensor.meta.clone(),
                        state: SlotState::Meta,
                    });
                    slots.len() - 1
                }),
                None => {
                    slots.push(Slot {
                        meta: tensor.meta.clone(),
                        state: SlotState::Meta,
                    });
                    slots.len() - 1
                }
            };
            slot_of[t] = slot;
        }
        let pool = if devices.gpu_count() > 0 {
            Some(
                devices
                    .pinned_pool(STAGING_SLOT, PinnedPool::DEFAULT_SLOTS)
                    .map_err(|e| Error::device("the pinned staging pool", e))?,
            )
        } else {
            None
        };
        let modules = tree.modules().len();
        let shared = Arc::new(Shared {
            tree,
            slot_of,
            slots: RwLock::new(slots),
            hooks: RwLock::new(vec![None; modules]),
            devices,
            pool,
            device_map: RwLock::new(None),
            live: Mutex::new(HashMap::new()),
            live_changed: Condvar::new(),
            streaming: RwLock::new(Streaming {
                order: Vec::new(),
                depth: 1,
                resident_budget: 0,
            }),
            clock: AtomicU64::new(0),
        });
        Ok(Model {
            shared,
            prefetch: Arc::new(Mutex::new(None)),
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
        self.shared.slots.read().len()
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
        let (a, b) = (self.tensor_id(a)?, self.tensor_id(b)?);
        Ok(self.shared.slot_of[a] == self.shared.slot_of[b])
    }

    /// Where tensor `name` is.
    pub fn placement(&self, name: &str) -> Result<Placement> {
        let t = self.tensor_id(name)?;
        let slots = self.shared.slots.read();
        Ok(match &slots[self.shared.slot_of[t]].state {
            SlotState::Meta => Placement::Meta,
            SlotState::Resident(b) => Placement::Resident(b.device()),
            SlotState::Offloaded { tier, .. } => Placement::Offloaded(*tier),
        })
    }

    /// The stored value of tensor `name` outside any forward pass: resident
    /// bytes, or the offloaded copy (host RAM or the mapped file).
    pub fn weight(&self, name: &str) -> Result<Weight> {
        let t = self.tensor_id(name)?;
        let slots = self.shared.slots.read();
        let slot = &slots[self.shared.slot_of[t]];
        match &slot.state {
            SlotState::Meta => Err(Error::NotLoaded(name.to_string())),
            SlotState::Resident(b) | SlotState::Offloaded { bytes: b, .. } => Ok(Weight {
                meta: slot.meta.clone(),
                bytes: Arc::clone(b),
            }),
        }
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
        self.shared.streaming.write().depth = depth;
    }

    /// Bytes of offloaded weights that may stay on their execution device
    /// between forward passes (default 0: released after each block, as
    /// Accelerate does). Least recently used weights go first.
    pub fn set_resident_budget(&self, bytes: u64) {
        self.shared.streaming.write().resident_budget = bytes;
        self.shared.evict_idle(&mut self.shared.live.lock());
    }

    /// Offloaded weights currently materialised on execution devices
    /// (in use, prefetched or kept by the resident budget): count and bytes.
    pub fn materialised(&self) -> (usize, u64) {
        let live = self.shared.live.lock();
        let bytes = live
            .values()
            .map(|e| match &e.state {
                LiveState::Ready(b) => b.len() as u64,
                LiveState::Loading => 0,
            })
            .sum();
        (live.len(), bytes)
    }

    pub(crate) fn set_streaming_order(&self, order: Vec<ModuleId>) {
        self.shared.streaming.write().order = order;
        let mut tx = self.prefetch.lock();
        if tx.is_none() {
            *tx = Some(spawn_prefetcher(Arc::downgrade(&self.shared)));
        }
    }

    // ---- hooks ----

    /// The hook of module `name`, if any.
    pub fn hook(&self, name: &str) -> Result<Option<Arc<dyn ModelHook>>> {
        let m = self.module_id(name)?;
        Ok(self.shared.hooks.read()[m].clone())
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
                let mut hooks = match old.as_any().downcast_ref::<SequentialHook>() {
                    Some(seq) => seq.hooks.clone(),
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
        let modules: Vec<ModuleId> = if recurse {
            self.shared
                .tree
                .preorder()
                .iter()
                .copied()
                .filter(|&m| self.shared.tree.is_within(m, root))
                .collect()
        } else {
            vec![root]
        };
        for m in modules {
            let hook = self.shared.hooks.write()[m].take();
            if let Some(h) = hook {
                h.detach(self, m)?;
            }
        }
        if recurse && root == 0 {
            self.set_device_map(None);
            self.shared.streaming.write().order.clear();
            self.shared.live.lock().clear();
        }
        Ok(())
    }

    /// True when any module has an offloading [`AlignDevicesHook`] or any
    /// tensor is offloaded.
    pub fn has_offloaded_parts(&self) -> bool {
        let slots = self.shared.slots.read();
        slots
            .iter()
            .any(|s| matches!(s.state, SlotState::Offloaded { .. }))
            || self.shared.hooks.read().iter().flatten().any(|h| {
                crate::hooks::flatten(h).iter().any(|h| {
                    h.as_any()
                        .downcast_ref::<AlignDevicesHook>()
                        .is_some_and(|a| a.offload)
                })
            })
    }

    /// Moves every tensor to `device` (`model.to(device)`). A model with
    /// offloaded parts cannot move: Accelerate's error.
    pub fn to(&self, device: Device) -> Result<()> {
        if self.has_offloaded_parts() {
            return Err(Error::MoveOffloaded);
        }
        let all: Vec<SlotId> = (0..self.slot_count()).collect();
        self.move_slots(&all, device)
    }

    /// Moves resident slots to `device`.
    pub(crate) fn move_slots(&self, slots_to_move: &[SlotId], device: Device) -> Result<()> {
        let mut slots = self.shared.slots.write();
        for &s in slots_to_move {
            if let SlotState::Resident(b) = &slots[s].state {
                let moved = move_bytes(
                    &format!("slot {s}"),
                    b,
                    device,
                    &self.shared.devices,
                    self.shared.pool.as_ref(),
                )?;
                slots[s].state = SlotState::Resident(moved);
            }
        }
        Ok(())
    }

    /// The device of the first parameter (as `next(model.parameters()).device`).
    pub fn first_param_device(&self) -> Option<Device> {
        let t = self
            .shared
            .tree
            .tensors()
            .iter()
            .position(|t| t.kind == TensorKind::Param)?;
        let slots = self.shared.slots.read();
        match &slots[self.shared.slot_of[t]].state {
            SlotState::Resident(b) => Some(b.device()),
            _ => None,
        }
    }

    /// The slots of the tensors of module `m` (its direct ones, or its
    /// whole subtree), without non-persistent buffers, and buffers only
    /// when `buffers`.
    pub(crate) fn module_slots(&self, m: ModuleId, subtree: bool, buffers: bool) -> Vec<SlotId> {
        let tree = &self.shared.tree;
        let mut out: Vec<SlotId> = Vec::new();
        let modules: Vec<ModuleId> = if subtree {
            tree.preorder()
                .iter()
                .copied()
                .filter(|&x| tree.is_within(x, m))
                .collect()
        } else {
            vec![m]
        };
        for x in modules {
            let module = tree.module(x);
            let bufs = module.buffers.iter().filter(|&&t| {
                buffers && tree.tensor(t).kind == TensorKind::Buffer { persistent: true }
            });
            for &t in module.params.iter().chain(bufs) {
                let s = self.shared.slot_of[t];
                if !out.contains(&s) {
                    out.push(s);
                }
            }
        }
        out
    }

    // ---- execution ----

    /// Starts the forward pass of module `name` with `inputs`: runs its
    /// hook's `pre_forward` (inputs to the execution device, offloaded
    /// weights materialised) and returns the guard through which the
    /// caller reads the moved inputs and the weights, then calls
    /// [`Forward::exit`] with the outputs.
    pub fn enter(&self, name: &str, inputs: Activations) -> Result<Forward> {
        let module = self.module_id(name)?;
        let hook = self.shared.hooks.read()[module].clone();
        let mut fwd = Forward {
            model: self.clone(),
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
}

impl Shared {
    fn tick(&self) -> u64 {
        self.clock.fetch_add(1, Ordering::Relaxed)
    }

    /// The bytes of slot `slot` on `device`, shared with every concurrent
    /// user; loaded once. With `prefetch`, only starts the load and keeps
    /// the result until a forward takes it.
    fn materialise(
        &self,
        slot: SlotId,
        device: Device,
        prefetch: bool,
    ) -> Result<Option<Arc<Bytes>>> {
        let key = (slot, device);
        let mut live = self.live.lock();
        loop {
            match live.get_mut(&key) {
                Some(_) if prefetch => return Ok(None),
                Some(entry) => match &entry.state {
                    LiveState::Ready(b) => {
                        entry.users += 1;
                        entry.prefetched = false;
                        entry.last_used = self.tick();
                        return Ok(Some(Arc::clone(b)));
                    }
                    LiveState::Loading => self.live_changed.wait(&mut live),
                },
                None => {
                    live.insert(
                        key,
                        LiveEntry {
                            state: LiveState::Loading,
                            users: 0,
                            last_used: 0,
                            prefetched: prefetch,
                        },
                    );
                    break;
                }
            }
        }
        drop(live);
        let mut produced = self.produce(slot, device);
        // Idle weights (prefetched for a block that has already run, or kept
        // by the resident budget) are a cache: a forward short of room waits
        // for prefetches in flight on the device, drops idle weights, and
        // tries again, until nothing more can be freed.
        while !prefetch
            && matches!(&produced, Err(e) if e.is_out_of_device_memory())
            && self.make_room_on(device)
        {
            produced = self.produce(slot, device);
        }
        let mut live = self.live.lock();
        let out = match produced {
            Ok(bytes) => {
                let tick = self.tick();
                if let Some(entry) = live.get_mut(&key) {
                    entry.state = LiveState::Ready(Arc::clone(&bytes));
                    entry.last_used = tick;
                    if !prefetch {
                        entry.users += 1;
                        entry.prefetched = false;
                    }
                }
                Ok(Some(bytes))
            }
            Err(e) => {
                live.remove(&key);
                Err(e)
            }
        };
        self.live_changed.notify_all();
        out
    }

    /// Makes the bytes of `slot` on `device`: zero-copy when the stored
    /// copy is already host memory and the device is the CPU (a mapped
    /// file is used in place), a copy otherwise.
    fn produce(&self, slot: SlotId, device: Device) -> Result<Arc<Bytes>> {
        let source = {
            let slots = self.slots.read();
            match &slots[slot].state {
                SlotState::Meta => {
                    let name = self.slot_name(slot);
                    return Err(Error::NotLoaded(name));
                }
                SlotState::Resident(b) | SlotState::Offloaded { bytes: b, .. } => Arc::clone(b),
            }
        };
        if source.device() == device {
            return Ok(source);
        }
        let what = self.slot_name(slot);
        match source.host() {
            Some(host) => Ok(Arc::new(upload(
                &what,
                host,
                device,
                &self.devices,
                self.pool.as_ref(),
            )?)),
            None => move_bytes(&what, &source, device, &self.devices, self.pool.as_ref()),
        }
    }

    fn slot_name(&self, slot: SlotId) -> String {
        self.slot_of
            .iter()
            .position(|&s| s == slot)
            .map(|t| self.tree.tensor(t).name.clone())
            .unwrap_or_else(|| format!("slot {slot}"))
    }

    fn release(&self, slot: SlotId, device: Device) {
        let mut live = self.live.lock();
        if let Some(entry) = live.get_mut(&(slot, device)) {
            entry.users = entry.users.saturating_sub(1);
            if entry.users == 0 {
                self.evict_idle(&mut live);
            }
        }
    }

    /// Waits until no prefetch is loading onto `device`, then drops every
    /// weight there that no forward is using, prefetched ones included.
    /// True when something was dropped.
    fn make_room_on(&self, device: Device) -> bool {
        let mut live = self.live.lock();
        while live.iter().any(|((_, d), e)| {
            *d == device && e.prefetched && matches!(e.state, LiveState::Loading)
        }) {
            self.live_changed.wait(&mut live);
        }
        let before = live.len();
        live.retain(|(_, d), e| {
            *d != device || e.users > 0 || matches!(e.state, LiveState::Loading)
        });
        before != live.len()
    }

    /// Drops idle weights (no user, not prefetched) beyond the resident
    /// budget, least recently used first.
    fn evict_idle(&self, live: &mut HashMap<(SlotId, Device), LiveEntry>) {
        let budget = self.streaming.read().resident_budget;
        let mut idle: Vec<((SlotId, Device), u64, u64)> = live
            .iter()
            .filter(|(_, e)| e.users == 0 && !e.prefetched)
            .filter_map(|(k, e)| match &e.state {
                LiveState::Ready(b) => Some((*k, e.last_used, b.len() as u64)),
                LiveState::Loading => None,
            })
            .collect();
        let mut total: u64 = idle.iter().map(|x| x.2).sum();
        idle.sort_by_key(|x| x.1);
        for (key, _, bytes) in idle {
            if total <= budget {
                break;
            }
            live.remove(&key);
            total -= bytes;
        }
    }
}

fn spawn_prefetcher(shared: Weak<Shared>) -> Sender<PrefetchJob> {
    let (tx, rx) = channel::<PrefetchJob>();
    std::thread::Builder::new()
        .name("bm-dispatch-prefetch".into())
        .spawn(move || {
            while let Ok(mut job) = rx.recv() {
                // Forwards have moved on past the blocks of older jobs.
                while let Ok(newer) = rx.try_recv() {
                    job = newer;
                }
                let Some(shared) = shared.upgrade() else {
                    return;
                };
                for (slot, device) in job {
                    // A failure here is reported by the forward that needs
                    // the weight, which loads it again itself.
                    let _ = shared.materialise(slot, device, true);
                }
            }
        })
        .ok();
    tx
}

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
        &self.model.shared.tree.module(self.module).name
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
        let slots = self.model.module_slots(self.module, subtree, buffers);
        for s in slots {
            let offloaded = matches!(
                self.model.shared.slots.read()[s].state,
                SlotState::Offloaded { .. }
            );
            if offloaded && !self.held.iter().any(|h| h.0 == s && h.1 == device) {
                if let Some(bytes) = self.model.shared.materialise(s, device, false)? {
                    self.held.push((s, device, bytes));
                }
            }
        }
        // Only now: a prefetch started earlier could take the room this
        // block's own weights need.
        self.prefetch_next();
        Ok(())
    }

    /// Asks the prefetch worker for the next `depth` offloaded blocks
    /// after this one in execution order.
    fn prefetch_next(&self) {
        let (next, depth): (Vec<ModuleId>, usize) = {
            let streaming = self.model.shared.streaming.read();
            let Some(pos) = streaming.order.iter().position(|&m| m == self.module) else {
                return;
            };
            (
                streaming.order[pos + 1..]
                    .iter()
                    .copied()
                    .take(streaming.depth)
                    .collect(),
                streaming.depth,
            )
        };
        if depth == 0 || next.is_empty() {
            return;
        }
        let mut job = Vec::new();
        for m in next {
            let exec = self.model.shared.hooks.read()[m]
                .as_ref()
                .and_then(crate::hooks::execution_device)
                .unwrap_or(Device::Cpu);
            for s in self.model.module_slots(m, true, true) {
                if matches!(
                    self.model.shared.slots.read()[s].state,
                    SlotState::Offloaded { .. }
                ) {
                    job.push((s, exec));
                }
            }
        }
        if let Some(tx) = self.model.prefetch.lock().as_ref() {
            let _ = tx.send(job);
        }
    }

    /// Releases every weight this forward materialised.
    pub fn release(&mut self) {
        for (s, d, bytes) in self.held.drain(..) {
            drop(bytes);
            self.model.shared.release(s, d);
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
        let t = self.model.tensor_id(&name)?;
        let s = self.model.shared.slot_of[t];
        let (meta, resident) = {
            let slots = self.model.shared.slots.read();
            let slot = &slots[s];
            let resident = match &slot.state {
                SlotState::Meta => return Err(Error::NotLoaded(name)),
                SlotState::Resident(b) => Some(Arc::clone(b)),
                SlotState::Offloaded { .. } => None,
            };
            (slot.meta.clone(), resident)
        };
        let device = match (self.exec, &resident) {
            (None, Some(b)) => b.device(),
            (Some(d), _) => d,
            (None, None) => Device::Cpu,
        };
        if let Some(b) = &resident {
            if b.device() == device {
                return Ok(Weight {
                    meta,
                    bytes: Arc::clone(b),
                });
            }
        }
        if let Some(h) = self.held.iter().find(|h| h.0 == s && h.1 == device) {
            return Ok(Weight {
                meta,
                bytes: Arc::clone(&h.2),
            });
        }
        let bytes = self
            .model
            .shared
            .materialise(s, device, false)?
            .ok_or_else(|| Error::NotLoaded(name.clone()))?;
        self.held.push((s, device, Arc::clone(&bytes)));
        Ok(Weight { meta, bytes })
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
