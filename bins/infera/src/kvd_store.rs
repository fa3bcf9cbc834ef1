//! The engines' side of kvd in the binary: the block-store port ([`KvBlockStore`]) on kvd's
//! client, which the mock engine saves to and loads from (`infera up --kvd`, `infera worker mock
//! --infera-kvd-socket`), and the launchers' [`preflight`], which checks that kvd answers `hello`
//! before an engine is started against it; its answer names where the daemon publishes its
//! inventory, which the worker registers ([`registration_fields`]).
//!
//! [`KvdBlockStore`] keeps one connection, opened on first use and again after a failure (a
//! restarted daemon is picked up by the next call); calls take turns on it. Each call,
//! connecting included, answers within [`CALL_DEADLINE`], so a daemon that stopped answering
//! costs a request a miss, never a hang.

use async_trait::async_trait;
use bytes::Bytes;
use infera_core::event::Retention;
use infera_core::kv_events::kvd;
use infera_core::ports::kv_store::{
    BlockNamespace, BlockStoreError, KVD_BACKED_FIELD, KvBlockStore, StoredBlock,
};
use infera_kvd::{ClientError, HelloAck, KvdClient, Namespace, SetItem};
use std::path::{Path, PathBuf};
use std::time::Duration;
use tokio::sync::Mutex;

/// How long one block-store call may take, connecting included.
pub const CALL_DEADLINE: Duration = Duration::from_secs(2);

/// How long the launchers' `hello` may take.
pub const PREFLIGHT_DEADLINE: Duration = Duration::from_secs(5);

/// Checks that kvd answers `hello` at `socket`, within [`PREFLIGHT_DEADLINE`]; returns its
/// answer.
///
/// # Errors
/// A message naming the socket: nothing listens there, the daemon did not answer in time, or it
/// answered something else.
pub async fn preflight(socket: &Path, client_id: &str) -> anyhow::Result<HelloAck> {
    let hello = async {
        let mut client = KvdClient::connect(socket).await?;
        client.hello(client_id).await
    };
    let hint = "start it first (`infera kvd --socket PATH`) or fix --infera-kvd-socket";
    match tokio::time::timeout(PREFLIGHT_DEADLINE, hello).await {
        Ok(Ok(ack)) => {
            tracing::info!(socket = %socket.display(), server_id = %ack.server_id,
                protocol_version = ack.protocol_version,
                kv_events = ack.kv_events_endpoint.as_deref().unwrap_or("off"),
                "kvd answered hello");
            Ok(ack)
        }
        Ok(Err(e)) => anyhow::bail!(
            "kvd at {} did not answer hello: {e}; {hint}",
            socket.display()
        ),
        Err(_) => anyhow::bail!(
            "kvd at {} did not answer hello within {} s (a wedged daemon: restart it); {hint}",
            socket.display(),
            PREFLIGHT_DEADLINE.as_secs()
        ),
    }
}

/// What a kvd-backed worker adds to its registration (PROTOCOLS.md §1): `kvd_backed`, and where
/// its node's kvd publishes its inventory when it says (so the router credits what it holds).
pub fn registration_fields(ack: &HelloAck) -> serde_json::Map<String, serde_json::Value> {
    let mut m = serde_json::Map::new();
    m.insert(KVD_BACKED_FIELD.into(), true.into());
    if let Some(e) = &ack.kv_events_endpoint {
        m.insert(kvd::KVD_EVENTS_ENDPOINT.into(), e.as_str().into());
    }
    if let Some(e) = &ack.kv_events_replay_endpoint {
        m.insert(kvd::KVD_EVENTS_REPLAY_ENDPOINT.into(), e.as_str().into());
    }
    m
}

/// [`KvBlockStore`] on the kvd daemon at a socket (see the module docs).
#[derive(Debug)]
pub struct KvdBlockStore {
    path: PathBuf,
    client: Mutex<Option<KvdClient>>,
}

impl KvdBlockStore {
    pub fn new(path: PathBuf) -> Self {
        Self {
            path,
            client: Mutex::new(None),
        }
    }

    /// Runs `call` on the connection (opened if needed) within [`CALL_DEADLINE`]; a failed call
    /// drops the connection so that the next one reconnects.
    async fn with_client<T, F>(&self, call: F) -> Result<T, BlockStoreError>
    where
        F: for<'c> FnOnce(
            &'c mut KvdClient,
        ) -> std::pin::Pin<
            Box<dyn std::future::Future<Output = Result<T, ClientError>> + Send + 'c>,
        >,
    {
        let attempt = async {
            let mut slot = self.client.lock().await;
            if slot.is_none() {
                *slot = Some(KvdClient::connect(&self.path).await?);
            }
            let Some(client) = slot.as_mut() else {
                return Err(ClientError::Closed);
            };
            let result = call(client).await;
            if result.is_err() {
                *slot = None;
            }
            result
        };
        match tokio::time::timeout(CALL_DEADLINE, attempt).await {
            Ok(result) => result.map_err(|e| BlockStoreError::Unavailable(Box::new(e))),
            Err(_) => {
                // The connection may be mid-reply: never reuse it.
                *self.client.lock().await = None;
                Err(BlockStoreError::Timeout(
                    u64::try_from(CALL_DEADLINE.as_millis()).unwrap_or(u64::MAX),
                ))
            }
        }
    }
}

fn namespace(ns: &BlockNamespace) -> Namespace {
    Namespace::new(ns.model.clone(), ns.compat_key.clone())
}

fn keys(keys: &[Vec<u8>]) -> Vec<Bytes> {
    keys.iter().map(|k| Bytes::copy_from_slice(k)).collect()
}

#[async_trait]
impl KvBlockStore for KvdBlockStore {
    async fn exists(
        &self,
        ns: &BlockNamespace,
        keys_: &[Vec<u8>],
    ) -> Result<Vec<bool>, BlockStoreError> {
        let (ns, keys) = (namespace(ns), keys(keys_));
        self.with_client(move |c| Box::pin(async move { c.exists(&ns, keys).await }))
            .await
    }

    async fn get(
        &self,
        ns: &BlockNamespace,
        keys_: &[Vec<u8>],
    ) -> Result<Vec<Option<Vec<u8>>>, BlockStoreError> {
        let (ns, keys) = (namespace(ns), keys(keys_));
        let hits = self
            .with_client(move |c| Box::pin(async move { c.batch_get(&ns, keys).await }))
            .await?;
        Ok(hits
            .into_iter()
            .map(|hit| hit.map(|h| h.value.to_vec()))
            .collect())
    }

    async fn set(
        &self,
        ns: &BlockNamespace,
        blocks: Vec<StoredBlock>,
        retention: Retention,
    ) -> Result<usize, BlockStoreError> {
        let ns = namespace(ns);
        let items: Vec<SetItem> = blocks
            .into_iter()
            .map(|b| SetItem::new(b.key, b.value).retention(retention))
            .collect();
        let acks = self
            .with_client(move |c| Box::pin(async move { c.batch_set(&ns, items).await }))
            .await?;
        Ok(acks.iter().filter(|a| a.accepted).count())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use infera_kvd::{KvdOptions, KvdServer, ShutdownHandle};

    async fn serve(socket: &Path) -> (ShutdownHandle, tokio::task::JoinHandle<()>) {
        let server = KvdServer::bind(KvdOptions::new(socket, 16 << 20))
            .await
            .unwrap();
        let stop = server.shutdown_handle();
        let task = tokio::spawn(async move { server.serve().await.unwrap() });
        (stop, task)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn blocks_round_trip_and_a_restarted_daemon_is_picked_up() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("kvd.sock");
        let no_daemon = preflight(&socket, "test").await.unwrap_err().to_string();
        assert!(
            no_daemon.contains(&socket.display().to_string()),
            "{no_daemon}"
        );

        let (stop, task) = serve(&socket).await;
        preflight(&socket, "test").await.unwrap();
        let store = KvdBlockStore::new(socket.clone());
        let ns = BlockNamespace {
            model: "m".to_owned(),
            compat_key: String::new(),
        };
        let block = |k: u8| StoredBlock {
            key: vec![k; 8],
            value: vec![k; 64],
        };
        let keys = vec![vec![1; 8], vec![2; 8]];
        assert_eq!(
            store
                .set(&ns, vec![block(1)], Retention::Long)
                .await
                .unwrap(),
            1
        );
        assert_eq!(store.exists(&ns, &keys).await.unwrap(), vec![true, false]);
        assert_eq!(
            store.get(&ns, &keys).await.unwrap(),
            vec![Some(vec![1; 64]), None]
        );
        let other = BlockNamespace {
            model: "other".to_owned(),
            compat_key: String::new(),
        };
        assert_eq!(
            store.exists(&other, &keys).await.unwrap(),
            vec![false, false]
        );

        // The daemon goes away: a call fails; once it is back, the next call reconnects.
        stop.shutdown();
        task.await.unwrap();
        assert!(store.exists(&ns, &keys).await.is_err());
        let (stop, task) = serve(&socket).await;
        assert_eq!(store.exists(&ns, &keys).await.unwrap(), vec![false, false]);
        stop.shutdown();
        task.await.unwrap();
    }
}
