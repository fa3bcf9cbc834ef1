//! Reading the JetStream log: batched direct gets for `read`, an ordered consumer for
//! `subscribe`. Both hand out contiguous sequence numbers or an error, never a silent skip.

use super::JetStreamLog;
use crate::log::codec;
use async_nats::jetstream::consumer::{DeliverPolicy, push};
use async_nats::{HeaderMap, StatusCode, header};
use futures::StreamExt;
use futures::stream::BoxStream;
use infera_core::event::{Envelope, Seq};
use infera_core::log::LogError;
use std::time::Duration;

/// The most envelopes one direct get asks for.
const MAX_DIRECT_BATCH: usize = 4096;
/// The most bytes one direct get asks for.
const MAX_DIRECT_BYTES: usize = 16 << 20;
/// How long a direct get may go without its next reply.
const READ_IDLE_TIMEOUT: Duration = Duration::from_secs(10);
/// Status of the empty message that ends a batched direct get.
const END_OF_BATCH: u16 = 204;
const NUM_PENDING: &str = "Nats-Num-Pending";

fn header_u64(headers: Option<&HeaderMap>, name: &str) -> Option<u64> {
    headers?.get(name)?.as_str().parse().ok()
}

/// The store's name in error messages.
fn store_name(log: &JetStreamLog) -> String {
    format!("stream {}", log.inner.name)
}

/// Why envelopes from `from` are missing, given the oldest one still stored.
async fn missing(log: &JetStreamLog, from: Seq, first_available: Seq) -> LogError {
    match log.snapshot_upto().await {
        Ok(upto) => codec::missing(&store_name(log), from, first_available, upto),
        Err(e) => e,
    }
}

/// Up to `max` envelopes from `from` (see [`infera_core::log::EventLog::read`]).
pub(super) async fn read(
    log: &JetStreamLog,
    from: Seq,
    max: usize,
) -> Result<Vec<Envelope>, LogError> {
    let from = from.max(1);
    if max == 0 {
        return Ok(Vec::new());
    }
    let batch = max.min(MAX_DIRECT_BATCH);
    let client = &log.inner.client;
    let inbox = client.new_inbox();
    let mut replies = client
        .subscribe(inbox.clone())
        .await
        .map_err(|e| log.backend("subscribing for a direct get", e))?;
    let request = serde_json::json!({ "seq": from, "batch": batch, "max_bytes": MAX_DIRECT_BYTES });
    client
        .publish_with_reply(
            format!("$JS.API.DIRECT.GET.{}", log.inner.name),
            inbox,
            request.to_string().into(),
        )
        .await
        .map_err(|e| log.backend("requesting a direct get", e))?;
    let store = store_name(log);
    let mut out: Vec<Envelope> = Vec::with_capacity(batch.min(1024));
    loop {
        let message = tokio::time::timeout(READ_IDLE_TIMEOUT, replies.next())
            .await
            .map_err(|_| log.backend("reading", format!("no reply within {READ_IDLE_TIMEOUT:?}")))?
            .ok_or(LogError::Closed)?;
        if let Some(status) = message.status {
            match status.as_u16() {
                END_OF_BATCH => break,
                // Nothing at or after `from`.
                s if s == StatusCode::NOT_FOUND.as_u16() => break,
                s if s == StatusCode::NO_RESPONDERS.as_u16() => {
                    return Err(log.backend("reading", "the stream is unavailable (no responders)"));
                }
                _ => {
                    return Err(log.backend(
                        "reading",
                        format!(
                            "direct get answered {status}: {}",
                            message.description.unwrap_or_default()
                        ),
                    ));
                }
            }
        }
        let headers = message.headers.as_ref();
        let seq = header_u64(headers, header::NATS_SEQUENCE.as_ref())
            .ok_or_else(|| log.backend("reading", "a direct get reply has no Nats-Sequence"))?;
        let expected = out.last().map_or(from, |e| e.seq + 1);
        if seq != expected {
            return Err(missing(log, expected, seq).await);
        }
        let mut env = codec::decode_envelope(&message.payload, seq, &store)?;
        env.seq = seq;
        out.push(env);
        let pending = header_u64(headers, NUM_PENDING);
        if out.len() >= batch || pending == Some(0) {
            break;
        }
    }
    if out.is_empty() {
        // Nothing at or after `from`: fine past the end, but not below it.
        let (first, last) = log.bounds().await?;
        if from <= last {
            return Err(missing(log, from, first).await);
        }
    }
    Ok(out)
}

struct Sub {
    log: JetStreamLog,
    next: Seq,
    messages: Option<push::Ordered>,
    done: bool,
}

/// Every envelope from `from` on, through an ordered push consumer (see
/// [`infera_core::log::EventLog::subscribe`]).
pub(super) fn subscribe(
    log: JetStreamLog,
    from: Seq,
) -> BoxStream<'static, Result<Envelope, LogError>> {
    let state = Sub {
        log,
        next: from.max(1),
        messages: None,
        done: false,
    };
    Box::pin(futures::stream::unfold(state, |mut s| async move {
        if s.done {
            return None;
        }
        let item = next(&mut s).await;
        s.done = item.is_err();
        Some((item, s))
    }))
}

async fn start(log: &JetStreamLog, from: Seq) -> Result<push::Ordered, LogError> {
    let upto = log.snapshot_upto().await?;
    if from <= upto {
        return Err(LogError::Compacted { upto });
    }
    let (first, last) = log.bounds().await?;
    if from < first && from <= last {
        return Err(codec::missing(&store_name(log), from, first, upto));
    }
    let consumer = log
        .inner
        .stream
        .create_consumer(push::OrderedConfig {
            deliver_subject: log.inner.client.new_inbox(),
            filter_subject: log.inner.subject.clone(),
            deliver_policy: DeliverPolicy::ByStartSequence {
                start_sequence: from,
            },
            ..Default::default()
        })
        .await
        .map_err(|e| log.backend("creating a subscription consumer", e))?;
    consumer
        .messages()
        .await
        .map_err(|e| log.backend("starting a subscription", e))
}

async fn next(s: &mut Sub) -> Result<Envelope, LogError> {
    if s.messages.is_none() {
        s.messages = Some(start(&s.log, s.next).await?);
    }
    let Some(messages) = s.messages.as_mut() else {
        return Err(LogError::Closed);
    };
    loop {
        let message = messages
            .next()
            .await
            .ok_or(LogError::Closed)?
            .map_err(|e| s.log.backend("subscription", e))?;
        let seq = message
            .info()
            .map_err(|e| s.log.backend("subscription: reading message metadata", e))?
            .stream_sequence;
        if seq < s.next {
            // Redelivered after the consumer was recreated: already handed out.
            continue;
        }
        if seq > s.next {
            return Err(missing(&s.log, s.next, seq).await);
        }
        let mut env = codec::decode_envelope(&message.payload, seq, &store_name(&s.log))?;
        env.seq = seq;
        s.next = seq + 1;
        return Ok(env);
    }
}
