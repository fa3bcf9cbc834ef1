//! The replay client: fetch an engine's retained batches from a seq on (layout in [`super`]).

use super::ZmqTransportError;
use super::frames::seq_of;
use bytes::Bytes;
use std::time::Duration;
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

/// The seq of the replay terminator (with an empty payload).
pub const REPLAY_END_SEQ: u64 = u64::MAX;

/// Asks the replay socket at `endpoint` for every batch from `start_seq` on and returns them as
/// `(seq, payload)` in the order received, without the terminator.
///
/// # Errors
/// [`ZmqTransportError::ReplayTimeout`] when connecting, or receiving the terminator, takes
/// longer than `timeout` (retryable); `Socket` on a socket error; `MalformedReply` when a reply
/// has no 8-byte seq frame where one belongs.
pub async fn replay_from(
    endpoint: &str,
    start_seq: u64,
    timeout: Duration,
) -> Result<Vec<(u64, Bytes)>, ZmqTransportError> {
    let mut out = Vec::new();
    let work = replay_inner(endpoint, start_seq, &mut out);
    match tokio::time::timeout(timeout, work).await {
        Ok(r) => r.map(|()| out),
        Err(_) => Err(ZmqTransportError::ReplayTimeout {
            endpoint: endpoint.to_owned(),
            timeout_ms: u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX),
            received: out.len(),
        }),
    }
}

async fn replay_inner(
    endpoint: &str,
    start_seq: u64,
    out: &mut Vec<(u64, Bytes)>,
) -> Result<(), ZmqTransportError> {
    let mut socket = DealerSocket::new();
    socket
        .connect(endpoint)
        .await
        .map_err(|e| ZmqTransportError::socket("connect", endpoint, e))?;
    let mut request = ZmqMessage::from(Bytes::new());
    request.push_back(Bytes::copy_from_slice(&start_seq.to_be_bytes()));
    socket
        .send(request)
        .await
        .map_err(|e| ZmqTransportError::socket("send", endpoint, e))?;
    loop {
        let reply = socket
            .recv()
            .await
            .map_err(|e| ZmqTransportError::socket("recv", endpoint, e))?;
        let mut frames = reply.into_vec();
        let first = frames
            .iter()
            .position(|f| !f.is_empty())
            .unwrap_or(frames.len());
        let frames = frames.split_off(first);
        // [seq, payload], [topic, seq, payload], or the terminator [seq] / [seq, ""].
        let (seq_frame, payload) = match frames.as_slice() {
            [seq] => (seq, Bytes::new()),
            [seq, payload] => (seq, payload.clone()),
            [_topic, seq, payload] => (seq, payload.clone()),
            other => {
                return Err(ZmqTransportError::MalformedReply {
                    endpoint: endpoint.to_owned(),
                    reason: format!("{} non-empty-led frame(s)", other.len()),
                });
            }
        };
        let seq = seq_of(seq_frame).ok_or_else(|| ZmqTransportError::MalformedReply {
            endpoint: endpoint.to_owned(),
            reason: format!("seq frame of {} bytes, expected 8", seq_frame.len()),
        })?;
        if seq == REPLAY_END_SEQ && payload.is_empty() {
            return Ok(());
        }
        out.push((seq, payload));
    }
}
