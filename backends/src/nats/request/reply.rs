//! The replies of one NATS request: read in sequence, bounded by the idle and total deadlines,
//! and a cancel published for the worker when they are dropped before the end.

use super::{Cancel, LEFT_IDLE, NatsRequestConfig};
use crate::nats::jetstream::REQUEST_STREAM;
use crate::nats::{
    HDR_SEQ, HDR_STATUS, HDR_TYPE, TYPE_DATA, TYPE_DONE, TYPE_ERROR, request_subject,
};
use bytes::Bytes;
use futures::StreamExt as _;
use infera_core::ids::WorkerId;
use infera_core::ports::transport::{BodyStream, TransportError};
use std::sync::atomic::{AtomicBool, Ordering};
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// Publishes the inbox on the cancel subject when dropped while armed.
#[derive(Debug)]
pub(super) struct CancelOnDrop {
    pub(super) tx: mpsc::Sender<Cancel>,
    /// `None` once disarmed.
    pub(super) subject: Option<String>,
    pub(super) inbox: String,
    /// JetStream mode: the request's sequence in the stream until a reply shows that a worker
    /// took it.
    pub(super) queued: Option<u64>,
}

impl CancelOnDrop {
    pub(super) fn disarm(&mut self) {
        self.subject = None;
    }
}

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        if let Some(subject) = self.subject.take() {
            let inbox = std::mem::take(&mut self.inbox);
            let cancel = Cancel {
                subject,
                inbox,
                queued: self.queued,
            };
            if self.tx.try_send(cancel).is_err() {
                tracing::warn!("cancel queue full; a worker keeps generating for nobody");
            }
        }
    }
}

#[derive(Debug, PartialEq)]
pub(super) enum Chunk {
    Data(Bytes),
    Done(http::StatusCode),
}

/// Reads one reply message of `worker`: its `rs-seq` (checked against `next_seq`, which it
/// advances), `rs-type` and `rs-status`. A missing `rs-type` is `data` and a missing or invalid
/// `rs-status` is 200, as the Python Infera reads them; a missing `rs-seq` is not checked.
pub(super) fn parse_reply(
    msg: &async_nats::Message,
    next_seq: &mut u64,
    worker: &str,
) -> Result<Chunk, TransportError> {
    if msg.status == Some(async_nats::StatusCode::NO_RESPONDERS) {
        return Err(TransportError::Unreachable(format!(
            "worker {worker} is not subscribed to {}",
            request_subject(worker)
        )));
    }
    let header = |name: &str| {
        msg.headers
            .as_ref()
            .and_then(|h| h.get(name))
            .map(|v| v.as_str().to_owned())
    };
    if let Some(seq) = header(HDR_SEQ) {
        let expected = *next_seq;
        match seq.trim().parse::<u64>() {
            Ok(n) if n == expected => *next_seq += 1,
            _ => {
                return Err(TransportError::Sequence(format!(
                    "worker {worker} sent reply {seq:?} where {expected} was due; a chunk was \
                     lost or reordered, so the rest of the reply is dropped"
                )));
            }
        }
    }
    match header(HDR_TYPE).as_deref().unwrap_or(TYPE_DATA) {
        TYPE_DATA => Ok(Chunk::Data(msg.payload.clone())),
        TYPE_DONE => Ok(Chunk::Done(
            header(HDR_STATUS)
                .and_then(|s| s.trim().parse::<u16>().ok())
                .and_then(|s| http::StatusCode::from_u16(s).ok())
                .unwrap_or(http::StatusCode::OK),
        )),
        // The worker's own --nats-req-max-duration or idle timeout ended it: a timeout, not a
        // failed worker.
        TYPE_ERROR if header(HDR_STATUS).is_some_and(|s| s.trim() == "504") => {
            Err(TransportError::Timeout(format!(
                "worker {worker}: {}",
                String::from_utf8_lossy(&msg.payload)
            )))
        }
        TYPE_ERROR => Err(TransportError::Failed(
            String::from_utf8_lossy(&msg.payload).into_owned(),
        )),
        other => Err(TransportError::Failed(format!(
            "worker {worker} sent a reply of unknown {HDR_TYPE} {other:?}"
        ))),
    }
}

/// Whether `msg` is JetStream's ack of a core request that an `INFERA_REQUESTS` stream left over
/// from JetStream mode captured: never a worker's reply (those carry `rs-type`). Dropped with
/// a warning (once), so core NATS keeps working beside such a stream.
pub(super) fn is_stray_pub_ack(msg: &async_nats::Message) -> bool {
    static WARNED: AtomicBool = AtomicBool::new(false);
    let prefix = format!("{{\"stream\":\"{REQUEST_STREAM}\"");
    let stray = msg.headers.is_none() && msg.payload.starts_with(prefix.as_bytes());
    if stray && !WARNED.swap(true, Ordering::Relaxed) {
        tracing::warn!(
            "the JetStream stream {REQUEST_STREAM} captures core NATS requests: set \
             --nats-req-max-pending on every server and worker, or delete the stream"
        );
    }
    stray
}

/// The replies of one request.
pub(super) struct Reply {
    pub(super) sub: async_nats::Subscriber,
    /// Cancelled when the worker leaves the fleet.
    pub(super) left: CancellationToken,
    pub(super) worker: WorkerId,
    pub(super) next_seq: u64,
    pub(super) started: Instant,
    pub(super) config: NatsRequestConfig,
    /// Core NATS mode (no JetStream): the inbox may also get a stray JetStream ack.
    pub(super) core: bool,
    pub(super) cancel: CancelOnDrop,
}

impl Reply {
    /// The next data or done reply. An `Err` ends the request.
    pub(super) async fn next(&mut self) -> Result<Chunk, TransportError> {
        loop {
            let msg = self.recv().await?;
            if self.core && is_stray_pub_ack(&msg) {
                continue;
            }
            // Whatever the worker sent, it has the request: nothing left queued to delete.
            self.cancel.queued = None;
            let parsed = parse_reply(&msg, &mut self.next_seq, self.worker.as_str());
            if matches!(
                parsed,
                Ok(Chunk::Done(_))
                    | Err(TransportError::Failed(_)
                        | TransportError::Unreachable(_)
                        | TransportError::Timeout(_))
            ) {
                // The worker is done with it (or never had it): nothing to cancel.
                self.cancel.disarm();
            }
            match parsed {
                Ok(Chunk::Data(data)) if data.is_empty() => {}
                other => return other,
            }
        }
    }

    async fn recv(&mut self) -> Result<async_nats::Message, TransportError> {
        loop {
            let now = Instant::now();
            // A worker that left the fleet may be draining (it still sends) or dead (it never
            // will): it gets at most LEFT_IDLE per reply.
            let left = self.left.is_cancelled();
            let idle = match (self.config.idle_timeout, left) {
                (Some(d), true) => Some(d.min(LEFT_IDLE)),
                (None, true) => Some(LEFT_IDLE),
                (d, false) => d,
            };
            let total = self.config.max_duration.map(|d| self.started + d);
            let deadline = match (idle.map(|d| now + d), total) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
            let token = self.left.clone();
            let next = async {
                tokio::select! {
                    msg = self.sub.next() => Some(msg),
                    () = token.cancelled(), if !left => None,
                }
            };
            let next = match deadline {
                None => Ok(next.await),
                Some(at) => tokio::time::timeout_at(at, next).await,
            };
            let msg = match next {
                Ok(Some(msg)) => msg,
                // The worker just left: wait again, on the shorter clock.
                Ok(None) => continue,
                Err(_) => {
                    let at = deadline.unwrap_or(now);
                    let why = match (total, self.config.max_duration) {
                        (Some(t), Some(d)) if t <= at => {
                            format!("the request ran past --nats-req-max-duration ({d:?})")
                        }
                        _ if left => format!(
                            "it left the fleet and sent nothing for {:?}",
                            idle.unwrap_or(LEFT_IDLE)
                        ),
                        _ => format!(
                            "no reply for --nats-req-idle-timeout ({:?})",
                            self.config.idle_timeout.unwrap_or_default()
                        ),
                    };
                    return Err(TransportError::Timeout(format!(
                        "worker {}: {why}; the worker was told to cancel",
                        self.worker.as_str()
                    )));
                }
            };
            return msg.ok_or_else(|| {
                TransportError::Failed("the nats reply subscription closed".to_owned())
            });
        }
    }

    pub(super) fn into_stream(self) -> BodyStream {
        futures::stream::unfold(Some(self), |state| async move {
            let mut reply = state?;
            match reply.next().await {
                Ok(Chunk::Data(data)) => Some((Ok(data), Some(reply))),
                Ok(Chunk::Done(_)) => None,
                Err(e) => Some((Err(e), None)),
            }
        })
        .boxed()
    }
}
