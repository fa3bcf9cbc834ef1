//! The trace context port: W3C Trace Context (`traceparent`, `tracestate`) between the client,
//! this process's spans and the engines, implemented by `infera-adapters`' OpenTelemetry export
//! (`infera server --otlp-endpoint`).
//!
//! The request path opens its spans with `tracing` under the target [`TARGET`] at `TRACE`
//! level: without an exporter nothing subscribes to them, so each costs one comparison with
//! the subscriber's maximum level, and no context is read or written. With one, the edge makes
//! the client's `traceparent` the parent of its request span ([`TraceContext::adopt`]) and each
//! attempt writes its own span's context into the headers every transport sends
//! ([`TraceContext::inject`]), so the engine's spans are children of the attempt that reached
//! it, over HTTP and NATS alike.

use http::HeaderMap;

/// The `tracing` target of the request path's spans (the exporter subscribes to it alone).
pub const TARGET: &str = "infera::otel";

/// Reads and writes trace context in headers, for spans of [`TARGET`].
pub trait TraceContext: Send + Sync + std::fmt::Debug {
    /// Makes the context in `headers` (a client's `traceparent`), if any, the parent of `span`.
    fn adopt(&self, span: &tracing::Span, headers: &HeaderMap);
    /// Writes `span`'s context into `headers` for the next hop.
    fn inject(&self, span: &tracing::Span, headers: &mut HeaderMap);
}
