//! The daemon: a tokio Unix-socket server in front of the tiered [`Store`].
//!
//! - The socket is created mode 0700 with no window in which it is reachable with other modes:
//!   it is bound inside a fresh 0700 directory next to `--socket`, chmod-ed, then renamed into
//!   place. A stale socket file (nobody accepting) is replaced; a live one makes [`KvdServer::bind`]
//!   fail, and a path that is not a socket is never touched.
//! - [`KvdServer::bind`] also creates the shared arena (a memfd, when `--shared-arena-bytes` is
//!   not 0) and opens the long-term backend (recovering the L3 region from disk), so a daemon
//!   that listens is ready to serve.
//! - Each connection is one task (`conn.rs`) that reads a frame, answers it, and only then
//!   reads the next, so pipelined requests are answered in order. Frame errors follow
//!   [`crate::proto`]. A connection's arena leases die with it.
//! - Every connection is bounded: at most `max_connections` are open (one more is answered
//!   `error{code: too_many_connections}` and closed at once); one idle past `idle_timeout` is
//!   closed; a frame must arrive whole within `frame_timeout` of its first byte
//!   (`error{code: frame_timeout}`, then closed); a frame is at most `max_frame_bytes` and a
//!   batch at most `max_batch_keys` (see [`crate::proto`] for what decoding may cost). So a
//!   connection holds at most one frame, its decoded request and its reply at a time.
//! - Background tasks: the sweeper (TTL expiry in every tier), the checkpointer (L3
//!   checkpoints) and the prefetcher (`prefetch_hint`s, through a queue bounded in hints and
//!   in bytes; a hint that finds the queue full or outlives its deadline is dropped and
//!   counted).
//! - Inventory ([`KvdServer::bind_publishing`]): the store notes every tier's changes and the
//!   publisher task hands them to the sink as KV-event batches ([`crate::inventory`]);
//!   `hello_ack` advertises the endpoints. Every `get` and `batch_get` with a hit is timed for
//!   the tiers' load speeds, whether or not the daemon publishes.
//! - Every task lives in a `JoinSet`. Shutdown ([`ShutdownHandle`], or SIGTERM/SIGINT through
//!   [`crate::run`]) stops accepting, lets each connection finish the request in hand, waits up
//!   to the grace period, aborts the rest, publishes the inventory's last changes, closes the
//!   backend (flush + checkpoint) and removes the socket file if it is still ours.

mod conn;

use crate::arena::Arena;
use crate::inventory::{
    Inventory, InventoryPublishing, LoadMeter, PublishCounters, Publisher, Recorder, TIERS,
};
use crate::long::{self, LongBackendConfig, LongOpenError};
use crate::proto::{self, Namespace};
use crate::stats::{InventoryStats, Stats, metrics_text};
use crate::store::Store;
use bytes::Bytes;
use std::io;
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use tokio::net::UnixListener;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc, watch};
use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// How the daemon runs. Built from the validated `KvdConfig` by `infera kvd`.
#[derive(Debug, Clone, PartialEq)]
pub struct KvdOptions {
    /// The Unix socket clients connect to (`--socket`).
    pub socket: PathBuf,
    /// The L2 budget in bytes (`--max-bytes`).
    pub max_bytes: u64,
    /// The shared arena size (`--shared-arena-bytes`, resolved); 0 = no arena.
    pub shared_arena_bytes: u64,
    /// The arena slot size; `None` lets the first write decide it (upstream's behaviour).
    pub arena_slot_bytes: Option<u64>,
    /// The arena's memory (`--shared-arena-hugetlb`).
    pub arena_backing: crate::arena::Backing,
    /// The long-term tier (`--long-backend` with `--long-path(s)`); `None` for RAM only.
    pub long: Option<LongBackendConfig>,
    /// Set by a caller that asked for the L3 tier without describing it in `long` (older
    /// wiring); [`KvdServer::bind`] then refuses to start rather than run without the tier.
    pub long_tier_requested: bool,
    /// The largest frame accepted.
    pub max_frame_bytes: usize,
    /// The most keys (or items) in one batch request (`--max-batch-keys`).
    pub max_batch_keys: usize,
    /// The most open connections (`--max-connections`); one more is answered
    /// `error{code: too_many_connections}` and closed.
    pub max_connections: usize,
    /// A connection with no request for this long is closed (`--idle-timeout`; `None`: never).
    pub idle_timeout: Option<Duration>,
    /// A frame must arrive whole within this long of its first byte (`--frame-timeout`), or
    /// the connection is answered `error{code: frame_timeout}` and closed.
    pub frame_timeout: Duration,
    /// How often expired entries are swept.
    pub sweep_interval: Duration,
    /// How often the L3 index is checkpointed.
    pub checkpoint_interval: Duration,
    /// How often the metrics text is logged (at debug level).
    pub metrics_log_interval: Duration,
    /// How long shutdown waits for open connections before aborting them.
    pub shutdown_grace: Duration,
    /// `SO_SNDBUF`/`SO_RCVBUF` of each connection (0 leaves the kernel's default).
    pub socket_buffer_bytes: usize,
    /// `prefetch_hint`s queued at most; more are dropped and counted.
    pub prefetch_queue: usize,
    /// Bytes of queued `prefetch_hint`s at most (keys plus a per-key handle); a hint that would
    /// go over is dropped and counted.
    pub prefetch_queue_bytes: u64,
    /// `hello_ack.server_id`; a random `kvd-xxxxxxxx` when `None`.
    pub server_id: Option<String>,
}

impl KvdOptions {
    /// Defaults for everything but the socket and the budget (no arena, no L3).
    pub fn new(socket: impl Into<PathBuf>, max_bytes: u64) -> Self {
        Self {
            socket: socket.into(),
            max_bytes,
            shared_arena_bytes: 0,
            arena_slot_bytes: None,
            arena_backing: crate::arena::Backing::default(),
            long: None,
            long_tier_requested: false,
            max_frame_bytes: proto::DEFAULT_MAX_FRAME_BYTES,
            max_batch_keys: proto::DEFAULT_MAX_BATCH_KEYS,
            max_connections: 1024,
            idle_timeout: Some(Duration::from_secs(600)),
            frame_timeout: Duration::from_secs(30),
            sweep_interval: Duration::from_secs(1),
            checkpoint_interval: Duration::from_secs(60),
            metrics_log_interval: Duration::from_secs(60),
            shutdown_grace: Duration::from_secs(5),
            socket_buffer_bytes: 4 << 20,
            prefetch_queue: 256,
            prefetch_queue_bytes: 16 << 20,
            server_id: None,
        }
    }
}

/// Why the daemon could not start or run. Nothing here is worth retrying unchanged.
#[derive(Debug, thiserror::Error)]
pub enum KvdError {
    /// Another daemon accepts on the socket path.
    #[error("another kvd is already listening on {0}; stop it or choose another --socket")]
    AlreadyRunning(PathBuf),
    /// The socket path exists and is not a socket.
    #[error("{0} exists and is not a socket; remove it or choose another --socket")]
    NotASocket(PathBuf),
    /// Creating, binding or publishing the socket failed.
    #[error("cannot create the socket {path}: {source}")]
    Socket { path: PathBuf, source: io::Error },
    /// The shared arena could not be created.
    #[error(
        "cannot create the shared arena of {bytes} bytes: {source}; lower --shared-arena-bytes or pass 0"
    )]
    Arena { bytes: u64, source: io::Error },
    /// The long-term tier could not start.
    #[error(transparent)]
    Long(#[from] LongOpenError),
    /// A configured feature is not part of this build.
    #[error("{0}")]
    Unsupported(String),
    /// The runtime or the signal handlers could not be set up.
    #[error("cannot start the daemon runtime: {0}")]
    Runtime(io::Error),
}

/// Stops a running [`KvdServer`]; cheap to clone.
#[derive(Debug, Clone)]
pub struct ShutdownHandle(CancellationToken);

impl ShutdownHandle {
    /// Asks the server to shut down gracefully; [`KvdServer::serve`] returns once it has.
    pub fn shutdown(&self) {
        self.0.cancel();
    }
}

/// The daemon's clock: wall-clock milliseconds at start plus tokio's elapsed time, so entries
/// on disk carry absolute expiries while paused tokio time still drives TTLs in tests.
#[derive(Debug, Clone, Copy)]
struct Clock {
    start: Instant,
    epoch_ms: u64,
}

impl Clock {
    fn new() -> Self {
        let epoch_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or_default();
        Self {
            start: Instant::now(),
            epoch_ms,
        }
    }

    fn now_ms(&self) -> u64 {
        self.epoch_ms + self.start.elapsed().as_millis() as u64
    }
}

/// A queued `prefetch_hint`, holding its share of the queue's byte budget.
#[derive(Debug)]
struct Hint {
    ns: Namespace,
    keys: Vec<Bytes>,
    deadline: Instant,
    _bytes: OwnedSemaphorePermit,
}

#[derive(Debug)]
struct Shared {
    store: Store,
    clock: Clock,
    server_id: String,
    max_frame: usize,
    limits: proto::Limits,
    idle_timeout: Option<Duration>,
    frame_timeout: Duration,
    socket_buffer: usize,
    hints: mpsc::Sender<Hint>,
    hint_bytes: Arc<Semaphore>,
    next_conn: AtomicU64,
    load: Arc<LoadMeter>,
    /// The endpoints `hello_ack` advertises, while publishing.
    kv_events: Option<(String, Option<String>)>,
    published: Arc<PublishCounters>,
}

impl Shared {
    /// Every owner's counters (see [`crate::stats`]).
    fn stats(&self) -> Stats {
        let mut stats = self.store.stats();
        let mut loads = [0; 3];
        for (load, tier) in loads.iter_mut().zip(TIERS) {
            *load = self
                .load
                .load(tier)
                .map_or(0, |l| l.bytes_per_s.round() as u64);
        }
        stats.inventory = InventoryStats {
            batches_total: self.published.batches(),
            events_total: self.published.events(),
            dropped_total: self.published.dropped(),
            tier_load_bytes_per_second: loads,
        };
        stats
    }
}

/// Reads a daemon's statistics while it serves (see [`KvdServer::stats_reader`]).
#[derive(Debug, Clone)]
pub struct StatsReader(Arc<Shared>);

impl StatsReader {
    /// The statistics now.
    pub fn snapshot(&self) -> Stats {
        self.0.stats()
    }

    /// [`StatsReader::snapshot`] in the Prometheus text format ([`metrics_text`]).
    pub fn metrics_text(&self) -> String {
        metrics_text(&self.snapshot())
    }
}

/// A bound, not yet serving daemon.
#[derive(Debug)]
pub struct KvdServer {
    listener: UnixListener,
    path: PathBuf,
    inode: (u64, u64),
    shared: Arc<Shared>,
    options: KvdOptions,
    token: CancellationToken,
    sweeps: watch::Sender<u64>,
    prefetches: watch::Sender<u64>,
    hints: mpsc::Receiver<Hint>,
    /// The inventory publisher, started by `serve`.
    publisher: Option<Publisher>,
}

impl KvdServer {
    /// Creates the arena, opens (recovers) the long-term tier and binds the socket (mode 0700).
    /// Must run inside a tokio runtime. Publishes no inventory.
    ///
    /// # Errors
    /// [`KvdError::AlreadyRunning`], [`KvdError::NotASocket`], [`KvdError::Socket`],
    /// [`KvdError::Arena`], [`KvdError::Long`] or [`KvdError::Unsupported`].
    pub async fn bind(options: KvdOptions) -> Result<Self, KvdError> {
        Self::bind_publishing(options, None).await
    }

    /// [`KvdServer::bind`], publishing the inventory through `publishing` when given: every
    /// tier notes its changes from the start, the first batch is `AllBlocksCleared`, and
    /// `hello_ack` names `publishing`'s endpoints.
    ///
    /// # Errors
    /// As [`KvdServer::bind`].
    pub async fn bind_publishing(
        options: KvdOptions,
        publishing: Option<InventoryPublishing>,
    ) -> Result<Self, KvdError> {
        if options.long_tier_requested && options.long.is_none() {
            return Err(KvdError::Unsupported(
                "the L3 tier (--long-path / --long-paths) was requested but the daemon was not \
                 given its settings (KvdOptions::long); build the options from the validated \
                 kvd configuration"
                    .to_owned(),
            ));
        }
        let arena = match options.shared_arena_bytes {
            0 => None,
            bytes => Some(Arc::new(
                Arena::with_backing(bytes, options.arena_slot_bytes, options.arena_backing)
                    .map_err(|source| KvdError::Arena { bytes, source })?,
            )),
        };
        let long = match &options.long {
            Some(config) => Some(long::open(config).await?),
            None => None,
        };
        let (std_listener, inode) = bind_socket(&options.socket)?;
        let listener = UnixListener::from_std(std_listener).map_err(|source| KvdError::Socket {
            path: options.socket.clone(),
            source,
        })?;
        let server_id = options.server_id.clone().unwrap_or_else(random_server_id);
        let (hints_tx, hints) = mpsc::channel(options.prefetch_queue.max(1));
        let load = Arc::new(LoadMeter::default());
        let published = Arc::new(PublishCounters::default());
        let (inventory, publisher, kv_events) = match publishing {
            Some(p) => {
                let recorder = Arc::new(Recorder::default());
                let publisher =
                    Publisher::new(recorder.clone(), load.clone(), p.sink, published.clone());
                (
                    Inventory::recording(recorder),
                    Some(publisher),
                    Some((p.endpoint, p.replay_endpoint)),
                )
            }
            None => (Inventory::off(), None, None),
        };
        let shared = Arc::new(Shared {
            store: Store::new(options.max_bytes, arena, long).with_inventory(inventory),
            clock: Clock::new(),
            server_id,
            max_frame: options.max_frame_bytes,
            limits: proto::Limits {
                max_keys: options.max_batch_keys,
            },
            idle_timeout: options.idle_timeout,
            frame_timeout: options.frame_timeout,
            socket_buffer: options.socket_buffer_bytes,
            hints: hints_tx,
            hint_bytes: Arc::new(Semaphore::new(
                options
                    .prefetch_queue_bytes
                    .min(Semaphore::MAX_PERMITS as u64) as usize,
            )),
            next_conn: AtomicU64::new(1),
            load,
            kv_events,
            published,
        });
        Ok(Self {
            listener,
            path: options.socket.clone(),
            inode,
            shared,
            options,
            token: CancellationToken::new(),
            sweeps: watch::channel(0).0,
            prefetches: watch::channel(0).0,
            hints,
            publisher,
        })
    }

    /// The handle that stops [`KvdServer::serve`].
    pub fn shutdown_handle(&self) -> ShutdownHandle {
        ShutdownHandle(self.token.clone())
    }

    /// Counts completed sweeps, so a test can wait for one instead of sleeping.
    pub fn sweeps(&self) -> watch::Receiver<u64> {
        self.sweeps.subscribe()
    }

    /// Counts processed (or dropped) prefetch hints, so a test can wait for one.
    pub fn prefetches(&self) -> watch::Receiver<u64> {
        self.prefetches.subscribe()
    }

    /// The socket path.
    /// A reader of the daemon's statistics, for an exporter outside it.
    pub fn stats_reader(&self) -> StatsReader {
        StatsReader(Arc::clone(&self.shared))
    }

    pub fn socket_path(&self) -> &Path {
        &self.path
    }

    /// `hello_ack.server_id`.
    pub fn server_id(&self) -> &str {
        &self.shared.server_id
    }

    /// Serves until the shutdown handle fires, then shuts down gracefully.
    ///
    /// # Errors
    /// None today; the signature leaves room for fatal runtime failures.
    pub async fn serve(self) -> Result<(), KvdError> {
        let Self {
            listener,
            path,
            inode,
            shared,
            options,
            token,
            sweeps,
            prefetches,
            hints,
            publisher,
        } = self;
        let stats = shared.stats();
        tracing::info!(
            server_id = %shared.server_id,
            socket = %path.display(),
            max_bytes = options.max_bytes,
            shared_arena_bytes = stats.arena.bytes,
            long_backend = shared.store.long().map_or("none", |l| l.kind()),
            long_entries = stats.long.entries,
            max_frame_bytes = options.max_frame_bytes,
            kv_events = shared.kv_events.as_ref().map_or("off", |(e, _)| e.as_str()),
            "kvd listening"
        );
        // Stopped after the connections, so that their last changes are published.
        let publishing = CancellationToken::new();
        let mut publishers = JoinSet::new();
        if let Some(publisher) = publisher {
            publishers.spawn(publisher.run(publishing.clone()));
        }
        let mut background = JoinSet::new();
        background.spawn(sweeper(
            shared.clone(),
            token.clone(),
            sweeps,
            options.sweep_interval,
            options.metrics_log_interval,
        ));
        background.spawn(prefetcher(shared.clone(), token.clone(), hints, prefetches));
        if shared.store.long().is_some() {
            background.spawn(checkpointer(
                shared.clone(),
                token.clone(),
                options.checkpoint_interval,
            ));
        }
        let mut connections = JoinSet::new();
        let open = Arc::new(Semaphore::new(options.max_connections.max(1)));
        loop {
            tokio::select! {
                () = token.cancelled() => break,
                accepted = listener.accept() => match accepted {
                    Ok((stream, _)) => match open.clone().try_acquire_owned() {
                        Ok(slot) => {
                            let id = shared.next_conn.fetch_add(1, Ordering::Relaxed);
                            connections.spawn(conn::connection(
                                stream,
                                shared.clone(),
                                token.clone(),
                                id,
                                slot,
                            ));
                        }
                        Err(_) => conn::refuse(&stream, options.max_connections),
                    },
                    Err(error) => {
                        // EMFILE and friends: back off briefly instead of spinning.
                        tracing::warn!(%error, "kvd accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                },
                Some(done) = connections.join_next(), if !connections.is_empty() => {
                    if let Err(error) = done
                        && error.is_panic()
                    {
                        tracing::error!(%error, "kvd connection task panicked");
                    }
                }
            }
        }
        drop(listener);
        remove_if_ours(&path, inode);
        let drained = tokio::time::timeout(options.shutdown_grace, async {
            while connections.join_next().await.is_some() {}
        })
        .await;
        if drained.is_err() {
            tracing::warn!(
                open = connections.len(),
                "kvd shutdown grace period over; closing the remaining connections"
            );
            connections.shutdown().await;
        }
        publishing.cancel();
        while publishers.join_next().await.is_some() {}
        background.shutdown().await;
        if let Some(long) = shared.store.long()
            && let Err(error) = long.close().await
        {
            tracing::error!(%error, "kvd could not flush and checkpoint the long-term tier at shutdown");
        }
        tracing::info!(
            metrics = %metrics_text(&shared.stats()),
            "kvd stopped"
        );
        Ok(())
    }
}

fn random_server_id() -> String {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u32(std::process::id());
    format!("kvd-{:08x}", h.finish() as u32)
}

/// Binds `path` mode 0700 without a window of wider access (see the module docs).
fn bind_socket(path: &Path) -> Result<(std::os::unix::net::UnixListener, (u64, u64)), KvdError> {
    let fail = |source: io::Error| KvdError::Socket {
        path: path.to_path_buf(),
        source,
    };
    match std::fs::symlink_metadata(path) {
        Ok(meta) if !meta.file_type().is_socket() => {
            return Err(KvdError::NotASocket(path.to_path_buf()));
        }
        Ok(_) => match std::os::unix::net::UnixStream::connect(path) {
            Ok(_) => return Err(KvdError::AlreadyRunning(path.to_path_buf())),
            Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => {
                tracing::info!(socket = %path.display(), "replacing a stale kvd socket");
            }
            Err(e) => return Err(fail(e)),
        },
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(fail(e)),
    }
    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    std::fs::create_dir_all(&parent).map_err(fail)?;
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let staging = parent.join(format!(
        ".kvd{:x}.{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::DirBuilder::new()
        .mode(0o700)
        .create(&staging)
        .map_err(fail)?;
    let staged = staging.join("s");
    let result = (|| {
        let listener = std::os::unix::net::UnixListener::bind(&staged)?;
        std::fs::set_permissions(&staged, std::fs::Permissions::from_mode(0o700))?;
        std::fs::rename(&staged, path)?;
        listener.set_nonblocking(true)?;
        let meta = std::fs::symlink_metadata(path)?;
        Ok((listener, (meta.dev(), meta.ino())))
    })();
    let _ = std::fs::remove_file(&staged);
    let _ = std::fs::remove_dir(&staging);
    result.map_err(fail)
}

fn remove_if_ours(path: &Path, inode: (u64, u64)) {
    match std::fs::symlink_metadata(path) {
        Ok(meta) if (meta.dev(), meta.ino()) == inode => {
            if let Err(error) = std::fs::remove_file(path) {
                tracing::warn!(%error, socket = %path.display(), "cannot remove the kvd socket");
            }
        }
        _ => {}
    }
}

async fn sweeper(
    shared: Arc<Shared>,
    token: CancellationToken,
    sweeps: watch::Sender<u64>,
    every: Duration,
    log_every: Duration,
) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last_log = Instant::now();
    loop {
        tokio::select! {
            () = token.cancelled() => return,
            _ = tick.tick() => {}
        }
        let expired = shared.store.sweep(shared.clock.now_ms());
        if expired > 0 {
            tracing::debug!(expired, "kvd swept expired entries");
        }
        sweeps.send_modify(|n| *n += 1);
        if last_log.elapsed() >= log_every {
            last_log = Instant::now();
            tracing::debug!(metrics = %metrics_text(&shared.stats()), "kvd metrics");
        }
    }
}

async fn checkpointer(shared: Arc<Shared>, token: CancellationToken, every: Duration) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    loop {
        tokio::select! {
            () = token.cancelled() => return,
            _ = tick.tick() => {}
        }
        if let Some(long) = shared.store.long()
            && let Err(error) = long.checkpoint().await
        {
            tracing::error!(%error, "kvd L3 checkpoint failed; the journal keeps growing until one succeeds");
        }
    }
}

async fn prefetcher(
    shared: Arc<Shared>,
    token: CancellationToken,
    mut hints: mpsc::Receiver<Hint>,
    done: watch::Sender<u64>,
) {
    loop {
        let hint = tokio::select! {
            () = token.cancelled() => return,
            hint = hints.recv() => match hint {
                Some(hint) => hint,
                None => return,
            },
        };
        let now = shared.clock.now_ms();
        let work = shared.store.prefetch(&hint.ns, &hint.keys, now);
        // A hint is worth nothing past its deadline: one that waited that long is not started,
        // and one still running then is abandoned.
        if Instant::now() >= hint.deadline
            || tokio::time::timeout_at(hint.deadline, work).await.is_err()
        {
            shared.store.note_hint_expired();
        }
        done.send_modify(|n| *n += 1);
    }
}
