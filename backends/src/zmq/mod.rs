//! The ZeroMQ KV-event transport: subscribing to engines' PUB sockets ([`ZmqKvSource`], the
//! KV-event source port), replaying from their ROUTER replay sockets, and (for the mock engine)
//! publishing exactly like vLLM does. Frames travel undecoded; `infera_core::kv_events` decodes.
//!
//! # Wire layout (PROTOCOLS.md §3)
//!
//! PUB → SUB multipart messages, one event batch each (payload: msgpack, see
//! `infera_core::kv_events`):
//!
//! ```text
//! vLLM, SGLang:  [topic, seq: 8 bytes u64 big-endian, payload]   seq from 0 per engine process
//! ATOM:          [payload]  or  [topic, payload]                 no seq
//! ```
//!
//! Anything else (0 or 4+ frames, a 3-frame message whose middle frame is not 8 bytes) is
//! garbage: logged (rate-limited), counted, and reported as malformed.
//!
//! Replay (vLLM, SGLang): the client's DEALER connects to the engine's ROUTER and sends the first
//! seq it wants; the engine answers with every retained batch from there on, then a terminator:
//!
//! ```text
//! DEALER → ROUTER:  ["", start_seq: 8 bytes BE]       (the empty delimiter is optional for ours)
//! ROUTER → DEALER:  ["", seq: 8 bytes BE, payload]  or  ["", topic, seq, payload]   (repeated)
//!                   ["", 0xFFFFFFFFFFFFFFFF, ""]    end of replay
//! ```
//!
//! Leading empty delimiter frames are stripped on both sides, so the client works with vLLM's
//! publisher (which expects and sends them) and with ours.
//!
//! # Concurrency
//!
//! [`KvEventSubscriber`] and [`KvEventPublisher`] each own one background task, stopped by a
//! cancellation token that `shutdown()` and `Drop` trigger; nothing is detached. Items flow on a
//! bounded channel: a slow consumer back-pressures the socket reader (and ZeroMQ then drops at its
//! high-water mark, which the next seq reveals as a gap).

mod frames;
mod publisher;
mod replay;
mod source;
mod subscriber;

pub use frames::{FrameError, KvFrames, split_frames};
pub use publisher::{KvEventPublisher, PublisherConfig};
pub use replay::{REPLAY_END_SEQ, replay_from};
pub use source::{REPLAY_TIMEOUT, ZmqKvSource, rank_endpoint};
pub use subscriber::{KvEventSubscriber, SubscriberConfig, SubscriberItem, SubscriberStats};

/// Errors of the ZeroMQ transport.
#[derive(Debug, thiserror::Error)]
pub enum ZmqTransportError {
    /// A socket could not bind, connect, send or receive.
    #[error("zmq {op} on {endpoint}: {source}")]
    Socket {
        op: &'static str,
        endpoint: String,
        #[source]
        source: zeromq::ZmqError,
    },
    /// A replay did not finish in time.
    #[error(
        "replay from {endpoint} timed out after {timeout_ms} ms with {received} batch(es); is the engine's replay socket up?"
    )]
    ReplayTimeout {
        endpoint: String,
        timeout_ms: u64,
        received: usize,
    },
    /// The replay socket answered something that is not a replay reply.
    #[error("replay from {endpoint}: malformed reply: {reason}")]
    MalformedReply { endpoint: String, reason: String },
}

impl ZmqTransportError {
    /// Whether trying again later may succeed (the peer may come up or recover).
    pub fn is_retryable(&self) -> bool {
        match self {
            ZmqTransportError::Socket { .. } | ZmqTransportError::ReplayTimeout { .. } => true,
            ZmqTransportError::MalformedReply { .. } => false,
        }
    }

    fn socket(op: &'static str, endpoint: &str, source: zeromq::ZmqError) -> Self {
        ZmqTransportError::Socket {
            op,
            endpoint: endpoint.to_owned(),
            source,
        }
    }
}
