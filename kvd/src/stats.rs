//! The daemon's counters: a [`Stats`] snapshot (answered by the `stats` op) and its Prometheus
//! text rendering, [`metrics_text`], which the daemon logs periodically (at debug level) and at
//! shutdown (at info level). Counters only grow; gauges describe the store at the snapshot.

use crate::proto::{ExtendedStats, StatsReply};
use infera_core::event::Retention;
use std::fmt::Write as _;

/// A snapshot of the L2 store and the daemon's counters.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Stats {
    /// Entries held.
    pub entries: u64,
    /// Value bytes held (the payload, as upstream reports `host_bytes`).
    pub host_bytes: u64,
    /// Bytes charged against `--max-bytes`: values, keys, namespace, metadata and a fixed
    /// per-entry overhead.
    pub accounted_bytes: u64,
    /// `--max-bytes`.
    pub max_bytes: u64,
    /// `get`s, one per key (a `batch_get` of n keys counts n).
    pub gets_total: u64,
    /// `set`s, one per item.
    pub sets_total: u64,
    pub hits_total: u64,
    pub misses_total: u64,
    /// Entries removed to make room.
    pub evictions_total: u64,
    /// Entries removed because their TTL passed (by the sweeper or on access).
    pub expired_total: u64,
    /// Writes answered `accepted=false`.
    pub rejected_total: u64,
    /// `prefetch_hint` frames received.
    pub prefetch_hints_total: u64,
    /// Entries per retention class, indexed by `Retention as usize`.
    pub class_entries: [u64; 4],
    /// Charged bytes per retention class.
    pub class_bytes: [u64; 4],
}

impl Stats {
    /// The `stats_response` body; our additions only when `extended`.
    pub fn to_reply(&self, extended: bool) -> StatsReply {
        StatsReply {
            entries: self.entries,
            host_bytes: self.host_bytes,
            spillover_bytes: 0,
            long_bytes: 0,
            gets_total: self.gets_total,
            sets_total: self.sets_total,
            hits_total: self.hits_total,
            misses_total: self.misses_total,
            evictions_total: self.evictions_total,
            extended: extended.then_some(ExtendedStats {
                accounted_bytes: self.accounted_bytes,
                max_bytes: self.max_bytes,
                expired_total: self.expired_total,
                rejected_total: self.rejected_total,
                prefetch_hints_total: self.prefetch_hints_total,
                class_entries: self.class_entries,
                class_bytes: self.class_bytes,
            }),
        }
    }
}

/// Renders `stats` in the Prometheus text exposition format (version 0.0.4). Metric names are
/// `infera_kvd_*`; the per-class series carry a `class` label (`none|ephemeral|short|long`).
pub fn metrics_text(stats: &Stats) -> String {
    let mut out = String::with_capacity(2048);
    let mut metric = |name: &str, kind: &str, help: &str, value: u64| {
        let _ = writeln!(out, "# HELP infera_kvd_{name} {help}");
        let _ = writeln!(out, "# TYPE infera_kvd_{name} {kind}");
        let _ = writeln!(out, "infera_kvd_{name} {value}");
    };
    metric(
        "entries",
        "gauge",
        "Entries in the L2 store.",
        stats.entries,
    );
    metric(
        "host_bytes",
        "gauge",
        "Value bytes in the L2 store.",
        stats.host_bytes,
    );
    metric(
        "accounted_bytes",
        "gauge",
        "Bytes charged against --max-bytes.",
        stats.accounted_bytes,
    );
    metric("max_bytes", "gauge", "The L2 budget.", stats.max_bytes);
    metric("gets_total", "counter", "Keys looked up.", stats.gets_total);
    metric("sets_total", "counter", "Items written.", stats.sets_total);
    metric(
        "hits_total",
        "counter",
        "Lookups that hit.",
        stats.hits_total,
    );
    metric(
        "misses_total",
        "counter",
        "Lookups that missed.",
        stats.misses_total,
    );
    metric(
        "evictions_total",
        "counter",
        "Entries evicted to make room.",
        stats.evictions_total,
    );
    metric(
        "expired_total",
        "counter",
        "Entries removed at TTL expiry.",
        stats.expired_total,
    );
    metric(
        "rejected_total",
        "counter",
        "Writes refused.",
        stats.rejected_total,
    );
    metric(
        "prefetch_hints_total",
        "counter",
        "Prefetch hints received.",
        stats.prefetch_hints_total,
    );
    let mut classed = |name: &str, help: &str, values: &[u64; 4]| {
        let _ = writeln!(out, "# HELP infera_kvd_{name} {help}");
        let _ = writeln!(out, "# TYPE infera_kvd_{name} gauge");
        for class in Retention::ALL {
            let value = values[class as usize];
            let _ = writeln!(
                out,
                "infera_kvd_{name}{{class=\"{}\"}} {value}",
                class.as_str()
            );
        }
    };
    classed(
        "class_entries",
        "Entries per retention class.",
        &stats.class_entries,
    );
    classed(
        "class_bytes",
        "Charged bytes per retention class.",
        &stats.class_bytes,
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metrics_text_has_every_counter_and_class() {
        let stats = Stats {
            entries: 3,
            hits_total: 7,
            class_entries: [0, 1, 2, 0],
            ..Stats::default()
        };
        let text = metrics_text(&stats);
        assert!(text.contains("infera_kvd_entries 3\n"));
        assert!(text.contains("infera_kvd_hits_total 7\n"));
        assert!(text.contains("infera_kvd_class_entries{class=\"short\"} 2\n"));
        assert!(text.contains("# TYPE infera_kvd_evictions_total counter\n"));
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let (_, value) = line.rsplit_once(' ').unwrap();
            value.parse::<u64>().unwrap();
        }
    }

    #[test]
    fn the_reply_extends_only_on_request() {
        let stats = Stats {
            expired_total: 2,
            ..Stats::default()
        };
        assert_eq!(stats.to_reply(false).extended, None);
        assert_eq!(stats.to_reply(true).extended.unwrap().expired_total, 2);
    }
}
