//! Streams and events: ordering copies before the compute that uses them.

use std::time::{Duration, Instant};

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
/// On an emulated device every operation runs synchronously when it is
/// enqueued, so ordering is trivially kept.
#[derive(Clone)]
pub struct Stream {
    pub(crate) gpu_id: u64,
    pub(crate) ordinal: usize,
    role: StreamRole,
    pub(crate) imp: StreamImpl,
}

#[derive(Clone)]
pub(crate) enum StreamImpl {
    Emulated,
    Cuda {
        stream: std::sync::Arc<crate::cuda::CudaStream>,
        gpu: std::sync::Arc<crate::cuda::CudaGpu>,
    },
}

impl std::fmt::Debug for Stream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Stream({:?} on device {})", self.role, self.ordinal)
    }
}

impl Stream {
    pub(crate) fn new(gpu_id: u64, ordinal: usize, role: StreamRole, imp: StreamImpl) -> Self {
        Stream {
            gpu_id,
            ordinal,
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

    /// An event that completes when the work enqueued so far has.
    pub fn record(&self) -> Result<Event> {
        match &self.imp {
            StreamImpl::Emulated => Ok(Event::completed(self.device())),
            StreamImpl::Cuda { stream, .. } => Ok(Event {
                device: self.device(),
                imp: EventImpl::Cuda(crate::cuda::record(stream, self.device())?),
            }),
        }
    }

    /// Like [`Stream::record`], with timing enabled for [`Event::elapsed_since`].
    pub fn record_timed(&self) -> Result<Event> {
        match &self.imp {
            StreamImpl::Emulated => Ok(Event::completed(self.device())),
            StreamImpl::Cuda { stream, .. } => Ok(Event {
                device: self.device(),
                imp: EventImpl::Cuda(crate::cuda::record_timed(stream, self.device())?),
            }),
        }
    }

    /// Makes later work on this stream wait until `event` completes. The
    /// event may come from another GPU's stream.
    pub fn wait(&self, event: &Event) -> Result<()> {
        match (&self.imp, &event.imp) {
            (_, EventImpl::Completed(_)) => Ok(()),
            (StreamImpl::Cuda { stream, .. }, EventImpl::Cuda(e)) => {
                crate::cuda::wait(stream, e, self.device())
            }
            // An emulated stream runs work as it is enqueued: waiting on the
            // host is the ordering.
            (StreamImpl::Emulated, EventImpl::Cuda(_)) => event.synchronize(),
        }
    }

    /// Blocks until every piece of work enqueued so far has completed.
    pub fn synchronize(&self) -> Result<()> {
        match &self.imp {
            StreamImpl::Emulated => Ok(()),
            StreamImpl::Cuda { stream, .. } => crate::cuda::sync_stream(stream, self.device()),
        }
    }

    /// Enqueues work that keeps the device busy for about `duration`: a
    /// stand-in for compute when measuring copy/compute overlap and when
    /// testing event ordering. An emulated device sleeps.
    pub fn busy_wait(&self, duration: Duration) -> Result<()> {
        match &self.imp {
            StreamImpl::Emulated => {
                std::thread::sleep(duration);
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
/// are complete when created.
#[derive(Clone)]
pub struct Event {
    device: Device,
    imp: EventImpl,
}

#[derive(Clone)]
enum EventImpl {
    Completed(Instant),
    Cuda(std::sync::Arc<crate::cuda::CudaEvent>),
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
            imp: EventImpl::Completed(Instant::now()),
        }
    }

    /// The device whose stream recorded the event.
    pub fn device(&self) -> Device {
        self.device
    }

    /// Blocks until the event's work has completed.
    pub fn synchronize(&self) -> Result<()> {
        match &self.imp {
            EventImpl::Completed(_) => Ok(()),
            EventImpl::Cuda(e) => crate::cuda::sync_event(e, self.device),
        }
    }

    /// Whether the event's work has completed, without blocking.
    pub fn is_complete(&self) -> Result<bool> {
        match &self.imp {
            EventImpl::Completed(_) => Ok(true),
            EventImpl::Cuda(e) => crate::cuda::event_done(e, self.device),
        }
    }

    /// Time from `start` to this event, both from [`Stream::record_timed`]
    /// on the same device; waits for both. For emulated devices this is
    /// host wall-clock time between the two recordings.
    pub fn elapsed_since(&self, start: &Event) -> Result<Duration> {
        match (&start.imp, &self.imp) {
            (EventImpl::Completed(a), EventImpl::Completed(b)) => {
                Ok(b.saturating_duration_since(*a))
            }
            (EventImpl::Cuda(a), EventImpl::Cuda(b)) => {
                let ms = crate::cuda::elapsed_ms(a, b, self.device)?;
                Ok(Duration::from_secs_f64(f64::from(ms.max(0.0)) / 1e3))
            }
            _ => Err(Error::WrongDevice {
                operation: "timing between events",
                expected: self.device,
                found: start.device,
            }),
        }
    }
}
