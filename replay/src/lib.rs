//! `infera replay`: real request traces through the real router code, offline.
//!
//! - [`trace`]: the versioned Parquet trace schema and the Mooncake / Azure importers;
//! - [`sim`]: the discrete-event simulator (simulated engines + kvd tiers, core's router);
//! - [`rules`]: retention rules (`--retention-rule`);
//! - [`sweep`]: `--sweep` grids run in parallel;
//! - [`report`], [`output`], [`plot`]: tables, Parquet results and SVG plots.

pub mod output;
pub mod plot;
pub mod report;
pub mod rules;
pub mod sim;
pub mod sweep;
pub mod trace;
