//! JetStream-backed requests, the mode `--nats-req-max-pending` > 0 turns on (on the servers and
//! the workers alike), laid out exactly as the Python Infera lays it out so either side may be
//! the Python one:
//!
//! ```text
//! stream    INFERA_REQUESTS: subjects ["infera.req.>"], retention workqueue, storage memory,
//!           discard old, max_msgs 1000000 (created, or else updated, by every server and worker)
//! consumer  one durable push consumer per worker, named by its subject token, filter
//!           infera.req.<token>, ack explicit, ack_wait 3600 s, max_deliver 1, deliver policy all,
//!           deliver subject an inbox of the worker's
//! request   server → JetStream publish on infera.req.<token>, header rs-inbox = the reply inbox
//!           (a delivered message's reply subject is its ack subject); ours adds Nats-Msg-Id =
//!           the inbox, so a publish retried after a lost ack is stored once
//! replies   unchanged: worker → the inbox over core NATS; the worker acks the message when the
//!           request ends (done, error, cancel or timeout)
//! backlog   num_pending + num_ack_pending of the worker's consumer: queued plus in flight
//! ```

use super::subject_token;
use async_nats::jetstream::{self, consumer, response::Response, stream};
use std::time::Duration;

/// The work-queue stream of every worker's requests.
pub const REQUEST_STREAM: &str = "INFERA_REQUESTS";
/// Request header: the reply inbox (a JetStream message's own reply subject is its ack subject).
pub const HDR_INBOX: &str = "rs-inbox";
/// How long a delivered request may stay unacknowledged and still count as in flight.
pub const REQUEST_ACK_WAIT: Duration = Duration::from_secs(3600);
/// The stream's message cap (the oldest are dropped beyond it).
pub const REQUEST_STREAM_MAX_MSGS: i64 = 1_000_000;
/// How long a server reuses a worker's backlog reading before it reads it again.
pub const BACKLOG_TTL: Duration = Duration::from_millis(200);
/// How often a draining worker reads how many requests are still queued for it.
pub const QUEUED_POLL: Duration = Duration::from_millis(200);
/// Bound on each JetStream API call and publish ack.
const API_TIMEOUT: Duration = Duration::from_secs(2);

/// The durable consumer name of `worker_id`'s requests: its subject token.
pub fn request_durable(worker_id: &str) -> String {
    subject_token(worker_id)
}

/// The request stream's configuration (the Python Infera's `_ensure_request_stream`).
pub fn request_stream_config() -> stream::Config {
    stream::Config {
        name: REQUEST_STREAM.to_owned(),
        subjects: vec!["infera.req.>".to_owned()],
        retention: stream::RetentionPolicy::WorkQueue,
        storage: stream::StorageType::Memory,
        discard: stream::DiscardPolicy::Old,
        max_messages: REQUEST_STREAM_MAX_MSGS,
        ..stream::Config::default()
    }
}

/// `worker_id`'s durable consumer, delivering to `deliver_subject` (the Python worker's
/// `js.subscribe(..., durable=..., manual_ack=True, config=ConsumerConfig(...))`).
pub fn request_consumer_config(worker_id: &str, deliver_subject: &str) -> consumer::Config {
    consumer::Config {
        durable_name: Some(request_durable(worker_id)),
        deliver_subject: Some(deliver_subject.to_owned()),
        filter_subject: super::request_subject(worker_id),
        deliver_policy: consumer::DeliverPolicy::All,
        ack_policy: consumer::AckPolicy::Explicit,
        ack_wait: REQUEST_ACK_WAIT,
        max_deliver: 1,
        ..consumer::Config::default()
    }
}

/// A JetStream context on `client` whose calls are bounded by [`API_TIMEOUT`].
pub(crate) fn context(client: async_nats::Client) -> jetstream::Context {
    jetstream::ContextBuilder::new()
        .timeout(API_TIMEOUT)
        .build(client)
}

/// Creates the request stream, or updates one that differs (made by another version), as the
/// Python Infera does. An existing stream that cannot be updated is used as it is.
///
/// # Errors
/// The stream neither exists nor can be made (JetStream off, the broker unreachable).
pub async fn ensure_request_stream(js: &jetstream::Context) -> Result<(), String> {
    let config = request_stream_config();
    let Err(create) = js.create_stream(config.clone()).await else {
        return Ok(());
    };
    let Err(update) = js.update_stream(&config).await else {
        return Ok(());
    };
    if js.get_stream(REQUEST_STREAM).await.is_ok() {
        tracing::warn!(%create, %update, "the {REQUEST_STREAM} stream differs from ours and \
            cannot be updated; using it as it is");
        return Ok(());
    }
    Err(format!(
        "cannot create the JetStream stream {REQUEST_STREAM} ({create}) or update it ({update}); \
         --nats-req-max-pending needs a broker with JetStream (nats-server -js)"
    ))
}

/// Creates `worker_id`'s durable consumer delivering to `deliver_subject`, or points an existing
/// one there. One that cannot be updated in place (made with other settings) is replaced.
///
/// # Errors
/// The consumer cannot be made.
pub async fn bind_request_consumer(
    js: &jetstream::Context,
    worker_id: &str,
    deliver_subject: &str,
) -> Result<(), String> {
    let config = request_consumer_config(worker_id, deliver_subject);
    let Err(first) = js
        .create_consumer_on_stream(config.clone(), REQUEST_STREAM)
        .await
    else {
        return Ok(());
    };
    tracing::info!(error = %first, durable = %request_durable(worker_id),
        "replacing a request consumer that cannot be updated in place");
    let _ = js
        .delete_consumer_from_stream(request_durable(worker_id), REQUEST_STREAM)
        .await;
    js.create_consumer_on_stream(config, REQUEST_STREAM)
        .await
        .map(|_| ())
        .map_err(|e| {
            format!(
                "cannot create the JetStream consumer {} on {REQUEST_STREAM}: {first}; then {e}",
                request_durable(worker_id)
            )
        })
}

/// Reads the durable consumer `durable` of the request stream.
///
/// # Errors
/// It does not exist (yet), or the broker did not answer.
pub async fn request_consumer_info(
    js: &jetstream::Context,
    durable: &str,
) -> Result<consumer::Info, String> {
    let subject = format!("CONSUMER.INFO.{REQUEST_STREAM}.{durable}");
    match js
        .request::<_, _, Response<consumer::Info>>(subject, &serde_json::json!({}))
        .await
    {
        Ok(Response::Ok(info)) => Ok(info),
        Ok(Response::Err { error }) => Err(error.to_string()),
        Err(e) => Err(e.to_string()),
    }
}

/// Reads `worker_id`'s request consumer over `client` (for tools and tests).
///
/// # Errors
/// As [`request_consumer_info`].
pub async fn worker_request_consumer(
    client: &async_nats::Client,
    worker_id: &str,
) -> Result<consumer::Info, String> {
    request_consumer_info(&context(client.clone()), &request_durable(worker_id)).await
}

/// What a worker does at start, over `client`: makes the request stream and `worker_id`'s
/// consumer, delivering to `deliver_subject` (subscribe to it first). For tools and tests that
/// stand in for a worker.
///
/// # Errors
/// As [`ensure_request_stream`] and [`bind_request_consumer`].
pub async fn bind_worker_consumer(
    client: &async_nats::Client,
    worker_id: &str,
    deliver_subject: &str,
) -> Result<(), String> {
    let js = context(client.clone());
    ensure_request_stream(&js).await?;
    bind_request_consumer(&js, worker_id, deliver_subject).await
}

/// Deletes the request stream's message `seq` if it is still there (a request its server gave
/// up on before any worker took it).
pub(crate) async fn delete_request(js: &jetstream::Context, seq: u64) {
    let subject = format!("STREAM.MSG.DELETE.{REQUEST_STREAM}");
    let body = serde_json::json!({"seq": seq, "no_erase": true});
    match js
        .request::<_, _, Response<serde_json::Value>>(subject, &body)
        .await
    {
        Ok(Response::Ok(_)) => tracing::debug!(seq, "dropped an abandoned queued request"),
        // Taken by the worker meanwhile (it acks it when the cancel reaches it), or gone.
        Ok(Response::Err { error }) => tracing::debug!(seq, %error, "queued request not deleted"),
        Err(e) => tracing::debug!(seq, error = %e, "cannot delete a queued request"),
    }
}

/// Waits while JetStream still holds requests for `durable` that it has not delivered
/// (`num_pending`; delivered ones are the caller's in-flight requests), up to `limit`. Gives up
/// at once when the consumer cannot be read: a shutdown must not hang on the broker.
pub(crate) async fn wait_queued(js: &jetstream::Context, durable: &str, limit: Duration) {
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        let queued = match request_consumer_info(js, durable).await {
            Ok(info) => info.num_pending,
            Err(e) => {
                tracing::debug!(error = %e, "drain: cannot read the request backlog; not waiting");
                return;
            }
        };
        if queued == 0 {
            return;
        }
        let now = tokio::time::Instant::now();
        if now >= deadline {
            tracing::warn!(
                queued,
                "drain: requests still queued in JetStream; each is refused when it arrives"
            );
            return;
        }
        tracing::info!(queued, "drain: waiting for queued requests to be delivered");
        tokio::time::sleep(QUEUED_POLL.min(deadline - now)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{Value, json};

    #[test]
    fn the_stream_is_the_python_infera_s() {
        let config = serde_json::to_value(request_stream_config()).unwrap();
        for (field, want) in [
            ("name", json!("INFERA_REQUESTS")),
            ("subjects", json!(["infera.req.>"])),
            ("retention", json!("workqueue")),
            ("storage", json!("memory")),
            ("discard", json!("old")),
            ("max_msgs", json!(1_000_000)),
        ] {
            assert_eq!(config[field], want, "{field} in {config}");
        }
    }

    #[test]
    fn the_consumer_is_the_python_worker_s() {
        let config =
            serde_json::to_value(request_consumer_config("10.0.0.1:8080", "_INBOX.d")).unwrap();
        for (field, want) in [
            ("durable_name", json!("MTAuMC4wLjE6ODA4MA")),
            ("filter_subject", json!("infera.req.MTAuMC4wLjE6ODA4MA")),
            ("deliver_subject", json!("_INBOX.d")),
            ("deliver_policy", json!("all")),
            ("ack_policy", json!("explicit")),
            ("ack_wait", json!(3_600_000_000_000u64)),
            ("max_deliver", json!(1)),
        ] {
            assert_eq!(config[field], want, "{field} in {config}");
        }
        // Nothing the Python worker leaves to the server's defaults is set.
        for field in [
            "max_ack_pending",
            "flow_control",
            "idle_heartbeat",
            "deliver_group",
        ] {
            assert_eq!(config.get(field), None::<&Value>, "{field} in {config}");
        }
        assert_eq!(request_durable("10.0.0.1:8080"), "MTAuMC4wLjE6ODA4MA");
    }
}
