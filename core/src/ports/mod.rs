//! The plugin ports: every trait a backend or an edge implements, with its types and errors.
//! Implementations depend on this crate, never the reverse; the `infera` binary is the one
//! place that picks them (config → `Arc<dyn Port>`).
//!
//! | port | implemented by |
//! |---|---|
//! | [`discovery`]: `Discovery` (server side), `Registrar` (worker side) | etcd, Kubernetes (`infera-backends`) |
//! | [`transport`]: `RequestTransport` | HTTP (`infera-adapters`), NATS (`infera-backends`) |
//! | [`kv_events`]: `KvEventSource`, `KvReplay` | ZeroMQ, NATS (`infera-backends`), in-process channels |
//! | [`prefetch`]: `KvPrefetch` | the kvd client (`infera` binary) |
//! | [`metrics`]: `MetricsSource` | the trace recorder, the durable event log |
//!
//! The event log port is [`crate::log::EventLog`].

pub mod discovery;
pub mod kv_events;
pub mod metrics;
pub mod prefetch;
pub mod transport;
