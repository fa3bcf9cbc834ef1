//! The metrics-source port: metric families a component outside the server adds to its
//! `GET /metrics` (the trace recorder, the durable event log).

/// Metrics a component adds to the server's exposition.
pub trait MetricsSource: Send + Sync + std::fmt::Debug {
    /// Appends whole metric families in the Prometheus text format.
    fn render(&self, out: &mut String);
}
