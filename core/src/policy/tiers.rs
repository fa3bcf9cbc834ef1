//! What a prefix hit in a lower tier (a node kvd's host RAM or NVMe, the shared remote store)
//! is worth against a GPU hit of the same blocks.
//!
//! A block in a lower tier still has to be loaded into the engine; it saves the block's prefill
//! only in so far as loading it is faster than computing it. With the tier's measured speed
//! (`TierLoadMeasured`: the median of the kvd's recent loads and their block size) and the
//! candidate's prefill speed (its registration's `prefill_tokens_per_s`), one block is credited
//!
//! ```text
//! credit(tier) = max(0, 1 − load_time / prefill_time)
//! load_time    = block_bytes / bytes_per_s
//! prefill_time = block_size / prefill_tokens_per_s
//! ```
//!
//! of a GPU hit: between 0 (loading is no faster than recomputing) and 1 (free), so a tier hit
//! never outweighs a GPU hit of the same length. Until a tier's speed is measured its credit
//! is a prior: NVIDIA Dynamo's fixed weights (host 0.75, disk 0.25) and 0.1 for the remote
//! store. `--router-host-cache-hit-weight`, `--router-disk-cache-hit-weight` and
//! `--router-remote-cache-hit-weight` fix a tier's credit instead.

use crate::event::Tier;
use crate::fleet::TierLoad;
use serde::{Deserialize, Serialize};

/// A tier's credit before its speed is measured.
pub fn prior(tier: Tier) -> f64 {
    match tier {
        Tier::Gpu => 1.0,
        Tier::Host => 0.75,
        Tier::Disk => 0.25,
        Tier::External => 0.1,
    }
}

/// Fixed credits per lower tier (`None`: measured).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct TierWeights {
    pub host: Option<f64>,
    pub disk: Option<f64>,
    pub external: Option<f64>,
}

impl TierWeights {
    fn fixed(&self, tier: Tier) -> Option<f64> {
        match tier {
            Tier::Gpu => Some(1.0),
            Tier::Host => self.host,
            Tier::Disk => self.disk,
            Tier::External => self.external,
        }
    }

    /// The credit of one block found in `tier` (see the module docs), in `[0, 1]`.
    pub fn credit(
        &self,
        tier: Tier,
        load: Option<TierLoad>,
        block_size: u32,
        prefill_tokens_per_s: f64,
    ) -> f64 {
        let credit = match (self.fixed(tier), load) {
            (Some(fixed), _) => fixed,
            (None, Some(load)) => measured_credit(load, block_size, prefill_tokens_per_s),
            (None, None) => prior(tier),
        };
        if credit.is_nan() {
            return 0.0;
        }
        credit.clamp(0.0, 1.0)
    }
}

/// `max(0, 1 − load_time / prefill_time)` for one block (see the module docs); 0 when either
/// speed is unknown or zero.
pub fn measured_credit(load: TierLoad, block_size: u32, prefill_tokens_per_s: f64) -> f64 {
    if !(load.bytes_per_s > 0.0 && prefill_tokens_per_s > 0.0) || block_size == 0 {
        return 0.0;
    }
    let load_s = load.block_bytes as f64 / load.bytes_per_s;
    let prefill_s = f64::from(block_size) / prefill_tokens_per_s;
    (1.0 - load_s / prefill_s).clamp(0.0, 1.0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn load(bytes_per_s: f64, block_bytes: u64) -> TierLoad {
        TierLoad {
            bytes_per_s,
            block_bytes,
        }
    }

    #[test]
    fn a_tier_as_fast_as_prefill_earns_nothing_and_a_free_one_all() {
        // 16 tokens at 16k tokens/s: 1 ms per block; 2 MB at 2 GB/s: 1 ms per block.
        assert_eq!(measured_credit(load(2e9, 2_000_000), 16, 16_000.0), 0.0);
        assert!((measured_credit(load(20e9, 2_000_000), 16, 16_000.0) - 0.9).abs() < 1e-9);
        assert_eq!(measured_credit(load(0.0, 2_000_000), 16, 16_000.0), 0.0);
        let w = TierWeights::default();
        assert_eq!(w.credit(Tier::Host, None, 16, 16_000.0), 0.75);
        assert_eq!(w.credit(Tier::Disk, None, 16, 16_000.0), 0.25);
        let fixed = TierWeights {
            host: Some(0.5),
            ..TierWeights::default()
        };
        let fast = Some(load(1e12, 0));
        assert_eq!(fixed.credit(Tier::Host, fast, 16, 16_000.0), 0.5);
        assert_eq!(fixed.credit(Tier::Disk, fast, 16, 16_000.0), 1.0);
    }

    proptest! {
        #[test]
        fn a_tier_hit_never_outweighs_a_gpu_hit(
            bps in 0.0f64..1e13, bytes in 0u64..1 << 30, bs in 0u32..1024,
            rate in 0.0f64..1e7, tier in 0usize..4, fixed in proptest::option::of(-2.0f64..3.0),
        ) {
            let w = TierWeights { host: fixed, disk: fixed, external: fixed };
            let c = w.credit(Tier::ALL[tier], Some(load(bps, bytes)), bs, rate);
            prop_assert!((0.0..=1.0).contains(&c));
        }

        #[test]
        fn a_tier_slower_than_recompute_earns_nothing(
            bytes in 1u64..1 << 30, bs in 1u32..1024, rate in 1.0f64..1e7, slower in 1.0f64..100.0,
        ) {
            // The speed at which loading a block takes `slower` times its prefill.
            let prefill_s = f64::from(bs) / rate;
            let bps = bytes as f64 / (prefill_s * slower);
            prop_assert_eq!(measured_credit(load(bps, bytes), bs, rate), 0.0);
        }

        #[test]
        fn a_faster_tier_earns_at_least_as_much(
            bps in 1.0f64..1e12, more in 1.0f64..100.0, bytes in 1u64..1 << 24,
            bs in 1u32..1024, rate in 1.0f64..1e6,
        ) {
            let slow = measured_credit(load(bps, bytes), bs, rate);
            let fast = measured_credit(load(bps * more, bytes), bs, rate);
            prop_assert!(fast >= slow);
        }
    }
}
