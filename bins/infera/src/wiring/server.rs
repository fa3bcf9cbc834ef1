//! The server's ports toward its workers and its event store: the request transport
//! (`--request-transport`: HTTP with the worker-edge deadlines, or NATS), the KV-event source
//! (`--kv-event-transport`: every rank's ZeroMQ PUB socket, or the worker's NATS subjects), both
//! NATS ones sharing one connection on `--nats-server`, and the durable `--event-log`; and the
//! KV-event source alone, for `infera gaie`.

#[cfg(not(feature = "zmq"))]
use super::Backend;
use super::NatsLink;
use crate::config::server::FirstByteTimeout;
use crate::config::{ConfigError, KvEventTransport, RequestTransport, ServerConfig};
use anyhow::Context as _;
use infera_adapters::server::{FirstByteDeadline, HttpDeadlines, HttpTransport};
use infera_backends::log::{EventLogConfig, open_event_log_with};
#[cfg(feature = "zmq")]
use infera_backends::zmq::ZmqKvSource;
use infera_core::clock::SystemClock;
use infera_core::log::EventLog;
use infera_core::ports::kv_events::KvEventSource;
use infera_core::ports::transport::RequestTransport as Transport;
use std::sync::Arc;

/// The server's ports toward its workers.
#[derive(Debug)]
pub struct ServerPorts {
    /// How requests reach workers.
    pub transport: Arc<dyn Transport>,
    /// Where each worker's KV events come from.
    pub kv_source: Arc<dyn KvEventSource>,
}

/// Builds the request transport and the KV-event source of `config`, connecting to NATS first
/// when either uses it.
///
/// # Errors
/// NATS unreachable, or a transport this build lacks.
pub async fn server_ports(config: &ServerConfig) -> anyhow::Result<ServerPorts> {
    let nats_flag = if config.request_transport == RequestTransport::Nats {
        Some("--request-transport")
    } else if config.kv_event_transport == KvEventTransport::Nats {
        Some("--kv-event-transport")
    } else {
        None
    };
    let nats = match nats_flag {
        Some(flag) => Some(NatsLink::connect(&config.nats.server, "infera-server", flag).await?),
        None => None,
    };
    let transport: Arc<dyn Transport> = match (config.request_transport, &nats) {
        (RequestTransport::Nats, Some(link)) => link.request_transport(&config.nats),
        _ => {
            let edge = &config.worker_edge;
            Arc::new(HttpTransport::with_deadlines(HttpDeadlines {
                connect: edge.connect_timeout.map(|d| d.0),
                first_byte: match edge.first_byte_timeout {
                    FirstByteTimeout::Derived => FirstByteDeadline::Derived,
                    FirstByteTimeout::Off => FirstByteDeadline::Off,
                    FirstByteTimeout::Fixed(d) => FirstByteDeadline::Fixed(d.0),
                },
                idle: edge.idle_timeout.map(|d| d.0),
                max_duration: edge.max_duration.map(|d| d.0),
            }))
        }
    };
    let kv_source: Arc<dyn KvEventSource> = match (config.kv_event_transport, &nats) {
        (KvEventTransport::Nats, Some(link)) => link.kv_source(),
        _ => zmq_source()?,
    };
    Ok(ServerPorts {
        transport,
        kv_source,
    })
}

/// The KV-event source alone (`infera gaie`, which sends no requests): the workers' NATS
/// subjects on its own connection to `nats_server` as `client`, or their ZeroMQ sockets.
///
/// # Errors
/// NATS unreachable, or a transport this build lacks.
pub async fn kv_event_source(
    transport: KvEventTransport,
    nats_server: &str,
    client: &str,
) -> anyhow::Result<Arc<dyn KvEventSource>> {
    Ok(match transport {
        KvEventTransport::Nats => NatsLink::connect(nats_server, client, "--kv-event-transport")
            .await?
            .kv_source(),
        KvEventTransport::Zmq => zmq_source()?,
    })
}

/// The source of node kvds' inventory: their ZeroMQ PUB sockets, whatever transport the
/// engines' events take.
///
/// # Errors
/// A build without ZeroMQ.
pub fn kvd_event_source() -> Result<Arc<dyn KvEventSource>, ConfigError> {
    zmq_source()
}

/// Subscribes to every rank's ZeroMQ PUB socket of each worker (replaying gaps from its ROUTER).
fn zmq_source() -> Result<Arc<dyn KvEventSource>, ConfigError> {
    #[cfg(feature = "zmq")]
    return Ok(Arc::new(ZmqKvSource::default()));
    #[cfg(not(feature = "zmq"))]
    Err(Backend::Zmq.not_built("--kv-event-transport", "zmq"))
}

/// Opens a durable `--event-log` (every form but `memory`), stamping envelopes with the system
/// clock.
///
/// # Errors
/// The store cannot be reached or prepared, or its backend is not in this build.
pub async fn open_event_log(config: &EventLogConfig) -> anyhow::Result<Arc<dyn EventLog>> {
    open_event_log_with(config, Arc::new(SystemClock))
        .await
        .context("cannot open the event log (--event-log)")
}
