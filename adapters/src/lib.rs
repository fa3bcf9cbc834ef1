//! Infera's adapters: protocol translation at the edges — client APIs (OpenAI chat/completions,
//! Anthropic messages, SSE), engines (vLLM, SGLang, ATOM command lines, health and drain probes) and the mock engine —
//! and the one HTTP serve loop both fronts run on ([`serve`]). Adapters do not know which
//! backend is in use.
pub mod mock;
pub mod serve;
pub mod server;
pub mod tokenize;
