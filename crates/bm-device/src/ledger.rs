//! Per-device byte accounting: live, peak, budget.

use parking_lot::Mutex;

use crate::{Device, Error, Result};

/// Live and peak bytes of one device against its budget. Reservations are
/// taken before the driver is asked, so a budget overrun fails with
/// [`Error::BudgetExceeded`] and never reaches the driver.
#[derive(Debug)]
pub(crate) struct Ledger {
    device: Device,
    state: Mutex<LedgerState>,
}

#[derive(Debug, Clone, Copy)]
struct LedgerState {
    budget: u64,
    live: u64,
    peak: u64,
}

impl Ledger {
    pub(crate) fn new(device: Device, budget: u64) -> Self {
        Ledger {
            device,
            state: Mutex::new(LedgerState {
                budget,
                live: 0,
                peak: 0,
            }),
        }
    }

    /// Reserves `bytes`, or fails without changing anything.
    pub(crate) fn reserve(&self, bytes: u64) -> Result<()> {
        let mut s = self.state.lock();
        match s.live.checked_add(bytes) {
            Some(total) if total <= s.budget => {
                s.live = total;
                s.peak = s.peak.max(total);
                Ok(())
            }
            _ => Err(Error::BudgetExceeded {
                device: self.device,
                requested: bytes,
                live: s.live,
                budget: s.budget,
            }),
        }
    }

    /// Returns `bytes` taken by [`Ledger::reserve`].
    pub(crate) fn release(&self, bytes: u64) {
        let mut s = self.state.lock();
        debug_assert!(s.live >= bytes, "released more than reserved");
        s.live = s.live.saturating_sub(bytes);
    }

    pub(crate) fn live(&self) -> u64 {
        self.state.lock().live
    }

    pub(crate) fn peak(&self) -> u64 {
        self.state.lock().peak
    }

    pub(crate) fn budget(&self) -> u64 {
        self.state.lock().budget
    }

    pub(crate) fn set_budget(&self, budget: u64) {
        self.state.lock().budget = budget;
    }

    /// Starts a new peak measurement from what is live now.
    pub(crate) fn reset_peak(&self) {
        let mut s = self.state.lock();
        s.peak = s.live;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reserve_release_and_peak() {
        let l = Ledger::new(Device::Gpu(0), 100);
        l.reserve(60).unwrap();
        l.reserve(40).unwrap();
        let err = l.reserve(1).unwrap_err();
        assert!(
            matches!(
                err,
                Error::BudgetExceeded {
                    requested: 1,
                    live: 100,
                    budget: 100,
                    ..
                }
            ),
            "{err}"
        );
        l.release(60);
        assert_eq!((l.live(), l.peak()), (40, 100));
        l.reset_peak();
        assert_eq!(l.peak(), 40);
        assert!(l.reserve(u64::MAX).is_err(), "overflow must not wrap");
        l.release(40);
        assert_eq!(l.live(), 0);
    }
}
