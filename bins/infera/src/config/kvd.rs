//! [`KvdConfig`]: the validated configuration of `infera kvd`.
//!
//! Built only by `TryFrom<KvdArgs>`, which checks: `--max-bytes`, `--long-bytes`,
//! `--long-workers-per-shard`, `--max-connections`, `--max-batch-keys` and `--frame-timeout`
//! are positive (`--idle-timeout 0` means never); `--long-path` and `--long-paths` are not both
//! given; striped paths are non-empty and distinct; `--long-backend lmcache|mooncake` (L4
//! instead of L3) takes no `--long-path(s)` and no `--l4-backend`; `--l4-backend` (L4 behind L3)
//! needs `--long-path(s)`; `--l4-required` needs an L4; the store's settings
//! (`--lmcache-config` or `--mooncake-config`, and `INFERA_L4_*`) resolve and parse.
//! `--use-tablespace` is accepted and ignored with a warning.
//! `--shared-arena-bytes auto` resolves to `--max-bytes`. `--kv-events-endpoint` and
//! `--kv-events-replay-endpoint` are `tcp://HOST:PORT` or `off` (`events.rs`).
//!
//! The Python kvd's other flags, each with the Python's meaning where this kvd has the knob:
//! `--log-level` (the log filter when `RUST_LOG` is unset), `--shared-arena-hugetlb` (also
//! `INFERA_KVD_ARENA_HUGETLB`), `--tablespace-container-bytes`, `--tablespace-flush-interval-ms`
//! (the journal sync interval, or durable writes at 0), `--tablespace-buffered-io` and
//! `--tablespace-auto-detect-fs` (the I/O mode, in the Python's precedence). Where it has not
//! (`--tablespace-slot-bytes`, `--tablespace-pools`, `--shared-arena-pin`, `--mooncake-config`
//! without a Mooncake L4, and the tablespace flags without an L3 region), the value
//! is validated where the Python validates it and listed in [`KvdConfig::inert_flags`] with
//! what this kvd does instead, and a warning is logged.
//!
//! The one conversion from a validated config to the daemon's options is
//! `From<KvdConfig> for infera_kvd::KvdOptions`.

use crate::cli::kvd::KvdArgs;
use crate::config::units::{ByteSize, HumanDuration};
use crate::config::{ConfigError, positive};
use serde::{Deserialize, Serialize};
use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;

mod events;
mod l4;
mod tablespace;

pub use events::KvEventsConfig;
use events::kv_events;
use l4::l4_tier;
pub use tablespace::IO_MODE_ENV;
use tablespace::{long_tier, no_region, striped_paths};

/// The long-term store behind the RAM tier (`--long-backend`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LongBackend {
    /// L3: container files on local NVMe (or NFS).
    Tablespace,
    /// L4: a Mooncake Store cluster (`--mooncake-config`), instead of L3.
    Mooncake,
    /// L4: an LMCache remote store (Redis/Valkey layout, `lm://` server or S3 bucket), instead
    /// of L3.
    Lmcache,
}

/// The store stacked behind L3 (`--l4-backend`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum L4Backend {
    /// An LMCache remote store (Redis/Valkey layout, `lm://` server or S3 bucket).
    Lmcache,
    /// A Mooncake Store cluster.
    Mooncake,
}

impl L4Backend {
    fn name(self) -> &'static str {
        match self {
            L4Backend::Lmcache => "lmcache",
            L4Backend::Mooncake => "mooncake",
        }
    }
}

/// The L4 tier: an LMCache remote store or a Mooncake Store, alone or behind L3.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct L4TierConfig {
    /// `lmcache` or `mooncake`.
    pub store: String,
    /// `instead_of_l3` (`--long-backend`) or `behind_l3` (`--l4-backend`).
    pub placement: String,
    /// The store (any password masked).
    pub remote_url: String,
    /// The store name prefix.
    pub prefix: String,
    /// Largest block stored.
    pub max_value_bytes: u64,
    /// Deadline of every remote operation.
    pub rpc_timeout: HumanDuration,
    /// `connector_extra` keys (ignored by kvd's native client).
    pub connector_extra: Vec<String>,
    /// `--l4-required`.
    pub required: bool,
    /// The resolved settings, credentials included (never printed).
    #[serde(skip)]
    pub resolved: Option<infera_kvd::l4::L4Config>,
}

/// How the L3 region does I/O (`--io-mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum IoMode {
    /// Probe the device: O_DIRECT on NVMe, buffered on NFS/SATA.
    Auto,
    /// O_DIRECT.
    Direct,
    /// Through the page cache.
    Buffered,
    /// By the file system's type (`--tablespace-auto-detect-fs`); not an `--io-mode` value.
    #[value(skip)]
    FileSystem,
}

/// `--log-level`: the Python kvd's levels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum LogLevel {
    /// `debug` and above.
    #[value(name = "DEBUG")]
    Debug,
    /// `info` and above.
    #[value(name = "INFO")]
    Info,
    /// `warn` and above.
    #[value(name = "WARNING")]
    Warning,
    /// `error` only.
    #[value(name = "ERROR")]
    Error,
}

impl LogLevel {
    /// The `tracing` filter directive of this level.
    pub fn directive(self) -> &'static str {
        match self {
            Self::Debug => "debug",
            Self::Info => "info",
            Self::Warning => "warn",
            Self::Error => "error",
        }
    }
}

/// `--shared-arena-bytes`: `auto` (the size of the RAM tier) or an explicit size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ArenaSize {
    /// Same as `--max-bytes`.
    Auto,
    /// This many bytes; 0 disables the arena.
    Bytes(ByteSize),
}

impl FromStr for ArenaSize {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        if text.eq_ignore_ascii_case("auto") {
            return Ok(Self::Auto);
        }
        text.parse()
            .map(Self::Bytes)
            .map_err(|error| format!("{error}, or auto"))
    }
}

impl fmt::Display for ArenaSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Auto => f.write_str("auto"),
            Self::Bytes(size) => size.fmt(f),
        }
    }
}

/// Where the L3 region lives.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum LongLayout {
    /// One directory on one device (`--long-path`).
    Single {
        /// The region's directory.
        path: PathBuf,
    },
    /// One shard per directory, keys hash-routed (`--long-paths`).
    Striped {
        /// The shards' directories, in the given order.
        paths: Vec<PathBuf>,
        /// I/O parallelism inside each shard.
        workers_per_shard: u32,
    },
}

/// How often the L3 journal is synced in the background.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum JournalSync {
    /// Every this long (`--tablespace-flush-interval-ms`, else 200 ms).
    Every(HumanDuration),
    /// Decided at startup (`"file_system"`: `--tablespace-auto-detect-fs`).
    Decided(SyncSource),
}

/// What decides the journal sync at startup.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SyncSource {
    /// The Python kvd's per-file-system table (`--tablespace-auto-detect-fs`).
    FileSystem,
}

/// The L3 tier: a tablespace region on disk.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LongTierConfig {
    /// Where the region lives.
    pub layout: LongLayout,
    /// Total region size.
    pub bytes: ByteSize,
    /// Direct or buffered I/O.
    pub io_mode: IoMode,
    /// Acknowledge `long` writes only once durable (`--durable-long-writes`, or
    /// `--tablespace-flush-interval-ms` 0).
    pub durable_writes: bool,
    /// The background journal sync (`--tablespace-flush-interval-ms`,
    /// `--tablespace-auto-detect-fs`).
    pub journal_sync: JournalSync,
    /// The largest container file (`--tablespace-container-bytes`).
    pub container_bytes: ByteSize,
}

/// A Python kvd flag accepted for compatibility that changes nothing here.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InertFlag {
    /// The flag.
    pub flag: String,
    /// Its value as given (empty for a switch).
    pub value: String,
    /// Why it has no effect, and what this kvd does instead.
    pub reason: String,
}

/// What one client may hold (`--max-connections`, `--idle-timeout`, `--frame-timeout`,
/// `--max-batch-keys`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConnectionLimits {
    /// Most open connections.
    pub max_connections: u32,
    /// Idle connections are closed after this; `None`: never.
    pub idle_timeout: Option<HumanDuration>,
    /// A started frame must arrive whole within this.
    pub frame_timeout: HumanDuration,
    /// Most keys in one batch.
    pub max_batch_keys: u32,
}

/// The validated configuration of `infera kvd`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KvdConfig {
    /// The Unix socket clients connect to.
    pub socket: PathBuf,
    /// The RAM (L2) budget.
    pub max_bytes: ByteSize,
    /// The shared arena size, resolved; 0 = no arena.
    pub shared_arena_bytes: ByteSize,
    /// Back the arena with 2 MiB hugepages (`--shared-arena-hugetlb`,
    /// `INFERA_KVD_ARENA_HUGETLB`).
    pub shared_arena_hugetlb: bool,
    /// The L3 tier; `None` when neither `--long-path` nor `--long-paths` is given.
    pub long_tier: Option<LongTierConfig>,
    /// The L4 tier; `None` without `--long-backend lmcache` or `--l4-backend`.
    pub l4_tier: Option<L4TierConfig>,
    /// Per-connection bounds.
    pub limits: ConnectionLimits,
    /// Where `/metrics` is served (`--metrics-bind`); omitted when off.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metrics_bind: Option<std::net::SocketAddr>,
    /// Where the inventory is published as KV events (`--kv-events-endpoint`); omitted when
    /// off.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_events: Option<KvEventsConfig>,
    /// The log filter when `RUST_LOG` is unset (`--log-level`).
    pub log_level: LogLevel,
    /// Python kvd flags given that have no effect here; omitted when none is.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub inert_flags: Vec<InertFlag>,
}

impl TryFrom<KvdArgs> for KvdConfig {
    type Error = ConfigError;

    fn try_from(args: KvdArgs) -> Result<Self, ConfigError> {
        let max_bytes = ByteSize(positive("--max-bytes", args.max_bytes.bytes())?);
        let long_bytes = ByteSize(positive("--long-bytes", args.long_bytes.bytes())?);
        let workers_per_shard = positive("--long-workers-per-shard", args.long_workers_per_shard)?;
        let limits = ConnectionLimits {
            max_connections: positive("--max-connections", args.max_connections)?,
            idle_timeout: args.idle_timeout.non_zero(),
            frame_timeout: positive("--frame-timeout", args.frame_timeout)?,
            max_batch_keys: positive("--max-batch-keys", args.max_batch_keys)?,
        };
        let l4_tier = l4_tier(&args, &|name| std::env::var(name).ok())?;
        let kv_events = kv_events(&args)?;
        let mut inert = Vec::new();
        if let Some(path) = &args.mooncake_config
            && l4_tier.as_ref().is_none_or(|t| t.store != "mooncake")
        {
            inert.push(InertFlag::new(
                "--mooncake-config",
                path.display(),
                "read only with --long-backend mooncake or --l4-backend mooncake; as in the \
                 Python kvd, it changes nothing alone",
            ));
        }
        if args.shared_arena_pin {
            inert.push(InertFlag::new(
                "--shared-arena-pin",
                "",
                "this kvd does not mlock the shared arena: its pages are allocated on first \
                 touch, as in the Python kvd when RLIMIT_MEMLOCK refuses the lock",
            ));
        }
        if args.use_tablespace {
            tracing::warn!(
                "--use-tablespace is deprecated and has no effect: \
                 the L3 tier always uses the tablespace layout"
            );
        }
        let layout = match (args.long_path.clone(), args.long_paths.clone()) {
            (Some(_), Some(_)) => {
                return Err(ConfigError::new(
                    "--long-path",
                    "cannot be combined with --long-paths: use --long-path DIR for one \
                     device, or --long-paths DIR,DIR,... to stripe across devices",
                ));
            }
            (Some(path), None) => Some(LongLayout::Single { path }),
            (None, Some(list)) => Some(LongLayout::Striped {
                paths: striped_paths(&list)?,
                workers_per_shard,
            }),
            (None, None) => None,
        };
        let shared_arena_bytes = match args.shared_arena_bytes {
            ArenaSize::Auto => max_bytes,
            ArenaSize::Bytes(size) => size,
        };
        let long_tier = match layout {
            Some(layout) => Some(long_tier(
                &args,
                layout,
                long_bytes,
                std::env::var(IO_MODE_ENV).ok().as_deref(),
                &mut inert,
            )?),
            None => {
                no_region(&args, &mut inert);
                None
            }
        };
        for flag in &inert {
            let value = if flag.value.is_empty() {
                String::new()
            } else {
                format!(" {}", flag.value)
            };
            tracing::warn!("{}{value} has no effect: {}", flag.flag, flag.reason);
        }
        let hugetlb_env = std::env::var(HUGETLB_ENV).ok();
        Ok(Self {
            socket: args.socket.clone(),
            max_bytes,
            shared_arena_bytes,
            shared_arena_hugetlb: args.shared_arena_hugetlb || truthy(hugetlb_env.as_deref()),
            long_tier,
            l4_tier,
            limits,
            metrics_bind: args.metrics_bind,
            kv_events,
            log_level: args.log_level,
            inert_flags: inert,
        })
    }
}

impl InertFlag {
    fn new(flag: &str, value: impl fmt::Display, reason: &str) -> Self {
        Self {
            flag: flag.to_owned(),
            value: value.to_string(),
            reason: reason.to_owned(),
        }
    }
}

/// The variable that turns `--shared-arena-hugetlb` on, as in the Python kvd.
pub const HUGETLB_ENV: &str = "INFERA_KVD_ARENA_HUGETLB";

/// The Python kvd's reading of a boolean variable: `1`, `true`, `yes`, `on` (any case, trimmed).
fn truthy(value: Option<&str>) -> bool {
    value.is_some_and(|v| {
        matches!(
            v.trim().to_ascii_lowercase().as_str(),
            "1" | "true" | "yes" | "on"
        )
    })
}

impl From<IoMode> for infera_kvd::IoMode {
    fn from(mode: IoMode) -> Self {
        match mode {
            IoMode::Auto => infera_kvd::IoMode::Auto,
            IoMode::Direct => infera_kvd::IoMode::Direct,
            IoMode::Buffered => infera_kvd::IoMode::Buffered,
            IoMode::FileSystem => infera_kvd::IoMode::FileSystem,
        }
    }
}

impl From<KvdConfig> for infera_kvd::KvdOptions {
    /// The daemon's options: the RAM tier, the arena, the L3 tablespace when a region is
    /// configured (one shard per `--long-paths` directory; `--long-workers-per-shard` I/O
    /// workers each, the daemon's default for a single `--long-path`), and the L4 instead of
    /// it or behind it.
    fn from(config: KvdConfig) -> Self {
        let mut options = infera_kvd::KvdOptions::new(config.socket, config.max_bytes.bytes());
        options.shared_arena_bytes = config.shared_arena_bytes.bytes();
        options.arena_backing = infera_kvd::arena::Backing {
            hugetlb: config.shared_arena_hugetlb,
        };
        options.max_connections = config.limits.max_connections as usize;
        options.idle_timeout = config.limits.idle_timeout.map(|d| d.0);
        options.frame_timeout = config.limits.frame_timeout.0;
        options.max_batch_keys = config.limits.max_batch_keys as usize;
        let l3 = config.long_tier.map(|tier| {
            let (paths, workers) = match tier.layout {
                LongLayout::Single { path } => (vec![path], None),
                LongLayout::Striped {
                    paths,
                    workers_per_shard,
                } => (paths, Some(workers_per_shard)),
            };
            let mut ts = infera_kvd::TablespaceConfig::new(paths, tier.bytes.bytes());
            ts.io_mode = tier.io_mode.into();
            ts.container_bytes = tier.container_bytes.bytes();
            match tier.journal_sync {
                JournalSync::Every(window) => ts.set_flush_interval(window.0),
                JournalSync::Decided(SyncSource::FileSystem) => ts.sync_by_file_system = true,
            }
            ts.durable_writes = tier.durable_writes;
            if let Some(workers) = workers {
                ts.workers_per_shard = workers;
            }
            ts
        });
        let l4 = config.l4_tier.and_then(|tier| tier.resolved);
        options.long = match (l3, l4) {
            (Some(ts), Some(l4)) => Some(infera_kvd::LongBackendConfig::Stacked(ts, l4)),
            (Some(ts), None) => Some(infera_kvd::LongBackendConfig::Tablespace(ts)),
            (None, Some(l4)) => Some(infera_kvd::LongBackendConfig::L4(l4)),
            (None, None) => None,
        };
        options
    }
}

#[cfg(test)]
mod tests;
