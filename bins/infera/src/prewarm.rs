//! `--kvd-socket-path`: the server's prewarm port ([`KvPrefetch`]) on the kvd client. One
//! connection, opened on first use and again after a failure (a restarted daemon is picked up by
//! the next prewarm).

use async_trait::async_trait;
use bytes::Bytes;
use infera_adapters::server::KvPrefetch;
use infera_kvd::{KvdClient, Namespace};
use std::path::PathBuf;
use tokio::sync::Mutex;

/// Prefetch hints to the daemon at `path`.
#[derive(Debug)]
pub struct KvdPrefetch {
    path: PathBuf,
    client: Mutex<Option<KvdClient>>,
}

impl KvdPrefetch {
    pub fn new(path: PathBuf) -> Self {
        Self {
            path,
            client: Mutex::new(None),
        }
    }
}

#[async_trait]
impl KvPrefetch for KvdPrefetch {
    async fn prefetch(
        &self,
        model: &str,
        compat_key: &str,
        keys: Vec<Vec<u8>>,
        deadline_ms: u64,
    ) -> Result<(), String> {
        let ns = Namespace::new(model, compat_key);
        let keys: Vec<Bytes> = keys.into_iter().map(Bytes::from).collect();
        let mut slot = self.client.lock().await;
        // A kept connection may have died with an earlier daemon: one retry on a fresh one.
        for fresh in [false, true] {
            if fresh || slot.is_none() {
                *slot = None;
                *slot = Some(
                    KvdClient::connect(&self.path)
                        .await
                        .map_err(|e| e.to_string())?,
                );
            }
            let Some(client) = slot.as_mut() else {
                continue;
            };
            match client.prefetch_hint(&ns, keys.clone(), deadline_ms).await {
                Ok(()) => return Ok(()),
                Err(e) if fresh => {
                    *slot = None;
                    return Err(e.to_string());
                }
                Err(_) => {}
            }
        }
        Err("no connection".to_owned())
    }
}
