//! Flags of `infera kvd` (the seed's `python -m infera.kvd`).
//!
//! Only the shape of the command line lives here; `TryFrom<KvdArgs> for KvdConfig` checks it.
//! Where the seed gives no default (`--socket`, `--max-bytes`, `--long-bytes`), the Python
//! daemon's own defaults are used so that existing command lines keep their meaning.

use crate::config::kvd::{ArenaSize, IoMode, LongBackend};
use crate::config::units::{ByteSize, HumanDuration};
use clap::Args;
use std::path::PathBuf;

const L3: &str = "L3 tier (NVMe tablespace)";
const LIMITS: &str = "Connection limits";

/// Arguments of `infera kvd`.
#[derive(Debug, Clone, Args)]
pub struct KvdArgs {
    /// Unix socket path engines connect to.
    #[arg(long, default_value = "/var/run/infera-kvd.sock", value_name = "PATH")]
    pub socket: PathBuf,

    /// Host RAM (L2) budget, e.g. 64GiB, 512MiB, 1G or plain bytes.
    #[arg(long, default_value = "8GiB", value_name = "SIZE")]
    pub max_bytes: ByteSize,

    /// Zero-copy shared arena size: auto = --max-bytes; 0 = off (inline bytes on the socket).
    #[arg(long, default_value = "auto", value_name = "SIZE|auto")]
    pub shared_arena_bytes: ArenaSize,

    /// L3 region on a single device (directory); mutually exclusive with --long-paths.
    #[arg(long, value_name = "DIR", help_heading = L3)]
    pub long_path: Option<PathBuf>,

    /// L3 region striped across devices: comma-separated directories, one shard each;
    /// mutually exclusive with --long-path.
    #[arg(long, value_name = "DIR,DIR,...", help_heading = L3)]
    pub long_paths: Option<String>,

    /// L3 region size (with --long-paths: the total, split evenly across shards).
    #[arg(long, default_value = "32GiB", value_name = "SIZE", help_heading = L3)]
    pub long_bytes: ByteSize,

    /// (deprecated) no-op, accepted for backward compatibility; the L3 tier is always the
    /// container-file tablespace layout now.
    #[arg(long, help_heading = L3)]
    pub use_tablespace: bool,

    /// Long-term store, one only: tablespace (L3) | mooncake | lmcache (L4); the L4 stores are
    /// not available in this build yet (choosing one is refused with a one-line error).
    #[arg(long, value_enum, default_value = "tablespace", help_heading = L3)]
    pub long_backend: LongBackend,

    /// L3 I/O: auto picks O_DIRECT on NVMe, buffered on NFS/SATA/rotating disks (decided from
    /// /sys/block and logged at startup); io_uring is used where the kernel allows it.
    /// INFERA_KVD_IO_MODE=direct|buffered overrides this flag, as in the Python kvd.
    #[arg(long, value_enum, default_value = "auto", help_heading = L3)]
    pub io_mode: IoMode,

    /// Intra-shard I/O parallelism for the striped (--long-paths) region.
    #[arg(long, default_value_t = 8, value_name = "N", help_heading = L3)]
    pub long_workers_per_shard: u32,

    /// Acknowledge a `long` write only once it is durable: its block written and its journal
    /// record fdatasync'd (group commit: concurrent writers share one sync).
    ///
    /// Without this flag a `long` write is acknowledged once recorded. It survives a graceful
    /// stop, but a crash (kill -9, OOM kill, power loss) can lose the acknowledged writes of
    /// the last journal flush interval: 5 ms, up to about a second under heavy disk I/O (and
    /// up to the 200 ms journal sync interval more on power loss). Such a key then reads as
    /// its previous value or as a miss, never as another key's bytes. With this flag every
    /// acknowledged `long` write is readable after a crash and restart; a write that cannot be
    /// made durable is answered accepted=false, reason not_durable.
    #[arg(long, help_heading = L3)]
    pub durable_long_writes: bool,

    /// Most open client connections; one more is answered error{code: too_many_connections}
    /// and closed.
    #[arg(long, default_value_t = 1024, value_name = "N", help_heading = LIMITS)]
    pub max_connections: u32,

    /// Close a connection that sends no request for this long (0 = never).
    #[arg(long, default_value = "10m", value_name = "DURATION", help_heading = LIMITS)]
    pub idle_timeout: HumanDuration,

    /// A frame must arrive whole within this long of its first byte, or the connection is
    /// answered error{code: frame_timeout} and closed (a stalled or half-sent frame).
    #[arg(long, default_value = "30s", value_name = "DURATION", help_heading = LIMITS)]
    pub frame_timeout: HumanDuration,

    /// Most keys (or items) in one batch request (batch_get, batch_set, exists,
    /// prefetch_hint); a larger batch is answered error{code: too_many_keys} and the
    /// connection stays usable.
    #[arg(long, default_value_t = 131_072, value_name = "N", help_heading = LIMITS)]
    pub max_batch_keys: u32,

    /// Validate, print the resolved configuration as JSON on stdout and exit.
    #[arg(long)]
    pub check_config: bool,
}
