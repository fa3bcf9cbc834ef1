//! The daemon: a tokio Unix-socket server in front of the [`L2Store`].
//!
//! - The socket is created mode 0700 with no window in which it is reachable with other modes:
//!   it is bound inside a fresh 0700 directory next to `--socket`, chmod-ed, then renamed into
//!   place. A stale socket file (nobody accepting) is replaced; a live one makes [`KvdServer::bind`]
//!   fail, and a path that is not a socket is never touched.
//! - Each connection is one task that reads a frame, answers it, and only then reads the next, so
//!   pipelined requests are answered in order. Frame errors follow [`crate::proto`]: a broken frame
//!   is answered with `error` and the connection closes; a bad request is answered with `error`
//!   and the connection stays.
//! - Every task (acceptor's connections, the TTL sweeper) lives in a `JoinSet`. Shutdown
//!   ([`ShutdownHandle`], or SIGTERM/SIGINT through [`crate::run`]) stops accepting, lets each
//!   connection finish the request in hand, waits up to the grace period, then aborts the rest
//!   and removes the socket file if it is still ours.
//! - The shared arena (`set_reserve`/`set_commit`/`set_cancel`, `hello.prefers_shared_arena`) is
//!   part 2: until then `hello_ack.shared_arena` is nil and the arena ops answer upstream's
//!   no-arena replies (`lease_token=0, reason="no_arena"`), which the vLLM connector takes as
//!   "fall back to inline `set`".

use crate::proto::{self, DecodedRequest, FrameError, PROTOCOL_VERSION, Request, Response};
use crate::stats::metrics_text;
use crate::store::L2Store;
use bytes::{Bytes, BytesMut};
use std::io;
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader, BufWriter};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::watch;
use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// How the daemon runs. Built from the validated `KvdConfig` by `infera kvd`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvdOptions {
    /// The Unix socket clients connect to (`--socket`).
    pub socket: PathBuf,
    /// The L2 budget in bytes (`--max-bytes`).
    pub max_bytes: u64,
    /// The shared arena size (`--shared-arena-bytes`, resolved); the arena is part 2, so a
    /// non-zero size is logged and clients are answered without one.
    pub shared_arena_bytes: u64,
    /// Whether `--long-path`/`--long-paths` asked for the L3 tier; it is part 2, so
    /// [`crate::run`] refuses to start rather than silently run without it.
    pub long_tier_requested: bool,
    /// The largest frame accepted.
    pub max_frame_bytes: usize,
    /// How often expired entries are swept.
    pub sweep_interval: Duration,
    /// How often the metrics text is logged (at debug level).
    pub metrics_log_interval: Duration,
    /// How long shutdown waits for open connections before aborting them.
    pub shutdown_grace: Duration,
    /// `hello_ack.server_id`; a random `kvd-xxxxxxxx` when `None`.
    pub server_id: Option<String>,
}

impl KvdOptions {
    /// Defaults for everything but the socket and the budget.
    pub fn new(socket: impl Into<PathBuf>, max_bytes: u64) -> Self {
        Self {
            socket: socket.into(),
            max_bytes,
            shared_arena_bytes: 0,
            long_tier_requested: false,
            max_frame_bytes: proto::DEFAULT_MAX_FRAME_BYTES,
            sweep_interval: Duration::from_secs(1),
            metrics_log_interval: Duration::from_secs(60),
            shutdown_grace: Duration::from_secs(5),
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

/// The daemon's clock: milliseconds since start on tokio's clock (so paused time drives TTLs).
#[derive(Debug, Clone, Copy)]
struct Clock(Instant);

impl Clock {
    fn now_ms(&self) -> u64 {
        self.0.elapsed().as_millis() as u64
    }
}

#[derive(Debug)]
struct Shared {
    store: L2Store,
    clock: Clock,
    server_id: String,
    max_frame: usize,
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
}

impl KvdServer {
    /// Creates the store and binds the socket (mode 0700). Must run inside a tokio runtime.
    ///
    /// # Errors
    /// [`KvdError::AlreadyRunning`], [`KvdError::NotASocket`] or [`KvdError::Socket`].
    pub async fn bind(options: KvdOptions) -> Result<Self, KvdError> {
        let (std_listener, inode) = bind_socket(&options.socket)?;
        let listener = UnixListener::from_std(std_listener).map_err(|source| KvdError::Socket {
            path: options.socket.clone(),
            source,
        })?;
        let server_id = options.server_id.clone().unwrap_or_else(random_server_id);
        let shared = Arc::new(Shared {
            store: L2Store::new(options.max_bytes),
            clock: Clock(Instant::now()),
            server_id,
            max_frame: options.max_frame_bytes,
        });
        Ok(Self {
            listener,
            path: options.socket.clone(),
            inode,
            shared,
            options,
            token: CancellationToken::new(),
            sweeps: watch::channel(0).0,
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

    /// The socket path.
    pub fn socket_path(&self) -> &Path {
        &self.path
    }

    /// `hello_ack.server_id`.
    pub fn server_id(&self) -> &str {
        &self.shared.server_id
    }

    /// Serves until the shutdown handle fires, then shuts down gracefully.
    pub async fn serve(self) -> Result<(), KvdError> {
        let Self {
            listener,
            path,
            inode,
            shared,
            options,
            token,
            sweeps,
        } = self;
        tracing::info!(
            server_id = %shared.server_id,
            socket = %path.display(),
            max_bytes = options.max_bytes,
            max_frame_bytes = options.max_frame_bytes,
            "kvd listening"
        );
        let mut background = JoinSet::new();
        background.spawn(sweeper(
            shared.clone(),
            token.clone(),
            sweeps,
            options.sweep_interval,
            options.metrics_log_interval,
        ));
        let mut connections = JoinSet::new();
        loop {
            tokio::select! {
                () = token.cancelled() => break,
                accepted = listener.accept() => match accepted {
                    Ok((stream, _)) => {
                        connections.spawn(connection(stream, shared.clone(), token.clone()));
                    }
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
        background.shutdown().await;
        tracing::info!(
            metrics = %metrics_text(&shared.store.stats()),
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
            tracing::debug!(metrics = %metrics_text(&shared.store.stats()), "kvd metrics");
        }
    }
}

/// What reading one frame produced.
enum Read {
    Frame(Bytes),
    Eof,
    Broken(FrameError),
}

async fn read_frame(
    rd: &mut BufReader<tokio::net::unix::OwnedReadHalf>,
    max: usize,
) -> io::Result<Read> {
    let mut header = [0u8; 4];
    let mut got = 0;
    while got < 4 {
        let n = rd.read(&mut header[got..]).await?;
        if n == 0 {
            return Ok(if got == 0 {
                Read::Eof
            } else {
                Read::Broken(FrameError::Truncated { got, want: 4 })
            });
        }
        got += n;
    }
    let len = u32::from_be_bytes(header) as usize;
    if len > max {
        return Ok(Read::Broken(FrameError::TooLarge {
            len: len as u64,
            max,
        }));
    }
    let mut body = BytesMut::zeroed(len);
    let mut got = 0;
    while got < len {
        let n = rd.read(&mut body[got..]).await?;
        if n == 0 {
            return Ok(Read::Broken(FrameError::Truncated { got, want: len }));
        }
        got += n;
    }
    Ok(Read::Frame(body.freeze()))
}

async fn write_frame(
    wr: &mut BufWriter<tokio::net::unix::OwnedWriteHalf>,
    parts: Vec<Bytes>,
) -> io::Result<()> {
    for part in parts {
        wr.write_all(&part).await?;
    }
    wr.flush().await
}

async fn connection(stream: UnixStream, shared: Arc<Shared>, token: CancellationToken) {
    let (rd, wr) = stream.into_split();
    let mut rd = BufReader::with_capacity(64 << 10, rd);
    let mut wr = BufWriter::with_capacity(64 << 10, wr);
    loop {
        let read = tokio::select! {
            () = token.cancelled() => break,
            read = read_frame(&mut rd, shared.max_frame) => read,
        };
        let frame = match read {
            Ok(Read::Frame(frame)) => frame,
            Ok(Read::Eof) => break,
            Ok(Read::Broken(error)) => {
                tracing::debug!(%error, "kvd closing a connection on a broken frame");
                let reply = Response::error(error.code(), error.to_string());
                let _ = write_frame(&mut wr, reply.encode(None)).await;
                break;
            }
            Err(error) => {
                tracing::debug!(%error, "kvd connection read failed");
                break;
            }
        };
        let (id, reply) = match proto::decode_request(&frame) {
            Ok(DecodedRequest { id, request }) => match request {
                Ok(request) => (id, dispatch(&shared, request)),
                Err(error) => (id, Some(error.to_response())),
            },
            Err(error) => {
                let reply = Response::error(error.code(), error.to_string());
                let _ = write_frame(&mut wr, reply.encode(None)).await;
                break;
            }
        };
        drop(frame);
        if let Some(reply) = reply
            && let Err(error) = write_frame(&mut wr, reply.encode(id.as_ref())).await
        {
            tracing::debug!(%error, "kvd connection write failed");
            break;
        }
    }
}

/// Answers one request; `None` for the one-way `prefetch_hint`.
fn dispatch(shared: &Shared, request: Request) -> Option<Response> {
    let store = &shared.store;
    let now = shared.clock.now_ms();
    Some(match request {
        Request::Hello {
            client_id,
            protocol_version,
            prefers_shared_arena,
        } => {
            tracing::debug!(%client_id, protocol_version, prefers_shared_arena, "kvd hello");
            Response::HelloAck {
                server_id: shared.server_id.clone(),
                protocol_version: PROTOCOL_VERSION,
                shared_arena: None,
            }
        }
        Request::Get { ns, key } => match store.get(&ns, &key, now) {
            Some(hit) => Response::Get {
                value: Some(hit.value),
                retention: Some(hit.retention),
            },
            None => Response::Get {
                value: None,
                retention: None,
            },
        },
        Request::BatchGet { ns, keys } => {
            let (values, retentions) = store
                .get_many(&ns, &keys, now)
                .into_iter()
                .map(|h| match h {
                    Some(hit) => (Some(hit.value), Some(hit.retention)),
                    None => (None, None),
                })
                .unzip();
            Response::BatchGet { values, retentions }
        }
        Request::Set { ns, item } => Response::SetAck(store.set(&ns, &item, now)),
        Request::BatchSet { ns, items } => Response::BatchSetAck(store.set_many(&ns, &items, now)),
        Request::SetReserve { .. } => Response::SetReserve {
            lease_token: 0,
            slot_id: -1,
            payload_offset: 0,
            payload_max_size: 0,
            reason: "no_arena".to_owned(),
        },
        Request::SetCommit { .. } => Response::SetCommit {
            accepted: false,
            reason: "no_arena".to_owned(),
        },
        Request::SetCancel { .. } => Response::SetCancel,
        Request::PrefetchHint { .. } => {
            // No L3 yet: nothing below RAM to warm from. Counted so the router's hints show.
            store.note_prefetch_hint();
            return None;
        }
        Request::Exists { ns, keys } => Response::Exists {
            present: store.exists(&ns, &keys, now),
        },
        Request::Clear { ns } => Response::Clear {
            cleared_entries: store.clear(&ns),
        },
        Request::Stats { extended } => Response::Stats(store.stats().to_reply(extended)),
    })
}
