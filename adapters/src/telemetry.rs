//! OpenTelemetry traces of the request path (`infera server --otlp-endpoint`, or the standard
//! `OTEL_EXPORTER_OTLP_*ENDPOINT` variables): the spans `infera_core::ports::trace` describes,
//! exported over OTLP/gRPC, with W3C Trace Context taken from clients and passed to engines.
//!
//! The exporter subscribes to the spans' target alone, through its own filter, so `RUST_LOG`
//! still decides the log and a log level never decides what is exported. Without an endpoint
//! no exporter is built and the spans stay disabled (see the port's docs for what that costs).
//!
//! The OTLP client is tonic: its connection runs on a one-thread runtime of its own, so an
//! export never takes a thread from the request path; the SDK's batch processor sends from
//! its own thread (queue, batch size and delay from the `OTEL_BSP_*` variables). At exit,
//! [`Exporter`]'s drop flushes what is queued.

use http::{HeaderMap, HeaderName, HeaderValue};
use infera_core::ports::trace::{TARGET, TraceContext};
use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator as _};
use opentelemetry::trace::{TraceContextExt as _, TracerProvider as _};
use opentelemetry_otlp::WithExportConfig as _;
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{Sampler, SdkTracerProvider};
use tracing_opentelemetry::OpenTelemetrySpanExt as _;
use tracing_subscriber::Layer;
use tracing_subscriber::filter::Targets;
use tracing_subscriber::registry::LookupSpan;

/// Whether [`layer`] built an exporter in this process: every server front made after it
/// propagates trace context ([`crate::server::ServerState`] gives its service [`W3c`]).
static EXPORTING: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Whether spans are exported (see [`EXPORTING`]).
pub fn exporting() -> bool {
    EXPORTING.load(std::sync::atomic::Ordering::Relaxed)
}

/// The service name when `OTEL_SERVICE_NAME` names none.
const SERVICE_NAME: &str = "infera-server";

/// Why the export cannot start.
#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    #[error("{0}")]
    Flag(String),
    #[error("starting the OTLP export's runtime: {0}")]
    Runtime(std::io::Error),
    #[error("building the OTLP trace exporter: {0}")]
    Exporter(String),
}

/// What turns the export on.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Settings {
    /// `--otlp-endpoint`; else the `OTEL_EXPORTER_OTLP_*ENDPOINT` variables.
    pub endpoint: Option<String>,
    /// `--otlp-sample-ratio`.
    pub sample_ratio: Option<f64>,
}

impl Settings {
    /// Whether spans are exported: an endpoint from the flag or the standard variables, and
    /// the SDK not disabled (`OTEL_SDK_DISABLED=true`, `OTEL_TRACES_EXPORTER=none`).
    pub fn enabled(&self, env: impl Fn(&str) -> Option<String>) -> bool {
        let set = |k: &str| env(k).is_some_and(|v| !v.trim().is_empty());
        let off = env("OTEL_SDK_DISABLED").is_some_and(|v| v.trim().eq_ignore_ascii_case("true"))
            || env("OTEL_TRACES_EXPORTER").is_some_and(|v| v.trim().eq_ignore_ascii_case("none"));
        !off && (self.endpoint.is_some()
            || set("OTEL_EXPORTER_OTLP_ENDPOINT")
            || set("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))
    }

    /// The flags' checks: a ratio from 0 to 1, an endpoint that is an http(s) URL.
    pub fn validate(&self) -> Result<(), TelemetryError> {
        if let Some(r) = self.sample_ratio
            && !(0.0..=1.0).contains(&r)
        {
            return Err(TelemetryError::Flag(format!(
                "--otlp-sample-ratio must be from 0 to 1 (got {r})"
            )));
        }
        if let Some(e) = &self.endpoint
            && !(e.starts_with("http://") || e.starts_with("https://"))
        {
            return Err(TelemetryError::Flag(format!(
                "--otlp-endpoint {e:?}: expected an http:// or https:// URL"
            )));
        }
        Ok(())
    }
}

/// The running export: flushes and stops at drop.
#[derive(Debug)]
pub struct Exporter {
    provider: SdkTracerProvider,
    /// The OTLP client's connection lives on it.
    _runtime: tokio::runtime::Runtime,
}

impl Drop for Exporter {
    fn drop(&mut self) {
        if let Err(e) = self.provider.shutdown() {
            eprintln!("infera: flushing the OTLP trace export: {e}");
        }
    }
}

/// The exporter and the `tracing` layer that feeds it the spans of [`TARGET`].
pub fn layer<S>(settings: &Settings) -> Result<(Exporter, impl Layer<S> + use<S>), TelemetryError>
where
    S: tracing::Subscriber + for<'a> LookupSpan<'a>,
{
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("infera-otlp")
        .enable_all()
        .build()
        .map_err(TelemetryError::Runtime)?;
    let exporter = {
        let _in = runtime.enter();
        let mut builder = opentelemetry_otlp::SpanExporter::builder().with_tonic();
        if let Some(endpoint) = &settings.endpoint {
            builder = builder.with_endpoint(endpoint.clone());
        }
        builder
            .build()
            .map_err(|e| TelemetryError::Exporter(e.to_string()))?
    };
    let mut resource = Resource::builder();
    if std::env::var_os("OTEL_SERVICE_NAME").is_none() {
        resource = resource.with_service_name(SERVICE_NAME);
    }
    let mut provider = SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(resource.build());
    if let Some(ratio) = settings.sample_ratio {
        let sampler = Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(ratio)));
        provider = provider.with_sampler(sampler);
    }
    let provider = provider.build();
    let layer = spans(&provider);
    EXPORTING.store(true, std::sync::atomic::Ordering::Relaxed);
    Ok((
        Exporter {
            provider,
            _runtime: runtime,
        },
        layer,
    ))
}

/// The `tracing` layer that turns the spans of [`TARGET`] into `provider`'s.
pub fn spans<S>(provider: &SdkTracerProvider) -> impl Layer<S> + use<S>
where
    S: tracing::Subscriber + for<'a> LookupSpan<'a>,
{
    // The spans' own attributes only: no source location, thread or busy/idle times, which
    // cost every span and say nothing about the request.
    tracing_opentelemetry::layer()
        .with_tracer(provider.tracer("infera"))
        .with_location(false)
        .with_threads(false)
        .with_tracked_inactivity(false)
        .with_filter(Targets::new().with_target(TARGET, tracing::Level::TRACE))
}

/// W3C Trace Context in HTTP (and NATS) headers, for the spans the layer exports.
#[derive(Debug, Default)]
pub struct W3c(TraceContextPropagator);

impl TraceContext for W3c {
    fn adopt(&self, span: &tracing::Span, headers: &HeaderMap) {
        let cx = self.0.extract(&Headers(headers));
        if cx.span().span_context().is_valid() {
            let _ = span.set_parent(cx);
        }
    }

    fn inject(&self, span: &tracing::Span, headers: &mut HeaderMap) {
        self.0
            .inject_context(&span.context(), &mut HeadersMut(headers));
    }
}

struct Headers<'a>(&'a HeaderMap);

impl Extractor for Headers<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(HeaderName::as_str).collect()
    }
}

struct HeadersMut<'a>(&'a mut HeaderMap);

impl Injector for HeadersMut<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(k), Ok(v)) = (
            HeaderName::from_bytes(key.as_bytes()),
            HeaderValue::from_str(&value),
        ) {
            self.0.insert(k, v);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_export_is_on_with_an_endpoint_and_off_when_disabled() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |k: &str| {
                pairs
                    .iter()
                    .find(|(n, _)| *n == k)
                    .map(|(_, v)| v.to_string())
            }
        };
        let flag = Settings {
            endpoint: Some("http://127.0.0.1:4317".into()),
            sample_ratio: None,
        };
        assert!(!Settings::default().enabled(env(&[])));
        assert!(flag.enabled(env(&[])));
        assert!(
            Settings::default().enabled(env(&[("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4317")]))
        );
        assert!(Settings::default().enabled(env(&[(
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
            "http://c:4317"
        )])));
        assert!(!flag.enabled(env(&[("OTEL_SDK_DISABLED", "true")])));
        assert!(!flag.enabled(env(&[("OTEL_TRACES_EXPORTER", "none")])));
        assert!(flag.validate().is_ok());
        let bad_ratio = Settings {
            sample_ratio: Some(1.5),
            ..flag.clone()
        };
        assert!(bad_ratio.validate().is_err());
        let bad_url = Settings {
            endpoint: Some("localhost:4317".into()),
            ..flag
        };
        assert!(bad_url.validate().is_err());
    }

    #[test]
    fn a_clients_traceparent_round_trips_through_the_headers() {
        let mut headers = HeaderMap::new();
        let parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        headers.insert("traceparent", HeaderValue::from_static(parent));
        let cx = TraceContextPropagator::new().extract(&Headers(&headers));
        let mut out = HeaderMap::new();
        TraceContextPropagator::new().inject_context(&cx, &mut HeadersMut(&mut out));
        assert_eq!(out.get("traceparent").unwrap(), parent);
    }
}
