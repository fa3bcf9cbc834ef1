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
//! | [`kv_store`]: `KvBlockStore` | the kvd client (`infera` binary), for the mock engine |
//! | [`scaling`]: `PoolScaler` | the InferaDeployment on Kubernetes (`infera-backends`) |
//! | [`tokenize`]: `Tokenize` | the server front's tokenizer and chat templates (`infera-adapters`) |
//! | [`trace`]: `TraceContext` | the OpenTelemetry export (`infera-adapters`) |
//!
//! The event log port is [`crate::log::EventLog`]. Metrics need no port of ours: a component
//! registers its families in its process's `prometheus_client` registry.

pub mod discovery;
pub mod kv_events;
pub mod kv_store;
pub mod prefetch;
pub mod scaling;
pub mod tokenize;
pub mod trace;
pub mod transport;
