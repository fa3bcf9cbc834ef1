//! `--auto-tune apply`: which of the shadow replay's recommendations the router adopts, and when
//! it takes one back.
//!
//! - **Adopt** the recommended candidate ([`super::Assessment::recommended`], a neighbour of the
//!   current tunables, so the router moves one step at a time) when its predicted gain is at
//!   least [`MIN_GAIN`] and beyond the window's noise (its resampled 5th percentile is above 0),
//!   the window says what the fleet realised, and it was not rolled back in the last
//!   [`HOLD_WINDOWS`] windows.
//! - **Probation.** The replay's bias is its predicted minus the realised hit rate under the old
//!   tunables, on the window that decided. The next window (traffic routed under the new
//!   tunables only: the caller clears the window on every change) is judged by what the old
//!   tunables would have realised there: the replay's prediction for them (they are a neighbour
//!   of the new ones) less that bias. When the new tunables realised less than half of the gain
//!   the replay predicts over them, by more than the noise (at least [`MIN_MARGIN`]), the gain
//!   did not materialise and the old tunables come back (**rollback**).
//!
//! [`Tuner`] is a pure state machine over assessments; the server commits each [`Change`] as a
//! `RouterRetuned` event and logs it.

use super::Assessment;
use infera_core::event::Tunables;

/// The smallest predicted gain (a fraction of the prompt tokens) worth a change.
pub const MIN_GAIN: f64 = 0.005;
/// The least over-prediction beyond the bias that rolls a change back.
pub const MIN_MARGIN: f64 = 0.01;
/// Windows for which a rolled-back setting is not adopted again.
pub const HOLD_WINDOWS: u32 = 3;

/// Why the tunables change.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Reason {
    Adopt,
    Rollback,
}

impl Reason {
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::Adopt => "adopt",
            Reason::Rollback => "rollback",
        }
    }
}

/// One change of the router's tunables.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Change {
    pub from: Tunables,
    pub to: Tunables,
    pub reason: Reason,
    /// The replay's hit rate for `to` over the deciding window.
    pub predicted_hit_rate: f64,
    /// What the fleet realised over that window, under `from`.
    pub realised_hit_rate: f64,
}

/// A change waiting for its first window.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Probation {
    from: Tunables,
    to: Tunables,
    /// Predicted minus realised under `from`, when it was decided.
    bias: f64,
}

/// See the module docs.
#[derive(Debug, Default)]
pub struct Tuner {
    probation: Option<Probation>,
    /// Rolled-back settings and the windows left before they may be adopted again.
    held: Vec<(Tunables, u32)>,
}

impl Tuner {
    /// The change `a` calls for, if any. Call once per assessment, in order.
    pub fn decide(&mut self, a: &Assessment) -> Option<Change> {
        self.held.retain_mut(|(_, left)| {
            *left = left.saturating_sub(1);
            *left > 0
        });
        let current = a.current();
        let realised = a.realised.hit_rate?;
        if let Some(p) = self.probation.take()
            && current.tunables == p.to
            && let Some(old) = a.candidates.iter().find(|c| c.tunables == p.from)
        {
            let would_have = old.hit_rate - p.bias;
            let materialised = realised - would_have;
            let predicted = current.hit_rate - old.hit_rate;
            let margin = a.fidelity_noise.unwrap_or(0.0).max(MIN_MARGIN);
            if materialised < predicted / 2.0 - margin {
                self.held.push((p.to, HOLD_WINDOWS));
                return Some(Change {
                    from: p.to,
                    to: p.from,
                    reason: Reason::Rollback,
                    predicted_hit_rate: old.hit_rate,
                    realised_hit_rate: realised,
                });
            }
        }
        let best = a.recommendation();
        let held = self.held.iter().any(|(t, _)| *t == best.tunables);
        if a.recommended == 0 || best.gain < MIN_GAIN || best.gain_p5 <= 0.0 || held {
            return None;
        }
        self.probation = Some(Probation {
            from: current.tunables,
            to: best.tunables,
            bias: current.hit_rate - realised,
        });
        Some(Change {
            from: current.tunables,
            to: best.tunables,
            reason: Reason::Adopt,
            predicted_hit_rate: best.hit_rate,
            realised_hit_rate: realised,
        })
    }
}
