//! The daemon's counters: a [`Stats`] snapshot (answered by the `stats` op) and its Prometheus
//! text rendering by `prometheus_client`, [`metrics_text`], which the daemon logs periodically
//! (at debug level) and at shutdown (at info level). Counters only grow; gauges describe the
//! store at the snapshot.
//!
//! The snapshot is assembled from four owners, each counting locally and reporting once: the
//! L2 store (with its arena placement), the long-term backend ([`LongStats`]), the server's
//! prefetcher, and its inventory publisher with the load meter ([`InventoryStats`]).

use crate::inventory::TIERS;
use crate::proto::{ExtendedStats, StatsReply};
use infera_core::event::Retention;
use prometheus_client::encoding::{EncodeMetric, MetricEncoder, prometheus_text};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Registry;
use std::fmt;

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

/// What the L4 tier reports (all zero without one).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct L4Stats {
    /// 1 while the breaker is closed (the store answers).
    pub up: u64,
    /// Bytes of puts queued (write-behind).
    pub queued_bytes: u64,
    /// Operations queued (puts and removals).
    pub queued_ops: u64,
    /// Blocks written to the store.
    pub puts_total: u64,
    /// Blocks whose L4 copy was dropped (queue full, or the breaker open).
    pub dropped_total: u64,
    /// Blocks the store answered but did not keep (full, or the key busy): not in L4, and a
    /// removal of the key's older value queued in their place.
    pub refused_total: u64,
    /// Removals written to the store.
    pub removes_total: u64,
    /// Blocks looked up in L4 (queued ones included).
    pub gets_total: u64,
    /// Lookups L4 answered.
    pub hits_total: u64,
    /// Stored values refused on read: foreign, torn or another key's (read as misses).
    pub rejected_total: u64,
    /// Remote operations that failed.
    pub errors_total: u64,
    /// Remote operations past their deadline.
    pub timeouts_total: u64,
    /// Times the breaker opened.
    pub breaker_opens_total: u64,
    /// Times the breaker closed again (the store answered a probe).
    pub reconnects_total: u64,
}

impl L4Stats {
    /// Every field as `(name without the l4_ prefix, value)`, in a stable order.
    pub fn fields(&self) -> [(&'static str, u64); 14] {
        [
            ("up", self.up),
            ("queued_bytes", self.queued_bytes),
            ("queued_ops", self.queued_ops),
            ("puts_total", self.puts_total),
            ("dropped_total", self.dropped_total),
            ("refused_total", self.refused_total),
            ("removes_total", self.removes_total),
            ("gets_total", self.gets_total),
            ("hits_total", self.hits_total),
            ("rejected_total", self.rejected_total),
            ("errors_total", self.errors_total),
            ("timeouts_total", self.timeouts_total),
            ("breaker_opens_total", self.breaker_opens_total),
            ("reconnects_total", self.reconnects_total),
        ]
    }

    /// The inverse of [`L4Stats::fields`]: `get` answers a field by name.
    pub fn from_fields(get: impl Fn(&str) -> u64) -> Self {
        Self {
            up: get("up"),
            queued_bytes: get("queued_bytes"),
            queued_ops: get("queued_ops"),
            puts_total: get("puts_total"),
            dropped_total: get("dropped_total"),
            refused_total: get("refused_total"),
            removes_total: get("removes_total"),
            gets_total: get("gets_total"),
            hits_total: get("hits_total"),
            rejected_total: get("rejected_total"),
            errors_total: get("errors_total"),
            timeouts_total: get("timeouts_total"),
            breaker_opens_total: get("breaker_opens_total"),
            reconnects_total: get("reconnects_total"),
        }
    }
}

/// What a long-term backend (L3 tablespace, L4, or both) reports.
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
    /// The L4 tier's counters (zero for the tablespace alone).
    pub l4: L4Stats,
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
        let (a, b) = (self.l4.fields(), other.l4.fields());
        self.l4 = L4Stats::from_fields(|name| {
            let at = a.iter().position(|(n, _)| *n == name).unwrap_or_default();
            a[at].1 + b[at].1
        });
        self
    }
}

/// What the inventory publisher and the load meter report ([`crate::inventory`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct InventoryStats {
    /// Batches of inventory events published.
    pub batches_total: u64,
    /// Events in them.
    pub events_total: u64,
    /// Block changes never published (the recorder overflowed, or a batch was refused).
    pub dropped_total: u64,
    /// Per tier (L2, L3, L4, as [`TIERS`]): the median speed of recent hits served from it,
    /// bytes per second (0 before its first).
    pub tier_load_bytes_per_second: [u64; 3],
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
    /// The inventory publication (all zero while it is off) and the tiers' load speeds.
    pub inventory: InventoryStats,
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
            l4: l.l4,
        }
    }
}

/// Renders `stats` in the Prometheus text exposition format (version 0.0.4), through a
/// `prometheus_client` registry of the snapshot's values. Metric names are `infera_kvd_*`; the
/// per-class series carry a `class` label (`none|ephemeral|short|long`). Names ending in `_total`
/// are counters, the rest gauges.
pub fn metrics_text(stats: &Stats) -> String {
    // Help texts end without a period: the encoder adds one.
    let base = [
        ("entries", "Entries in the L2 store", stats.entries),
        (
            "host_bytes",
            "Value bytes in the L2 store",
            stats.host_bytes,
        ),
        ("gets_total", "Keys looked up", stats.gets_total),
        ("sets_total", "Items written", stats.sets_total),
        (
            "hits_total",
            "Lookups answered from any tier",
            stats.hits_total,
        ),
        (
            "misses_total",
            "Lookups that missed every tier",
            stats.misses_total,
        ),
        (
            "evictions_total",
            "L2 entries evicted to make room",
            stats.evictions_total,
        ),
        (
            "spillover_bytes",
            "Value bytes of short entries in L3",
            stats.long.short_bytes,
        ),
        (
            "long_bytes",
            "Value bytes of long entries in L3",
            stats.long.long_bytes,
        ),
    ];
    let mut registry = Registry::with_prefix("infera_kvd");
    // The encoder adds `_total` to a counter's name.
    let mut metric = |name: &str, help: &str, value: u64| match name.strip_suffix("_total") {
        Some(counter) => registry.register(counter, help, ConstCounter::new(value)),
        None => registry.register(name, help, ConstGauge::new(value)),
    };
    for (name, help, value) in base {
        metric(name, help, value);
    }
    for (name, value) in stats.extended().fields() {
        if name.ends_with("_entries") && is_class_series(&name) || name.ends_with("_class_bytes") {
            continue;
        }
        metric(&name, "See the kvd stats_response documentation", value);
    }
    registry.register(
        "class_entries",
        "L2 entries per retention class",
        PerClass(stats.class_entries),
    );
    registry.register(
        "class_bytes",
        "L2 charged bytes per retention class",
        PerClass(stats.class_bytes),
    );
    let inv = &stats.inventory;
    registry.register(
        "inventory_batches",
        "Batches of inventory KV events published",
        ConstCounter::new(inv.batches_total),
    );
    registry.register(
        "inventory_events",
        "Inventory KV events published",
        ConstCounter::new(inv.events_total),
    );
    registry.register(
        "inventory_dropped",
        "Block changes never published (recorder overflow or a refused batch; the next batch \
         clears the router's view of this kvd)",
        ConstCounter::new(inv.dropped_total),
    );
    registry.register(
        "tier_load_bytes_per_second",
        "Median speed of recent hits served per tier (host L2, disk L3, external L4)",
        PerTier(inv.tier_load_bytes_per_second),
    );
    let mut out = String::with_capacity(4096);
    // Writing to a String cannot fail.
    let _ = prometheus_text::encode(&mut out, &registry);
    out
}

/// A gauge with one series per retention class (label `class`), indexed by `Retention as usize`
/// and written in [`Retention::ALL`]'s order.
#[derive(Debug)]
struct PerClass([u64; 4]);

impl EncodeMetric for PerClass {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), fmt::Error> {
        for class in Retention::ALL {
            let label = [("class", class.as_str())];
            ConstGauge::new(self.0[class as usize]).encode(encoder.encode_family(&label)?)?;
        }
        Ok(())
    }

    fn metric_type(&self) -> MetricType {
        MetricType::Gauge
    }
}

/// A gauge with one series per tier kvd holds (label `tier`: `host`, `disk`, `external`),
/// indexed as [`TIERS`].
#[derive(Debug)]
struct PerTier([u64; 3]);

impl EncodeMetric for PerTier {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), fmt::Error> {
        for (i, tier) in TIERS.into_iter().enumerate() {
            let label = [("tier", tier.as_str())];
            ConstGauge::new(self.0[i]).encode(encoder.encode_family(&label)?)?;
        }
        Ok(())
    }

    fn metric_type(&self) -> MetricType {
        MetricType::Gauge
    }
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
            inventory: InventoryStats {
                events_total: 9,
                tier_load_bytes_per_second: [0, 2_000_000, 0],
                ..InventoryStats::default()
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
        assert!(text.contains("# HELP infera_kvd_entries Entries in the L2 store.\n"));
        assert!(text.contains("# HELP infera_kvd_hits_total Lookups answered from any tier.\n"));
        assert!(text.contains(
            "# HELP infera_kvd_l3_reads_total See the kvd stats_response documentation.\n"
        ));
        assert!(text.contains("# TYPE infera_kvd_class_entries gauge\n"));
        assert!(text.contains("infera_kvd_inventory_events_total 9\n"));
        assert!(text.contains("infera_kvd_inventory_dropped_total 0\n"));
        assert!(text.contains("# TYPE infera_kvd_inventory_batches_total counter\n"));
        assert!(text.contains("infera_kvd_tier_load_bytes_per_second{tier=\"disk\"} 2000000\n"));
        assert!(text.contains("infera_kvd_tier_load_bytes_per_second{tier=\"external\"} 0\n"));
        assert!(!text.contains("infera_kvd_short_entries"));
        let classes: Vec<&str> = text
            .lines()
            .filter_map(|l| l.strip_prefix("infera_kvd_class_bytes{class=\""))
            .collect();
        assert_eq!(
            classes,
            ["none\"} 0", "ephemeral\"} 0", "short\"} 0", "long\"} 0"],
            "one series per class, in order"
        );
        // Every family once, described before its samples.
        let mut families = Vec::new();
        for line in text.lines() {
            if let Some(help) = line.strip_prefix("# HELP ") {
                let (name, _) = help.split_once(' ').unwrap();
                assert!(!families.contains(&name), "{name} twice");
                families.push(name);
            } else if !line.starts_with('#') {
                let name = line.split(['{', ' ']).next().unwrap();
                assert_eq!(families.last(), Some(&name), "{line}");
            }
        }
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
