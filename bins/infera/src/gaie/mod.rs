//! `infera gaie` (the Python Infera's `python -m infera.gaie`): the Gateway API Inference
//! Extension's endpoint picker. An Envoy-based Inference Gateway asks it, over Envoy's ext_proc
//! gRPC protocol, where each HTTP request goes; it decides with the router of `infera server`
//! and answers in headers ([`ext_proc`]); the gateway sends the request itself.
//!
//! # Setup (shared with `infera server`)
//! The tokenizer and the policy come from [`crate::server_cmd::load_tokenizer`] and
//! [`crate::server_cmd::router_config`]; the fleet is followed by
//! [`crate::server_cmd::follow_fleet`] (discovery, and each worker's KV events from
//! [`crate::wiring::kv_event_source`]) into a [`ServerState`] that never sends a request:
//! decisions are [`ServerState::pick`], with the server's load accounting.
//!
//! # Ports
//! - `--grpc-port`: ext_proc and the gRPC health service ([`health`]), over TLS with an
//!   in-memory self-signed certificate unless `--no-secure-serving` (gateways connect without
//!   verifying it);
//! - `--grpc-health-port`: the health service alone, plaintext, for the Kubernetes probe.
//!
//! Both are bound once discovery is watching, so a probe that connects sees a ready picker.
//! SIGTERM or Ctrl-C stops accepting; streams in flight end as their requests end.

mod ext_proc;
mod health;
mod proto;

use crate::config::GaieConfig;
use crate::signals::Signals;
use crate::{server_cmd, wiring};
use anyhow::Context as _;
use ext_proc::ExtProc;
use health::Health;
use infera_adapters::server::{ClientOptions, ServerOptions, ServerState};
use infera_adapters::tokenize::Tokenizer;
use infera_core::event::Retention;
use infera_core::fleet::FleetConfig;
use infera_core::policy::RouterConfig;
use infera_core::service::ServiceOptions;
use std::sync::Arc;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tonic::transport::server::TcpIncoming;
use tonic::transport::{Identity, Server, ServerTlsConfig};

/// HTTP/2 streams (requests in flight) per gateway connection.
const MAX_STREAMS: u32 = 4096;

/// Runs the endpoint picker until SIGTERM or Ctrl-C.
///
/// # Errors
/// A tokenizer that does not load, a port that cannot be bound, discovery or NATS unreachable
/// at startup.
pub fn run(config: GaieConfig) -> anyhow::Result<()> {
    let tokenizer = server_cmd::load_tokenizer(&config.router.tokenizer_path)?;
    let options = ServerOptions {
        service: ServiceOptions {
            router: RouterConfig {
                balance_tokens: config.router.balance_tokens,
                ..server_cmd::router_config(
                    config.router.policy,
                    config.router.kv_overlap_weight,
                    config.router.kv_prefill_overlap_weight,
                    config.router.kv_decode_overlap_weight,
                )
            },
            fleet: FleetConfig::default(),
            request_max_retries: 0,
            max_body_bytes: ext_proc::MAX_BODY,
        },
        chat_template: None,
        template_defaults: Default::default(),
        per_worker_template_kwargs: true,
        model_tokenizers: Default::default(),
        lora_loading: None,
        direct: false,
        client: ClientOptions {
            default_retention: Retention::Long,
            ..ClientOptions::default()
        },
    };
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("infera-gaie")
        .build()
        .context("cannot start the tokio runtime")?
        .block_on(serve(config, options, Arc::new(tokenizer)))
}

async fn serve(
    config: GaieConfig,
    options: ServerOptions,
    tokenizer: Arc<Tokenizer>,
) -> anyhow::Result<()> {
    let grpc = &config.grpc;
    let kv_source = wiring::kv_event_source(
        config.kv_event_transport,
        &config.nats_server,
        "infera-gaie",
    )
    .await?;
    let state = ServerState::new(options, tokenizer);
    let mut signals = Signals::register()?;
    let shutdown = CancellationToken::new();
    let discovery =
        server_cmd::follow_fleet(&config.discovery, &state, kv_source, &shutdown).await?;

    let main = bind(&grpc.host, grpc.grpc_port).await?;
    let probe = match grpc.grpc_health_port {
        Some(port) => Some(bind(&grpc.host, port).await?),
        None => None,
    };
    let mut builder = Server::builder().max_concurrent_streams(MAX_STREAMS);
    if grpc.secure_serving {
        builder = builder
            .tls_config(ServerTlsConfig::new().identity(self_signed()?))
            .context("cannot configure TLS for --secure-serving")?;
    }
    let mut main = tokio::spawn(
        builder
            .add_service(ExtProc::new(state, grpc.destination_port))
            .add_service(Health)
            .serve_with_incoming_shutdown(main, shutdown.clone().cancelled_owned()),
    );
    let probe = probe.map(|incoming| {
        tokio::spawn(
            Server::builder()
                .add_service(Health)
                .serve_with_incoming_shutdown(incoming, shutdown.clone().cancelled_owned()),
        )
    });
    tracing::info!(host = %grpc.host, grpc_port = grpc.grpc_port,
        health_port = ?grpc.grpc_health_port, tls = grpc.secure_serving,
        destination_port = grpc.destination_port,
        discovery = %wiring::describe(&config.discovery), "infera gaie serving ext_proc");
    // A server that fails on its own (its listener broke) stops the picker too.
    let ended = tokio::select! {
        () = signals.recv() => None,
        ended = &mut main => Some(ended),
    };
    shutdown.cancel();
    let served = match ended {
        Some(ended) => ended,
        None => main.await,
    }
    .context("the ext_proc server task failed")?;
    if let Some(probe) = probe {
        probe
            .await
            .context("the health server task failed")?
            .context("the health server failed")?;
    }
    if let Err(e) = discovery.await {
        tracing::error!(error = %e, "discovery task failed");
    }
    served.context("the ext_proc server failed")?;
    tracing::info!("infera gaie stopped");
    Ok(())
}

/// Listens on `host:port`.
async fn bind(host: &str, port: u16) -> anyhow::Result<TcpIncoming> {
    let addr = crate::net::socket_addr(host, port);
    let listener = TcpListener::bind(&addr)
        .await
        .with_context(|| format!("cannot bind {addr}"))?;
    Ok(TcpIncoming::from(listener))
}

/// A certificate for `infera-epp` and its key, generated in memory at each start.
fn self_signed() -> anyhow::Result<Identity> {
    let certified = rcgen::generate_simple_self_signed(vec!["infera-epp".to_owned()])
        .context("cannot generate the self-signed certificate")?;
    Ok(Identity::from_pem(
        certified.cert.pem(),
        certified.signing_key.serialize_pem(),
    ))
}
