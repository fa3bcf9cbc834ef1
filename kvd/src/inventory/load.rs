//! [`LoadMeter`]: how fast the daemon serves hits from each tier, from its recent `get` and
//! `batch_get` requests.
//!
//! A request is one sample of the slowest tier that answered any of its keys (L4 over L3 over
//! L2): that tier's bytes over the request's time, from its dispatch to its reply written on
//! the socket. So an L2 sample is a request answered from RAM alone (for an arena client the
//! reply carries offsets: the engine's copy out of the shared mapping is not timed), and an L3
//! or L4 sample includes the read, the check and the send of the blocks it counts. The last
//! [`SAMPLES`] samples per tier are kept; a tier's load is their median rate and their mean
//! block size.

use super::TIERS;
use infera_core::event::Tier;
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

/// Samples kept per tier.
pub const SAMPLES: usize = 256;

/// One tier's recent speed.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TierLoad {
    /// The median of the recent samples' rates.
    pub bytes_per_s: f64,
    /// The mean size of the blocks they served.
    pub block_bytes: u64,
}

#[derive(Debug, Clone, Copy, Default)]
struct Sample {
    bytes_per_s: f64,
    bytes: u64,
    blocks: u64,
}

#[derive(Debug)]
struct Ring {
    samples: Box<[Sample; SAMPLES]>,
    len: usize,
    next: usize,
}

impl Default for Ring {
    fn default() -> Self {
        Self {
            samples: Box::new([Sample::default(); SAMPLES]),
            len: 0,
            next: 0,
        }
    }
}

/// Bytes served per tier by one request (see [`LoadMeter::record`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Served {
    /// Bytes per tier, indexed as [`TIERS`].
    pub bytes: [u64; 3],
    /// Blocks per tier, indexed as [`TIERS`].
    pub blocks: [u64; 3],
}

impl Served {
    /// Counts one block of `bytes` served from `tier` (tiers a kvd does not hold are ignored).
    pub fn add(&mut self, tier: Tier, bytes: u64) {
        if let Some(i) = super::tier_slot(tier) {
            self.bytes[i] += bytes;
            self.blocks[i] += 1;
        }
    }

    /// The slowest tier that served a block, with its bytes and blocks.
    pub fn slowest(&self) -> Option<(Tier, u64, u64)> {
        (0..TIERS.len())
            .rev()
            .find(|&i| self.blocks[i] > 0)
            .map(|i| (TIERS[i], self.bytes[i], self.blocks[i]))
    }
}

/// See the module docs.
#[derive(Debug, Default)]
pub struct LoadMeter {
    tiers: [Mutex<Ring>; 3],
}

impl LoadMeter {
    fn ring(&self, i: usize) -> MutexGuard<'_, Ring> {
        self.tiers[i].lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Notes a request that served `served` in `elapsed` (nothing for a request with no hit).
    pub fn record(&self, served: &Served, elapsed: Duration) {
        let Some((tier, bytes, blocks)) = served.slowest() else {
            return;
        };
        let Some(i) = super::tier_slot(tier) else {
            return;
        };
        let secs = elapsed.as_secs_f64().max(1e-9);
        let sample = Sample {
            bytes_per_s: bytes as f64 / secs,
            bytes,
            blocks,
        };
        let mut ring = self.ring(i);
        let at = ring.next;
        ring.samples[at] = sample;
        ring.next = (at + 1) % SAMPLES;
        ring.len = (ring.len + 1).min(SAMPLES);
    }

    /// `tier`'s load over its recent samples; `None` before its first.
    pub fn load(&self, tier: Tier) -> Option<TierLoad> {
        let i = super::tier_slot(tier)?;
        let (mut rates, bytes, blocks) = {
            let ring = self.ring(i);
            let kept = &ring.samples[..ring.len];
            let rates: Vec<f64> = kept.iter().map(|s| s.bytes_per_s).collect();
            let bytes: u64 = kept.iter().map(|s| s.bytes).sum();
            let blocks: u64 = kept.iter().map(|s| s.blocks).sum();
            (rates, bytes, blocks)
        };
        if rates.is_empty() {
            return None;
        }
        let mid = rates.len() / 2;
        let (_, median, _) = rates.select_nth_unstable_by(mid, f64::total_cmp);
        Some(TierLoad {
            bytes_per_s: *median,
            block_bytes: bytes / blocks.max(1),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= b.abs() * 1e-9
    }

    #[test]
    fn a_request_counts_for_its_slowest_tier_and_the_median_rules() {
        let meter = LoadMeter::default();
        assert_eq!(meter.load(Tier::Host), None);
        for ms in [1, 2, 1000] {
            let mut served = Served::default();
            served.add(Tier::Host, 1_000_000);
            meter.record(&served, Duration::from_millis(ms));
        }
        let host = meter.load(Tier::Host).unwrap_or_else(|| panic!("samples"));
        assert!(close(host.bytes_per_s, 500e6), "the median, not the mean");
        assert_eq!(host.block_bytes, 1_000_000);
        let mut mixed = Served::default();
        mixed.add(Tier::Host, 4096);
        mixed.add(Tier::Disk, 100);
        mixed.add(Tier::Disk, 300);
        meter.record(&mixed, Duration::from_millis(1));
        let disk = meter
            .load(Tier::Disk)
            .unwrap_or_else(|| panic!("a disk sample"));
        assert!(close(disk.bytes_per_s, 400e3));
        assert_eq!(disk.block_bytes, 200);
        assert_eq!(meter.load(Tier::External), None);
        meter.record(&Served::default(), Duration::from_millis(1));
        assert_eq!(meter.load(Tier::External), None, "a miss is no sample");
    }

    #[test]
    fn only_the_last_samples_count() {
        let meter = LoadMeter::default();
        let mut served = Served::default();
        served.add(Tier::External, 1000);
        for _ in 0..SAMPLES {
            meter.record(&served, Duration::from_secs(1));
        }
        for _ in 0..SAMPLES / 2 + 1 {
            meter.record(&served, Duration::from_millis(1));
        }
        let l4 = meter
            .load(Tier::External)
            .unwrap_or_else(|| panic!("samples"));
        assert!(close(l4.bytes_per_s, 1e6));
    }
}
