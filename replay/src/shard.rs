//! Sweeps that outgrow one machine: `infera replay --shard I/N` runs one slice of a sweep's
//! (or `--tune`'s) grid, and [`crate::merge`] joins the slices' `--out` files into what one
//! machine would have written.
//!
//! Configuration `i` of the grid belongs to slice `i mod N`: neighbouring configurations differ
//! in the last axis only and cost about the same to simulate, so every slice gets a like share
//! of the work. A slice keeps each configuration's index in the whole grid (`config_index`), so
//! the slices' files are also one table to a reader that globs them (DuckDB:
//! `SELECT * FROM 'slices/*.summary.parquet' ORDER BY config_index`).
//!
//! Every file `--out` writes carries a [`SweepMeta`] in its Parquet footer (key
//! [`META_KEY`]): which trace and grid it came from, as digests, and which slice it holds. The
//! merge refuses slices of different sweeps and reports missing or doubled ones.

use crate::sweep::{Point, SweepAxis};
use crate::trace::Trace;
use serde::{Deserialize, Serialize};
use std::fmt;
use xxhash_rust::xxh3::Xxh3;

/// The footer key of [`SweepMeta`] in both files of `--out`.
pub const META_KEY: &str = "infera.replay.sweep";

/// `--shard I/N`: slice `index` of `count`, from 0.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Shard {
    pub index: usize,
    pub count: usize,
}

impl Shard {
    /// The whole grid (what an unsharded run writes).
    pub const WHOLE: Shard = Shard { index: 0, count: 1 };

    /// Whether configuration `i` of the grid is this slice's.
    pub fn holds(&self, i: usize) -> bool {
        i % self.count == self.index
    }
}

impl std::str::FromStr for Shard {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || format!("`{s}` is not I/N with 0 <= I < N (e.g. 0/4)");
        let (i, n) = s.split_once('/').ok_or_else(bad)?;
        let index: usize = i.trim().parse().map_err(|_| bad())?;
        let count: usize = n.trim().parse().map_err(|_| bad())?;
        if count == 0 || index >= count {
            return Err(bad());
        }
        Ok(Shard { index, count })
    }
}

impl fmt::Display for Shard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.index, self.count)
    }
}

/// What a results file belongs to.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SweepMeta {
    /// The trace as the command line named it (for people; [`Self::trace_digest`] decides).
    pub trace: String,
    /// [`trace_digest`] of the trace as replayed (after `--limit` and `--tenant-scale`).
    pub trace_digest: String,
    /// [`grid_digest`] of the whole grid (every configuration, not only this slice's).
    pub grid_digest: String,
    /// Configurations in the whole grid.
    pub configs: usize,
    /// The grid's axes, each as `--sweep` takes it (`KEY=V1,V2`).
    pub axes: Vec<String>,
    /// Whether the run was `--tune` (the merge then prints the Pareto front).
    pub tune: bool,
    pub shard: Shard,
}

impl SweepMeta {
    pub fn new(
        trace_name: &str,
        trace: &Trace,
        points: &[Point],
        axes: &[SweepAxis],
        tune: bool,
        shard: Shard,
    ) -> Self {
        Self {
            trace: trace_name.to_owned(),
            trace_digest: trace_digest(trace),
            grid_digest: grid_digest(points),
            configs: points.len(),
            axes: axes
                .iter()
                .map(|a| format!("{}={}", a.key, a.values.join(",")))
                .collect(),
            tune,
            shard,
        }
    }

    /// Whether two files come from the same sweep (same trace, same grid), whatever their slice.
    pub fn same_sweep(&self, other: &Self) -> bool {
        self.trace_digest == other.trace_digest
            && self.grid_digest == other.grid_digest
            && self.configs == other.configs
            && self.tune == other.tune
    }

    /// The axes, parsed back.
    pub fn sweep_axes(&self) -> Result<Vec<SweepAxis>, crate::sweep::SweepError> {
        self.axes.iter().map(|a| a.parse()).collect()
    }
}

/// XXH3-128 of every request as the simulator reads it (all its fields, in order), as hex.
pub fn trace_digest(trace: &Trace) -> String {
    let mut h = Digest(Xxh3::new());
    for r in &trace.requests {
        // Writing to a hasher cannot fail, and every request serializes.
        let _ = serde_json::to_writer(&mut h, r);
    }
    format!("{:032x}", h.0.digest128())
}

/// XXH3-128 of every configuration of the grid (label and settings), in order, as hex.
pub fn grid_digest(points: &[Point]) -> String {
    let mut h = Digest(Xxh3::new());
    for p in points {
        let _ = serde_json::to_writer(&mut h, &(&p.label, &p.config));
    }
    format!("{:032x}", h.0.digest128())
}

/// Serialized bytes straight into the hash, without building the text.
struct Digest(Xxh3);

impl std::io::Write for Digest {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.update(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_slices_and_rejects_bad_ones() {
        assert_eq!("2/4".parse(), Ok(Shard { index: 2, count: 4 }));
        assert_eq!(" 0 / 1 ".parse(), Ok(Shard::WHOLE));
        for bad in ["4/4", "1/0", "a/2", "2", "-1/3", "1/2/3"] {
            assert!(bad.parse::<Shard>().is_err(), "{bad}");
        }
        assert_eq!(Shard { index: 3, count: 8 }.to_string(), "3/8");
    }

    #[test]
    fn the_slices_cover_the_grid_once() {
        for count in 1..6 {
            for i in 0..40 {
                let owners = (0..count)
                    .filter(|&index| Shard { index, count }.holds(i))
                    .count();
                assert_eq!(owners, 1, "config {i} of {count} slices");
            }
        }
    }
}
