//! Infera's adapters: protocol translation at the edges — client APIs (OpenAI chat/completions,
//! Anthropic messages, SSE), engines (vLLM, SGLang, ATOM command lines, health and drain probes) and the mock engine —
//! and the HTTP serve loop both fronts run on ([`serve`]). The request pipeline behind the
//! server's front is `infera_core::service`. Adapters do not know which backend is in use.
pub mod mock;
pub mod serve;
pub mod server;
pub mod telemetry;
pub mod tokenize;
