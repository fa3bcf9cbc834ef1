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

/// The proleptic Gregorian date `(year, month, day)` of `days` since 1970-01-01 (Howard
/// Hinnant's `civil_from_days`): what timestamps written as text (RFC 3339, SigV4 dates, hour
/// buckets) are made of.
pub fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (yoe + era * 400 + i64::from(month <= 2), month, day)
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
    fn civil_dates_of_known_days() {
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(civil_from_days(-1), (1969, 12, 31));
        assert_eq!(civil_from_days(11_016), (2000, 2, 29));
        assert_eq!(civil_from_days(11_017), (2000, 3, 1));
        assert_eq!(civil_from_days(19_677), (2023, 11, 16));
    }

    #[test]
    fn system_clock_is_after_2020() {
        assert!(SystemClock.now_us() > 1_577_836_800_000_000);
    }
}
