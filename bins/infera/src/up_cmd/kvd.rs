//! The in-process kvd of `infera up --kvd`: the daemon on a Unix socket in the same runtime,
//! and its inventory on an in-process KV-event stream, numbered as on the wire, that the same
//! pipeline as every transport runs into the server's state under the kvd's pseudo worker
//! ([`UP_KVD_ENDPOINT`], which the mocks register as their node's kvd).

use anyhow::Context as _;
use infera_adapters::server::ServerState;
use infera_core::kv_events::{EngineBatch, kvd, pipeline};
use infera_core::ports::kv_events::{KvEventStream, KvItem, KvSubscription};
use infera_kvd::{
    InventoryPublishing, InventorySink, KvdError, KvdOptions, KvdServer, ShutdownHandle, SinkError,
};
use std::os::unix::fs::DirBuilderExt as _;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

/// The host-RAM budget of `infera up --kvd`'s daemon.
const LOCAL_KVD_BYTES: u64 = 1 << 30;

/// The name under which the in-process kvd's inventory is known (no socket is bound).
pub(super) const UP_KVD_ENDPOINT: &str = "tcp://infera-up-kvd:0";

/// Inventory batches waiting for the pipeline; a full queue refuses a batch (the daemon then
/// starts over with a clear).
const QUEUE: usize = 1024;

/// The in-process kvd of `infera up --kvd`.
pub(super) struct LocalKvd {
    pub(super) socket: PathBuf,
    stop: ShutdownHandle,
    /// Its inventory stream, until [`LocalKvd::follow`] hands it to the pipeline.
    inventory: Option<Box<dyn KvEventStream>>,
    task: JoinHandle<Result<(), KvdError>>,
    /// The temporary directory holding the socket, removed on stop.
    temp_dir: Option<PathBuf>,
}

impl LocalKvd {
    /// Binds kvd on `socket` (else in a fresh 0700 temporary directory), publishing its
    /// inventory in process, and serves it.
    pub(super) async fn start(socket: Option<PathBuf>) -> anyhow::Result<Self> {
        let (socket, temp_dir) = match socket {
            Some(socket) => (socket, None),
            None => {
                let dir = std::env::temp_dir().join(format!(
                    "infera-up-kvd-{}-{}",
                    std::process::id(),
                    std::time::SystemTime::now()
                        .duration_since(std::time::UNIX_EPOCH)
                        .map_or(0, |d| d.as_nanos())
                ));
                std::fs::DirBuilder::new()
                    .mode(0o700)
                    .create(&dir)
                    .with_context(|| format!("cannot create {}", dir.display()))?;
                (dir.join("kvd.sock"), Some(dir))
            }
        };
        let (frames, inventory) = pipeline::channel(QUEUE);
        let publishing = InventoryPublishing {
            sink: Arc::new(InProcess {
                frames,
                seq: AtomicU64::new(0),
            }),
            endpoint: UP_KVD_ENDPOINT.to_owned(),
            replay_endpoint: None,
        };
        let options = KvdOptions::new(&socket, LOCAL_KVD_BYTES);
        let server = match KvdServer::bind_publishing(options, Some(publishing)).await {
            Ok(server) => server,
            Err(e) => {
                if let Some(dir) = &temp_dir {
                    let _ = std::fs::remove_dir_all(dir);
                }
                let what = format!("cannot start kvd on {}", socket.display());
                return Err(anyhow::Error::new(e).context(what));
            }
        };
        let stop = server.shutdown_handle();
        tracing::info!(socket = %socket.display(), "infera up: kvd serving");
        Ok(Self {
            socket,
            stop,
            inventory: Some(inventory),
            task: tokio::spawn(server.serve()),
            temp_dir,
        })
    }

    /// Runs the inventory into `state` (once the mocks that name it registered); the task ends
    /// when the daemon stops.
    pub(super) fn follow(&mut self, state: &ServerState) -> Option<JoinHandle<()>> {
        let events = self.inventory.take()?;
        let state = state.clone();
        let source = kvd::source_rank(UP_KVD_ENDPOINT).worker;
        Some(tokio::spawn(async move {
            let subscription = KvSubscription {
                events,
                replay: None,
            };
            pipeline::consume(source, subscription, &state, std::future::pending()).await;
        }))
    }

    /// Stops the daemon (after the mocks: nothing uses it any more) and removes its directory.
    pub(super) async fn stop(self) -> anyhow::Result<()> {
        self.stop.shutdown();
        let served = match self.task.await {
            Ok(result) => result.context("kvd failed"),
            Err(e) => Err(anyhow::Error::new(e).context("the kvd task failed")),
        };
        if let Some(dir) = self.temp_dir
            && let Err(e) = std::fs::remove_dir_all(&dir)
        {
            tracing::warn!(dir = %dir.display(), error = %e, "cannot remove kvd's directory");
        }
        served
    }
}

/// The daemon's inventory batches as numbered frames on the in-process stream.
#[derive(Debug)]
struct InProcess {
    frames: mpsc::Sender<KvItem>,
    seq: AtomicU64,
}

impl InventorySink for InProcess {
    fn publish(&self, batch: &EngineBatch) -> Result<(), SinkError> {
        let seq = self.seq.load(Ordering::Relaxed);
        match self.frames.try_send(super::numbered(seq, batch)) {
            Ok(()) => {
                // Only a sent batch takes a number: a refused one leaves no gap.
                self.seq.store(seq + 1, Ordering::Relaxed);
                Ok(())
            }
            Err(mpsc::error::TrySendError::Full(_)) => Err(SinkError::Full),
            Err(mpsc::error::TrySendError::Closed(_)) => Err(SinkError::Closed),
        }
    }
}
