//! `infera server`: wires the HTTP front ([`infera_adapters::server`]) to discovery (etcd or
//! Kubernetes), to the request transport (`--request-transport http`, or `nats`: one NATS
//! connection on `--nats-server` for requests and KV events, see [`infera_backends::nats`]) and to
//! the workers' KV events (ZeroMQ publishers, or NATS subjects).
//!
//! # Tasks
//! - the HTTP server, which stops accepting on SIGTERM/Ctrl-C and lets in-flight requests end;
//! - one discovery task: the backend's watch → `WorkerRegistered` / `WorkerDraining` /
//!   `WorkerDeregistered` events (a draining worker keeps its KV subscribers: it is still listed,
//!   still finishes its requests, and may register again);
//! - per registered worker with a `kv_events_endpoint`, one subscriber task per dp rank (rank
//!   `r` of a record starting at `dp_rank` d subscribes to port P + (r − d) of the endpoint; a
//!   wildcard host is replaced by the worker URL's host): batches → `to_core_events` (parents
//!   resolved through the fleet's index) → events; an engine restart clears the rank's cache.
//!   With `--kv-event-transport nats`, one subscriber per worker on
//!   `infera.kv.events.<token>.*` instead; a lost batch or a restarted worker clears that
//!   rank's blocks, which the following batches rebuild.
//!
//! Every task is owned: the discovery task by the shutdown token and a join at exit, the
//! subscriber tasks by the discovery task, which cancels and joins them when their worker
//! deregisters, re-registers with another endpoint, or at shutdown.
//!
//! # Durability and recording
//! A durable `--event-log` is attached through [`infera_adapters::server::attach_event_log`];
//! `--record-trace DIR` (and `--record-prompts`) records through [`crate::record`].

use crate::config::server::{RouterMode, RouterPolicy};
use crate::config::{KvEventTransport, RequestTransport, ServerConfig};
use crate::record::Recording;
use crate::signals::Signals;
use anyhow::Context as _;
use infera_adapters::kv_events::{EngineBatch, decode_batch};
use infera_adapters::server::{
    DurableLog, HttpTransport, RequestTransport as Transport, ServerOptions, ServerState,
    attach_event_log, serve,
};
use infera_adapters::tokenize::Tokenizer;
use infera_backends::discovery::{DiscoveryChange, DiscoveryStream};
use infera_backends::log::{EventLogConfig, open_event_log_with};
use infera_backends::nats::kv::KvItem;
use infera_backends::nats::{self, NatsRequestConfig, NatsTransport};
use infera_backends::zmq::{KvEventSubscriber, SubscriberConfig, SubscriberItem, replay_from};
use infera_core::clock::SystemClock;
use infera_core::event::{Event, KvCacheCleared, Source, WorkerRecord};
use infera_core::fleet::FleetConfig;
use infera_core::ids::{WorkerId, WorkerRank};
use infera_core::log::NewEvent;
use infera_core::policy::{PolicyKind, RouterConfig};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// Runs the server until SIGTERM or Ctrl-C.
///
/// # Errors
/// An unsupported option, a tokenizer or chat template that does not load, an address that
/// cannot be bound, or etcd unreachable at startup.
pub fn run(config: ServerConfig) -> anyhow::Result<()> {
    let tokenizer = Tokenizer::from_path(&config.router.tokenizer_path).with_context(|| {
        format!(
            "cannot load the router tokenizer from {}",
            config.router.tokenizer_path.display()
        )
    })?;
    tracing::info!(path = %config.router.tokenizer_path.display(),
        fast_path = ?tokenizer.fast_path(), "router tokenizer loaded");
    let chat_template = match &config.router.chat_template {
        Some(path) => Some(Arc::new(tokenizer.load_chat_template(path).with_context(
            || format!("cannot load the chat template {}", path.display()),
        )?)),
        None => None,
    };
    let options = ServerOptions {
        max_body_bytes: usize::try_from(config.http.max_body_bytes.bytes()).unwrap_or(usize::MAX),
        request_max_retries: config.router.request_max_retries,
        router: RouterConfig {
            policy: match config.router.policy {
                RouterPolicy::KvAware => PolicyKind::KvAware,
                RouterPolicy::RoundRobin => PolicyKind::RoundRobin,
            },
            overlap_weight: config.router.kv_overlap_weight,
            prefill_overlap_weight: config.router.kv_prefill_overlap_weight,
            decode_overlap_weight: config.router.kv_decode_overlap_weight,
            temperature: config.router.temperature,
            ..RouterConfig::default()
        },
        fleet: FleetConfig::default(),
        chat_template,
        direct: config.router.mode == RouterMode::Direct,
    };
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("infera-server")
        .build()
        .context("cannot start the tokio runtime")?
        .block_on(serve_all(config, options, Arc::new(tokenizer)))
}

async fn serve_all(
    config: ServerConfig,
    options: ServerOptions,
    tokenizer: Arc<Tokenizer>,
) -> anyhow::Result<()> {
    let addr = crate::net::socket_addr(&config.http.host, config.http.port);
    let listener = TcpListener::bind(&addr)
        .await
        .with_context(|| format!("cannot bind {addr}"))?;
    let uses_nats = config.request_transport == RequestTransport::Nats
        || config.kv_event_transport == KvEventTransport::Nats;
    let nats = if uses_nats {
        Some(nats::connect(&config.nats.server, "infera-server").await?)
    } else {
        None
    };
    let transport: Arc<dyn Transport> = match (&config.request_transport, &nats) {
        (RequestTransport::Nats, Some(client)) => Arc::new(NatsTransport::new(
            client.clone(),
            NatsRequestConfig {
                idle_timeout: config.nats.req_idle_timeout.map(|d| d.0),
                max_duration: config.nats.req_max_duration.map(|d| d.0),
                max_pending: config.nats.req_max_pending,
            },
        )),
        _ => Arc::new(HttpTransport::new()),
    };
    let kv_source = match (&config.kv_event_transport, nats) {
        (KvEventTransport::Nats, Some(client)) => KvSource::Nats(client),
        _ => KvSource::Zmq,
    };
    let state = ServerState::with_transport(options, tokenizer, transport);
    state.set_profiling(config.enable_profiling);
    if let Some(path) = &config.kvd_socket_path {
        state.set_prefetch(Arc::new(crate::prewarm::KvdPrefetch::new(path.clone())));
        tracing::info!(socket = %path.display(), "POST /v1/cache/prewarm hints the KV-cache daemon");
    }
    let durable = open_durable_log(&config, &state).await?;
    let stream = crate::discovery::watch(&config.discovery).await?;
    let recording = match &config.record_trace {
        Some(r) => Some(Recording::start(&state, r)?),
        None => None,
    };
    let mut signals = Signals::register()?;
    let shutdown = CancellationToken::new();
    let discovery = tokio::spawn(run_discovery(
        stream,
        state.clone(),
        kv_source,
        shutdown.clone(),
    ));
    tracing::info!(%addr, discovery = %crate::discovery::describe(&config.discovery),
        request_transport = ?config.request_transport,
        kv_event_transport = ?config.kv_event_transport, "infera server listening");

    let stop = shutdown.clone();
    let served = serve(listener, state.clone(), async move {
        tokio::select! {
            () = signals.recv() => {}
            () = stop.cancelled() => {}
        }
    })
    .await;
    shutdown.cancel();
    if let Err(e) = discovery.await {
        tracing::error!(error = %e, "discovery task failed");
    }
    // Nothing commits anymore: let the taps' consumers write what they hold.
    state.close_taps();
    if let Some(recording) = recording {
        let _ = tokio::task::spawn_blocking(move || recording.finish()).await;
    }
    if let Some(durable) = durable {
        durable.close(DURABLE_GRACE).await;
    }
    served.context("http server failed")?;
    tracing::info!("infera server stopped");
    Ok(())
}

/// How long shutdown waits for the durable event log to take the last events.
const DURABLE_GRACE: Duration = Duration::from_secs(10);

/// Opens `--event-log` (unless `memory`) and attaches it: the workers' KV index is restored from
/// it as they register, every commit is written behind, and peers' requests are followed.
async fn open_durable_log(
    config: &ServerConfig,
    state: &ServerState,
) -> anyhow::Result<Option<DurableLog>> {
    if config.event_log == EventLogConfig::Memory {
        return Ok(None);
    }
    let log = open_event_log_with(&config.event_log, Arc::new(SystemClock))
        .await
        .context("cannot open the event log (--event-log)")?;
    let durable = attach_event_log(state, log)
        .await
        .context("cannot read the event log (--event-log)")?;
    tracing::info!(replica = %state.replica_id(), "durable event log attached");
    Ok(Some(durable))
}

/// The subscriber tasks of one worker, and what they were started for.
struct WorkerSubs {
    key: (Option<String>, u32, u32),
    cancel: CancellationToken,
    tasks: Vec<JoinHandle<()>>,
}

impl WorkerSubs {
    async fn stop(self) {
        self.cancel.cancel();
        for t in self.tasks {
            let _ = t.await;
        }
    }
}

fn subs_key(r: &WorkerRecord) -> (Option<String>, u32, u32) {
    (r.kv_events_endpoint.clone(), r.dp_rank, r.dp_size)
}

/// Where KV events come from.
#[derive(Debug, Clone)]
enum KvSource {
    /// Each worker's `kv_events_endpoint`, one ZeroMQ subscriber per rank.
    Zmq,
    /// Each worker's `infera.kv.events.<token>.*` subjects.
    Nats(nats::Client),
}

async fn run_discovery(
    mut stream: DiscoveryStream,
    state: ServerState,
    kv_source: KvSource,
    shutdown: CancellationToken,
) {
    let mut subs: HashMap<WorkerId, WorkerSubs> = HashMap::new();
    loop {
        let change = tokio::select! {
            () = shutdown.cancelled() => break,
            change = stream.recv() => change,
        };
        match change {
            None => {
                tracing::error!("discovery stream ended; the worker set is frozen");
                break;
            }
            Some(DiscoveryChange::Registered(record)) => {
                let sends = state.transport_name();
                let takes = match record.request_transport {
                    infera_core::event::RequestTransport::Http => "http",
                    infera_core::event::RequestTransport::Nats => "nats",
                };
                if sends != takes {
                    tracing::warn!(worker = %record.worker_id.as_str(), takes, sends,
                        "worker registered with another request transport than this server's");
                }
                let id = record.worker_id.clone();
                let key = subs_key(&record);
                let unchanged = subs.get(&id).is_some_and(|s| s.key == key);
                if !unchanged && let Some(old) = subs.remove(&id) {
                    old.stop().await;
                }
                state.register_worker(record.clone());
                if !unchanged
                    && let Some(new) = start_subscribers(&record, &state, &kv_source, &shutdown)
                {
                    subs.insert(id, new);
                }
            }
            Some(DiscoveryChange::Draining { worker, reason }) => {
                state.drain_worker(worker, reason);
            }
            Some(DiscoveryChange::Deregistered { worker, reason }) => {
                if let Some(old) = subs.remove(&worker) {
                    old.stop().await;
                }
                state.deregister_worker(worker, reason);
            }
        }
    }
    for (_, s) in subs.drain() {
        s.stop().await;
    }
}

fn start_subscribers(
    record: &WorkerRecord,
    state: &ServerState,
    kv_source: &KvSource,
    shutdown: &CancellationToken,
) -> Option<WorkerSubs> {
    if let KvSource::Nats(client) = kv_source {
        let cancel = shutdown.child_token();
        tracing::info!(worker = %record.worker_id.as_str(), "subscribing to kv events over nats");
        let task = tokio::spawn(run_nats_subscriber(
            client.clone(),
            record.worker_id.clone(),
            state.clone(),
            cancel.clone(),
        ));
        return Some(WorkerSubs {
            key: subs_key(record),
            cancel,
            tasks: vec![task],
        });
    }
    let Some(endpoint) = record.kv_events_endpoint.as_deref() else {
        tracing::warn!(worker = %record.worker_id.as_str(),
            "worker has no kv_events_endpoint: routing to it ignores its cache");
        return None;
    };
    let cancel = shutdown.child_token();
    let mut tasks = Vec::new();
    for offset in 0..record.dp_size.max(1) {
        let rank = WorkerRank::new(record.worker_id.clone(), record.dp_rank + offset);
        let replay = record
            .kv_events_replay_endpoint()
            .and_then(|r| rank_endpoint(r, &record.url, offset));
        match rank_endpoint(endpoint, &record.url, offset) {
            Some(ep) => {
                tracing::info!(worker = %record.worker_id.as_str(), dp_rank = rank.dp_rank,
                    endpoint = %ep, "subscribing to kv events");
                tasks.push(tokio::spawn(run_subscriber(
                    ep,
                    replay,
                    rank,
                    state.clone(),
                    cancel.clone(),
                )));
            }
            None => tracing::error!(worker = %record.worker_id.as_str(), %endpoint,
                "kv_events_endpoint is not tcp://HOST:PORT; kv events of this worker are ignored"),
        }
    }
    Some(WorkerSubs {
        key: subs_key(record),
        cancel,
        tasks,
    })
}

/// `tcp://HOST:P` → `tcp://HOST':P+offset`, where a wildcard host becomes the worker URL's host.
pub(crate) fn rank_endpoint(endpoint: &str, worker_url: &str, offset: u32) -> Option<String> {
    let rest = endpoint.strip_prefix("tcp://")?;
    let (host, port) = rest.rsplit_once(':')?;
    let port: u32 = port.parse().ok()?;
    let port = u16::try_from(port + offset).ok()?;
    let host = if matches!(host, "*" | "0.0.0.0" | "") {
        let after = worker_url.split_once("://").map_or(worker_url, |(_, r)| r);
        let authority = after.split('/').next().unwrap_or(after);
        authority
            .rsplit_once(':')
            .map_or(authority, |(h, _)| h)
            .to_owned()
    } else {
        host.to_owned()
    };
    Some(format!("tcp://{host}:{port}"))
}

async fn run_subscriber(
    endpoint: String,
    replay: Option<String>,
    rank: WorkerRank,
    state: ServerState,
    cancel: CancellationToken,
) {
    let mut sub = KvEventSubscriber::spawn(SubscriberConfig::new(endpoint));
    loop {
        let item = tokio::select! {
            () = cancel.cancelled() => break,
            item = sub.recv() => item,
        };
        let Some(item) = item else { break };
        let worker = rank.worker.as_str();
        match item {
            SubscriberItem::Batch { seq, batch, .. } => {
                if state.ingest_kv_batch(&rank, seq, &batch).is_none() {
                    tracing::debug!(worker, "kv batch of an unregistered worker dropped");
                }
            }
            // Sent before the batch that revealed it, so the lost batches go in first.
            SubscriberItem::Gap { missing } => {
                repair_gap(&state, &rank, replay.as_deref(), missing).await;
            }
            SubscriberItem::Restart { expected, got } => {
                tracing::warn!(
                    worker,
                    dp_rank = rank.dp_rank,
                    expected,
                    got,
                    "engine restarted; clearing its cached blocks"
                );
                clear_rank(&state, &rank, Some(got));
            }
            SubscriberItem::Malformed { reason } => {
                tracing::warn!(worker, dp_rank = rank.dp_rank, %reason, "malformed kv event message");
            }
        }
    }
    sub.shutdown().await;
}

/// How long a gap repair waits for the engine's replay socket.
const REPLAY_TIMEOUT: Duration = Duration::from_secs(2);

/// Batches `missing` of `rank` were lost. They are fetched from the engine's replay socket and
/// applied in order; where that cannot be done (no replay socket, no answer, the engine no
/// longer holds them all, a batch that does not decode) the rank's blocks are forgotten and the
/// batches that follow rebuild them. Either way the index never keeps blocks the engine may
/// have evicted in a batch nobody saw.
async fn repair_gap(
    state: &ServerState,
    rank: &WorkerRank,
    replay: Option<&str>,
    missing: std::ops::RangeInclusive<u64>,
) {
    let worker = rank.worker.as_str();
    let why = match replay {
        None => "the engine has no replay socket".to_owned(),
        Some(ep) => match replayed(ep, &missing).await {
            Ok(batches) => {
                for (seq, batch) in &batches {
                    state.ingest_kv_batch(rank, Some(*seq), batch);
                }
                state.metrics().kv_gap(true);
                tracing::info!(
                    worker,
                    dp_rank = rank.dp_rank,
                    ?missing,
                    endpoint = ep,
                    "kv events lost in transit were replayed by the engine"
                );
                return;
            }
            Err(why) => why,
        },
    };
    tracing::warn!(worker, dp_rank = rank.dp_rank, ?missing, reason = %why,
        "kv events lost; clearing the rank's blocks for later events to rebuild");
    clear_rank(state, rank, None);
    state.metrics().kv_gap(false);
}

/// Exactly the batches `missing`, in order, from the replay socket at `endpoint`.
async fn replayed(
    endpoint: &str,
    missing: &std::ops::RangeInclusive<u64>,
) -> Result<Vec<(u64, EngineBatch)>, String> {
    let got = replay_from(endpoint, *missing.start(), REPLAY_TIMEOUT)
        .await
        .map_err(|e| e.to_string())?;
    let mut out = Vec::new();
    let mut want = *missing.start();
    for (seq, payload) in got {
        if seq > *missing.end() {
            break;
        }
        if seq != want {
            return Err(format!(
                "the engine replayed batch {seq} where {want} belonged (it no longer holds it)"
            ));
        }
        let batch = decode_batch(&payload).map_err(|e| format!("replayed batch {seq}: {e}"))?;
        out.push((seq, batch));
        want += 1;
    }
    if want <= *missing.end() {
        return Err(format!("the engine did not replay batch {want}"));
    }
    Ok(out)
}

/// Forgets every block of `rank` (its engine restarted, or its events can no longer be trusted);
/// the batches that follow rebuild them.
fn clear_rank(state: &ServerState, rank: &WorkerRank, seq: Option<u64>) {
    let source = Source {
        worker: rank.worker.clone(),
        dp_rank: rank.dp_rank,
        seq,
    };
    state.apply(vec![NewEvent::from_source(
        source,
        Event::KvCacheCleared(KvCacheCleared {
            worker: rank.clone(),
            tier: None,
        }),
    )]);
}

/// One worker's KV events over NATS, every rank: batches are ingested; a gap or a restart
/// clears that rank's blocks, which the following batches rebuild.
async fn run_nats_subscriber(
    client: nats::Client,
    worker: WorkerId,
    state: ServerState,
    cancel: CancellationToken,
) {
    let mut sub = match nats::kv::KvEventSubscription::subscribe(&client, worker.as_str()).await {
        Ok(sub) => sub,
        Err(e) => {
            tracing::error!(worker = worker.as_str(), error = %e,
                "kv events of this worker are ignored");
            return;
        }
    };
    loop {
        let item = tokio::select! {
            () = cancel.cancelled() => break,
            item = sub.recv() => item,
        };
        let Some(item) = item else { break };
        match item {
            KvItem::Batch {
                dp_rank,
                seq,
                batch,
            } => {
                let rank = WorkerRank::new(worker.clone(), dp_rank);
                if state.ingest_kv_batch(&rank, seq, &batch).is_none() {
                    tracing::debug!(
                        worker = worker.as_str(),
                        "kv batch of an unregistered worker dropped"
                    );
                }
            }
            KvItem::Gap { dp_rank, missing } => {
                tracing::warn!(
                    worker = worker.as_str(),
                    dp_rank,
                    ?missing,
                    "kv events lost; clearing the rank's blocks so they rebuild"
                );
                state.metrics().kv_gap(false);
                clear_rank(&state, &WorkerRank::new(worker.clone(), dp_rank), None);
            }
            KvItem::Restart { dp_rank } => {
                tracing::warn!(
                    worker = worker.as_str(),
                    dp_rank,
                    "worker restarted; clearing the rank's blocks"
                );
                clear_rank(&state, &WorkerRank::new(worker.clone(), dp_rank), None);
            }
            KvItem::Malformed { reason } => {
                tracing::warn!(worker = worker.as_str(), %reason, "malformed kv event message");
            }
        }
    }
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
    }
}
