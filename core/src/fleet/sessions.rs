//! Sessions: where each conversation the clients named went last.
//!
//! A request that names its session (`x-session-id`, or the body's `prompt_cache_key` or
//! `session_id`) carries its [`SessionKey`] in its `RequestRouted`; folding the event pins the
//! session to each leg's rank (its index slot), per role, at the decision's time. Every replica folds every
//! replica's events, so a session is pinned fleet-wide. A pin is live for the router's
//! `--router-session-ttl` after its last request ([`Sessions::pinned`]); the table keeps at most
//! [`MAX_SESSIONS`] pins, dropping the older half when full (the folded events decide which, so
//! every replica drops the same ones). Pins are soft state, like the tips: a snapshot does not
//! carry them, and a rebuilt state pins sessions again as their requests come. A slot freed by a
//! worker that left and taken by a new one keeps the old worker's pins: its sessions lost their
//! cache with the worker anyway.

use crate::clock::Micros;
use crate::event::Role;
use crate::ids::SessionKey;
use crate::index::WorkerSlot;
use rustc_hash::FxHashMap;

/// Pins kept at most (about 48 MiB).
pub const MAX_SESSIONS: usize = 1 << 20;

#[derive(Debug, Clone, PartialEq)]
struct Pin {
    slot: WorkerSlot,
    at_us: Micros,
}

/// The session table. See the module docs.
#[derive(Debug, Clone, Default)]
pub(crate) struct Sessions {
    pins: FxHashMap<(SessionKey, Role), Pin>,
}

impl Sessions {
    /// Pins `session`'s `role` leg to `slot` as of `at_us`.
    pub(crate) fn pin(&mut self, session: SessionKey, role: Role, slot: WorkerSlot, at_us: Micros) {
        if let Some(pin) = self.pins.get_mut(&(session, role)) {
            if at_us >= pin.at_us {
                *pin = Pin { slot, at_us };
            }
            return;
        }
        if self.pins.len() >= MAX_SESSIONS {
            self.drop_older_half();
        }
        self.pins.insert((session, role), Pin { slot, at_us });
    }

    /// The slot `session`'s `role` leg is pinned to, if its last request was at most `ttl_us`
    /// before `now_us`.
    pub(crate) fn pinned(
        &self,
        session: SessionKey,
        role: Role,
        now_us: Micros,
        ttl_us: Micros,
    ) -> Option<WorkerSlot> {
        self.pins
            .get(&(session, role))
            .filter(|p| now_us.saturating_sub(p.at_us) <= ttl_us)
            .map(|p| p.slot)
    }

    pub(crate) fn len(&self) -> usize {
        self.pins.len()
    }

    /// Keeps the newer half of the pins (ties broken by key, so that the outcome depends on the
    /// pins alone, not on the map's order).
    fn drop_older_half(&mut self) {
        let mut ages: Vec<(Micros, SessionKey, Role)> = self
            .pins
            .iter()
            .map(|((s, r), p)| (p.at_us, *s, *r))
            .collect();
        let half = ages.len() / 2;
        ages.select_nth_unstable_by(half, |a, b| {
            (a.0, a.1, a.2 as u8).cmp(&(b.0, b.1, b.2 as u8))
        });
        for (_, s, r) in &ages[..half] {
            self.pins.remove(&(*s, *r));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const W1: WorkerSlot = WorkerSlot(1);
    const W2: WorkerSlot = WorkerSlot(2);

    #[test]
    fn a_pin_follows_the_sessions_last_request_and_lapses_after_the_ttl() {
        let mut s = Sessions::default();
        let a = SessionKey::of("a");
        s.pin(a, Role::Mixed, W1, 1_000);
        assert_eq!(s.pinned(a, Role::Mixed, 1_000, 10), Some(W1));
        assert_eq!(s.pinned(a, Role::Prefill, 1_000, 10), None, "per role");
        assert_eq!(s.pinned(SessionKey::of("b"), Role::Mixed, 1_000, 10), None);
        s.pin(a, Role::Mixed, W2, 2_000);
        assert_eq!(s.pinned(a, Role::Mixed, 2_010, 10), Some(W2));
        assert_eq!(s.pinned(a, Role::Mixed, 2_011, 10), None, "past the ttl");
        // An older decision folded late changes nothing.
        s.pin(a, Role::Mixed, W1, 1_500);
        assert_eq!(s.pinned(a, Role::Mixed, 2_010, 10), Some(W2));
    }

    #[test]
    fn a_full_table_keeps_its_newest_pins() {
        let mut s = Sessions::default();
        for i in 0..MAX_SESSIONS as u64 {
            s.pin(SessionKey(i), Role::Mixed, W1, i);
        }
        assert_eq!(s.len(), MAX_SESSIONS);
        s.pin(SessionKey(u64::MAX), Role::Mixed, W1, u64::MAX);
        assert_eq!(s.len(), MAX_SESSIONS / 2 + 1);
        let newest = MAX_SESSIONS as u64 - 1;
        assert!(
            s.pinned(SessionKey(newest), Role::Mixed, newest, 0)
                .is_some()
        );
        assert!(s.pinned(SessionKey(0), Role::Mixed, 0, u64::MAX).is_none());
        assert!(
            s.pinned(SessionKey(u64::MAX), Role::Mixed, u64::MAX, 0)
                .is_some()
        );
    }
}
