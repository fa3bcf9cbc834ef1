//! [`KvEventPublisher`]: the mock engine's side — a PUB socket publishing `[topic, seq, payload]`
//! with seq from 0, and a ROUTER replay socket serving the last `ring_capacity` payloads, exactly
//! as vLLM's publisher does (layout in [`super`]).
//!
//! The ring is shared between [`KvEventPublisher::publish`] and the replay task behind a
//! `std::sync::Mutex` that is never held across an `.await` (replies are cloned out first;
//! `Bytes` clones are reference counts).

use super::ZmqTransportError;
use super::frames::seq_of;
use super::replay::REPLAY_END_SEQ;
use bytes::Bytes;
use infera_core::kv_events::{EngineBatch, encode_batch_vllm};
use std::collections::VecDeque;
use std::sync::{Arc, Mutex, PoisonError};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use zeromq::{PubSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

/// Where and how to publish.
#[derive(Debug, Clone)]
pub struct PublisherConfig {
    /// PUB endpoint to bind, e.g. `tcp://127.0.0.1:0` (port 0 picks a free port).
    pub endpoint: String,
    /// ROUTER replay endpoint to bind; `None` for no replay socket.
    pub replay_endpoint: Option<String>,
    pub topic: String,
    /// How many recent payloads the replay socket can serve.
    pub ring_capacity: usize,
}

impl PublisherConfig {
    /// vLLM's defaults: topic `kv-events`, a ring of 10 000 batches.
    pub fn new(endpoint: impl Into<String>, replay_endpoint: Option<String>) -> Self {
        Self {
            endpoint: endpoint.into(),
            replay_endpoint,
            topic: "kv-events".to_owned(),
            ring_capacity: 10_000,
        }
    }
}

type Ring = Arc<Mutex<VecDeque<(u64, Bytes)>>>;

/// A bound publisher. Dropping it stops the replay task and closes both sockets.
pub struct KvEventPublisher {
    socket: PubSocket,
    endpoint: String,
    replay_endpoint: Option<String>,
    topic: Bytes,
    next_seq: u64,
    ring: Ring,
    ring_capacity: usize,
    cancel: CancellationToken,
    replay_task: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for KvEventPublisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvEventPublisher")
            .field("endpoint", &self.endpoint)
            .field("replay_endpoint", &self.replay_endpoint)
            .field("topic", &self.topic)
            .field("next_seq", &self.next_seq)
            .field("ring_capacity", &self.ring_capacity)
            .finish_non_exhaustive()
    }
}

impl KvEventPublisher {
    /// Binds the PUB socket (and the replay socket, if configured). Must be called inside a
    /// tokio runtime.
    ///
    /// # Errors
    /// [`ZmqTransportError::Socket`] when an endpoint cannot be bound (in use, bad address).
    pub async fn bind(config: PublisherConfig) -> Result<Self, ZmqTransportError> {
        let mut socket = PubSocket::new();
        let endpoint = socket
            .bind(&config.endpoint)
            .await
            .map_err(|e| ZmqTransportError::socket("bind", &config.endpoint, e))?
            .to_string();
        let ring: Ring = Arc::new(Mutex::new(VecDeque::new()));
        let cancel = CancellationToken::new();
        let (replay_endpoint, replay_task) = match &config.replay_endpoint {
            None => (None, None),
            Some(ep) => {
                let mut router = RouterSocket::new();
                let bound = router
                    .bind(ep)
                    .await
                    .map_err(|e| ZmqTransportError::socket("bind", ep, e))?
                    .to_string();
                let task = tokio::spawn(serve_replay(router, Arc::clone(&ring), cancel.clone()));
                (Some(bound), Some(task))
            }
        };
        Ok(Self {
            socket,
            endpoint,
            replay_endpoint,
            topic: Bytes::copy_from_slice(config.topic.as_bytes()),
            next_seq: 0,
            ring,
            ring_capacity: config.ring_capacity.max(1),
            cancel,
            replay_task,
        })
    }

    /// The bound PUB endpoint, port resolved (`tcp://127.0.0.1:40123`).
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// The bound replay endpoint, port resolved.
    pub fn replay_endpoint(&self) -> Option<&str> {
        self.replay_endpoint.as_deref()
    }

    /// The seq the next publish will carry.
    pub fn next_seq(&self) -> u64 {
        self.next_seq
    }

    /// Sets the seq of the next publish: a jump forward makes subscribers see a gap, a jump back
    /// a restart (for tests and fault injection).
    pub fn set_next_seq(&mut self, seq: u64) {
        self.next_seq = seq;
    }

    /// Publishes one payload as `[topic, seq, payload]`, keeps it for replay, and returns its seq.
    /// With no subscriber connected the message is dropped (ZeroMQ PUB semantics) but still kept.
    ///
    /// # Errors
    /// [`ZmqTransportError::Socket`] when the socket fails.
    pub async fn publish(&mut self, payload: Bytes) -> Result<u64, ZmqTransportError> {
        let seq = self.next_seq;
        self.next_seq = seq.wrapping_add(1);
        {
            let mut ring = self.ring.lock().unwrap_or_else(PoisonError::into_inner);
            if ring.len() >= self.ring_capacity {
                ring.pop_front();
            }
            ring.push_back((seq, payload.clone()));
        }
        let mut msg = ZmqMessage::from(self.topic.clone());
        msg.push_back(Bytes::copy_from_slice(&seq.to_be_bytes()));
        msg.push_back(payload);
        self.socket
            .send(msg)
            .await
            .map_err(|e| ZmqTransportError::socket("send", &self.endpoint, e))?;
        Ok(seq)
    }

    /// Encodes a batch as vLLM does and publishes it.
    ///
    /// # Errors
    /// As [`KvEventPublisher::publish`].
    pub async fn publish_batch(&mut self, batch: &EngineBatch) -> Result<u64, ZmqTransportError> {
        self.publish(Bytes::from(encode_batch_vllm(batch))).await
    }

    /// Sends arbitrary frames, not numbered or kept (fault injection: garbage, ATOM layouts).
    ///
    /// # Errors
    /// As [`KvEventPublisher::publish`]; an empty frame list is a no-op.
    pub async fn publish_raw(&mut self, frames: Vec<Bytes>) -> Result<(), ZmqTransportError> {
        let Ok(msg) = ZmqMessage::try_from(frames) else {
            return Ok(());
        };
        self.socket
            .send(msg)
            .await
            .map_err(|e| ZmqTransportError::socket("send", &self.endpoint, e))
    }

    /// Stops the replay task and closes the sockets, waiting until they are unbound.
    pub async fn shutdown(mut self) {
        self.cancel.cancel();
        if let Some(task) = self.replay_task.take() {
            // A panic in the task has already been reported by tokio; nothing to add.
            let _ = task.await;
        }
        let socket = std::mem::replace(&mut self.socket, PubSocket::new());
        for e in socket.close().await {
            tracing::debug!(error = %e, "closing kv-event PUB socket");
        }
    }
}

impl Drop for KvEventPublisher {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

/// Serves replay requests until cancelled.
async fn serve_replay(mut router: RouterSocket, ring: Ring, cancel: CancellationToken) {
    loop {
        let msg = tokio::select! {
            () = cancel.cancelled() => break,
            m = router.recv() => m,
        };
        let Ok(msg) = msg else { continue };
        let mut frames = msg.into_vec();
        if frames.is_empty() {
            continue;
        }
        let identity = frames.remove(0);
        // [start] or ["", start]
        let delimited = frames.first().is_some_and(Bytes::is_empty);
        let start = frames
            .iter()
            .find(|f| !f.is_empty())
            .and_then(|f| seq_of(f));
        let Some(start) = start else {
            tracing::warn!(
                frames = frames.len(),
                "kv-event replay request without an 8-byte start seq"
            );
            continue;
        };
        let replies: Vec<(u64, Bytes)> = {
            let ring = ring.lock().unwrap_or_else(PoisonError::into_inner);
            ring.iter().filter(|(s, _)| *s >= start).cloned().collect()
        };
        let reply = |seq: u64, payload: Bytes| {
            let mut m = ZmqMessage::from(identity.clone());
            if delimited {
                m.push_back(Bytes::new());
            }
            m.push_back(Bytes::copy_from_slice(&seq.to_be_bytes()));
            m.push_back(payload);
            m
        };
        for (seq, payload) in replies {
            if let Err(e) = router.send(reply(seq, payload)).await {
                tracing::warn!(error = %e, "kv-event replay send failed");
                break;
            }
        }
        if let Err(e) = router.send(reply(REPLAY_END_SEQ, Bytes::new())).await {
            tracing::warn!(error = %e, "kv-event replay terminator send failed");
        }
    }
    for e in router.close().await {
        tracing::debug!(error = %e, "closing kv-event replay socket");
    }
}
