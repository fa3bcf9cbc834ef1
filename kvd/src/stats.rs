//! The daemon's counters: a [`Stats`] snapshot (answered by the `stats` op) and its Prometheus
//! text rendering, [`metrics_text`], which the daemon logs periodically (at debug level) and at
//! shutdown (at info level). Counters only grow; gauges describe the store at the snapshot.
//!
//! The snapshot is assembled from three owners, each counting locally and reporting once: the
//! L2 store (with its arena placement), the long-term backend ([`LongStats`]) and the server's
//! prefetcher.

use crate::proto::{ExtendedStats, StatsReply};
use infera_core::event::Retention;
use std::fmt::Write as _;

/// What the shared arena reports.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ArenaStats {
    /// The arena's size (0 = no arena).
    pub bytes: u64,
    /// Its slot size (0 until the first write decides it).
    pub slot_bytes: u64,
    /// Slots in the grid.
    pub slots: u64,
    /// L2 entries whose bytes live in the arena.
    pub entries: u64,
    /// Open `set_reserve` leases.
    pub leases: u64,
    /// Entries moved to the heap to free a slot for a lease.
    pub demotions_total: u64,
}

/// What a long-term backend (L3 tablespace, later L4) reports.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LongStats {
    /// Entries held (all shards).
    pub entries: u64,
    /// The region's size.
    pub capacity_bytes: u64,
    /// Value bytes of `short` entries (upstream's `spillover_bytes`).
    pub short_bytes: u64,
    /// Value bytes of `long` entries (upstream's `long_bytes`).
    pub long_bytes: u64,
    /// Blocks read.
    pub reads_total: u64,
    /// Blocks written.
    pub writes_total: u64,
    /// `short` blocks written when L2 evicted them.
    pub spills_total: u64,
    /// Reads whose slot failed its key, generation or checksum check.
    pub verify_failures_total: u64,
    /// Reads or writes the kernel failed.
    pub io_errors_total: u64,
    /// Journal `fdatasync`s (durable writes share them: group commit).
    pub journal_syncs_total: u64,
    /// Entries evicted to make room.
    pub evictions_total: u64,
    /// Entries removed because their TTL passed.
    pub expired_total: u64,
    /// Writes refused.
    pub rejected_total: u64,
    /// Whether the data path uses O_DIRECT.
    pub direct_io: bool,
    /// Whether the data path uses io_uring.
    pub io_uring: bool,
}

impl LongStats {
    /// The sum over shards (flags are true when true for any shard).
    pub fn merge(mut self, other: &LongStats) -> LongStats {
        self.entries += other.entries;
        self.capacity_bytes += other.capacity_bytes;
        self.short_bytes += other.short_bytes;
        self.long_bytes += other.long_bytes;
        self.reads_total += other.reads_total;
        self.writes_total += other.writes_total;
        self.spills_total += other.spills_total;
        self.verify_failures_total += other.verify_failures_total;
        self.io_errors_total += other.io_errors_total;
        self.journal_syncs_total += other.journal_syncs_total;
        self.evictions_total += other.evictions_total;
        self.expired_total += other.expired_total;
        self.rejected_total += other.rejected_total;
        self.direct_io |= other.direct_io;
        self.io_uring |= other.io_uring;
        self
    }
}

/// A snapshot of the daemon's state and counters.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Stats {
    /// L2 entries held.
    pub entries: u64,
    /// L2 value bytes held (the payload, as upstream reports `host_bytes`).
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
    /// Lookups answered from any tier.
    pub hits_total: u64,
    pub misses_total: u64,
    /// L2 entries removed to make room.
    pub evictions_total: u64,
    /// L2 entries removed because their TTL passed (by the sweeper or on access).
    pub expired_total: u64,
    /// Writes answered `accepted=false`.
    pub rejected_total: u64,
    /// `prefetch_hint` frames received.
    pub prefetch_hints_total: u64,
    /// Blocks promoted from L3 into L2 by hints.
    pub prefetch_promoted_total: u64,
    /// Hints dropped (queue full or deadline passed).
    pub prefetch_dropped_total: u64,
    /// L2 entries per retention class, indexed by `Retention as usize`.
    pub class_entries: [u64; 4],
    /// L2 charged bytes per retention class.
    pub class_bytes: [u64; 4],
    /// The shared arena.
    pub arena: ArenaStats,
    /// The long-term tier; all zero without one.
    pub long: LongStats,
}

impl Stats {
    /// The `stats_response` body; our additions only when `extended`.
    pub fn to_reply(&self, extended: bool) -> StatsReply {
        StatsReply {
            entries: self.entries,
            host_bytes: self.host_bytes,
            spillover_bytes: self.long.short_bytes,
            long_bytes: self.long.long_bytes,
            gets_total: self.gets_total,
            sets_total: self.sets_total,
            hits_total: self.hits_total,
            misses_total: self.misses_total,
            evictions_total: self.evictions_total,
            extended: extended.then(|| self.extended()),
        }
    }

    fn extended(&self) -> ExtendedStats {
        let l = &self.long;
        ExtendedStats {
            accounted_bytes: self.accounted_bytes,
            max_bytes: self.max_bytes,
            expired_total: self.expired_total,
            rejected_total: self.rejected_total,
            prefetch_hints_total: self.prefetch_hints_total,
            prefetch_promoted_total: self.prefetch_promoted_total,
            prefetch_dropped_total: self.prefetch_dropped_total,
            class_entries: self.class_entries,
            class_bytes: self.class_bytes,
            arena_bytes: self.arena.bytes,
            arena_slot_bytes: self.arena.slot_bytes,
            arena_entries: self.arena.entries,
            arena_leases: self.arena.leases,
            arena_demotions_total: self.arena.demotions_total,
            l3_entries: l.entries,
            l3_capacity_bytes: l.capacity_bytes,
            l3_reads_total: l.reads_total,
            l3_writes_total: l.writes_total,
            l3_spills_total: l.spills_total,
            l3_verify_failures_total: l.verify_failures_total,
            l3_io_errors_total: l.io_errors_total,
            l3_journal_syncs_total: l.journal_syncs_total,
            l3_evictions_total: l.evictions_total,
            l3_rejected_total: l.rejected_total,
            l3_direct_io: u64::from(l.direct_io),
            l3_io_uring: u64::from(l.io_uring),
        }
    }
}

/// Renders `stats` in the Prometheus text exposition format (version 0.0.4). Metric names are
/// `infera_kvd_*`; the per-class series carry a `class` label (`none|ephemeral|short|long`).
/// Names ending in `_total` are counters, the rest gauges.
pub fn metrics_text(stats: &Stats) -> String {
    let mut out = String::with_capacity(4096);
    let base = [
        ("entries", "Entries in the L2 store.", stats.entries),
        (
            "host_bytes",
            "Value bytes in the L2 store.",
            stats.host_bytes,
        ),
        ("gets_total", "Keys looked up.", stats.gets_total),
        ("sets_total", "Items written.", stats.sets_total),
        (
            "hits_total",
            "Lookups answered from any tier.",
            stats.hits_total,
        ),
        (
            "misses_total",
            "Lookups that missed every tier.",
            stats.misses_total,
        ),
        (
            "evictions_total",
            "L2 entries evicted to make room.",
            stats.evictions_total,
        ),
        (
            "spillover_bytes",
            "Value bytes of short entries in L3.",
            stats.long.short_bytes,
        ),
        (
            "long_bytes",
            "Value bytes of long entries in L3.",
            stats.long.long_bytes,
        ),
    ];
    let mut metric = |name: &str, help: &str, value: u64| {
        let kind = if name.ends_with("_total") {
            "counter"
        } else {
            "gauge"
        };
        let _ = writeln!(out, "# HELP infera_kvd_{name} {help}");
        let _ = writeln!(out, "# TYPE infera_kvd_{name} {kind}");
        let _ = writeln!(out, "infera_kvd_{name} {value}");
    };
    for (name, help, value) in base {
        metric(name, help, value);
    }
    for (name, value) in stats.extended().fields() {
        if name.ends_with("_entries") && is_class_series(&name) || name.ends_with("_class_bytes") {
            continue;
        }
        metric(&name, "See the kvd stats_response documentation.", value);
    }
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
        "L2 entries per retention class.",
        &stats.class_entries,
    );
    classed(
        "class_bytes",
        "L2 charged bytes per retention class.",
        &stats.class_bytes,
    );
    out
}

fn is_class_series(name: &str) -> bool {
    Retention::ALL
        .iter()
        .any(|c| name == format!("{}_entries", c.as_str()))
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
            long: LongStats {
                reads_total: 5,
                io_uring: true,
                ..LongStats::default()
            },
            ..Stats::default()
        };
        let text = metrics_text(&stats);
        assert!(text.contains("infera_kvd_entries 3\n"));
        assert!(text.contains("infera_kvd_hits_total 7\n"));
        assert!(text.contains("infera_kvd_l3_reads_total 5\n"));
        assert!(text.contains("infera_kvd_l3_io_uring 1\n"));
        assert!(text.contains("infera_kvd_class_entries{class=\"short\"} 2\n"));
        assert!(text.contains("# TYPE infera_kvd_evictions_total counter\n"));
        assert!(text.contains("# TYPE infera_kvd_arena_entries gauge\n"));
        assert!(!text.contains("infera_kvd_short_entries"));
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let (_, value) = line.rsplit_once(' ').unwrap();
            value.parse::<u64>().unwrap();
        }
    }

    #[test]
    fn the_reply_extends_only_on_request() {
        let stats = Stats {
            expired_total: 2,
            long: LongStats {
                short_bytes: 10,
                long_bytes: 20,
                ..LongStats::default()
            },
            ..Stats::default()
        };
        assert_eq!(stats.to_reply(false).extended, None);
        let reply = stats.to_reply(true);
        assert_eq!((reply.spillover_bytes, reply.long_bytes), (10, 20));
        assert_eq!(reply.extended.unwrap().expired_total, 2);
    }
}
