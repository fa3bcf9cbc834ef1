//! Infera's core: everything the router decides with, and nothing that touches a network or a disk.
//!
//! - [`event`]: typed, versioned events and their envelope; [`log`]: the event log and its
//!   in-memory implementation; [`projection`]: state as a fold of the log.
//! - [`hashing`]: the router's chained block hashes; [`index`]: the KV index (which worker holds
//!   which prefix, per tier); [`fleet`]: workers, roles and in-flight load.
//! - [`policy`]: `kv-aware`, `round-robin` and direct-mode routing.
//! - [`engine`]: the engine simulation model (paged KV cache, batch scheduler, timing) shared by
//!   `infera replay` and the mock engine.
//! - [`retention`]: retention-class eviction (the kvd tiers' policy, also simulated by replay).
//! - [`clock`], [`rng`]: time and randomness as explicit inputs, so replay is deterministic.

pub mod clock;
pub mod engine;
pub mod event;
pub mod fleet;
pub mod hashing;
pub mod ids;
pub mod index;
pub mod log;
pub mod policy;
pub mod projection;
pub mod retention;
pub mod rng;
