//! `--kvd-socket-path`: the server's prewarm port ([`KvPrefetch`]) on the kvd client. One
//! connection, opened on first use and again after a failure (a restarted daemon is picked up by
//! the next prewarm). Each hint, connection included, must be handed to the daemon within
//! [`SEND_DEADLINE`] (a daemon that stopped reading cannot hold the server's prewarms).

use async_trait::async_trait;
use bytes::Bytes;
use infera_core::ports::prefetch::{KvPrefetch, PrefetchError};
use infera_kvd::{KvdClient, Namespace};
use std::path::PathBuf;
use std::time::Duration;
use tokio::sync::Mutex;

/// How long one hint may take to reach the daemon, connecting included.
pub const SEND_DEADLINE: Duration = Duration::from_secs(2);

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
    ) -> Result<(), PrefetchError> {
        let ns = Namespace::new(model, compat_key);
        let keys: Vec<Bytes> = keys.into_iter().map(Bytes::from).collect();
        let send = async {
            let mut slot = self.client.lock().await;
            // A kept connection may have died with an earlier daemon: one retry on a fresh one.
            let mut last = None;
            for fresh in [false, true] {
                if fresh || slot.is_none() {
                    *slot = None;
                    let client = KvdClient::connect(&self.path)
                        .await
                        .map_err(|e| PrefetchError::Unavailable(Box::new(e)))?;
                    *slot = Some(client);
                }
                let Some(client) = slot.as_mut() else {
                    continue;
                };
                match client.prefetch_hint(&ns, keys.clone(), deadline_ms).await {
                    Ok(()) => return Ok(()),
                    Err(e) => {
                        *slot = None;
                        last = Some(e);
                    }
                }
            }
            Err(PrefetchError::Unavailable(match last {
                Some(e) => Box::new(e),
                None => "no connection to the daemon".into(),
            }))
        };
        tokio::time::timeout(SEND_DEADLINE, send)
            .await
            .unwrap_or_else(|_| {
                Err(PrefetchError::Timeout(
                    u64::try_from(SEND_DEADLINE.as_millis()).unwrap_or(u64::MAX),
                ))
            })
    }
}
