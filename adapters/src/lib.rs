//! Infera's adapters: protocol translation at the edges — client APIs (OpenAI chat/completions,
//! Anthropic messages, SSE), engines (vLLM, SGLang, ATOM command lines, health and drain probes) and the mock engine —
//! and what both fronts share: the HTTP serve loop they run on ([`serve`]) and the Prometheus
//! exposition their `GET /metrics` answers (`metrics`). Adapters do not know which backend is in
//! use.
mod metrics;
pub mod mock;
pub mod serve;
pub mod server;
pub mod tokenize;
