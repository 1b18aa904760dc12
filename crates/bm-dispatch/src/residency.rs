//! Residency of offloaded weights on their execution devices: each is
//! materialised once per device and shared by every forward that uses it,
//! kept as a cache (prefetched, or within the resident budget) while idle,
//! and loaded ahead of time by the prefetch worker.
//!
//! The prefetch worker only enqueues copies: a materialised weight carries
//! the event of its copy ([`Arrival`]), and the forward that takes it makes
//! its compute stream wait on that event. Weights are dropped (device
//! memory freed) after the `live` lock is released, never under it.

use std::collections::HashMap;
use std::sync::Weak;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Sender, channel};

use bm_device::Device;
use bm_plan::ModuleId;
use parking_lot::{Condvar, Mutex, RwLock};

use crate::Result;
use crate::slots::SlotId;
use crate::transfer::Arrival;

/// Slots to load ahead, each on its execution device.
pub(crate) type PrefetchJob = Vec<(SlotId, Device)>;

#[derive(Debug)]
enum LiveState {
    Loading,
    Ready(Arrival),
}

#[derive(Debug)]
struct LiveEntry {
    state: LiveState,
    users: usize,
    last_used: u64,
    prefetched: bool,
}

/// Streaming settings (see `Model::set_prefetch_depth`).
#[derive(Debug)]
struct Streaming {
    /// Offloaded blocks in execution order.
    order: Vec<ModuleId>,
    /// Blocks fetched ahead of the running one.
    depth: usize,
    /// Bytes of idle weights kept on their execution device.
    resident_budget: u64,
}

/// Offloaded weights materialised on execution devices, and the settings
/// that decide what is kept and fetched ahead.
#[derive(Debug)]
pub(crate) struct Residency {
    live: Mutex<HashMap<(SlotId, Device), LiveEntry>>,
    live_changed: Condvar,
    streaming: RwLock<Streaming>,
    clock: AtomicU64,
    prefetch: Mutex<Option<Sender<PrefetchJob>>>,
}

impl Residency {
    /// Nothing materialised; prefetch depth 1, resident budget 0.
    pub(crate) fn new() -> Residency {
        Residency {
            live: Mutex::new(HashMap::new()),
            live_changed: Condvar::new(),
            streaming: RwLock::new(Streaming {
                order: Vec::new(),
                depth: 1,
                resident_budget: 0,
            }),
            clock: AtomicU64::new(0),
            prefetch: Mutex::new(None),
        }
    }

    fn tick(&self) -> u64 {
        self.clock.fetch_add(1, Ordering::Relaxed)
    }

    pub(crate) fn set_depth(&self, depth: usize) {
        self.streaming.write().depth = depth;
    }

    pub(crate) fn depth(&self) -> usize {
        self.streaming.read().depth
    }

    pub(crate) fn set_resident_budget(&self, bytes: u64) {
        self.streaming.write().resident_budget = bytes;
        let evicted = self.evict_idle(&mut self.live.lock());
        drop(evicted);
    }

    /// Sets the execution order of offloaded blocks and starts the
    /// prefetch worker (once), which `materialise`s through `owner`.
    pub(crate) fn set_order(&self, order: Vec<ModuleId>, owner: Weak<dyn Prefetch>) {
        self.streaming.write().order = order;
        let mut tx = self.prefetch.lock();
        if tx.is_none() {
            *tx = Some(spawn_prefetcher(owner));
        }
    }

    /// Forgets the streaming order and every materialised weight.
    pub(crate) fn clear(&self) {
        self.streaming.write().order.clear();
        let dropped = std::mem::take(&mut *self.live.lock());
        drop(dropped);
    }

    /// The next `depth` offloaded blocks after `module` in execution order.
    pub(crate) fn next_blocks(&self, module: ModuleId) -> Vec<ModuleId> {
        let streaming = self.streaming.read();
        match streaming.order.iter().position(|&m| m == module) {
            Some(pos) => streaming.order[pos + 1..]
                .iter()
                .copied()
                .take(streaming.depth)
                .collect(),
            None => Vec::new(),
        }
    }

    /// Hands `job` to the prefetch worker.
    pub(crate) fn prefetch(&self, job: PrefetchJob) {
        if let Some(tx) = self.prefetch.lock().as_ref() {
            // The worker only stops with the model.
            let _ = tx.send(job);
        }
    }

    /// Count and bytes of materialised weights.
    pub(crate) fn materialised(&self) -> (usize, u64) {
        let live = self.live.lock();
        let bytes = live
            .values()
            .map(|e| match &e.state {
                LiveState::Ready(a) => a.bytes.len() as u64,
                LiveState::Loading => 0,
            })
            .sum();
        (live.len(), bytes)
    }

    /// The bytes of slot `slot` on `device`, shared with every concurrent
    /// user; `produce` makes them, once (its copy may still be in flight).
    /// With `prefetch`, only starts the load and keeps the result until a
    /// forward takes it.
    pub(crate) fn materialise(
        &self,
        slot: SlotId,
        device: Device,
        prefetch: bool,
        produce: impl Fn() -> Result<Arrival>,
    ) -> Result<Option<Arrival>> {
        let key = (slot, device);
        let mut live = self.live.lock();
        loop {
            match live.get_mut(&key) {
                Some(_) if prefetch => return Ok(None),
                Some(entry) => match &entry.state {
                    LiveState::Ready(a) => {
                        entry.users += 1;
                        entry.prefetched = false;
                        entry.last_used = self.tick();
                        return Ok(Some(a.clone()));
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
        let mut produced = produce();
        // Idle weights (prefetched for a block that has already run, or kept
        // by the resident budget) are a cache: a forward short of room waits
        // for prefetches in flight on the device, drops idle weights, and
        // tries again, until nothing more can be freed.
        while !prefetch
            && matches!(&produced, Err(e) if e.is_out_of_device_memory())
            && self.make_room_on(device)
        {
            produced = produce();
        }
        let mut live = self.live.lock();
        // A prefetch keeps no reference of its own: its arrival moves into
        // the entry, so that once the entry is visible, dropping it
        // (make_room_on) frees the memory. A copy kept here until after the
        // lock let a forward woken by the notification drop the entry, find
        // its retry still short of room and nothing left to drop, and fail.
        let (handed, stray) = match produced {
            Ok(arrival) => {
                let handed = (!prefetch).then(|| arrival.clone());
                let tick = self.tick();
                match live.get_mut(&key) {
                    Some(entry) => {
                        entry.state = LiveState::Ready(arrival);
                        entry.last_used = tick;
                        if !prefetch {
                            entry.users += 1;
                            entry.prefetched = false;
                        }
                        (Ok(handed), None)
                    }
                    // Forgotten meanwhile (`clear`): dropped after the lock.
                    None => (Ok(handed), Some(arrival)),
                }
            }
            Err(e) => {
                live.remove(&key);
                (Err(e), None)
            }
        };
        self.live_changed.notify_all();
        drop(live);
        drop(stray);
        handed
    }

    /// One user of `slot` on `device` is done with it.
    pub(crate) fn release(&self, slot: SlotId, device: Device) {
        let mut live = self.live.lock();
        let mut evicted = Vec::new();
        if let Some(entry) = live.get_mut(&(slot, device)) {
            entry.users = entry.users.saturating_sub(1);
            if entry.users == 0 {
                evicted = self.evict_idle(&mut live);
            }
        }
        drop(live);
        drop(evicted);
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
        let idle: Vec<(SlotId, Device)> = live
            .iter()
            .filter(|((_, d), e)| {
                *d == device && e.users == 0 && matches!(e.state, LiveState::Ready(_))
            })
            .map(|(k, _)| *k)
            .collect();
        let dropped: Vec<LiveEntry> = idle.iter().filter_map(|k| live.remove(k)).collect();
        drop(live);
        !dropped.is_empty()
    }

    /// Takes idle weights (no user, not prefetched) beyond the resident
    /// budget out of `live`, least recently used first; the caller drops
    /// them once the lock is released.
    #[must_use = "the evicted weights are to be dropped after the lock"]
    fn evict_idle(&self, live: &mut HashMap<(SlotId, Device), LiveEntry>) -> Vec<LiveEntry> {
        let budget = self.streaming.read().resident_budget;
        let mut idle: Vec<((SlotId, Device), u64, u64)> = live
            .iter()
            .filter(|(_, e)| e.users == 0 && !e.prefetched)
            .filter_map(|(k, e)| match &e.state {
                LiveState::Ready(a) => Some((*k, e.last_used, a.bytes.len() as u64)),
                LiveState::Loading => None,
            })
            .collect();
        let mut total: u64 = idle.iter().map(|x| x.2).sum();
        idle.sort_by_key(|x| x.1);
        let mut evicted = Vec::new();
        for (key, _, bytes) in idle {
            if total <= budget {
                break;
            }
            evicted.extend(live.remove(&key));
            total -= bytes;
        }
        evicted
    }
}

/// What the prefetch worker loads through: the model's shared state.
pub(crate) trait Prefetch: Send + Sync {
    /// Starts materialising `slot` on `device` for a later forward.
    fn prefetch(&self, slot: SlotId, device: Device) -> Result<()>;
}

fn spawn_prefetcher(owner: Weak<dyn Prefetch>) -> Sender<PrefetchJob> {
    let (tx, rx) = channel::<PrefetchJob>();
    std::thread::Builder::new()
        .name("bm-dispatch-prefetch".into())
        .spawn(move || {
            while let Ok(mut job) = rx.recv() {
                // Forwards have moved on past the blocks of older jobs.
                while let Ok(newer) = rx.try_recv() {
                    job = newer;
                }
                let Some(owner) = owner.upgrade() else {
                    return;
                };
                for (slot, device) in job {
                    // A failure here is reported by the forward that needs
                    // the weight, which loads it again itself.
                    let _ = owner.prefetch(slot, device);
                }
            }
        })
        .ok();
    tx
}
