//! The engine loop's step clock: sleeps until a step's modelled end with microsecond precision.
//!
//! tokio's timer wheel ticks in whole milliseconds and rounds every deadline up to the next
//! tick, and its driver then parks for a whole number of milliseconds: a sleep until `t` wakes
//! anywhere in `[t, t + 2 ms)`, about 1 ms late on average. The engine loop already times each
//! step from the previous step's modelled end, so the lateness does not add up over many
//! steps, but every step's results (a request's first token among them) are still published
//! that late. At `--speedup 5` a cached prefill step takes 3.3 ms, so a millisecond of timer is
//! a third of it.
//!
//! On Linux, [`StepClock`] arms one `timerfd` (`CLOCK_MONOTONIC`, the clock behind
//! [`Instant`]) per engine loop and waits for it through the tokio reactor, so the loop wakes
//! within the kernel's timer slack (50 µs by default) of the deadline without blocking a runtime
//! thread. Elsewhere, or if the timerfd cannot be created or armed (logged once, loudly), it
//! falls back to tokio's sleep; `infera_mock_step_lateness_seconds` shows which one is running
//! (0.1–0.3 ms mean lateness with the timerfd in the fidelity bench, on a loaded 2-core VM). The
//! one `unsafe` block registers the timerfd with the reactor (`AsyncFd::register_with_interest`;
//! tokio deprecated its safe constructor).
//!
//! # Invariants
//! - [`StepClock::sleep_until`] never returns before its deadline by the monotonic clock.
//! - It is cancel-safe: a sleep dropped half-way (the loop's cancellation) leaves at most an
//!   armed timer or a pending expiry, both cleared by the next `sleep_until`.

use std::time::Instant;

/// A precise sleep for one engine loop (see the module docs).
#[derive(Debug)]
pub(crate) struct StepClock {
    #[cfg(target_os = "linux")]
    timer: Option<tokio::io::unix::AsyncFd<std::os::fd::OwnedFd>>,
}

impl StepClock {
    /// A clock on a fresh timerfd (Linux), else on tokio's timer. Must be called inside a tokio
    /// runtime with I/O enabled.
    pub(crate) fn new() -> Self {
        #[cfg(target_os = "linux")]
        {
            let timer = match linux::create() {
                Ok(timer) => Some(timer),
                Err(e) => {
                    tracing::warn!(
                        error = %e,
                        "mock engine cannot create a timerfd; steps are timed by tokio's \
                         millisecond timer and end up to 2 ms late"
                    );
                    None
                }
            };
            Self { timer }
        }
        #[cfg(not(target_os = "linux"))]
        Self {}
    }

    /// Whether steps are timed by the precise timer (false: tokio's millisecond timer).
    #[cfg(all(test, target_os = "linux"))]
    pub(crate) fn is_precise(&self) -> bool {
        self.timer.is_some()
    }

    /// Returns at `deadline` (at once if it has passed).
    pub(crate) async fn sleep_until(&mut self, deadline: Instant) {
        let now = Instant::now();
        if deadline <= now {
            return;
        }
        #[cfg(target_os = "linux")]
        if let Some(timer) = &self.timer {
            match linux::wait(timer, deadline - now).await {
                Ok(()) => return,
                Err(e) => {
                    tracing::error!(
                        error = %e,
                        "mock engine timerfd failed; steps are timed by tokio's millisecond \
                         timer from now on and end up to 2 ms late"
                    );
                    self.timer = None;
                }
            }
        }
        tokio::time::sleep_until(deadline.into()).await;
    }
}

#[cfg(target_os = "linux")]
mod linux {
    use rustix::time::{
        Itimerspec, TimerfdClockId, TimerfdFlags, TimerfdTimerFlags, Timespec, timerfd_create,
        timerfd_settime,
    };
    use std::io;
    use std::os::fd::OwnedFd;
    use std::time::Duration;
    use tokio::io::Interest;
    use tokio::io::unix::AsyncFd;

    pub(super) fn create() -> io::Result<AsyncFd<OwnedFd>> {
        let fd = timerfd_create(
            TimerfdClockId::Monotonic,
            TimerfdFlags::NONBLOCK | TimerfdFlags::CLOEXEC,
        )?;
        // SAFETY: the `OwnedFd` is moved into the `AsyncFd`, so the descriptor stays open and
        // names the same timerfd until the `AsyncFd` is dropped, which closes it.
        #[allow(unsafe_code)]
        let timer = unsafe { AsyncFd::register_with_interest(fd, Interest::READABLE) };
        timer.map_err(|e| e.into_parts().1)
    }

    /// Arms the timer `after` from now (which also clears any expiry left unread) and waits
    /// for it to fire.
    pub(super) async fn wait(timer: &AsyncFd<OwnedFd>, after: Duration) -> io::Result<()> {
        let value = Timespec {
            tv_sec: after.as_secs().try_into().unwrap_or(i64::MAX),
            // At least 1 ns: an all-zero value would disarm the timer instead.
            tv_nsec: i64::from(after.subsec_nanos().max(u32::from(after.as_secs() == 0))),
        };
        let spec = Itimerspec {
            it_interval: Timespec {
                tv_sec: 0,
                tv_nsec: 0,
            },
            it_value: value,
        };
        timerfd_settime(timer.get_ref(), TimerfdTimerFlags::empty(), &spec)?;
        loop {
            let mut ready = timer.readable().await?;
            let mut expirations = [0u8; 8];
            // A stale readiness (an expiry cleared by the re-arm) reads EAGAIN: wait again.
            match ready.try_io(|fd| Ok(rustix::io::read(fd.get_ref(), &mut expirations)?)) {
                Ok(Ok(_)) => return Ok(()),
                Ok(Err(e)) => return Err(e),
                Err(_would_block) => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn never_wakes_before_the_deadline() {
        let mut clock = StepClock::new();
        #[cfg(target_os = "linux")]
        assert!(clock.is_precise());
        for us in [0, 1, 150, 700, 1_300] {
            let deadline = Instant::now() + Duration::from_micros(us);
            clock.sleep_until(deadline).await;
            assert!(Instant::now() >= deadline, "woke before a {us} µs deadline");
        }
    }

    /// The loop's cancellation drops a sleep half-way: its timer then fires with nobody reading
    /// it, leaving an expiry in the timerfd and a readiness cached by the reactor. Neither may
    /// end the next sleep early.
    #[cfg(target_os = "linux")]
    #[tokio::test]
    async fn a_sleep_dropped_half_way_does_not_cut_the_next_one_short() {
        let mut clock = StepClock::new();
        {
            let sleep = clock.sleep_until(Instant::now() + Duration::from_millis(20));
            tokio::pin!(sleep);
            assert!(futures::poll!(sleep.as_mut()).is_pending(), "timer armed");
        }
        // Wait for the abandoned timer to fire, reading nothing and keeping the readiness.
        let timer = clock.timer.as_ref().expect("a timerfd");
        drop(timer.readable().await.expect("timerfd readable"));
        let next = Instant::now() + Duration::from_millis(3);
        clock.sleep_until(next).await;
        assert!(Instant::now() >= next, "woke on the stale expiry");
    }

    /// Off the precise timer (no timerfd), the fallback keeps the same promise.
    #[tokio::test]
    async fn the_fallback_never_wakes_before_the_deadline() {
        let mut clock = StepClock {
            #[cfg(target_os = "linux")]
            timer: None,
        };
        for us in [0, 1, 700, 2_300] {
            let deadline = Instant::now() + Duration::from_micros(us);
            clock.sleep_until(deadline).await;
            assert!(Instant::now() >= deadline, "woke before a {us} µs deadline");
        }
    }
}
