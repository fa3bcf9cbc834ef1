//! Infera's core: everything the router decides with and the request pipeline it serves, and
//! nothing that touches a network or a disk: the ports name those, other crates implement them.
//!
//! - [`event`]: typed, versioned events and their envelope; [`log`]: the event log and its
//!   in-memory implementation; [`projection`]: state as a fold of the log.
//! - [`hashing`]: the router's chained block hashes; [`index`]: the KV index (which worker holds
//!   which prefix, per tier); [`fleet`]: workers, roles and in-flight load.
//! - [`policy`]: `kv-aware`, `round-robin` and direct-mode routing; [`pd`]: the prefill/decode
//!   protocols and the `disagg_meta` PD workers register.
//! - [`kernel`]: the one type that owns fleet, router and log; commit, route, ingest and
//!   compaction are its methods (the live server and `infera replay` both run on it).
//! - [`service`]: the request pipeline as an application service on the kernel and the ports:
//!   decide, dispatch with failover (and prefill/decode pairs), relay, record; its circuit
//!   breaker, taps and metrics. The HTTP front in `infera-adapters` is the adapter before it.
//! - [`tenancy`]: tenants (API keys, weights, priorities), their limits and the fair order of
//!   the router's queue.
//! - [`engine`]: the engine simulation model (paged KV cache, batch scheduler, timing) shared by
//!   `infera replay` and the mock engine.
//! - [`retention`]: retention-class eviction (the kvd tiers' policy, also simulated by replay).
//! - [`kv_events`]: engine KV-event payloads (every vLLM / SGLang / ATOM shape) and the one
//!   pipeline that turns any transport's frames into index events (sequence, epoch, gaps, restarts).
//! - [`ports`]: the plugin traits backends and edges implement (discovery, request transport,
//!   KV-event source, prefetch, KV block store, scaling, tokenizer).
//! - [`error`]: the one table from an error's code to its HTTP status and OpenAI / Anthropic
//!   error types.
//! - [`clock`], [`rng`]: time and randomness as explicit inputs, so replay is deterministic.

pub mod clock;
pub mod engine;
pub mod error;
pub mod event;
pub mod fleet;
pub mod hashing;
pub mod ids;
pub mod index;
pub mod kernel;
pub mod kv_events;
pub mod log;
pub mod pd;
pub mod policy;
pub mod ports;
pub mod projection;
pub mod retention;
pub mod rng;
pub mod service;
pub mod tenancy;
