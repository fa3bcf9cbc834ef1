//! [`KvdConfig`]: the validated configuration of `infera kvd`.
//!
//! Built only by `TryFrom<KvdArgs>`, which checks: `--max-bytes`, `--long-bytes`,
//! `--long-workers-per-shard`, `--max-connections`, `--max-batch-keys` and `--frame-timeout`
//! are positive (`--idle-timeout 0` means never); `--long-path` and `--long-paths` are not both
//! given; striped paths are non-empty and distinct; `--long-backend` is available in this
//! build (the daemon's resolver, `infera_kvd::long::check_available`, says which: the L4 stores
//! are not yet). `--use-tablespace` is accepted and ignored with a warning.
//! `--shared-arena-bytes auto` resolves to `--max-bytes`.
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
    /// L4: a Mooncake Store cluster (not available yet).
    Mooncake,
    /// L4: an LMCache remote backend (not available yet).
    Lmcache,
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
    /// Acknowledge `long` writes only once durable (`--durable-long-writes`).
    pub durable_writes: bool,
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
    /// The L3 tier; `None` when neither `--long-path` nor `--long-paths` is given.
    pub long_tier: Option<LongTierConfig>,
    /// Per-connection bounds.
    pub limits: ConnectionLimits,
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
        let backend = match args.long_backend {
            LongBackend::Tablespace => "tablespace",
            LongBackend::Mooncake => "mooncake",
            LongBackend::Lmcache => "lmcache",
        };
        infera_kvd::long::check_available(backend)
            .map_err(|reason| ConfigError::new("--long-backend", reason))?;
        if args.use_tablespace {
            tracing::warn!(
                "--use-tablespace is deprecated and has no effect: \
                 the L3 tier always uses the tablespace layout"
            );
        }
        let layout = match (args.long_path, args.long_paths) {
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
        Ok(Self {
            socket: args.socket,
            max_bytes,
            shared_arena_bytes,
            long_tier: layout.map(|layout| LongTierConfig {
                layout,
                bytes: long_bytes,
                io_mode: io_mode(args.io_mode, std::env::var(IO_MODE_ENV).ok().as_deref()),
                durable_writes: args.durable_long_writes,
            }),
            limits,
        })
    }
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
        }
    }
}

impl From<KvdConfig> for infera_kvd::KvdOptions {
    /// The daemon's options: the RAM tier, the arena, and the L3 tablespace when a region is
    /// configured (one shard per `--long-paths` directory; `--long-workers-per-shard` I/O
    /// workers each, the daemon's default for a single `--long-path`).
    fn from(config: KvdConfig) -> Self {
        let mut options = infera_kvd::KvdOptions::new(config.socket, config.max_bytes.bytes());
        options.shared_arena_bytes = config.shared_arena_bytes.bytes();
        options.max_connections = config.limits.max_connections as usize;
        options.idle_timeout = config.limits.idle_timeout.map(|d| d.0);
        options.frame_timeout = config.limits.frame_timeout.0;
        options.max_batch_keys = config.limits.max_batch_keys as usize;
        options.long = config.long_tier.map(|tier| {
            let (paths, workers) = match tier.layout {
                LongLayout::Single { path } => (vec![path], None),
                LongLayout::Striped {
                    paths,
                    workers_per_shard,
                } => (paths, Some(workers_per_shard)),
            };
            let mut ts = infera_kvd::TablespaceConfig::new(paths, tier.bytes.bytes());
            ts.io_mode = tier.io_mode.into();
            ts.durable_writes = tier.durable_writes;
            if let Some(workers) = workers {
                ts.workers_per_shard = workers;
            }
            infera_kvd::LongBackendConfig::Tablespace(ts)
        });
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
        let cases: [(&[&str], &str); 9] = [
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
            (&["--long-backend", "mooncake"], "--long-backend"),
            (&["--long-backend", "lmcache"], "--long-backend"),
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
        let config = parse(&["--long-paths", "/a,/b"]).unwrap();
        let json = serde_json::to_string(&config).unwrap();
        assert_eq!(serde_json::from_str::<KvdConfig>(&json).unwrap(), config);
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
