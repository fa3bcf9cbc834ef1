//! Time as a port: the live server reads the system clock, replay drives a virtual one.
//!
//! Timestamps are microseconds since the Unix epoch (live) or since the start of a trace (replay).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

/// Microseconds on some clock's timeline.
pub type Micros = u64;

/// A source of the current time.
pub trait Clock: Send + Sync + std::fmt::Debug {
    /// The current time in microseconds.
    fn now_us(&self) -> Micros;
}

/// Wall-clock time.
#[derive(Debug, Default, Clone, Copy)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now_us(&self) -> Micros {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_micros() as u64)
            .unwrap_or(0)
    }
}

/// A clock that only moves when its owner moves it. Never goes backwards.
#[derive(Debug, Default)]
pub struct VirtualClock {
    now: AtomicU64,
}

impl VirtualClock {
    pub fn new(start_us: Micros) -> Self {
        Self {
            now: AtomicU64::new(start_us),
        }
    }

    /// Moves the clock to `t`, or leaves it where it is if `t` is in the past.
    pub fn set(&self, t: Micros) {
        self.now.fetch_max(t, Ordering::AcqRel);
    }

    /// Moves the clock forward by `d`.
    pub fn advance(&self, d: Micros) {
        self.now.fetch_add(d, Ordering::AcqRel);
    }
}

impl Clock for VirtualClock {
    fn now_us(&self) -> Micros {
        self.now.load(Ordering::Acquire)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn virtual_clock_moves_only_forward() {
        let c = VirtualClock::new(10);
        c.advance(5);
        assert_eq!(c.now_us(), 15);
        c.set(12);
        assert_eq!(c.now_us(), 15);
        c.set(100);
        assert_eq!(c.now_us(), 100);
    }

    #[test]
    fn system_clock_is_after_2020() {
        assert!(SystemClock.now_us() > 1_577_836_800_000_000);
    }
}
