//! Session affinity: how a conversation the client named (`x-session-id`, or the body's
//! `prompt_cache_key` or `session_id`) keeps to the rank its last request went to.
//!
//! The fleet pins each session to its last ranks, fleet-wide and per role
//! ([`FleetState::session_pin`]). A pin is live for [`SessionAffinity::ttl_s`] after the
//! session's last request, and only on a candidate: a worker that left, drains, failed this
//! request, or is out by its breaker or health checks is not one, so the session moves. Then:
//! - `tie-break` (the default): the policy decides; among candidates of equal cost the session's
//!   wins (before the lower load and the seeded draw). KV-aware routing already keeps a
//!   conversation where its prefix is cached; the pin decides where the cost cannot, such as a
//!   fleet whose engines publish no KV events. `round-robin` has no ties: it ignores sessions.
//! - `override`: the session's rank, unless it is saturated (its prompt tokens not yet
//!   prefilled reach [`SessionAffinity::saturation`] prefill budgets, the router queue's line);
//!   the policy decides otherwise.
//! - `off`: sessions are ignored.

use crate::clock::Micros;
use crate::event::Role;
use crate::fleet::{Candidate, FleetState};
use crate::ids::SessionKey;
use serde::{Deserialize, Serialize};

/// `--router-session-affinity`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum AffinityMode {
    #[default]
    TieBreak,
    Override,
    Off,
}

impl AffinityMode {
    pub const ALL: [AffinityMode; 3] = [Self::TieBreak, Self::Override, Self::Off];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::TieBreak => "tie-break",
            Self::Override => "override",
            Self::Off => "off",
        }
    }
}

impl std::fmt::Display for AffinityMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for AffinityMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|m| m.as_str() == s)
            .ok_or_else(|| format!("unknown session affinity {s:?}: tie-break, override or off"))
    }
}

/// How sessions are kept (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SessionAffinity {
    /// `--router-session-affinity`.
    pub mode: AffinityMode,
    /// `--router-session-ttl`, in seconds: how long after its last request a session stays
    /// pinned.
    pub ttl_s: u64,
    /// Prefill budgets of unprefilled prompt tokens at which `override` lets a session move:
    /// `--router-queue-threshold`.
    pub saturation: f64,
}

impl Default for SessionAffinity {
    /// `tie-break`, 10 minutes (the longest an engine's prefix cache usually outlives a pause),
    /// four prefill budgets.
    fn default() -> Self {
        Self {
            mode: AffinityMode::TieBreak,
            ttl_s: 600,
            saturation: 4.0,
        }
    }
}

/// What a session's pin means for one leg's decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Pinned {
    /// No live pin on a candidate (or sessions are off).
    None,
    /// The policy decides; this candidate wins its ties.
    TieBreak(usize),
    /// This candidate, without asking the policy.
    Take(usize),
}

impl SessionAffinity {
    /// The pin of `session`'s `role` leg among `cands` at `now_us`.
    pub(super) fn pinned(
        &self,
        fleet: &FleetState,
        session: Option<SessionKey>,
        role: Role,
        cands: &[Candidate],
        now_us: Micros,
    ) -> Pinned {
        if self.mode == AffinityMode::Off {
            return Pinned::None;
        }
        let ttl_us = self.ttl_s.saturating_mul(1_000_000);
        let Some(slot) = session.and_then(|s| fleet.session_pin(s, role, now_us, ttl_us)) else {
            return Pinned::None;
        };
        let Some(i) = cands.iter().position(|c| c.slot == slot) else {
            return Pinned::None;
        };
        match self.mode {
            AffinityMode::Override if !fleet.saturated(&cands[i], self.saturation) => {
                Pinned::Take(i)
            }
            _ => Pinned::TieBreak(i),
        }
    }
}
