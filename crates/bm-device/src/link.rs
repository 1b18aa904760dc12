//! A simulated host link for emulated GPUs: a copy-engine thread that runs
//! the copy stream's work in order, each host↔device copy taking as long
//! as it would over a link of the given bandwidth and latency, while the
//! caller goes on, as a GPU's DMA engine does. With it the overlap of
//! transfers with (host) compute is measurable without a GPU.
//!
//! Without a link an emulated stream runs each piece of work on the
//! caller's thread when it is enqueued; a linked GPU's copy stream hands
//! it to its engine instead, and events recorded on it complete when the
//! engine reaches them.

use std::collections::VecDeque;
use std::sync::{Arc, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use crate::stream::Event;
use crate::{Device, Error, Result};

/// The host link of an emulated GPU.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SimulatedLink {
    /// Bytes per second of a host↔device copy.
    pub bytes_per_second: f64,
    /// Fixed cost of each copy.
    pub latency: Duration,
}

impl SimulatedLink {
    /// How long a copy of `bytes` takes over this link: the latency plus
    /// the bytes at the bandwidth.
    pub fn transfer_time(&self, bytes: u64) -> Duration {
        let seconds = if self.bytes_per_second > 0.0 {
            bytes as f64 / self.bytes_per_second
        } else {
            0.0
        };
        self.latency + Duration::from_secs_f64(seconds)
    }
}

/// Sleeps until `start + duration`: the rest of a simulated transfer
/// after the memcpy that stands in for it.
pub(crate) fn pace(link: &SimulatedLink, bytes: u64, start: Instant) {
    let end = start + link.transfer_time(bytes);
    let now = Instant::now();
    if end > now {
        std::thread::sleep(end - now);
    }
}

/// One piece of a stream's work.
pub(crate) enum Job {
    /// A copy: `work` moves the bytes; a host↔device copy (`paced`) then
    /// lasts the link's transfer time of `bytes`.
    Copy {
        work: Box<dyn FnOnce() + Send>,
        bytes: u64,
        paced: bool,
    },
    /// Wait for an event of another stream.
    Wait(Event),
    /// Stand-in compute: keep the engine busy.
    Sleep(Duration),
    /// An event: the time the engine reached it.
    Marker(Arc<OnceLock<Instant>>),
}

struct State {
    queue: VecDeque<Job>,
    /// Jobs enqueued so far; a job's ticket is the count after it.
    submitted: u64,
    /// Jobs finished.
    completed: u64,
    closed: bool,
    /// The message of a job that panicked, reported by every later wait.
    failed: Option<String>,
}

pub(crate) struct Shared {
    device: Device,
    link: SimulatedLink,
    state: Mutex<State>,
    /// Signalled when work arrives or the engine closes.
    work: Condvar,
    /// Signalled when a job completes.
    done: Condvar,
}

impl Shared {
    /// Blocks until the job with `ticket` has completed.
    fn wait_for(&self, ticket: u64) -> Result<()> {
        let mut s = self.state.lock();
        while s.completed < ticket && s.failed.is_none() {
            self.done.wait(&mut s);
        }
        match &s.failed {
            Some(message) => Err(Error::Driver {
                operation: "simulated copy engine",
                device: Some(self.device),
                message: message.clone(),
            }),
            None => Ok(()),
        }
    }
}

/// An emulated GPU's copy engine: a thread running its copy stream's jobs
/// in order. Dropping it finishes the queued jobs, then joins the thread.
pub(crate) struct CopyEngine {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

/// An event on an engine stream: complete when the engine reached it.
#[derive(Clone)]
pub(crate) struct EngineEvent {
    shared: Arc<Shared>,
    ticket: u64,
    at: Arc<OnceLock<Instant>>,
}

impl EngineEvent {
    pub(crate) fn is_complete(&self) -> bool {
        self.at.get().is_some()
    }

    pub(crate) fn synchronize(&self) -> Result<()> {
        self.shared.wait_for(self.ticket)
    }

    /// When the engine reached the event (waits for it).
    pub(crate) fn instant(&self) -> Result<Instant> {
        self.synchronize()?;
        self.at.get().copied().ok_or_else(|| Error::Driver {
            operation: "simulated copy engine",
            device: Some(self.shared.device),
            message: "an event was skipped".into(),
        })
    }
}

impl CopyEngine {
    pub(crate) fn new(device: Device, link: SimulatedLink) -> CopyEngine {
        let shared = Arc::new(Shared {
            device,
            link,
            state: Mutex::new(State {
                queue: VecDeque::new(),
                submitted: 0,
                completed: 0,
                closed: false,
                failed: None,
            }),
            work: Condvar::new(),
            done: Condvar::new(),
        });
        let worker = Arc::clone(&shared);
        let thread = std::thread::Builder::new()
            .name(format!("bm-copy-engine-{device}"))
            .spawn(move || run(&worker))
            .ok();
        CopyEngine { shared, thread }
    }

    /// Enqueues `job`; returns its ticket. Without a thread (the system
    /// refused one) the job runs here, so work is never lost.
    pub(crate) fn push(&self, job: Job) -> u64 {
        let mut s = self.shared.state.lock();
        s.submitted += 1;
        let ticket = s.submitted;
        if self.thread.is_some() {
            s.queue.push_back(job);
            self.shared.work.notify_one();
        } else {
            drop(s);
            execute(&self.shared, job);
        }
        ticket
    }

    /// Records an event after everything enqueued so far.
    pub(crate) fn record(&self) -> EngineEvent {
        let at = Arc::new(OnceLock::new());
        let ticket = self.push(Job::Marker(Arc::clone(&at)));
        EngineEvent {
            shared: Arc::clone(&self.shared),
            ticket,
            at,
        }
    }

    /// Blocks until every job enqueued so far has completed.
    pub(crate) fn synchronize(&self) -> Result<()> {
        let ticket = self.shared.state.lock().submitted;
        self.shared.wait_for(ticket)
    }
}

impl Drop for CopyEngine {
    fn drop(&mut self) {
        self.shared.state.lock().closed = true;
        self.shared.work.notify_all();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The engine thread: jobs in order until closed and drained.
fn run(shared: &Shared) {
    loop {
        let job = {
            let mut s = shared.state.lock();
            loop {
                if let Some(job) = s.queue.pop_front() {
                    break job;
                }
                if s.closed {
                    return;
                }
                shared.work.wait(&mut s);
            }
        };
        execute(shared, job);
    }
}

/// Runs one job and counts it complete; a panic is kept as the engine's
/// failure, so waiters get an error instead of waiting forever.
fn execute(shared: &Shared, job: Job) {
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| match job {
        Job::Copy { work, bytes, paced } => {
            let start = Instant::now();
            work();
            if paced {
                pace(&shared.link, bytes, start);
            }
        }
        // An error of the awaited event's own stream is reported there.
        Job::Wait(event) => {
            let _ = event.synchronize();
        }
        Job::Sleep(d) => std::thread::sleep(d),
        Job::Marker(at) => {
            let _ = at.set(Instant::now());
        }
    }));
    let mut s = shared.state.lock();
    if let Err(payload) = outcome {
        let message = payload
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| payload.downcast_ref::<&str>().map(|m| m.to_string()))
            .unwrap_or_else(|| "a copy panicked".into());
        s.failed.get_or_insert(message);
    }
    s.completed += 1;
    shared.done.notify_all();
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    fn link(gbps: f64, latency_ms: u64) -> SimulatedLink {
        SimulatedLink {
            bytes_per_second: gbps * 1e9,
            latency: Duration::from_millis(latency_ms),
        }
    }

    #[test]
    fn transfer_time_is_latency_plus_bytes_over_bandwidth() {
        let l = link(2.0, 3);
        assert_eq!(l.transfer_time(0), Duration::from_millis(3));
        assert_eq!(l.transfer_time(2_000_000_000), Duration::from_millis(1003));
        let unlimited = SimulatedLink {
            bytes_per_second: 0.0,
            latency: Duration::ZERO,
        };
        assert_eq!(unlimited.transfer_time(1 << 30), Duration::ZERO);
    }

    #[test]
    fn jobs_run_in_order_and_events_complete_in_order() {
        let engine = CopyEngine::new(Device::Gpu(0), link(1000.0, 0));
        let order = Arc::new(Mutex::new(Vec::new()));
        let mut events = Vec::new();
        for i in 0..20 {
            let order = Arc::clone(&order);
            engine.push(Job::Copy {
                work: Box::new(move || order.lock().push(i)),
                bytes: 0,
                paced: false,
            });
            events.push(engine.record());
        }
        events[19].synchronize().unwrap();
        assert!(events.iter().all(EngineEvent::is_complete));
        assert_eq!(*order.lock(), (0..20).collect::<Vec<_>>());
        let times: Vec<Instant> = events.iter().map(|e| e.instant().unwrap()).collect();
        assert!(times.windows(2).all(|w| w[0] <= w[1]));
    }

    #[test]
    fn a_paced_copy_lasts_at_least_its_transfer_time() {
        // 50 MB at 1 GB/s plus 5 ms: at least 55 ms, whatever the machine.
        let engine = CopyEngine::new(Device::Gpu(0), link(1.0, 5));
        let start = engine.record();
        engine.push(Job::Copy {
            work: Box::new(|| {}),
            bytes: 50_000_000,
            paced: true,
        });
        let end = engine.record();
        let took = end.instant().unwrap() - start.instant().unwrap();
        assert!(took >= Duration::from_millis(55), "{took:?}");
        // A generous bound: a loaded machine may be slow, not ten times so.
        assert!(took < Duration::from_secs(5), "{took:?}");
    }

    #[test]
    fn a_panicking_job_fails_waiters_instead_of_hanging_them() {
        let engine = CopyEngine::new(Device::Gpu(3), link(1.0, 0));
        engine.push(Job::Copy {
            work: Box::new(|| panic!("bad copy")),
            bytes: 0,
            paced: false,
        });
        let e = engine.record();
        let err = e.synchronize().unwrap_err().to_string();
        assert!(
            err.contains("bad copy") && err.contains("device 3"),
            "{err}"
        );
        assert!(engine.synchronize().is_err());
    }

    #[test]
    fn dropping_the_engine_finishes_its_queue() {
        let ran = Arc::new(AtomicUsize::new(0));
        {
            let engine = CopyEngine::new(Device::Gpu(0), link(1.0, 0));
            for _ in 0..5 {
                let ran = Arc::clone(&ran);
                engine.push(Job::Copy {
                    work: Box::new(move || {
                        ran.fetch_add(1, Ordering::SeqCst);
                    }),
                    bytes: 1_000_000,
                    paced: true,
                });
            }
        }
        assert_eq!(ran.load(Ordering::SeqCst), 5);
    }
}
