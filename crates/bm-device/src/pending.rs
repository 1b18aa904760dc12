//! The work still using a piece of memory, per stream, under one lock.
//!
//! Every device buffer, pinned buffer and host registration keeps, for
//! each stream that used it, the last event of that use. Later work on
//! another stream first waits for those events; work on the same stream
//! needs nothing (a stream runs in order); host access and pinned frees
//! wait for all of them; a device buffer's free is enqueued on the stream
//! of its latest use after waits for the others, so dropping never blocks
//! the host.
//!
//! Uses are ordered by a sequence number taken after the work is enqueued
//! and before the event covering it is recorded (see
//! [`next_seq`](crate::stream::next_seq)). So of two uses noted on one
//! stream, the one with the larger number was recorded later and covers
//! the other's work, whatever order two threads note them in: a use is
//! never lost to a race.

use parking_lot::Mutex;

use crate::stream::{Event, Stream, next_seq};
use crate::{Error, Result};

/// The last use on one stream.
#[derive(Clone)]
pub(crate) struct Use {
    pub stream: Stream,
    pub seq: u64,
    /// `None` for work whose event was not worth recording when it was
    /// enqueued (an allocation): an event recorded on that stream when one
    /// is needed covers it, as it covers everything enqueued before.
    pub event: Option<Event>,
}

impl Use {
    /// The use's event, recorded now on its stream when it has none.
    pub fn event(&self) -> Result<Event> {
        match &self.event {
            Some(e) => Ok(e.clone()),
            None => self.stream.record(),
        }
    }
}

/// The uses of one piece of memory, at most one per stream.
#[derive(Default)]
pub(crate) struct Pending {
    uses: Mutex<Vec<Use>>,
}

impl Pending {
    /// Notes work on `stream` that `event` (recorded on it after the work)
    /// covers.
    pub fn note(&self, stream: &Stream, event: &Event) {
        if event.is_trivially_complete() {
            return;
        }
        self.put(Use {
            stream: stream.clone(),
            seq: event.seq(),
            event: Some(event.clone()),
        });
    }

    /// Notes work just enqueued on `stream` without an event of its own.
    pub fn note_enqueued(&self, stream: &Stream) {
        if !stream.is_asynchronous() {
            return;
        }
        self.put(Use {
            stream: stream.clone(),
            seq: next_seq(),
            event: None,
        });
    }

    fn put(&self, new: Use) {
        let mut uses = self.uses.lock();
        match uses.iter_mut().find(|u| u.stream.id == new.stream.id) {
            Some(old) if old.seq >= new.seq => {}
            Some(old) => *old = new,
            None => uses.push(new),
        }
    }

    fn snapshot(&self) -> Vec<Use> {
        self.uses.lock().clone()
    }

    /// Makes `stream` wait for every use on other streams.
    pub fn order_before(&self, stream: &Stream) -> Result<()> {
        for u in self.snapshot() {
            if u.stream.id != stream.id {
                stream.wait(&u.event()?)?;
            }
        }
        Ok(())
    }

    /// Blocks until every use has completed.
    pub fn synchronize(&self) -> Result<()> {
        let mut first: Option<Error> = None;
        for u in self.snapshot() {
            if let Err(e) = u.event().and_then(|e| e.synchronize()) {
                first.get_or_insert(e);
            }
        }
        first.map_or(Ok(()), Err)
    }

    /// Every use, leaving none.
    pub fn take(&self) -> Vec<Use> {
        std::mem::take(&mut *self.uses.lock())
    }

    #[cfg(test)]
    fn seqs(&self) -> Vec<(u64, u64)> {
        self.uses
            .lock()
            .iter()
            .map(|u| (u.stream.id, u.seq))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{DeviceSet, SimulatedLink};
    use std::time::Duration;

    fn linked() -> DeviceSet {
        DeviceSet::emulated_with_link(
            &[1 << 20],
            SimulatedLink {
                bytes_per_second: 1e12,
                latency: Duration::ZERO,
            },
        )
    }

    #[test]
    fn one_use_per_stream_and_the_latest_wins_whatever_the_note_order() {
        let set = linked();
        let copy = set.gpu(0).unwrap().copy_stream();
        let p = Pending::default();
        let a = copy.record().unwrap();
        let b = copy.record().unwrap();
        assert!(a.seq() < b.seq());
        // Noted in the opposite order of recording: b still wins.
        p.note(copy, &b);
        p.note(copy, &a);
        assert_eq!(p.seqs(), vec![(copy.id, b.seq())]);
        p.note_enqueued(copy);
        assert!(p.seqs()[0].1 > b.seq());
        assert_eq!(p.take().len(), 1);
        assert!(p.seqs().is_empty());
    }

    #[test]
    fn synchronous_streams_and_completed_events_leave_nothing_pending() {
        let set = linked();
        let compute = set.gpu(0).unwrap().compute_stream();
        let p = Pending::default();
        p.note_enqueued(compute);
        p.note(compute, &compute.record().unwrap());
        assert!(p.seqs().is_empty());
        p.synchronize().unwrap();
    }

    #[test]
    fn concurrent_notes_keep_the_latest_of_each_stream() {
        let set = linked();
        let copy = set.gpu(0).unwrap().copy_stream();
        let p = Pending::default();
        let latest = std::thread::scope(|s| {
            let handles: Vec<_> = (0..4)
                .map(|_| {
                    s.spawn(|| {
                        let mut last = 0;
                        for _ in 0..100 {
                            let e = copy.record().unwrap();
                            last = e.seq();
                            p.note(copy, &e);
                        }
                        last
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap())
                .max()
                .unwrap()
        });
        assert_eq!(p.seqs(), vec![(copy.id, latest)]);
        p.synchronize().unwrap();
    }
}
