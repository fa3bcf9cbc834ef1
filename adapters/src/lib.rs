//! Infera's adapters: protocol translation at the edges — client APIs (OpenAI chat/completions,
//! Anthropic messages, SSE), engines (vLLM, SGLang, ATOM command lines, health and drain probes) and the mock engine. Adapters do not know which backend is in use.
pub mod mock;
pub mod server;
pub mod tokenize;
