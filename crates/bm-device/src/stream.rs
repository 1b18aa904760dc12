//! Streams and events: ordering copies before the compute that uses them.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::link::{CopyEngine, EngineEvent, Job};
use crate::{Device, Error, Result};

/// What a stream is for. Each GPU has one of each, so a copy for layer
/// *i + 1* can run while layer *i* computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StreamRole {
    /// Kernels.
    Compute,
    /// Host↔device and device↔device transfers.
    Copy,
}

/// An in-order queue of work on one GPU. Cheap to clone.
///
/// On an emulated device work runs on the caller's thread when it is
/// enqueued, so ordering is trivially kept; the copy stream of an emulated
/// GPU with a [`SimulatedLink`](crate::SimulatedLink) runs it on a
/// copy-engine thread instead, concurrently with the caller.
#[derive(Clone)]
pub struct Stream {
    pub(crate) gpu_id: u64,
    pub(crate) ordinal: usize,
    /// Unique per process.
    pub(crate) id: u64,
    role: StreamRole,
    pub(crate) imp: StreamImpl,
}

#[derive(Clone)]
pub(crate) enum StreamImpl {
    /// Work runs on the caller's thread as it is enqueued.
    Emulated,
    /// Work runs in order on an emulated GPU's copy engine.
    Engine(Arc<CopyEngine>),
    Cuda {
        stream: Arc<crate::cuda::CudaStream>,
        gpu: Arc<crate::cuda::CudaGpu>,
    },
}

impl std::fmt::Debug for Stream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Stream({:?} on device {})", self.role, self.ordinal)
    }
}

/// The next number of the order that uses and events are compared in (see
/// `pending.rs`): taken after the work it stands for is enqueued and before
/// the event covering that work is recorded, from one counter for every
/// stream of the process.
pub(crate) fn next_seq() -> u64 {
    static SEQ: AtomicU64 = AtomicU64::new(1);
    SEQ.fetch_add(1, Ordering::Relaxed)
}

impl Stream {
    pub(crate) fn new(gpu_id: u64, ordinal: usize, role: StreamRole, imp: StreamImpl) -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        Stream {
            gpu_id,
            ordinal,
            id: NEXT.fetch_add(1, Ordering::Relaxed),
            role,
            imp,
        }
    }

    /// The GPU this stream runs on.
    pub fn device(&self) -> Device {
        Device::Gpu(self.ordinal)
    }

    /// Compute or copy.
    pub fn role(&self) -> StreamRole {
        self.role
    }

    /// Whether work enqueued here may still be running when the call that
    /// enqueued it returns.
    pub(crate) fn is_asynchronous(&self) -> bool {
        !matches!(self.imp, StreamImpl::Emulated)
    }

    /// The copy engine of an emulated GPU's linked copy stream.
    pub(crate) fn engine(&self) -> Option<&CopyEngine> {
        match &self.imp {
            StreamImpl::Engine(e) => Some(e),
            _ => None,
        }
    }

    fn record_with(&self, timed: bool) -> Result<Event> {
        let seq = next_seq();
        let imp = match &self.imp {
            StreamImpl::Emulated => EventImpl::Completed(Instant::now()),
            StreamImpl::Engine(engine) => EventImpl::Engine(engine.record()),
            StreamImpl::Cuda { stream, .. } => EventImpl::Cuda(if timed {
                crate::cuda::record_timed(stream, self.device())?
            } else {
                crate::cuda::record(stream, self.device())?
            }),
        };
        Ok(Event {
            device: self.device(),
            seq,
            imp,
        })
    }

    /// An event that completes when the work enqueued so far has.
    pub fn record(&self) -> Result<Event> {
        self.record_with(false)
    }

    /// Like [`Stream::record`], with timing enabled for [`Event::elapsed_since`].
    pub fn record_timed(&self) -> Result<Event> {
        self.record_with(true)
    }

    /// Makes later work on this stream wait until `event` completes. The
    /// event may come from another GPU's stream.
    pub fn wait(&self, event: &Event) -> Result<()> {
        match (&self.imp, &event.imp) {
            (_, EventImpl::Completed(_)) => Ok(()),
            (StreamImpl::Cuda { stream, .. }, EventImpl::Cuda(e)) => {
                crate::cuda::wait(stream, e, self.device())
            }
            (StreamImpl::Engine(engine), _) => {
                if !event.is_complete()? {
                    engine.push(Job::Wait(event.clone()));
                }
                Ok(())
            }
            // A stream running work as it is enqueued orders it by waiting
            // on the host; so does a CUDA stream for an emulated event
            // (sets never mix the two, but waiting is always correct).
            (StreamImpl::Emulated, _) | (StreamImpl::Cuda { .. }, EventImpl::Engine(_)) => {
                event.synchronize()
            }
        }
    }

    /// Blocks until every piece of work enqueued so far has completed.
    pub fn synchronize(&self) -> Result<()> {
        match &self.imp {
            StreamImpl::Emulated => Ok(()),
            StreamImpl::Engine(engine) => engine.synchronize(),
            StreamImpl::Cuda { stream, .. } => crate::cuda::sync_stream(stream, self.device()),
        }
    }

    /// Enqueues work that keeps the device busy for about `duration`: a
    /// stand-in for compute when measuring copy/compute overlap and when
    /// testing event ordering. An emulated device sleeps (on its copy
    /// engine, for a linked copy stream).
    pub fn busy_wait(&self, duration: Duration) -> Result<()> {
        match &self.imp {
            StreamImpl::Emulated => {
                std::thread::sleep(duration);
                Ok(())
            }
            StreamImpl::Engine(engine) => {
                engine.push(Job::Sleep(duration));
                Ok(())
            }
            StreamImpl::Cuda { stream, gpu } => gpu.busy_wait(stream, duration),
        }
    }

    /// Fails with [`Error::WrongDevice`] unless this stream belongs to the
    /// GPU identified by `gpu_id`.
    pub(crate) fn check_on(
        &self,
        gpu_id: u64,
        ordinal: usize,
        operation: &'static str,
    ) -> Result<()> {
        if self.gpu_id == gpu_id {
            Ok(())
        } else {
            Err(Error::WrongDevice {
                operation,
                expected: Device::Gpu(ordinal),
                found: self.device(),
            })
        }
    }
}

/// A point in a stream's work. Cheap to clone. Events of emulated devices
/// are complete when created, except on a linked copy stream, whose
/// engine reaches them later.
#[derive(Clone)]
pub struct Event {
    device: Device,
    /// Where the event stands in the order of all uses (0: nothing to wait for).
    seq: u64,
    imp: EventImpl,
}

#[derive(Clone)]
enum EventImpl {
    Completed(Instant),
    Engine(EngineEvent),
    Cuda(Arc<crate::cuda::CudaEvent>),
}

impl std::fmt::Debug for Event {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Event(device {})", self.device)
    }
}

impl Event {
    /// An event with nothing to wait for.
    pub fn completed(device: Device) -> Self {
        Event {
            device,
            seq: 0,
            imp: EventImpl::Completed(Instant::now()),
        }
    }

    /// The device whose stream recorded the event.
    pub fn device(&self) -> Device {
        self.device
    }

    pub(crate) fn seq(&self) -> u64 {
        self.seq
    }

    /// Complete from birth: recorded on a stream that runs work as it is
    /// enqueued.
    pub(crate) fn is_trivially_complete(&self) -> bool {
        matches!(self.imp, EventImpl::Completed(_))
    }

    /// Blocks until the event's work has completed.
    pub fn synchronize(&self) -> Result<()> {
        match &self.imp {
            EventImpl::Completed(_) => Ok(()),
            EventImpl::Engine(e) => e.synchronize(),
            EventImpl::Cuda(e) => crate::cuda::sync_event(e, self.device),
        }
    }

    /// Whether the event's work has completed, without blocking.
    pub fn is_complete(&self) -> Result<bool> {
        match &self.imp {
            EventImpl::Completed(_) => Ok(true),
            EventImpl::Engine(e) => Ok(e.is_complete()),
            EventImpl::Cuda(e) => crate::cuda::event_done(e, self.device),
        }
    }

    /// Host time at which an emulated event completed (waits for it).
    fn instant(&self) -> Result<Option<Instant>> {
        match &self.imp {
            EventImpl::Completed(t) => Ok(Some(*t)),
            EventImpl::Engine(e) => e.instant().map(Some),
            EventImpl::Cuda(_) => Ok(None),
        }
    }

    /// Time from `start` to this event, both from [`Stream::record_timed`]
    /// on the same device; waits for both. For emulated devices this is
    /// host wall-clock time between the moments the two were reached.
    pub fn elapsed_since(&self, start: &Event) -> Result<Duration> {
        if let (EventImpl::Cuda(a), EventImpl::Cuda(b)) = (&start.imp, &self.imp) {
            let ms = crate::cuda::elapsed_ms(a, b, self.device)?;
            return Ok(Duration::from_secs_f64(f64::from(ms.max(0.0)) / 1e3));
        }
        match (start.instant()?, self.instant()?) {
            (Some(a), Some(b)) => Ok(b.saturating_duration_since(a)),
            _ => Err(Error::WrongDevice {
                operation: "timing between events",
                expected: self.device,
                found: start.device,
            }),
        }
    }
}
