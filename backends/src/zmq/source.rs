//! `--kv-event-transport zmq`: the KV-event source port on engines' PUB sockets, one
//! [`KvEventSubscriber`] per rank of a worker, merged into one stream, and the engines' replay
//! sockets as the port's [`KvReplay`].
//!
//! A worker registered with `dp_size` ranks publishes rank `dp_rank + i` on its
//! `kv_events_endpoint`'s port `+ i` (and its replay socket likewise); a wildcard host (`*`,
//! `0.0.0.0`) is the worker URL's host.

use super::{KvEventSubscriber, SubscriberConfig, SubscriberItem, replay_from};
use async_trait::async_trait;
use bytes::Bytes;
use infera_core::event::WorkerRecord;
use infera_core::ports::kv_events::{
    KvEventSource, KvEventStream, KvFrame, KvItem, KvReplay, KvSourceError, KvSubscription,
    resolve_wildcard_host,
};
use std::collections::HashMap;
use std::ops::RangeInclusive;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio_util::sync::{CancellationToken, DropGuard};

/// How long a gap repair waits for an engine's replay socket.
pub const REPLAY_TIMEOUT: Duration = Duration::from_secs(2);

/// Frames of all ranks, merged, in the order they arrive.
const MERGED_CAPACITY: usize = 1024;

/// The ZeroMQ KV-event source. See the module docs.
#[derive(Debug, Clone)]
pub struct ZmqKvSource {
    replay_timeout: Duration,
}

impl ZmqKvSource {
    /// A source whose gap repairs wait up to `replay_timeout` for the engine.
    pub fn new(replay_timeout: Duration) -> Self {
        Self { replay_timeout }
    }
}

impl Default for ZmqKvSource {
    fn default() -> Self {
        Self::new(REPLAY_TIMEOUT)
    }
}

#[async_trait]
impl KvEventSource for ZmqKvSource {
    fn name(&self) -> &'static str {
        "zmq"
    }

    async fn subscribe(&self, record: &WorkerRecord) -> Result<KvSubscription, KvSourceError> {
        let worker = record.worker_id.as_str();
        let no_endpoint = |reason: &str| KvSourceError::NoEndpoint {
            worker: worker.to_owned(),
            reason: reason.to_owned(),
        };
        let endpoint = record
            .kv_events_endpoint
            .as_deref()
            .ok_or_else(|| no_endpoint("none registered: routing ignores its cache"))?;
        let replay_base = record.kv_events_replay_endpoint();
        let mut ranks = Vec::new();
        let mut replays = HashMap::new();
        for offset in 0..record.dp_size.max(1) {
            let dp_rank = record.dp_rank + offset;
            let ep = rank_endpoint(endpoint, &record.url, offset)
                .ok_or_else(|| no_endpoint(&format!("{endpoint} is not tcp://HOST:PORT")))?;
            if let Some(replay) = replay_base.and_then(|r| rank_endpoint(r, &record.url, offset)) {
                replays.insert(dp_rank, replay);
            }
            ranks.push((dp_rank, ep));
        }
        let cancel = CancellationToken::new();
        let (tx, rx) = mpsc::channel(MERGED_CAPACITY);
        for (dp_rank, ep) in ranks {
            tracing::info!(worker, dp_rank, endpoint = %ep, "subscribing to kv events");
            let sub = KvEventSubscriber::spawn(SubscriberConfig::new(ep));
            tokio::spawn(forward(dp_rank, sub, tx.clone(), cancel.clone()));
        }
        let replay = (!replays.is_empty()).then(|| {
            Arc::new(ZmqReplay {
                endpoints: replays,
                timeout: self.replay_timeout,
            }) as Arc<dyn KvReplay>
        });
        Ok(KvSubscription {
            events: Box::new(MergedStream {
                rx,
                _stop: cancel.drop_guard(),
            }),
            replay,
        })
    }
}

/// One rank's subscriber into the merged channel, until cancelled or nobody listens.
async fn forward(
    dp_rank: u32,
    mut sub: KvEventSubscriber,
    tx: mpsc::Sender<KvItem>,
    cancel: CancellationToken,
) {
    loop {
        let item = tokio::select! {
            () = cancel.cancelled() => break,
            item = sub.recv() => item,
        };
        let item = match item {
            None => break,
            Some(SubscriberItem::Malformed { reason }) => KvItem::Malformed {
                reason: format!("rank {dp_rank}: {reason}"),
            },
            Some(SubscriberItem::Frames(frames)) => KvItem::Frame(KvFrame {
                dp_rank,
                seq: frames.seq,
                epoch: None,
                payload: frames.payload,
            }),
        };
        let sent = tokio::select! {
            () = cancel.cancelled() => break,
            sent = tx.send(item) => sent,
        };
        if sent.is_err() {
            break;
        }
    }
    sub.shutdown().await;
}

/// The merged frames of one worker; dropping it stops every rank's subscriber.
#[derive(Debug)]
struct MergedStream {
    rx: mpsc::Receiver<KvItem>,
    _stop: DropGuard,
}

#[async_trait]
impl KvEventStream for MergedStream {
    async fn recv(&mut self) -> Option<KvItem> {
        self.rx.recv().await
    }
}

/// The replay sockets of one worker's ranks.
#[derive(Debug)]
struct ZmqReplay {
    endpoints: HashMap<u32, String>,
    timeout: Duration,
}

#[async_trait]
impl KvReplay for ZmqReplay {
    async fn replay(
        &self,
        dp_rank: u32,
        missing: RangeInclusive<u64>,
    ) -> Result<Vec<(u64, Bytes)>, KvSourceError> {
        let from = *missing.start();
        let endpoint = self
            .endpoints
            .get(&dp_rank)
            .ok_or_else(|| KvSourceError::Replay {
                from,
                reason: format!("rank {dp_rank} has no replay socket"),
            })?;
        replay_from(endpoint, from, self.timeout)
            .await
            .map_err(|e| KvSourceError::Replay {
                from,
                reason: e.to_string(),
            })
    }
}

/// `tcp://HOST:P` → `tcp://HOST':P+offset`, where a wildcard host becomes the worker URL's host
/// ([`resolve_wildcard_host`]).
pub fn rank_endpoint(endpoint: &str, worker_url: &str, offset: u32) -> Option<String> {
    let resolved = resolve_wildcard_host(endpoint, worker_url)?;
    let (host, port) = resolved.rsplit_once(':')?;
    let port: u32 = port.parse().ok()?;
    let port = u16::try_from(port.checked_add(offset)?).ok()?;
    Some(format!("{host}:{port}"))
}

#[cfg(test)]
mod tests {
    use super::rank_endpoint;

    #[test]
    fn rank_endpoints_offset_the_port_and_resolve_wildcards() {
        assert_eq!(
            rank_endpoint("tcp://10.0.0.5:5557", "http://10.0.0.5:8000", 0).as_deref(),
            Some("tcp://10.0.0.5:5557")
        );
        assert_eq!(
            rank_endpoint("tcp://*:5557", "http://node7:8000", 2).as_deref(),
            Some("tcp://node7:5559")
        );
        assert_eq!(rank_endpoint("ipc:///tmp/x", "http://a:1", 0), None);
        assert_eq!(rank_endpoint("tcp://h:65535", "http://a:1", 1), None);
    }
}
