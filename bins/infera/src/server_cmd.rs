//! `infera server`: connects the HTTP front ([`infera_adapters::server`]) to the ports
//! [`crate::wiring`] builds from the configuration: discovery (etcd or Kubernetes), the request
//! transport (`--request-transport http`, or `nats`: one NATS connection on `--nats-server` for
//! requests and KV events) and the workers' KV events (ZeroMQ publishers, or NATS subjects).
//!
//! # Tasks
//! - the HTTP server, which stops accepting on SIGTERM/Ctrl-C and lets in-flight requests end;
//! - one discovery task: the backend's watch → `WorkerRegistered` / `WorkerDraining` /
//!   `WorkerDeregistered` events (a draining worker keeps its KV subscribers: it is still listed,
//!   still finishes its requests, and may register again);
//! - per registered worker, one KV-event task: the KV-event source port (ZeroMQ: every rank's
//!   PUB socket; NATS: the worker's
//!   `infera.kv.events.<token>.*` subjects) run through the one pipeline,
//!   `infera_core::kv_events::pipeline::consume`, into the server's state (gaps replayed or
//!   cleared, restarts cleared, the same way for every transport).
//!
//! - per node kvd that a registered worker names (`kvd_events_endpoint`), one KV-event task on
//!   its ZeroMQ PUB socket (kvd always publishes there, whatever `--kv-event-transport` says),
//!   run through the same pipeline under the kvd's pseudo worker rank
//!   (`infera_core::kv_events::kvd`), started with the first worker naming it and stopped with
//!   the last.
//!
//! Every task is owned: the discovery task by the shutdown token and a join at exit, the
//! KV-event tasks by the discovery task, which cancels and joins them when their worker
//! deregisters, re-registers with other endpoints, or at shutdown.
//!
//! The tokenizer, the policy and the fleet-following tasks are set up by functions `infera gaie`
//! shares ([`load_tokenizer`], [`router_config`], [`follow_fleet`]).
//!
//! # Durability and recording
//! A durable `--event-log` is attached through [`infera_adapters::server::attach_event_log`];
//! `--record-trace DIR` (and `--record-prompts`) records through [`crate::record`].

use crate::auto_tune::AutoTune;
use crate::config::server::AutoTuneMode;
use crate::config::server::RouterMode;
use crate::config::{DiscoveryConfig, ServerConfig};
use crate::record::Recording;
use crate::signals::Signals;
use crate::wiring::{self, EventLogConfig, ServerPorts};
use anyhow::Context as _;
use infera_adapters::server::{
    BreakerConfig, DurableLog, ServerOptions, ServerState, attach_event_log, serve,
};
use infera_adapters::tokenize::Tokenizer;
use infera_core::clock::SystemClock;
use infera_core::event::WorkerRecord;
use infera_core::fleet::FleetConfig;
use infera_core::ids::WorkerId;
use infera_core::kv_events::{kvd, pipeline};
use infera_core::policy::{PolicyKind, RouterConfig, SessionAffinity};
use infera_core::ports::discovery::{DiscoveryChange, DiscoveryStream};
use infera_core::ports::kv_events::KvEventSource;
use infera_core::service::ServiceOptions;
use infera_core::service::{HealthConfig, QueueConfig};
use std::collections::HashMap;
use std::path::Path;
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
    let tokenizer = load_tokenizer(&config.router.tokenizer_path)?;
    let chat_template = match &config.router.chat_template {
        Some(path) => Some(Arc::new(tokenizer.load_chat_template(path).with_context(
            || format!("cannot load the chat template {}", path.display()),
        )?)),
        None => None,
    };
    let api_keys = (config.http.api_keys.as_deref())
        .map(infera_adapters::server::KeyStore::load)
        .transpose()
        .map_err(anyhow::Error::msg)?;
    let options = ServerOptions {
        service: ServiceOptions {
            router: RouterConfig {
                temperature: config.router.temperature,
                resident_weight: config.router.resident_weight,
                balance_tokens: config.router.balance_tokens,
                tier_weights: config.router.tier_weights,
                sessions: SessionAffinity {
                    mode: config.router.session_affinity,
                    ttl_s: config.router.session_ttl.0.as_secs(),
                    saturation: config
                        .router
                        .queue_threshold
                        .unwrap_or(SessionAffinity::default().saturation),
                },
                ..router_config(
                    config.router.policy,
                    config.router.kv_overlap_weight,
                    config.router.kv_prefill_overlap_weight,
                    config.router.kv_decode_overlap_weight,
                )
            },
            fleet: FleetConfig::default(),
            request_max_retries: config.router.request_max_retries,
            max_body_bytes: usize::try_from(config.http.max_body_bytes.bytes())
                .unwrap_or(usize::MAX),
        },
        chat_template,
        template_defaults: Arc::new(
            serde_json::from_value(serde_json::Value::Object(
                config.router.default_chat_template_kwargs.clone(),
            ))
            .context("--kv-default-chat-template-kwargs")?,
        ),
        per_worker_template_kwargs: config.router.per_worker_template_kwargs,
        model_tokenizers: config
            .router
            .model_tokenizers
            .iter()
            .map(|(model, _, file)| Ok((model.clone(), Arc::new(load_tokenizer(file)?))))
            .collect::<anyhow::Result<_>>()?,
        lora_loading: config.router.lora_loading.clone(),
        direct: config.router.mode == RouterMode::Direct,
        client: infera_adapters::server::ClientOptions {
            limits: infera_adapters::serve::ServeLimits {
                header_timeout: config.http.client_header_timeout.map(|d| d.0),
                idle_timeout: config.http.client_idle_timeout.map(|d| d.0),
                body_timeout: config.http.client_body_timeout.map(|d| d.0),
                write_timeout: config.http.client_write_timeout.map(|d| d.0),
                max_connections: config
                    .http
                    .max_connections
                    .map_or_else(infera_adapters::serve::default_max_connections, |n| {
                        n as usize
                    }),
            },
            admin_token: (config.http.admin_token.as_ref())
                .map(|t| infera_adapters::server::AdminToken::new(t.expose())),
            parse_budget: infera_adapters::server::ParseBudget::new(
                usize::try_from(config.http.parse_budget.bytes()).unwrap_or(usize::MAX),
            ),
            default_retention: config.router.default_retention,
            api_keys: api_keys.clone(),
        },
    };
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("infera-server")
        .build()
        .context("cannot start the tokio runtime")?
        .block_on(serve_all(config, options, Arc::new(tokenizer)))
}

/// Loads the router's tokenizer from `path` (`--router-tokenizer-path`, resolved).
///
/// # Errors
/// The tokenizer does not load.
pub(crate) fn load_tokenizer(path: &Path) -> anyhow::Result<Tokenizer> {
    let tokenizer = Tokenizer::from_path(path)
        .with_context(|| format!("cannot load the router tokenizer from {}", path.display()))?;
    tracing::info!(path = %path.display(), fast_path = ?tokenizer.fast_path(),
        images = tokenizer.vision().map_or("routed by load (no supported vision config)",
            |v| v.model_type()),
        "router tokenizer loaded");
    Ok(tokenizer)
}

/// The kernel's router configuration for `--router-policy` and the `--kv-*-overlap-weight`s.
pub(crate) fn router_config(
    policy: PolicyKind,
    overlap_weight: f64,
    prefill_overlap_weight: Option<f64>,
    decode_overlap_weight: Option<f64>,
) -> RouterConfig {
    RouterConfig {
        policy,
        overlap_weight,
        prefill_overlap_weight,
        decode_overlap_weight,
        ..RouterConfig::default()
    }
}

/// Watches the fleet of `discovery` and starts the discovery task that follows it into `state`
/// (registrations, drains, and each worker's KV events from `kv_source`) until `shutdown`.
///
/// # Errors
/// The discovery backend cannot be reached.
pub(crate) async fn follow_fleet(
    discovery: &DiscoveryConfig,
    state: &ServerState,
    kv_source: Arc<dyn KvEventSource>,
    shutdown: &CancellationToken,
) -> anyhow::Result<JoinHandle<()>> {
    let stream = wiring::watch(discovery).await?;
    Ok(tokio::spawn(run_discovery(
        stream,
        state.clone(),
        kv_source,
        shutdown.clone(),
    )))
}

async fn serve_all(
    config: ServerConfig,
    options: ServerOptions,
    tokenizer: Arc<Tokenizer>,
) -> anyhow::Result<()> {
    let api_keys = options.client.api_keys.clone();
    let addr = crate::net::socket_addr(&config.http.host, config.http.port);
    let listener = TcpListener::bind(&addr)
        .await
        .with_context(|| format!("cannot bind {addr}"))?;
    let ServerPorts {
        transport,
        kv_source,
    } = wiring::server_ports(&config).await?;
    let sim_base = crate::auto_tune::sim_base(options.service.fleet, config.router.queue_threshold);
    let state = ServerState::with_transport(options, tokenizer, transport);
    state.set_profiling(config.enable_profiling);
    state.service().set_sla_metrics(config.enable_sla_metrics);
    if let Some(scaling) = &config.scaling_api {
        state.set_scaler(wiring::scaler(scaling)?);
        tracing::info!(
            "scaling API enabled: GET/POST /v1/admin/scale resizes this deployment's pools \
             (needs RBAC to get this Pod and get/patch inferadeployments)"
        );
    }
    let seconds = |s: f64| Duration::try_from_secs_f64(s).unwrap_or(Duration::MAX);
    state.service().set_breaker(
        BreakerConfig {
            failure_threshold: config.worker_edge.breaker_failure_threshold,
            cooldown: seconds(config.worker_edge.breaker_cooldown_s),
            max_cooldown: seconds(config.worker_edge.breaker_max_cooldown_s),
        },
        Arc::new(SystemClock),
    );
    state
        .service()
        .set_migration_limit(config.worker_edge.migration_limit);
    let edge = &config.worker_edge;
    state.service().set_health(HealthConfig {
        interval: edge.health_check_interval.0,
        timeout: edge.health_check_timeout.0,
        unhealthy_threshold: edge.health_check_unhealthy_threshold,
        healthy_threshold: edge.health_check_healthy_threshold,
        max_ejection_percent: edge.max_ejection_percent,
        stall_timeout: edge.health_check_stall_timeout.0,
    });
    state.service().set_outliers(edge.outliers.config());
    let health = {
        let service = state.service().clone();
        tokio::spawn(async move { service.run_ejection().await })
    };
    state.service().set_queue(QueueConfig {
        threshold: config.router.queue_threshold,
        timeout: config.router.queue_timeout.0,
        max_waiting: config.router.queue_max as usize,
    });
    let key_reload = api_keys.as_ref().map(|keys| {
        tracing::info!(
            tenants = keys.tenants().all().len(),
            "data-plane requests need an API key"
        );
        keys.watch()
    });
    if let Some(path) = &config.kvd_socket_path {
        state.set_prefetch(Arc::new(crate::prewarm::KvdPrefetch::new(path.clone())));
        tracing::info!(socket = %path.display(), "POST /v1/cache/prewarm hints the KV-cache daemon");
    }
    let durable = open_durable_log(&config, &state).await?;
    let recording = match &config.record_trace {
        Some(r) => Some(Recording::start(&state, r)?),
        None => None,
    };
    let auto_tune = match config.auto_tune.mode {
        AutoTuneMode::Off => None,
        _ => Some(AutoTune::start(&state, config.auto_tune, sim_base)?),
    };
    let mut signals = Signals::register()?;
    let shutdown = CancellationToken::new();
    let discovery = follow_fleet(&config.discovery, &state, kv_source, &shutdown).await?;
    tracing::info!(%addr, discovery = %wiring::describe(&config.discovery),
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
    health.abort();
    if let Some(task) = key_reload {
        task.abort();
    }
    if let Err(e) = discovery.await {
        tracing::error!(error = %e, "discovery task failed");
    }
    // Nothing commits anymore: let the taps' consumers write what they hold.
    state.service().close_taps();
    if let Some(recording) = recording {
        let _ = tokio::task::spawn_blocking(move || recording.finish()).await;
    }
    if let Some(shadow) = auto_tune {
        let _ = tokio::task::spawn_blocking(move || shadow.finish()).await;
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
    let log = wiring::open_event_log(&config.event_log).await?;
    let durable = attach_event_log(state, log)
        .await
        .context("cannot read the event log (--event-log)")?;
    tracing::info!(replica = %state.replica_id(), "durable event log attached");
    Ok(Some(durable))
}

/// The KV-event task of one worker, and the record it was started for.
struct WorkerSubs {
    record: WorkerRecord,
    cancel: CancellationToken,
    task: JoinHandle<()>,
}

impl WorkerSubs {
    async fn stop(self) {
        self.cancel.cancel();
        let _ = self.task.await;
    }
}

async fn run_discovery(
    mut stream: DiscoveryStream,
    state: ServerState,
    kv_source: Arc<dyn KvEventSource>,
    shutdown: CancellationToken,
) {
    let mut subs: HashMap<WorkerId, WorkerSubs> = HashMap::new();
    let mut kvds = KvdSubs::default();
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
                let sends = state.service().transport().name();
                let takes = match record.request_transport {
                    infera_core::event::RequestTransport::Http => "http",
                    infera_core::event::RequestTransport::Nats => "nats",
                };
                if sends != takes {
                    tracing::warn!(worker = %record.worker_id.as_str(), takes, sends,
                        "worker registered with another request transport than this server's");
                }
                let id = record.worker_id.clone();
                let unchanged = subs
                    .get(&id)
                    .is_some_and(|s| !kv_source.resubscribe(&s.record, &record));
                if !unchanged && let Some(old) = subs.remove(&id) {
                    old.stop().await;
                }
                state.register_worker(record.clone());
                if !unchanged {
                    subs.insert(id, start_kv_events(record, &state, &kv_source, &shutdown));
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
        kvds.sync(&state, &shutdown).await;
    }
    for (_, s) in subs.drain() {
        s.stop().await;
    }
    kvds.stop_all().await;
}

/// The KV-event tasks of the node kvds that registered workers name, by events endpoint.
#[derive(Default)]
struct KvdSubs {
    subs: HashMap<String, WorkerSubs>,
    source: Option<Arc<dyn KvEventSource>>,
}

impl KvdSubs {
    /// Subscribes to every kvd the fleet names and not yet subscribed, and stops the tasks of
    /// the kvds no worker names any more.
    async fn sync(&mut self, state: &ServerState, shutdown: &CancellationToken) {
        let wanted = state.service().with_fleet(|f| f.kvd_sources());
        let gone: Vec<String> = (self.subs.keys())
            .filter(|e| !wanted.iter().any(|l| l.endpoint == **e))
            .cloned()
            .collect();
        for endpoint in gone {
            if let Some(old) = self.subs.remove(&endpoint) {
                old.stop().await;
            }
        }
        for link in wanted {
            if self.subs.contains_key(&link.endpoint) {
                continue;
            }
            let source = match &self.source {
                Some(s) => Arc::clone(s),
                None => match wiring::kvd_event_source() {
                    Ok(s) => Arc::clone(self.source.insert(s)),
                    Err(e) => {
                        tracing::error!(kvd = %link.endpoint, error = %e,
                            "a worker names a kvd whose inventory this build cannot read");
                        return;
                    }
                },
            };
            let record = kvd::source_record(&link, "");
            let task = start_kv_events(record, state, &source, shutdown);
            self.subs.insert(link.endpoint, task);
        }
    }

    async fn stop_all(&mut self) {
        for (_, s) in self.subs.drain() {
            s.stop().await;
        }
    }
}

/// Subscribes to `record`'s KV events and runs them through the pipeline into `state`.
fn start_kv_events(
    record: WorkerRecord,
    state: &ServerState,
    source: &Arc<dyn KvEventSource>,
    shutdown: &CancellationToken,
) -> WorkerSubs {
    let cancel = shutdown.child_token();
    let task = tokio::spawn({
        let (record, state, source, cancel) = (
            record.clone(),
            state.clone(),
            Arc::clone(source),
            cancel.clone(),
        );
        async move {
            let worker = record.worker_id.clone();
            match source.subscribe(&record).await {
                Ok(subscription) => {
                    tracing::info!(
                        worker = worker.as_str(),
                        transport = source.name(),
                        "kv events subscribed"
                    );
                    pipeline::consume(worker, subscription, &state, cancel.cancelled()).await;
                }
                Err(e) => tracing::error!(worker = worker.as_str(), error = %e,
                    "kv events of this worker are ignored: routing to it ignores its cache"),
            }
        }
    });
    WorkerSubs {
        record,
        cancel,
        task,
    }
}
