//! How long one engine step takes.
//!
//! A step's duration in milliseconds is the sum of the parts that ran in it, divided by the
//! engine's `speedup`:
//!
//! ```text
//! prefill_ms(t) = prefill_a·t² + prefill_b·t + prefill_c      t = uncached prompt tokens computed
//!                   (defaults 4.21e-7, 0.01518, 16.5)           in this step, over all sequences
//! decode_ms(u)  = decode_a·u² + decode_b·u + decode_c          u = KV-cache utilisation in [0, 1]
//!                   (defaults −25.74, 54.01, 5.74)              (referenced blocks / gpu_blocks)
//! load_ms(n)    = load_ms_per_block·n                          n = blocks loaded from lower tiers
//!                   (default 0.02)
//! step_ms       = [t > 0]·prefill_ms(t) + [any decode]·decode_ms(u) + load_ms(n)
//! ```
//!
//! Each part is clamped at 0 so that a user-supplied curve can never make time run backwards.

use super::EngineConfigError;
use serde::{Deserialize, Serialize};

/// Coefficients of the step-time curves (see the module docs for the formulas).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TimingModel {
    pub prefill_a: f64,
    pub prefill_b: f64,
    pub prefill_c: f64,
    pub decode_a: f64,
    pub decode_b: f64,
    pub decode_c: f64,
    /// Cost of loading one block from a lower tier (host RAM, NVMe, remote) into the GPU.
    pub load_ms_per_block: f64,
}

impl Default for TimingModel {
    fn default() -> Self {
        Self {
            prefill_a: 4.21e-7,
            prefill_b: 0.01518,
            prefill_c: 16.5,
            decode_a: -25.74,
            decode_b: 54.01,
            decode_c: 5.74,
            load_ms_per_block: 0.02,
        }
    }
}

impl TimingModel {
    /// Milliseconds to prefill `new_tokens` uncached prompt tokens in one step.
    pub fn prefill_ms(&self, new_tokens: u64) -> f64 {
        let t = new_tokens as f64;
        (self.prefill_a * t * t + self.prefill_b * t + self.prefill_c).max(0.0)
    }

    /// Milliseconds of one decode iteration at KV-cache `utilisation` (clamped to `[0, 1]`).
    pub fn decode_ms(&self, utilisation: f64) -> f64 {
        let u = if utilisation.is_nan() {
            0.0
        } else {
            utilisation.clamp(0.0, 1.0)
        };
        (self.decode_a * u * u + self.decode_b * u + self.decode_c).max(0.0)
    }

    /// Milliseconds to load `blocks` blocks from lower tiers.
    pub fn load_ms(&self, blocks: u64) -> f64 {
        (self.load_ms_per_block * blocks as f64).max(0.0)
    }

    /// Milliseconds of one whole step (before `speedup`).
    pub fn step_ms(&self, prefill_tokens: u64, decodes: u64, utilisation: f64, loaded: u64) -> f64 {
        let mut ms = self.load_ms(loaded);
        if prefill_tokens > 0 {
            ms += self.prefill_ms(prefill_tokens);
        }
        if decodes > 0 {
            ms += self.decode_ms(utilisation);
        }
        ms
    }

    pub(super) fn validate(&self) -> Result<(), EngineConfigError> {
        let coefficients = [
            ("timing.prefill_a", self.prefill_a),
            ("timing.prefill_b", self.prefill_b),
            ("timing.prefill_c", self.prefill_c),
            ("timing.decode_a", self.decode_a),
            ("timing.decode_b", self.decode_b),
            ("timing.decode_c", self.decode_c),
            ("timing.load_ms_per_block", self.load_ms_per_block),
        ];
        for (field, v) in coefficients {
            if !v.is_finite() {
                return Err(EngineConfigError::Invalid {
                    field,
                    problem: format!("must be finite (got {v})"),
                });
            }
        }
        if self.load_ms_per_block < 0.0 {
            return Err(EngineConfigError::Invalid {
                field: "timing.load_ms_per_block",
                problem: format!("must not be negative (got {})", self.load_ms_per_block),
            });
        }
        Ok(())
    }
}

/// Converts milliseconds to whole microseconds after dividing by `speedup`.
pub(super) fn scaled_us(ms: f64, speedup: f64) -> u64 {
    let us = (ms * 1000.0 / speedup).round();
    if us.is_finite() && us > 0.0 {
        us as u64
    } else {
        0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-9
    }

    #[test]
    fn prefill_formula_at_a_few_points() {
        let t = TimingModel::default();
        assert!(close(t.prefill_ms(0), 16.5));
        assert!(close(t.prefill_ms(1000), 4.21e-7 * 1e6 + 15.18 + 16.5));
        // 8192 tokens: 28.2527... + 124.35456 + 16.5
        let want = 4.21e-7 * 8192.0 * 8192.0 + 0.01518 * 8192.0 + 16.5;
        assert!(close(t.prefill_ms(8192), want));
        assert!((t.prefill_ms(8192) - 169.107).abs() < 0.01);
    }

    #[test]
    fn decode_formula_at_a_few_points() {
        let t = TimingModel::default();
        assert!(close(t.decode_ms(0.0), 5.74));
        assert!(close(t.decode_ms(0.5), -25.74 * 0.25 + 27.005 + 5.74));
        assert!(close(t.decode_ms(1.0), 34.01));
        // Out-of-range utilisation is clamped.
        assert!(close(t.decode_ms(2.0), 34.01));
        assert!(close(t.decode_ms(-1.0), 5.74));
        assert!(close(t.decode_ms(f64::NAN), 5.74));
    }

    #[test]
    fn step_sums_the_parts_that_ran() {
        let t = TimingModel::default();
        assert!(close(t.step_ms(0, 0, 0.3, 0), 0.0));
        assert!(close(t.step_ms(100, 0, 0.3, 0), t.prefill_ms(100)));
        assert!(close(t.step_ms(0, 5, 0.3, 0), t.decode_ms(0.3)));
        assert!(close(
            t.step_ms(100, 5, 0.3, 10),
            t.prefill_ms(100) + t.decode_ms(0.3) + 0.2
        ));
    }

    #[test]
    fn speedup_divides_durations() {
        assert_eq!(scaled_us(16.5, 1.0), 16_500);
        assert_eq!(scaled_us(16.5, 2.0), 8_250);
        assert_eq!(scaled_us(-3.0, 1.0), 0);
    }

    #[test]
    fn non_finite_coefficients_are_rejected() {
        let t = TimingModel {
            decode_b: f64::INFINITY,
            ..TimingModel::default()
        };
        assert!(t.validate().is_err());
        let t = TimingModel {
            load_ms_per_block: -1.0,
            ..TimingModel::default()
        };
        assert!(t.validate().is_err());
        assert!(TimingModel::default().validate().is_ok());
    }
}
