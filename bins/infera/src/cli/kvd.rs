//! Flags of `infera kvd` (the seed's `python -m infera.kvd`).
//!
//! Only the shape of the command line lives here; `TryFrom<KvdArgs> for KvdConfig` checks it.
//! Where the seed gives no default (`--socket`, `--max-bytes`, `--long-bytes`), the Python
//! daemon's own defaults are used so that existing command lines keep their meaning.
//!
//! Every flag of the Python kvd is accepted. Those whose knob this kvd does not have
//! (`--tablespace-slot-bytes`, `--tablespace-pools`, `--shared-arena-pin`, `--mooncake-config`
//! alone) are validated as the Python validates them, listed in `--check-config`'s
//! `inert_flags` with what this kvd does instead, and logged with a warning; their help says so.

use crate::config::kvd::{ArenaSize, IoMode, L4Backend, LogLevel, LongBackend};
use crate::config::units::{ByteSize, HumanDuration};
use clap::Args;
use std::path::PathBuf;

const L3: &str = "L3 tier (NVMe tablespace)";
const L4: &str = "L4 tier (remote store shared by a fleet)";
const EVENTS: &str = "Inventory events (for the router)";
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

    /// (Python kvd flag; no effect here) Lock the shared arena's pages in RAM with mlock(2),
    /// the Python kvd's default. This kvd does not lock the arena: its pages are allocated on
    /// first touch and may be swapped like other shared memory, as in the Python kvd when
    /// RLIMIT_MEMLOCK refuses the lock. Given explicitly, it is logged as having no effect.
    #[arg(long, overrides_with = "no_shared_arena_pin")]
    pub shared_arena_pin: bool,

    /// Do not lock the shared arena's pages in RAM: what this kvd always does (see
    /// --shared-arena-pin).
    #[arg(long, overrides_with = "shared_arena_pin")]
    pub no_shared_arena_pin: bool,

    /// Serve the daemon's counters in the Prometheus text format at http://ADDR/metrics (the
    /// `infera_kvd_*` families the daemon also logs). [default: off]
    #[arg(long, value_name = "HOST:PORT")]
    pub metrics_bind: Option<std::net::SocketAddr>,

    /// Back the shared arena with 2 MiB hugepages (MFD_HUGETLB; its size rounded up to 2 MiB).
    /// The pages must be reserved (sysctl vm.nr_hugepages): with too few free, kvd stops at
    /// startup saying how many it needs; a kernel without hugetlb memfds gets a warning and
    /// 4 KiB pages. Also on when INFERA_KVD_ARENA_HUGETLB is 1, true, yes or on.
    #[arg(long)]
    pub shared_arena_hugetlb: bool,

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

    /// Long-term store, one only: tablespace (L3) | mooncake | lmcache (L4). lmcache and
    /// mooncake replace L3 with a remote store (settings from --lmcache-config or
    /// --mooncake-config, and INFERA_L4_*) and cannot be combined with --long-path(s). To keep
    /// L3 and add an L4 behind it, use --l4-backend.
    #[arg(long, value_enum, default_value = "tablespace", help_heading = L3)]
    pub long_backend: LongBackend,

    /// L3 I/O: auto picks O_DIRECT on NVMe, buffered on NFS/SATA/rotating disks (decided from
    /// /sys/block and logged at startup); io_uring is used where the kernel allows it.
    /// INFERA_KVD_IO_MODE=direct|buffered overrides this flag, as in the Python kvd.
    #[arg(long, value_enum, default_value = "auto", help_heading = L3)]
    pub io_mode: IoMode,

    /// Buffered L3 I/O, as --io-mode buffered; wins over --io-mode, INFERA_KVD_IO_MODE and
    /// --tablespace-auto-detect-fs, as in the Python kvd.
    #[arg(long, help_heading = L3)]
    pub tablespace_buffered_io: bool,

    /// Take the L3 I/O mode and group commit from the file system of the (first) region
    /// directory, with the Python kvd's table: ext4/xfs/btrfs O_DIRECT and every `long` write
    /// durable before it is acknowledged; nfs/nfs4 O_DIRECT and a 20 ms window; wekafs
    /// buffered and 20 ms; anything else buffered and durable per write. Overrides --io-mode
    /// and INFERA_KVD_IO_MODE; --tablespace-buffered-io and --tablespace-flush-interval-ms
    /// win over it.
    #[arg(long, help_heading = L3)]
    pub tablespace_auto_detect_fs: bool,

    /// The Python kvd's group-commit window. N > 0: a `long` write is acknowledged once
    /// recorded and the journal is synced every N ms (a crash loses at most about N ms of
    /// acknowledged writes). 0 or less: every `long` write is acknowledged only once durable,
    /// as --durable-long-writes (the Python kvd's default, inline fsync). Without it: a sync
    /// every 200 ms, see --durable-long-writes.
    #[arg(long, value_name = "MS", allow_negative_numbers = true, help_heading = L3)]
    pub tablespace_flush_interval_ms: Option<i64>,

    /// Largest L3 container file [default: 1GiB]: each shard is cut into equal containers of
    /// at most this size. Unlike the Python kvd, a region smaller than one container is not
    /// grown to it. A change reinitializes an existing region (its cached blocks are dropped).
    #[arg(long, value_name = "SIZE", help_heading = L3)]
    pub tablespace_container_bytes: Option<ByteSize>,

    /// (Python kvd flag; no effect here) The Python tablespace's fixed slot size (64K), the
    /// largest block it stores. This kvd has no slots: each block takes an extent of its own
    /// size (4 KiB units), up to a container. Validated as the Python does (positive, at most
    /// --tablespace-container-bytes, a 4 KiB multiple under --io-mode direct), then ignored
    /// with a warning.
    #[arg(long, value_name = "SIZE", help_heading = L3)]
    pub tablespace_slot_bytes: Option<ByteSize>,

    /// (Python kvd flag; no effect here) The Python tablespace's pools of fixed slot sizes,
    /// e.g. 64K,1M or 64K*1,1M*4 (weights split --long-bytes). This kvd needs no pools: one
    /// region holds blocks of every size, each in an extent of its own size. Validated as the
    /// Python does (sizes with K/M/G/T, positive integer weights, no size twice, 4 KiB
    /// multiples under --io-mode direct), then ignored with a warning.
    #[arg(long, value_name = "SIZE[*WEIGHT],...", help_heading = L3)]
    pub tablespace_pools: Option<String>,

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

    /// Stack an L4 behind the L3 tablespace (L2 → L3 → L4): every block L3 gets is also
    /// written behind to the remote store, and L3 misses are read from it and promoted. Needs
    /// --long-path or --long-paths; settings as for --long-backend lmcache|mooncake.
    #[arg(long, value_enum, value_name = "STORE", help_heading = L4)]
    pub l4_backend: Option<L4Backend>,

    /// LMCache remote-store settings: a flat YAML file with remote_url (required:
    /// redis://host:port, valkey://…, lm://host:port or s3://HOST[:PORT][/BUCKET]), prefix
    /// (infera), connector_extra (for s3://: s3_region, disable_tls, aws_access_key_id,
    /// aws_secret_access_key, s3_max_inflight_reqs; else the AWS_* variables),
    /// max_value_bytes (64 MiB) and rpc_timeout_s (30); ${VAR} is expanded, and each key is
    /// overridden by INFERA_L4_<KEY> (e.g. INFERA_L4_REMOTE_URL), which may replace the file.
    #[arg(long, value_name = "PATH", help_heading = L4)]
    pub lmcache_config: Option<PathBuf>,

    /// Mooncake Store settings: a flat YAML file with master_address and cluster_id (both
    /// required), metadata_server, protocol (tcp | rdma), device_name, local_hostname
    /// (default $POD_IP:$INFERA_L4_LOCAL_PORT, 14001), global_segment_size (1 GiB; 0 gives no memory),
    /// local_buffer_size (256 MiB), max_value_bytes (64 MiB), rpc_timeout_s (30) and python
    /// (python3: the interpreter whose `mooncake` package runs kvd's store sidecar); each key
    /// is overridden by INFERA_L4_<KEY>. protocol rdma without its device under
    /// /sys/class/infiniband refuses to start unless INFERA_L4_ALLOW_TCP_FALLBACK=1. Read with
    /// --long-backend mooncake or --l4-backend mooncake; alone it has no effect, as in the
    /// Python kvd, and is logged so.
    #[arg(long, value_name = "PATH", help_heading = L4)]
    pub mooncake_config: Option<PathBuf>,

    /// Refuse to start when the L4 store does not answer at startup (by default that is a
    /// warning: kvd serves from L2/L3, and L4 joins when the store answers).
    #[arg(long, help_heading = L4)]
    pub l4_required: bool,

    /// Publish which KV blocks this kvd holds in L2, L3 and L4, and how fast each tier loads
    /// them, as KV events in vLLM's ZeroMQ layout on this PUB endpoint (topic kv-events); off
    /// disables it. Workers on this node name it in their registration (kvd's hello_ack
    /// advertises it), and the router subscribes to credit a worker for the blocks its node's
    /// kvd can load. Each kvd on a host needs its own port: tcp://127.0.0.1:0 binds a free one.
    #[arg(
        long,
        default_value = "tcp://*:5590",
        value_name = "tcp://HOST:PORT|off",
        help_heading = EVENTS
    )]
    pub kv_events_endpoint: String,

    /// The replay socket (ROUTER) of the inventory events, serving the last 10,000 batches to
    /// a router that missed some; off for none. [default: the events endpoint's port + 1, or a
    /// free port when that is 0]
    #[arg(long, value_name = "tcp://HOST:PORT|off", help_heading = EVENTS)]
    pub kv_events_replay_endpoint: Option<String>,

    /// The host that workers advertise for the inventory endpoints in their registration, in
    /// place of the bound one: the node's address where kvd runs in a Pod with hostPorts
    /// (the downward API's status.hostIP). [default: the bound host; a wildcard is resolved by
    /// the router to the worker's host]
    #[arg(long, env = "INFERA_KVD_EVENTS_ADVERTISE_HOST", value_name = "HOST", help_heading = EVENTS)]
    pub kv_events_advertise_host: Option<String>,

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

    /// Log level when RUST_LOG is unset (RUST_LOG, e.g. info,infera_kvd=debug, wins).
    #[arg(long, value_enum, default_value = "INFO", ignore_case = true)]
    pub log_level: LogLevel,

    /// Validate, print the resolved configuration as JSON on stdout and exit.
    #[arg(long)]
    pub check_config: bool,
}
