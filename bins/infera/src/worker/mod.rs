//! `infera worker {vllm,sglang,atom,mock}`: start one engine and join it to the fleet
//! (PROTOCOLS.md §1 and §7).
//!
//! The lifecycle, the same for every engine:
//!
//! 1. connect to discovery first (a GPU engine is not started for a worker that cannot register);
//! 2. with `--infera-kvd-socket`, check that kvd answers `hello` (see [`crate::kvd_store`]);
//!    start the engine: the mock in process ([`mock`]), a real engine as a child process in its
//!    own process group ([`process`]) with the command line and environment of its
//!    [`launch::LaunchPlan`];
//! 3. wait until it answers `GET /health` (`--engine-ready-timeout`), read the block size it
//!    resolved, and register the worker record: `worker_id` `ADVERTISE_HOST:PORT`, the served
//!    model, the engine (the mock registers as `vllm`, whose formats it speaks), PD role and
//!    metadata, `kv_events_endpoint`, block size, data-parallel ranks, request transport, and
//!    the LoRA adapters the engine lists in its `/v1/models` (re-read every
//!    [`inventory::REFRESH`]; a change re-registers, see [`inventory`]);
//! 4. serve until SIGTERM / Ctrl-C or until the engine exits; with `--request-transport nats`
//!    the worker also subscribes to `infera.req.<token>` (before registering) and proxies each
//!    request to the engine's HTTP port ([`crate::wiring::Responder`]), each one
//!    bounded by the worker's own `--nats-req-max-duration` when set (a backstop that holds even
//!    when the server died or its cancel was lost); with
//!    `--kv-event-transport nats` the KV events go to `infera.kv.events.<token>.<rank>`
//!    (the mock publishes there; a real engine's ZeroMQ events are relayed by
//!    [`crate::wiring::KvRelay`]);
//! 5. deregister first and stop taking NATS requests (no new work arrives), drain in-flight work bounded by
//!    `--drain-timeout`, then stop the engine (SIGTERM, SIGKILL to its group after
//!    [`process::STOP_GRACE`]).
//!
//! An engine that exits on its own is deregistered at once and the worker exits non-zero.

pub mod inventory;
pub mod launch;
pub mod mock;
pub mod probe;
pub mod process;
pub mod sglang_flags;

use crate::config::worker::{EngineKind, LaunchConfig};
use crate::config::{DiscoveryConfig, KvEventTransport, RequestTransport, WorkerConfig};
use crate::signals::Signals;
use crate::wiring::{self, KvRelay, NatsLink, Responder};
use anyhow::{Context as _, bail};
use infera_core::event::{self, Engine, Role, WorkerRecord};
use infera_core::ids::WorkerId;
use infera_core::ports::discovery::{Registrar, Registration};
use launch::{FreePorts, LaunchPlan};
use std::net::TcpListener;
use std::sync::Arc;

/// Runs the worker until SIGTERM or Ctrl-C.
///
/// # Errors
/// Discovery or NATS unreachable, an engine that does not start or become
/// healthy, or an engine that exits while serving.
pub fn run(config: WorkerConfig) -> anyhow::Result<()> {
    let config = advertise_pod_ip(config, std::env::var("POD_IP").ok());
    mock::runtime()?.block_on(async move {
        let mut signals = Signals::register()?;
        let registrar = wiring::registrar(&config.discovery, config.etcd_lease_ttl.0).await?;
        match &config.launch {
            LaunchConfig::Mock(engine) => {
                let engine = engine.clone();
                run_mock(&config, &engine, registrar, &mut signals).await
            }
            LaunchConfig::Process(process) => {
                let ports = free_ports()?;
                let plan = launch::plan(&config, process, &|k| std::env::var(k).ok(), ports)?;
                let kvd = match &plan.kvd_socket {
                    Some(socket) => {
                        Some(crate::kvd_store::preflight(socket, "infera-worker").await?)
                    }
                    None => None,
                };
                run_process(
                    &config,
                    &plan,
                    kvd.as_ref(),
                    process.ready_timeout.0,
                    registrar,
                    &mut signals,
                )
                .await
            }
        }
    })
}

/// Under Kubernetes discovery a worker bound to a wildcard address advertises its Pod's IP
/// (downward API `POD_IP`) unless `--advertise-host` names another host.
fn advertise_pod_ip(mut config: WorkerConfig, pod_ip: Option<String>) -> WorkerConfig {
    let wildcard = matches!(
        config.advertise_host.as_str(),
        "0.0.0.0" | "::" | "[::]" | ""
    );
    if let (DiscoveryConfig::Kubernetes { .. }, true, Some(ip)) = (
        &config.discovery,
        wildcard,
        pod_ip.filter(|ip| !ip.is_empty()),
    ) {
        tracing::info!(pod_ip = %ip, "kubernetes discovery: advertising the Pod IP");
        config.advertise_host = ip;
    }
    config
}

/// A number that differs across this worker's restarts (its start time in microseconds).
fn epoch() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

/// The NATS connection, when a transport of this worker uses it.
async fn nats_client(config: &WorkerConfig) -> anyhow::Result<Option<NatsLink>> {
    let flag = if config.request_transport == RequestTransport::Nats {
        "--request-transport"
    } else if config.kv_events.enabled && config.kv_events.transport == KvEventTransport::Nats {
        "--kv-event-transport"
    } else {
        return Ok(None);
    };
    Ok(Some(
        NatsLink::connect(&config.nats_server, "infera-worker", flag).await?,
    ))
}

/// The worker id (`ADVERTISE_HOST:PORT`) the server routes by.
fn worker_id(config: &WorkerConfig) -> String {
    format!("{}:{}", config.advertise_host, config.port)
}

/// With `--request-transport nats`, subscribes to the worker's request subject and proxies to
/// the engine's HTTP port (a wildcard bind address is reached on loopback).
async fn start_responder(
    config: &WorkerConfig,
    client: Option<&NatsLink>,
) -> anyhow::Result<Option<Responder>> {
    let (RequestTransport::Nats, Some(client)) = (config.request_transport, client) else {
        return Ok(None);
    };
    let host = match config.host.as_str() {
        "0.0.0.0" | "" => "127.0.0.1",
        "::" | "[::]" => "::1",
        other => other,
    };
    let engine_url = format!("http://{}", crate::net::socket_addr(host, config.port));
    let responder = client
        .start_responder(worker_id(config), engine_url, config)
        .await?;
    Ok(Some(responder))
}

/// Stops taking NATS requests (the first step of a drain).
async fn stop_accepting(responder: Option<&Responder>) {
    if let Some(r) = responder {
        r.stop_accepting().await;
    }
}

/// Waits for the NATS requests still in flight, bounded by the drain timeout.
async fn finish_responder(responder: Option<Responder>, config: &WorkerConfig) {
    if let Some(r) = responder {
        r.finish(config.drain_timeout.0).await;
    }
}

async fn run_mock(
    config: &WorkerConfig,
    engine: &crate::config::worker::MockEngineConfig,
    registrar: Arc<dyn Registrar>,
    signals: &mut Signals,
) -> anyhow::Result<()> {
    let nats = nats_client(config).await?;
    let kv = match (config.kv_events.enabled, config.kv_events.transport, &nats) {
        (false, _, _) => {
            tracing::info!("kv events disabled (--no-enable-kv-events)");
            None
        }
        (true, KvEventTransport::Nats, Some(link)) => Some(mock::KvOut::Nats {
            link: link.clone(),
            worker_id: worker_id(config),
            epoch: epoch(),
        }),
        (true, _, _) => Some(mock::KvOut::Zmq(mock::KvBind::from_port(
            &config.host,
            config.port,
        )?)),
    };
    let advertised = |offset: u16| {
        matches!(kv, Some(mock::KvOut::Zmq(_))).then(|| {
            format!(
                "tcp://{}",
                crate::net::socket_addr(&config.advertise_host, config.port + offset)
            )
        })
    };
    let kv_events_endpoint = advertised(mock::KV_EVENTS_PORT_OFFSET);
    let kv_events_replay_endpoint = advertised(mock::KV_REPLAY_PORT_OFFSET);
    let mut running = mock::RunningMock::start(config, engine, &config.model, kv).await?;
    let responder = match start_responder(config, nats.as_ref()).await {
        Ok(r) => r,
        Err(e) => {
            running.stop().await.ok();
            return Err(e);
        }
    };
    let mut record = base_record(config, &config.model, Engine::Vllm);
    record.kv_events_endpoint = kv_events_endpoint;
    record.kv_block_size = engine.block_size;
    record.extra = running.registration_extra();
    record.set_prefill_budget(engine.max_batched_tokens);
    record.set_kv_events_replay_endpoint(kv_events_replay_endpoint);
    if let Some(pd) = &engine.pd {
        record.disagg_mode = pd.role;
        record.disagg_meta = Some(launch::mock_disagg_meta(
            config,
            pd.protocol,
            pd.bootstrap_port,
        ));
    }
    let probe = probe::Probe::new(&config.host, config.port);
    inventory::fill(&probe, &mut record).await;
    let registration = match register(&registrar, &record).await {
        Ok(registration) => registration,
        Err(e) => {
            running.stop().await.ok();
            return Err(e);
        }
    };
    tokio::select! {
        never = inventory::follow(probe, &registration, record) => match never {},
        () = signals.recv() => {
            deregister(registration).await;
            stop_accepting(responder.as_ref()).await;
            let stopped = running.stop().await;
            finish_responder(responder, config).await;
            stopped
        }
        failed = running.failed() => {
            deregister(registration).await;
            failed
        }
    }
}

async fn run_process(
    config: &WorkerConfig,
    plan: &LaunchPlan,
    kvd: Option<&infera_kvd::HelloAck>,
    ready_timeout: std::time::Duration,
    registrar: Arc<dyn Registrar>,
    signals: &mut Signals,
) -> anyhow::Result<()> {
    let mut engine = process::EngineProcess::spawn(config.engine, plan, &config.host, config.port)?;
    let ready = tokio::select! {
        ready = engine.wait_ready(ready_timeout) => ready,
        () = signals.recv() => {
            tracing::info!("stopping before the engine became ready");
            engine.stop(process::STOP_GRACE).await;
            return Ok(());
        }
    };
    if let Err(e) = ready {
        engine.stop(process::STOP_GRACE).await;
        return Err(e);
    }
    let block_size = engine.resolve_block_size(plan.kv_block_size).await;
    let mut record = process_record(config, plan, block_size, kvd);
    let client = match nats_client(config).await {
        Ok(client) => client,
        Err(e) => {
            engine.stop(process::STOP_GRACE).await;
            return Err(e);
        }
    };
    let responder = match start_responder(config, client.as_ref()).await {
        Ok(r) => r,
        Err(e) => {
            engine.stop(process::STOP_GRACE).await;
            return Err(e);
        }
    };
    // With kv events over nats the server reads them from NATS, not from the engine's socket.
    let relay = match (
        &client,
        config.kv_events.transport,
        &plan.kv_events_endpoint,
    ) {
        (Some(client), KvEventTransport::Nats, Some(endpoint)) => {
            record.kv_events_endpoint = None;
            match KvRelay::start(
                client,
                &worker_id(config),
                endpoint,
                plan.dp_rank,
                plan.dp_size,
                epoch(),
            ) {
                Ok(relay) => Some(relay),
                Err(e) => {
                    engine.stop(process::STOP_GRACE).await;
                    return Err(e.into());
                }
            }
        }
        _ => None,
    };
    let probe = probe::Probe::new(&config.host, config.port);
    inventory::fill(&probe, &mut record).await;
    let registration = match register(&registrar, &record).await {
        Ok(registration) => registration,
        Err(e) => {
            engine.stop(process::STOP_GRACE).await;
            return Err(e);
        }
    };
    let exited = tokio::select! {
        never = inventory::follow(probe, &registration, record) => match never {},
        () = signals.recv() => None,
        status = engine.exited() => Some(status),
    };
    deregister(registration).await;
    stop_accepting(responder.as_ref()).await;
    if let Some(relay) = relay {
        relay.stop().await;
    }
    match exited {
        None => {
            engine.drain(config.drain_timeout.0).await;
            finish_responder(responder, config).await;
            engine.stop(process::STOP_GRACE).await;
            Ok(())
        }
        Some(status) => {
            engine.stop(process::STOP_GRACE).await;
            let status = status.context("cannot wait for the engine")?;
            bail!(
                "the {} engine exited while serving ({status}); worker deregistered",
                config.engine
            )
        }
    }
}

/// The record fields every engine shares.
fn base_record(config: &WorkerConfig, served_model: &str, engine: Engine) -> WorkerRecord {
    let host = crate::net::url_host(&config.advertise_host);
    WorkerRecord {
        worker_id: WorkerId::new(format!("{}:{}", config.advertise_host, config.port)),
        url: format!("http://{host}:{}", config.port),
        model_name: served_model.to_owned(),
        engine,
        disagg_mode: Role::Mixed,
        disagg_meta: None,
        kv_events_endpoint: None,
        kv_block_size: 0,
        dp_rank: 0,
        dp_size: 1,
        request_transport: match config.request_transport {
            RequestTransport::Http => event::RequestTransport::Http,
            RequestTransport::Nats => event::RequestTransport::Nats,
        },
        kv: None,
        extra: serde_json::Map::new(),
    }
}

/// The record of a real engine; `kvd` is the answer of the kvd it was wired to.
pub fn process_record(
    config: &WorkerConfig,
    plan: &LaunchPlan,
    block_size: Option<u32>,
    kvd: Option<&infera_kvd::HelloAck>,
) -> WorkerRecord {
    let engine = match config.engine {
        EngineKind::Sglang => Engine::Sglang,
        EngineKind::Atom => Engine::Atom,
        EngineKind::Vllm | EngineKind::Mock => Engine::Vllm,
    };
    let mut record = base_record(config, &plan.served_model, engine);
    record.disagg_mode = plan.role;
    record.disagg_meta = plan.disagg_meta.clone();
    record.kv_events_endpoint = plan.kv_events_endpoint.clone();
    record.set_kv_events_replay_endpoint(plan.kv_events_replay_endpoint.clone());
    record.kv_block_size = block_size.unwrap_or(0);
    record.dp_rank = plan.dp_rank;
    record.dp_size = plan.dp_size;
    if let Some(budget) = plan.prefill_budget {
        record.set_prefill_budget(budget);
    }
    if let Some(ack) = kvd {
        record
            .extra
            .extend(crate::kvd_store::registration_fields(ack));
    }
    record
}

async fn register(
    registrar: &Arc<dyn Registrar>,
    record: &WorkerRecord,
) -> anyhow::Result<Registration> {
    let registration = registrar
        .register(record)
        .await
        .with_context(|| format!("cannot register worker {}", record.worker_id.as_str()))?;
    tracing::info!(worker = record.worker_id.as_str(), model = %record.model_name,
        record = %serde_json::to_string(record).unwrap_or_default(), "worker registered");
    Ok(registration)
}

async fn deregister(registration: Registration) {
    let worker = registration.worker().clone();
    match registration.deregister().await {
        Ok(()) => tracing::info!(worker = worker.as_str(), "worker deregistered"),
        Err(e) => tracing::warn!(worker = worker.as_str(), error = %e,
            "cannot deregister; the record expires with its lease"),
    }
}

/// Free loopback-checked ports for the engine's KV-event and internal sockets.
fn free_ports() -> anyhow::Result<FreePorts> {
    // Hold all three until chosen so they differ.
    let listeners = (0..3)
        .map(|_| TcpListener::bind("0.0.0.0:0"))
        .collect::<Result<Vec<_>, _>>()
        .context("cannot find free ports for the engine's sockets")?;
    let port = |i: usize| -> anyhow::Result<u16> { Ok(listeners[i].local_addr()?.port()) };
    Ok(FreePorts {
        events: port(0)?,
        replay: port(1)?,
        atom_internal: port(2)?,
    })
}
