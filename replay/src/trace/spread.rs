//! Spreading bucketed timestamps: Mooncake traces log arrivals in ~3 s buckets, so a replay that
//! took them literally would release every request of a bucket in the same microsecond.
//!
//! [`spread_buckets`] takes non-decreasing arrivals and moves each group of two or more equal
//! timestamps to `t + offset`, where the offsets are drawn uniformly in `[0, width)` microseconds
//! from a SplitMix64 stream seeded with `seed` ([`infera_core::rng::Rng`]), sorted, and assigned in
//! file order. `width` is the gap to the next distinct timestamp; the last bucket, which has no
//! next timestamp, uses the median gap between consecutive distinct timestamps. Singletons stay
//! where they are. Invariants: the result is still non-decreasing, file order is kept, every
//! arrival stays in `[t, t + width)` of its bucket, and the same input and seed always give the
//! same output.

use infera_core::rng::Rng;

/// What [`spread_buckets`] did, for the trace's notes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BucketSpread {
    /// Distinct timestamps in the input.
    pub distinct_timestamps: usize,
    /// Timestamps shared by two or more requests (the buckets that were spread).
    pub buckets: usize,
    /// Requests that were moved (all members of those buckets).
    pub requests: usize,
    /// Median gap between consecutive distinct timestamps, in microseconds (the last bucket's width).
    pub median_gap_us: u64,
    pub seed: u64,
}

impl BucketSpread {
    /// A one-line note describing the spreading, for [`crate::trace::Trace::notes`].
    pub fn note(&self) -> String {
        format!(
            "bucketed timestamps spread (seed {}): {} requests sharing {} of {} distinct timestamps \
             were moved uniformly over the gap to the next timestamp (median {:.3} s; the last \
             bucket over the median), keeping file order within each bucket",
            self.seed,
            self.requests,
            self.buckets,
            self.distinct_timestamps,
            self.median_gap_us as f64 / 1e6
        )
    }
}

/// Spreads groups of equal arrivals (see the module docs). Returns `None`, changing nothing, when
/// `arrivals_us` is not non-decreasing.
pub fn spread_buckets(arrivals_us: &mut [u64], seed: u64) -> Option<BucketSpread> {
    if arrivals_us.windows(2).any(|w| w[1] < w[0]) {
        return None;
    }
    // (start index, end index) of each run of equal timestamps.
    let mut runs: Vec<(usize, usize)> = Vec::new();
    let mut start = 0;
    for i in 1..=arrivals_us.len() {
        if i == arrivals_us.len() || arrivals_us[i] != arrivals_us[start] {
            runs.push((start, i));
            start = i;
        }
    }
    let mut gaps: Vec<u64> = runs
        .windows(2)
        .map(|w| arrivals_us[w[1].0] - arrivals_us[w[0].0])
        .collect();
    gaps.sort_unstable();
    let median_gap_us = median(&gaps);

    let mut rng = Rng::new(seed);
    let mut offsets = Vec::new();
    let mut report = BucketSpread {
        distinct_timestamps: runs.len(),
        buckets: 0,
        requests: 0,
        median_gap_us,
        seed,
    };
    for (k, &(from, to)) in runs.iter().enumerate() {
        let n = to - from;
        if n < 2 {
            continue;
        }
        let t = arrivals_us[from];
        let width = match runs.get(k + 1) {
            Some(&(next, _)) => arrivals_us[next] - t,
            None => median_gap_us.min(u64::MAX - t),
        };
        if width <= 1 {
            continue;
        }
        offsets.clear();
        offsets.extend((0..n).map(|_| rng.below(width)));
        offsets.sort_unstable();
        for (slot, off) in arrivals_us[from..to].iter_mut().zip(&offsets) {
            *slot = t + off;
        }
        report.buckets += 1;
        report.requests += n;
    }
    Some(report)
}

/// The median of sorted values (mean of the middle two, rounded down); 0 when empty.
fn median(sorted: &[u64]) -> u64 {
    match sorted.len() {
        0 => 0,
        n if n % 2 == 1 => sorted[n / 2],
        n => {
            let (a, b) = (sorted[n / 2 - 1], sorted[n / 2]);
            a + (b - a) / 2
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spreads_within_buckets_and_keeps_singletons() {
        let mut a = vec![0, 0, 0, 3000, 3000, 6000, 9000, 9000];
        let report = spread_buckets(&mut a, 7).expect("sorted input");
        assert_eq!(report.distinct_timestamps, 4);
        assert_eq!(report.buckets, 3);
        assert_eq!(report.requests, 7);
        assert_eq!(report.median_gap_us, 3000);
        assert!(a.windows(2).all(|w| w[0] <= w[1]), "{a:?}");
        assert!(a[..3].iter().all(|&x| x < 3000));
        assert!(a[3..5].iter().all(|&x| (3000..6000).contains(&x)));
        assert_eq!(a[5], 6000);
        assert!(a[6..].iter().all(|&x| (9000..12000).contains(&x)));
    }

    #[test]
    fn unsorted_input_is_left_alone() {
        let mut a = vec![5, 1, 1];
        assert_eq!(spread_buckets(&mut a, 0), None);
        assert_eq!(a, vec![5, 1, 1]);
    }

    #[test]
    fn a_single_timestamp_has_no_width_to_spread_over() {
        let mut a = vec![10, 10, 10];
        let report = spread_buckets(&mut a, 0).expect("sorted");
        assert_eq!((report.buckets, report.median_gap_us), (0, 0));
        assert_eq!(a, vec![10, 10, 10]);
        assert!(spread_buckets(&mut [], 0).is_some());
    }

    #[test]
    fn median_of_even_and_odd_counts() {
        assert_eq!(median(&[]), 0);
        assert_eq!(median(&[1, 2, 9]), 2);
        assert_eq!(median(&[1, 2, 4, 9]), 3);
    }
}
