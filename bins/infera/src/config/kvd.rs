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
//! `--shared-arena-bytes auto` resolves to `--max-bytes`.
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

/// The long-term store behind the RAM tier (`--long-backend`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LongBackend {
    /// L3: container files on local NVMe (or NFS).
    Tablespace,
    /// L4: a Mooncake Store cluster (`--mooncake-config`), instead of L3.
    Mooncake,
    /// L4: an LMCache remote store (Redis/Valkey layout or `lm://` server), instead of L3.
    Lmcache,
}

/// The store stacked behind L3 (`--l4-backend`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum L4Backend {
    /// An LMCache remote store (Redis/Valkey layout or `lm://` server).
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

/// The Python tablespace's default slot size (`--tablespace-slot-bytes`).
const PYTHON_SLOT_BYTES: u64 = 64 << 10;
/// The O_DIRECT alignment the Python tablespace requires of a slot size.
const DIRECT_ALIGN: u64 = 4096;
/// The container size without `--tablespace-container-bytes` (the Python kvd's too).
const CONTAINER_BYTES: u64 = 1 << 30;

const NO_SLOTS: &str = "this kvd's L3 has no fixed-size slots: each block takes an extent of \
                        its own size (4 KiB units) in one region, so blocks of every size fit";
const NO_REGION: &str = "no L3 region without --long-path or --long-paths (as in the Python kvd)";

/// The L3 tier of `layout`, with the Python kvd's tablespace flags resolved and validated as
/// the Python validates them when it builds the region; `env_io_mode` is `INFERA_KVD_IO_MODE`.
fn long_tier(
    args: &KvdArgs,
    layout: LongLayout,
    bytes: ByteSize,
    env_io_mode: Option<&str>,
    inert: &mut Vec<InertFlag>,
) -> Result<LongTierConfig, ConfigError> {
    // The Python's order: --tablespace-buffered-io, then --tablespace-auto-detect-fs, then
    // INFERA_KVD_IO_MODE, then --io-mode.
    let io_mode = if args.tablespace_buffered_io {
        tracing::info!("L3 io_mode buffered (--tablespace-buffered-io)");
        IoMode::Buffered
    } else if args.tablespace_auto_detect_fs {
        IoMode::FileSystem
    } else {
        io_mode(args.io_mode, env_io_mode)
    };
    let default_sync = JournalSync::Every(HumanDuration(
        infera_kvd::TablespaceConfig::new(Vec::new(), 0).journal_sync,
    ));
    let (journal_sync, durable_writes) = match args.tablespace_flush_interval_ms {
        Some(ms) if ms <= 0 => (default_sync, true),
        Some(ms) => (
            JournalSync::Every(HumanDuration(std::time::Duration::from_millis(ms as u64))),
            args.durable_long_writes,
        ),
        None if args.tablespace_auto_detect_fs => (
            JournalSync::Decided(SyncSource::FileSystem),
            args.durable_long_writes,
        ),
        None => (default_sync, args.durable_long_writes),
    };
    let container_bytes = positive(
        "--tablespace-container-bytes",
        args.tablespace_container_bytes
            .map_or(CONTAINER_BYTES, ByteSize::bytes),
    )?;
    let direct = io_mode == IoMode::Direct;
    let pools = match (pools_spec(args), &layout) {
        (Some(spec), LongLayout::Single { .. }) => Some(tablespace_pools(spec, direct)?),
        _ => None,
    };
    if pools.is_none() {
        let slot = args
            .tablespace_slot_bytes
            .map_or(PYTHON_SLOT_BYTES, ByteSize::bytes);
        let slot = positive("--tablespace-slot-bytes", slot)?;
        if container_bytes < slot {
            return Err(ConfigError::new(
                "--tablespace-container-bytes",
                format!(
                    "{} is smaller than --tablespace-slot-bytes {}, which the Python kvd \
                     refuses",
                    ByteSize(container_bytes),
                    ByteSize(slot)
                ),
            ));
        }
        if direct && !slot.is_multiple_of(DIRECT_ALIGN) {
            return Err(ConfigError::new(
                "--tablespace-slot-bytes",
                format!(
                    "{} is not a multiple of 4096, which the Python kvd refuses under O_DIRECT",
                    ByteSize(slot)
                ),
            ));
        }
    }
    if let Some(slot) = args.tablespace_slot_bytes {
        inert.push(InertFlag::new("--tablespace-slot-bytes", slot, NO_SLOTS));
    }
    if let Some(spec) = pools_spec(args) {
        inert.push(InertFlag::new("--tablespace-pools", spec.trim(), NO_SLOTS));
    }
    Ok(LongTierConfig {
        layout,
        bytes,
        io_mode,
        durable_writes,
        journal_sync,
        container_bytes: ByteSize(container_bytes),
    })
}

/// Lists the tablespace flags given without an L3 region (the Python ignores them too).
fn no_region(args: &KvdArgs, inert: &mut Vec<InertFlag>) {
    let mut add = |flag: &str, value: Option<String>| {
        if let Some(value) = value {
            inert.push(InertFlag::new(flag, value, NO_REGION));
        }
    };
    let switch = |on: bool| on.then(String::new);
    add(
        "--tablespace-buffered-io",
        switch(args.tablespace_buffered_io),
    );
    add(
        "--tablespace-auto-detect-fs",
        switch(args.tablespace_auto_detect_fs),
    );
    add(
        "--tablespace-flush-interval-ms",
        args.tablespace_flush_interval_ms.map(|ms| ms.to_string()),
    );
    add(
        "--tablespace-container-bytes",
        args.tablespace_container_bytes.map(|b| b.to_string()),
    );
    add(
        "--tablespace-slot-bytes",
        args.tablespace_slot_bytes.map(|b| b.to_string()),
    );
    add(
        "--tablespace-pools",
        pools_spec(args).map(|p| p.trim().to_owned()),
    );
}

/// `--tablespace-pools`, unless empty: the Python reads `--tablespace-pools ''` as no pools.
fn pools_spec(args: &KvdArgs) -> Option<&str> {
    args.tablespace_pools.as_deref().filter(|s| !s.is_empty())
}

/// One pool of `--tablespace-pools`: a slot size and its weight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Pool {
    slot_bytes: u64,
    weight: u64,
}

/// Checks a `--tablespace-pools` spec as the Python kvd does when it builds the pools:
/// `SIZE[*WEIGHT]` entries (a size is an integer with an optional K/M/G/T, powers of 1024; a
/// weight a positive integer), empty entries skipped, at least one pool, no size twice, and
/// under O_DIRECT every size a multiple of 4096.
fn tablespace_pools(spec: &str, direct: bool) -> Result<Vec<Pool>, ConfigError> {
    let invalid = |why: String| ConfigError::new("--tablespace-pools", why);
    let mut pools: Vec<Pool> = Vec::new();
    for entry in spec.split(',').map(str::trim).filter(|e| !e.is_empty()) {
        let (size, weight) = match entry.split_once('*') {
            Some((size, weight)) => (size.trim(), Some(weight.trim())),
            None => (entry, None),
        };
        let slot_bytes = pool_size(size).ok_or_else(|| {
            invalid(format!(
                "has '{size}' in '{entry}', not a slot size: an integer with an optional \
                 K, M, G or T, e.g. 64K,1M"
            ))
        })?;
        let weight = match weight {
            None => 1,
            Some(w) => w.parse().ok().filter(|w| *w > 0).ok_or_else(|| {
                invalid(format!(
                    "has the weight '{w}' in '{entry}'; a weight is a positive integer, \
                     e.g. 64K*1,1M*4"
                ))
            })?,
        };
        if pools.iter().any(|p| p.slot_bytes == slot_bytes) {
            return Err(invalid(format!(
                "lists the slot size {} twice",
                ByteSize(slot_bytes)
            )));
        }
        if direct && !slot_bytes.is_multiple_of(DIRECT_ALIGN) {
            return Err(invalid(format!(
                "has the slot size {} under O_DIRECT, which the Python kvd refuses: it must \
                 be a multiple of 4096",
                ByteSize(slot_bytes)
            )));
        }
        pools.push(Pool { slot_bytes, weight });
    }
    if pools.is_empty() {
        return Err(invalid(format!(
            "'{spec}' names no pool; pass slot sizes such as 64K,1M"
        )));
    }
    Ok(pools)
}

/// A positive pool slot size as the Python reads it: `4096`, `64K`, `1M` (any case).
fn pool_size(text: &str) -> Option<u64> {
    let upper = text.to_ascii_uppercase();
    let (digits, unit) = match upper.char_indices().last()? {
        (i, 'K') => (&upper[..i], 1u64 << 10),
        (i, 'M') => (&upper[..i], 1 << 20),
        (i, 'G') => (&upper[..i], 1 << 30),
        (i, 'T') => (&upper[..i], 1 << 40),
        _ => (upper.as_str(), 1),
    };
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits
        .parse::<u64>()
        .ok()?
        .checked_mul(unit)
        .filter(|n| *n > 0)
}

/// Checks the L4 flags and resolves the store's settings (`env` looks variables up).
fn l4_tier(
    args: &KvdArgs,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Option<L4TierConfig>, ConfigError> {
    let l3 = args.long_path.is_some() || args.long_paths.is_some();
    let alone = match args.long_backend {
        LongBackend::Tablespace => None,
        LongBackend::Lmcache => Some(L4Backend::Lmcache),
        LongBackend::Mooncake => Some(L4Backend::Mooncake),
    };
    let (store, placement) = match (alone, args.l4_backend) {
        (Some(store), Some(_)) => {
            return Err(ConfigError::new(
                "--l4-backend",
                format!(
                    "stacks an L4 behind L3 and cannot be combined with --long-backend {} (L4 \
                     instead of L3); choose one",
                    store.name()
                ),
            ));
        }
        (Some(store), None) if l3 => {
            let name = store.name();
            return Err(ConfigError::new(
                "--long-backend",
                format!(
                    "{name} replaces L3 and cannot be combined with --long-path/--long-paths; \
                     to keep L3 and add an L4 behind it use --l4-backend {name}"
                ),
            ));
        }
        (Some(store), None) => (store, "instead_of_l3"),
        (None, Some(store)) if l3 => (store, "behind_l3"),
        (None, Some(store)) => {
            return Err(ConfigError::new(
                "--l4-backend",
                format!(
                    "stacks an L4 behind the L3 tablespace and needs --long-path or \
                     --long-paths; for an L4 alone use --long-backend {}",
                    store.name()
                ),
            ));
        }
        (None, None) => {
            if args.l4_required {
                return Err(ConfigError::new(
                    "--l4-required",
                    "needs an L4: --long-backend lmcache|mooncake or --l4-backend lmcache|mooncake",
                ));
            }
            if args.lmcache_config.is_some() {
                tracing::warn!("--lmcache-config has no effect without an LMCache L4");
            }
            return Ok(None);
        }
    };
    let mut resolved = match store {
        L4Backend::Lmcache => {
            infera_kvd::l4::L4Config::from_lmcache(args.lmcache_config.as_deref(), env)
                .map_err(|reason| ConfigError::new("--lmcache-config", reason))?
        }
        L4Backend::Mooncake => {
            infera_kvd::l4::L4Config::from_mooncake(args.mooncake_config.as_deref(), env)
                .map_err(|reason| ConfigError::new("--mooncake-config", reason))?
        }
    };
    resolved.required = args.l4_required;
    Ok(Some(L4TierConfig {
        store: store.name().to_owned(),
        placement: placement.to_owned(),
        remote_url: resolved.remote_url.clone(),
        prefix: resolved.prefix.clone(),
        max_value_bytes: resolved.max_value_bytes,
        rpc_timeout: HumanDuration(resolved.rpc_timeout),
        connector_extra: resolved
            .connector_extra
            .iter()
            .map(|(k, _)| k.clone())
            .collect(),
        required: resolved.required,
        resolved: Some(resolved),
    }))
}

/// The variable that overrides `--io-mode` (the Python kvd's operator escape hatch).
pub const IO_MODE_ENV: &str = "INFERA_KVD_IO_MODE";

/// The L3 I/O mode: [`IO_MODE_ENV`] when it is `direct` or `buffered` (any case, trimmed),
/// else the flag. The environment wins, as the Python kvd reads it.
fn io_mode(flag: IoMode, env: Option<&str>) -> IoMode {
    match env.map(|v| v.trim().to_ascii_lowercase()).as_deref() {
        Some("direct") => {
            tracing::info!("L3 io_mode direct ({IO_MODE_ENV})");
            IoMode::Direct
        }
        Some("buffered") => {
            tracing::info!("L3 io_mode buffered ({IO_MODE_ENV})");
            IoMode::Buffered
        }
        _ => flag,
    }
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

/// Splits the comma-separated shard list: no empty entry, no directory twice.
fn striped_paths(list: &str) -> Result<Vec<PathBuf>, ConfigError> {
    let mut paths: Vec<PathBuf> = Vec::new();
    for entry in list.split(',').map(str::trim) {
        if entry.is_empty() {
            return Err(ConfigError::new(
                "--long-paths",
                format!(
                    "has an empty entry in '{list}'; pass comma-separated directories, \
                     e.g. /mnt/nvme0/kvd,/mnt/nvme1/kvd"
                ),
            ));
        }
        let path = PathBuf::from(entry);
        if paths.contains(&path) {
            return Err(ConfigError::new(
                "--long-paths",
                format!("lists {entry} twice; each shard needs its own directory"),
            ));
        }
        paths.push(path);
    }
    Ok(paths)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::{Cli, Command};
    use clap::Parser;

    fn parse(extra: &[&str]) -> Result<KvdConfig, ConfigError> {
        let mut argv = vec!["infera", "kvd"];
        argv.extend_from_slice(extra);
        match Cli::try_parse_from(argv).unwrap().command {
            Command::Kvd(args) => KvdConfig::try_from(args),
            other => panic!("parsed as {other:?}"),
        }
    }

    #[test]
    fn defaults_resolve_the_arena_to_the_ram_budget() {
        let config = parse(&[]).unwrap();
        assert_eq!(config.socket, PathBuf::from("/var/run/infera-kvd.sock"));
        assert_eq!(config.max_bytes, ByteSize(8 << 30));
        assert_eq!(config.shared_arena_bytes, config.max_bytes);
        assert_eq!(config.long_tier, None);
        let config = parse(&["--max-bytes", "1G", "--shared-arena-bytes", "0"]).unwrap();
        assert_eq!(config.shared_arena_bytes, ByteSize(0));
        let config = parse(&["--max-bytes", "1G", "--shared-arena-bytes", "512MiB"]).unwrap();
        assert_eq!(config.shared_arena_bytes, ByteSize(512 << 20));
    }

    #[test]
    fn long_path_makes_a_single_region() {
        let config = parse(&["--long-path", "/mnt/a", "--io-mode", "buffered"]).unwrap();
        assert_eq!(
            config.long_tier,
            Some(LongTierConfig {
                layout: LongLayout::Single {
                    path: "/mnt/a".into()
                },
                bytes: ByteSize(32 << 30),
                io_mode: IoMode::Buffered,
                durable_writes: false,
                journal_sync: JournalSync::Every(HumanDuration(std::time::Duration::from_millis(
                    200
                ))),
                container_bytes: ByteSize(1 << 30),
            })
        );
    }

    #[test]
    fn long_paths_make_a_striped_region_in_order() {
        let config = parse(&["--long-paths", "/b,/a", "--long-workers-per-shard", "2"]).unwrap();
        let tier = config.long_tier.unwrap();
        assert_eq!(
            tier.layout,
            LongLayout::Striped {
                paths: vec!["/b".into(), "/a".into()],
                workers_per_shard: 2
            }
        );
        assert_eq!(
            parse(&["--long-paths", "/a,/a"]).unwrap_err().flag,
            "--long-paths"
        );
        assert_eq!(
            parse(&["--long-paths", "/a,,/b"]).unwrap_err().flag,
            "--long-paths"
        );
        assert_eq!(
            parse(&["--long-paths", ""]).unwrap_err().flag,
            "--long-paths"
        );
    }

    #[test]
    fn invalid_combinations_name_the_flag() {
        let cases: [(&[&str], &str); 12] = [
            (&["--max-bytes", "0"], "--max-bytes"),
            (&["--max-connections", "0"], "--max-connections"),
            (&["--max-batch-keys", "0"], "--max-batch-keys"),
            (&["--frame-timeout", "0"], "--frame-timeout"),
            (&["--long-bytes", "0"], "--long-bytes"),
            (
                &["--long-workers-per-shard", "0"],
                "--long-workers-per-shard",
            ),
            (
                &["--long-path", "/a", "--long-paths", "/b,/c"],
                "--long-path",
            ),
            (&["--long-backend", "mooncake"], "--mooncake-config"),
            (
                &["--long-backend", "lmcache", "--long-path", "/a"],
                "--long-backend",
            ),
            (
                &["--long-backend", "mooncake", "--long-path", "/a"],
                "--long-backend",
            ),
            (&["--l4-backend", "lmcache"], "--l4-backend"),
            (&["--l4-backend", "mooncake"], "--l4-backend"),
        ];
        for (argv, flag) in cases {
            assert_eq!(parse(argv).unwrap_err().flag, flag, "{argv:?}");
        }
    }

    #[test]
    fn connection_limits_default_and_reach_the_daemon() {
        let config = parse(&[]).unwrap();
        assert_eq!(
            config.limits,
            ConnectionLimits {
                max_connections: 1024,
                idle_timeout: Some(HumanDuration(std::time::Duration::from_secs(600))),
                frame_timeout: HumanDuration(std::time::Duration::from_secs(30)),
                max_batch_keys: 131_072,
            }
        );
        let options = infera_kvd::KvdOptions::from(
            parse(&[
                "--max-connections",
                "8",
                "--idle-timeout",
                "0",
                "--frame-timeout",
                "2s",
                "--max-batch-keys",
                "100",
                "--long-path",
                "/a",
                "--durable-long-writes",
            ])
            .unwrap(),
        );
        assert_eq!(options.max_connections, 8);
        assert_eq!(options.idle_timeout, None);
        assert_eq!(options.frame_timeout, std::time::Duration::from_secs(2));
        assert_eq!(options.max_batch_keys, 100);
        let Some(infera_kvd::LongBackendConfig::Tablespace(ts)) = options.long else {
            panic!("{:?}", options.long);
        };
        assert!(ts.durable_writes);
    }

    fn tier(argv: &[&str]) -> LongTierConfig {
        let mut argv = argv.to_vec();
        argv.extend(["--long-path", "/l3"]);
        parse(&argv).unwrap().long_tier.unwrap()
    }

    fn ts(argv: &[&str]) -> infera_kvd::TablespaceConfig {
        let mut argv = argv.to_vec();
        argv.extend(["--long-path", "/l3"]);
        match infera_kvd::KvdOptions::from(parse(&argv).unwrap()).long {
            Some(infera_kvd::LongBackendConfig::Tablespace(ts)) => ts,
            other => panic!("{other:?}"),
        }
    }

    fn inert(argv: &[&str]) -> Vec<(String, String)> {
        parse(argv)
            .unwrap()
            .inert_flags
            .into_iter()
            .map(|f| (f.flag, f.value))
            .collect()
    }

    fn owned(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(f, v)| ((*f).to_owned(), (*v).to_owned()))
            .collect()
    }

    #[test]
    fn every_python_kvd_flag_is_accepted() {
        let config = parse(&[
            "--long-path",
            "/l3",
            "--mooncake-config",
            "/etc/mooncake.yaml",
            "--tablespace-slot-bytes",
            "64K",
            "--tablespace-container-bytes",
            "2G",
            "--tablespace-flush-interval-ms",
            "20",
            "--tablespace-buffered-io",
            "--tablespace-auto-detect-fs",
            "--shared-arena-pin",
            "--no-shared-arena-pin",
            "--shared-arena-hugetlb",
            "--log-level",
            "DEBUG",
        ]);
        let config = config.unwrap();
        assert_eq!(config.log_level, LogLevel::Debug);
        assert!(config.shared_arena_hugetlb);
        let tier = config.long_tier.unwrap();
        assert_eq!(tier.io_mode, IoMode::Buffered);
        assert_eq!(tier.container_bytes, ByteSize(2 << 30));
        // The Python's --tablespace-pools is only read with one --long-path (the recipe's).
        let recipe = parse(&[
            "--long-path",
            "/kvd-l3",
            "--io-mode",
            "direct",
            "--use-tablespace",
            "--tablespace-pools",
            "1M,4M",
        ])
        .unwrap();
        assert_eq!(recipe.long_tier.unwrap().io_mode, IoMode::Direct);
        assert_eq!(
            recipe
                .inert_flags
                .iter()
                .map(|f| (f.flag.as_str(), f.value.as_str()))
                .collect::<Vec<_>>(),
            [("--tablespace-pools", "1M,4M")]
        );
        assert!(
            recipe.inert_flags[0]
                .reason
                .contains("extent of its own size")
        );
    }

    #[test]
    fn log_level_takes_the_python_names_and_sets_the_filter() {
        assert_eq!(parse(&[]).unwrap().log_level, LogLevel::Info);
        for (name, level, directive) in [
            ("DEBUG", LogLevel::Debug, "debug"),
            ("INFO", LogLevel::Info, "info"),
            ("WARNING", LogLevel::Warning, "warn"),
            ("error", LogLevel::Error, "error"),
        ] {
            let config = parse(&["--log-level", name]).unwrap();
            assert_eq!((config.log_level, level.directive()), (level, directive));
        }
        let argv = ["infera", "kvd", "--log-level", "TRACE"];
        assert!(Cli::try_parse_from(argv).is_err(), "not a Python level");
        let json = serde_json::to_value(parse(&["--log-level", "warning"]).unwrap()).unwrap();
        assert_eq!(json["log_level"], "WARNING");
    }

    #[test]
    fn flush_interval_is_the_journal_sync_or_durable_writes() {
        let ms = |n| JournalSync::Every(HumanDuration(std::time::Duration::from_millis(n)));
        let nfs = tier(&["--tablespace-flush-interval-ms", "20"]);
        assert_eq!((nfs.journal_sync, nfs.durable_writes), (ms(20), false));
        let options = ts(&["--tablespace-flush-interval-ms", "20"]);
        assert_eq!(options.journal_sync, std::time::Duration::from_millis(20));
        assert!(!options.durable_writes && !options.sync_by_file_system);
        for inline in ["0", "-5"] {
            let tier = tier(&["--tablespace-flush-interval-ms", inline]);
            assert_eq!((tier.journal_sync, tier.durable_writes), (ms(200), true));
            assert!(ts(&["--tablespace-flush-interval-ms", inline]).durable_writes);
        }
        let default = ts(&[]);
        assert_eq!(
            (
                default.journal_sync,
                default.journal_flush,
                default.durable_writes
            ),
            (
                std::time::Duration::from_millis(200),
                std::time::Duration::from_millis(5),
                false
            )
        );
        let argv = ["infera", "kvd", "--tablespace-flush-interval-ms", "2.5"];
        assert!(
            Cli::try_parse_from(argv).is_err(),
            "an integer, as in the Python"
        );
    }

    #[test]
    fn io_mode_follows_the_pythons_precedence() {
        let mode = |argv: &[&str], env: Option<&str>| {
            let mut argv = argv.to_vec();
            argv.extend(["--long-path", "/l3"]);
            let mut full = vec!["infera", "kvd"];
            full.extend_from_slice(&argv);
            let Command::Kvd(args) = Cli::try_parse_from(full).unwrap().command else {
                panic!("not kvd");
            };
            let layout = LongLayout::Single { path: "/l3".into() };
            long_tier(&args, layout, ByteSize(1 << 30), env, &mut Vec::new())
                .unwrap()
                .io_mode
        };
        let buffered = ["--tablespace-buffered-io", "--io-mode", "direct"];
        assert_eq!(mode(&buffered, Some("direct")), IoMode::Buffered);
        let both = ["--tablespace-buffered-io", "--tablespace-auto-detect-fs"];
        assert_eq!(mode(&both, None), IoMode::Buffered);
        let fs = ["--tablespace-auto-detect-fs", "--io-mode", "direct"];
        assert_eq!(mode(&fs, Some("direct")), IoMode::FileSystem);
        assert_eq!(
            mode(&["--io-mode", "buffered"], Some("direct")),
            IoMode::Direct
        );
        assert_eq!(mode(&[], None), IoMode::Auto);

        let auto = tier(&["--tablespace-auto-detect-fs"]);
        assert_eq!(
            auto.journal_sync,
            JournalSync::Decided(SyncSource::FileSystem)
        );
        let options = ts(&["--tablespace-auto-detect-fs"]);
        assert_eq!(options.io_mode, infera_kvd::IoMode::FileSystem);
        assert!(options.sync_by_file_system && !options.durable_writes);
        let explicit = ts(&[
            "--tablespace-auto-detect-fs",
            "--tablespace-flush-interval-ms",
            "7",
        ]);
        assert!(!explicit.sync_by_file_system, "an explicit window wins");
        assert_eq!(explicit.journal_sync, std::time::Duration::from_millis(7));
        let json = serde_json::to_value(tier(&["--tablespace-auto-detect-fs"])).unwrap();
        assert_eq!(json["journal_sync"], "file_system");
        let mut argv = vec!["infera", "kvd", "--io-mode", "file-system"];
        assert!(
            Cli::try_parse_from(&argv).is_err(),
            "not an --io-mode value"
        );
        argv[3] = "file_system";
        assert!(
            Cli::try_parse_from(&argv).is_err(),
            "not an --io-mode value"
        );
    }

    #[test]
    fn container_bytes_size_the_containers() {
        assert_eq!(tier(&[]).container_bytes, ByteSize(1 << 30));
        let options = ts(&["--tablespace-container-bytes", "256M"]);
        assert_eq!(options.container_bytes, 256 << 20);
        let cases: [(&[&str], &str); 4] = [
            (
                &["--tablespace-container-bytes", "0"],
                "--tablespace-container-bytes",
            ),
            (
                &["--tablespace-container-bytes", "32K"],
                "--tablespace-container-bytes",
            ),
            (
                &[
                    "--tablespace-container-bytes",
                    "32K",
                    "--tablespace-slot-bytes",
                    "16K",
                ],
                "",
            ),
            (&["--tablespace-slot-bytes", "0"], "--tablespace-slot-bytes"),
        ];
        for (argv, flag) in cases {
            let mut argv = argv.to_vec();
            argv.extend(["--long-path", "/l3"]);
            match parse(&argv) {
                Ok(_) => assert_eq!(flag, "", "{argv:?}"),
                Err(error) => assert_eq!(error.flag, flag, "{argv:?}"),
            }
        }
    }

    #[test]
    fn slot_sizes_are_validated_as_the_python_does_and_listed_as_inert() {
        let direct = ["--long-path", "/l3", "--io-mode", "direct"];
        let with = |extra: &[&str]| {
            let mut argv = direct.to_vec();
            argv.extend_from_slice(extra);
            parse(&argv)
        };
        assert_eq!(
            with(&["--tablespace-slot-bytes", "6000"]).unwrap_err().flag,
            "--tablespace-slot-bytes"
        );
        assert!(with(&["--tablespace-slot-bytes", "8K"]).is_ok());
        assert_eq!(
            inert(&["--long-path", "/l3", "--tablespace-slot-bytes", "6000"]),
            owned(&[("--tablespace-slot-bytes", "6000B")]),
            "buffered I/O takes any size"
        );
        assert_eq!(inert(&["--long-path", "/l3", "--tablespace-pools", ""]), []);
        let refused = [
            " ", " , ", "64K,64k", "1MiB", "1.5M", "0", "64K*0", "64K*-1", "64K*x", "K", "6000",
        ];
        for spec in refused {
            let error = with(&["--tablespace-pools", spec]).unwrap_err();
            assert_eq!(error.flag, "--tablespace-pools", "{spec:?}");
        }
        let accepted = ["64K,1M", "64K*1, 1M*4 ,4M*1", "4096,,1m", "1M,4M"];
        for spec in accepted {
            assert!(with(&["--tablespace-pools", spec]).is_ok(), "{spec}");
        }
        assert_eq!(
            tablespace_pools("64K*1,1M*4", false).unwrap(),
            [
                Pool {
                    slot_bytes: 64 << 10,
                    weight: 1
                },
                Pool {
                    slot_bytes: 1 << 20,
                    weight: 4
                }
            ]
        );
        // Pools stand in for the slot size: the slot size is not then checked.
        assert!(
            with(&[
                "--tablespace-pools",
                "64K",
                "--tablespace-slot-bytes",
                "6000"
            ])
            .is_ok()
        );
        // The Python reads no pools for a striped region; it checks the slot size instead.
        let striped = [
            "--long-paths",
            "/a,/b",
            "--io-mode",
            "direct",
            "--tablespace-pools",
            "6000",
        ];
        assert!(parse(&striped).is_ok());
    }

    #[test]
    fn flags_without_a_region_or_a_backend_are_inert_and_named() {
        assert_eq!(inert(&[]), []);
        assert_eq!(
            inert(&[
                "--tablespace-buffered-io",
                "--tablespace-auto-detect-fs",
                "--tablespace-flush-interval-ms",
                "20",
                "--tablespace-container-bytes",
                "0",
                "--tablespace-slot-bytes",
                "64K",
                "--tablespace-pools",
                " junk ",
            ]),
            owned(&[
                ("--tablespace-buffered-io", ""),
                ("--tablespace-auto-detect-fs", ""),
                ("--tablespace-flush-interval-ms", "20"),
                ("--tablespace-container-bytes", "0B"),
                ("--tablespace-slot-bytes", "64KiB"),
                ("--tablespace-pools", "junk"),
            ]),
            "the Python reads none of them without an L3 region"
        );
        assert_eq!(
            inert(&["--mooncake-config", "/m.yaml", "--shared-arena-pin"]),
            owned(&[("--mooncake-config", "/m.yaml"), ("--shared-arena-pin", ""),])
        );
        assert_eq!(inert(&["--no-shared-arena-pin"]), []);
        assert_eq!(
            inert(&["--shared-arena-pin", "--no-shared-arena-pin"]),
            [],
            "the last of the pair wins, as in argparse"
        );
        let error = parse(&["--long-backend", "mooncake", "--mooncake-config", "/m.yaml"]);
        let error = error.unwrap_err();
        assert_eq!(error.flag, "--mooncake-config");
        assert!(error.reason.contains("cannot read /m.yaml"), "{error:?}");
        let json = serde_json::to_value(parse(&["--shared-arena-pin"]).unwrap()).unwrap();
        assert!(
            json["inert_flags"][0]["reason"]
                .as_str()
                .unwrap()
                .contains("does not mlock")
        );
        let plain = serde_json::to_value(parse(&[]).unwrap()).unwrap();
        assert!(plain.get("inert_flags").is_none(), "omitted when none");
    }

    #[test]
    fn a_mooncake_store_replaces_l3_or_stacks_behind_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("mooncake.yaml");
        std::fs::write(
            &path,
            "master_address: 127.0.0.1:50051\ncluster_id: team\nlocal_hostname: 127.0.0.1:14001\n",
        )
        .unwrap();
        let file = path.to_str().unwrap();
        let alone = parse(&["--long-backend", "mooncake", "--mooncake-config", file]).unwrap();
        let tier = alone.l4_tier.clone().unwrap();
        assert_eq!(
            (
                tier.store.as_str(),
                tier.placement.as_str(),
                tier.prefix.as_str()
            ),
            ("mooncake", "instead_of_l3", "team")
        );
        assert_eq!(tier.remote_url, "mooncake://127.0.0.1:50051");
        assert!(alone.inert_flags.is_empty(), "{:?}", alone.inert_flags);
        let options = infera_kvd::KvdOptions::from(alone);
        assert!(matches!(
            options.long,
            Some(infera_kvd::LongBackendConfig::L4(_))
        ));

        let stacked = parse(&[
            "--long-path",
            "/l3",
            "--l4-backend",
            "mooncake",
            "--mooncake-config",
            file,
        ]);
        let tier = stacked.unwrap().l4_tier.unwrap();
        assert_eq!(
            (tier.store.as_str(), tier.placement.as_str()),
            ("mooncake", "behind_l3")
        );
    }

    #[test]
    fn hugetlb_comes_from_the_flag_or_the_pythons_variable() {
        let config = parse(&["--shared-arena-hugetlb"]).unwrap();
        assert!(config.shared_arena_hugetlb);
        let options = infera_kvd::KvdOptions::from(config);
        assert!(options.arena_backing.hugetlb);
        for yes in ["1", "TRUE", " yes ", "On"] {
            assert!(truthy(Some(yes)), "{yes}");
        }
        for no in ["0", "false", "2", "", "y"] {
            assert!(!truthy(Some(no)), "{no}");
        }
        assert!(!truthy(None));
    }

    #[test]
    fn use_tablespace_is_a_no_op() {
        assert_eq!(parse(&["--use-tablespace"]).unwrap(), parse(&[]).unwrap());
    }

    #[test]
    fn arena_size_parses_auto_and_sizes() {
        assert_eq!("AUTO".parse(), Ok(ArenaSize::Auto));
        assert_eq!("1K".parse(), Ok(ArenaSize::Bytes(ByteSize(1024))));
        assert!(
            "many"
                .parse::<ArenaSize>()
                .unwrap_err()
                .ends_with("or auto")
        );
        assert_eq!(ArenaSize::Auto.to_string(), "auto");
    }

    #[test]
    fn options_carry_the_arena_and_the_l3_region() {
        let options = infera_kvd::KvdOptions::from(
            parse(&[
                "--max-bytes",
                "1G",
                "--long-paths",
                "/a,/b",
                "--io-mode",
                "direct",
            ])
            .unwrap(),
        );
        assert_eq!(options.max_bytes, 1 << 30);
        assert_eq!(options.shared_arena_bytes, 1 << 30);
        let Some(infera_kvd::LongBackendConfig::Tablespace(ts)) = options.long else {
            panic!("{:?}", options.long);
        };
        assert_eq!(ts.paths, [PathBuf::from("/a"), PathBuf::from("/b")]);
        assert_eq!(
            (ts.bytes, ts.io_mode),
            (32 << 30, infera_kvd::IoMode::Direct)
        );
        assert_eq!(ts.workers_per_shard, 8);
        let ram_only = infera_kvd::KvdOptions::from(parse(&["--shared-arena-bytes", "0"]).unwrap());
        assert_eq!((ram_only.shared_arena_bytes, ram_only.long), (0, None));
        assert!(!ram_only.long_tier_requested);
    }

    #[test]
    fn the_config_round_trips_through_json() {
        let cases: [&[&str]; 3] = [
            &["--long-paths", "/a,/b"],
            &[
                "--long-path",
                "/a",
                "--tablespace-auto-detect-fs",
                "--shared-arena-pin",
            ],
            &["--long-path", "/a", "--tablespace-flush-interval-ms", "20"],
        ];
        for argv in cases {
            let config = parse(argv).unwrap();
            let json = serde_json::to_string(&config).unwrap();
            assert_eq!(serde_json::from_str::<KvdConfig>(&json).unwrap(), config);
        }
    }

    #[test]
    fn the_io_mode_variable_overrides_the_flag_as_in_the_python_kvd() {
        assert_eq!(io_mode(IoMode::Auto, Some(" Direct ")), IoMode::Direct);
        assert_eq!(io_mode(IoMode::Direct, Some("buffered")), IoMode::Buffered);
        assert_eq!(io_mode(IoMode::Direct, Some("auto")), IoMode::Direct);
        assert_eq!(io_mode(IoMode::Buffered, Some("")), IoMode::Buffered);
        assert_eq!(io_mode(IoMode::Auto, None), IoMode::Auto);
    }
}
