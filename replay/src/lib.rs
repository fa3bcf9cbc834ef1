//! `infera replay`: real request traces through the real router code, offline.
//!
//! - [`bench`]: the library side of `infera bench` (prompts from block hashes, SSE, statistics);
//! - [`trace`]: the versioned Parquet trace schema and the Mooncake / Azure importers;
//! - [`sim`]: the discrete-event simulator (simulated engines + kvd tiers, core's router);
//! - [`rules`]: retention rules (`--retention-rule`);
//! - [`sweep`]: `--sweep` grids run in parallel;
//! - [`shard`], [`merge`]: `--shard I/N` slices of a grid, and `infera replay merge` joining them;
//! - [`tune`]: `--tune`, the Pareto front of a search over the router's tunables;
//! - [`suite`]: the routing-quality suite behind `cargo xtask bench routing`;
//! - [`record`]: the trace recorder behind `infera server --record-trace`;
//! - [`shadow`]: the shadow replay and adoption behind `infera server --auto-tune`;
//! - [`report`], [`output`], [`plot`]: tables, Parquet results, SVG and PNG charts.

pub mod bench;
pub mod merge;
pub mod output;
pub mod plot;
pub mod record;
pub mod report;
pub mod rules;
pub mod shadow;
pub mod shard;
pub mod sim;
pub mod suite;
pub mod sweep;
pub mod trace;
pub mod tune;
