//! The NATS connection a command opens once and shares between its NATS ports: the server's
//! request transport and KV-event source, the worker's request responder and KV publishers.
//!
//! In a build without the `nats` feature [`NatsLink`] has no values: [`NatsLink::connect`] is
//! the error naming the feature, and nothing that needs a connection can be reached.

#[cfg(not(feature = "nats"))]
use super::Backend;
use crate::config::WorkerConfig;
use crate::config::server::NatsConfig;
#[cfg(feature = "nats")]
use infera_backends::nats::{
    self, NatsRequestConfig, NatsResponder, NatsTransport, ResponderConfig,
    kv::{KvEventPublisher, NatsKvSource},
};
use infera_core::ports::kv_events::KvEventSource;
use infera_core::ports::transport::RequestTransport;
use std::sync::Arc;
use std::time::Duration;

#[cfg(feature = "nats")]
type Client = nats::Client;
#[cfg(not(feature = "nats"))]
type Client = std::convert::Infallible;

/// One NATS connection, reconnecting forever after the first success.
#[derive(Debug, Clone)]
pub struct NatsLink(Client);

#[cfg_attr(not(feature = "nats"), allow(unused_variables))]
impl NatsLink {
    /// Connects to the broker at `url` as `name`; `flag` is the flag that chose NATS (named when
    /// this build has no NATS).
    ///
    /// # Errors
    /// The broker does not answer, or this build has no NATS.
    #[cfg_attr(feature = "nats", allow(unused_variables))]
    pub async fn connect(url: &str, name: &str, flag: &'static str) -> anyhow::Result<Self> {
        #[cfg(feature = "nats")]
        return Ok(Self(nats::connect(url, name).await?));
        #[cfg(not(feature = "nats"))]
        Err(Backend::Nats.not_built(flag, "nats").into())
    }

    /// The server's request transport over this connection (through JetStream, admitting by
    /// each worker's backlog, with `--nats-req-max-pending`).
    pub fn request_transport(&self, config: &NatsConfig) -> Arc<dyn RequestTransport> {
        #[cfg(feature = "nats")]
        return Arc::new(NatsTransport::new(
            self.0.clone(),
            NatsRequestConfig {
                idle_timeout: config.req_idle_timeout.map(|d| d.0),
                max_duration: config.req_max_duration.map(|d| d.0),
                max_pending: config.req_max_pending,
            },
        ));
        #[cfg(not(feature = "nats"))]
        match self.0 {}
    }

    /// The server's KV-event source over this connection: each worker's
    /// `infera.kv.events.<token>.*` subjects.
    pub fn kv_source(&self) -> Arc<dyn KvEventSource> {
        #[cfg(feature = "nats")]
        return Arc::new(NatsKvSource::new(self.0.clone()));
        #[cfg(not(feature = "nats"))]
        match self.0 {}
    }

    /// A publisher of `worker_id`'s KV events whose epoch is `epoch`.
    #[cfg(feature = "nats")]
    pub(super) fn kv_publisher(&self, worker_id: &str, epoch: u64) -> KvEventPublisher {
        KvEventPublisher::new(self.0.clone(), worker_id, epoch)
    }

    /// Takes `worker_id`'s requests (its core NATS subject, or with `--nats-req-max-pending` its
    /// durable consumer on the JetStream work queue, which this creates) and proxies each to
    /// `engine_url`, bounded by the worker's `--nats-req-*` settings.
    ///
    /// # Errors
    /// A subscription cannot be made.
    pub async fn start_responder(
        &self,
        worker_id: String,
        engine_url: String,
        config: &WorkerConfig,
    ) -> anyhow::Result<Responder> {
        #[cfg(feature = "nats")]
        return Ok(Responder(
            NatsResponder::start(
                self.0.clone(),
                ResponderConfig {
                    worker_id,
                    engine_url,
                    max_duration: config.nats_req_max_duration.map(|d| d.0),
                    idle_timeout: config.nats_req_idle_timeout.map(|d| d.0),
                    max_pending: config.nats_req_max_pending,
                },
            )
            .await?,
        ));
        #[cfg(not(feature = "nats"))]
        match self.0 {}
    }
}

#[cfg(feature = "nats")]
type ResponderTask = NatsResponder;
#[cfg(not(feature = "nats"))]
type ResponderTask = std::convert::Infallible;

/// A worker's running NATS request responder.
#[derive(Debug)]
pub struct Responder(ResponderTask);

#[cfg_attr(not(feature = "nats"), allow(unused_variables))]
impl Responder {
    /// Unsubscribes from new requests (the first step of a drain); in-flight ones go on.
    pub async fn stop_accepting(&self) {
        #[cfg(feature = "nats")]
        self.0.stop_accepting().await;
        #[cfg(not(feature = "nats"))]
        match self.0 {}
    }

    /// Waits up to `timeout` for the requests still in flight, then cancels the rest.
    pub async fn finish(self, timeout: Duration) {
        #[cfg(feature = "nats")]
        self.0.finish(timeout).await;
        #[cfg(not(feature = "nats"))]
        match self.0 {}
    }
}
