//! Replay-vs-live fidelity benchmark: the bundled Mooncake trace through `infera up` (driven by
//! `infera bench`) and through the simulator with the same fleet, in release mode, printing the
//! comparison table with TTFT (which `tests/fidelity.rs` leaves out of its assertions).
//!
//! `cargo bench -p infera --bench fidelity`; `FIDELITY_LIMIT` (default 1000 requests),
//! `FIDELITY_SPEEDUP` (default 5), `FIDELITY_WORKERS` (default 4) and `FIDELITY_GPU_BLOCKS`
//! (default 2048) change the slice and the fleet.
#![allow(clippy::unwrap_used)]

#[path = "../tests/common/mod.rs"]
mod common;
#[path = "../tests/fidelity_harness/mod.rs"]
mod fidelity_harness;

use fidelity_harness::{Setup, live, mooncake_trace, offline, share_allowance, share_gap, table};
use std::str::FromStr;

fn env_or<T: FromStr>(key: &str, default: T) -> T {
    std::env::var(key)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn main() {
    // `cargo bench` passes `--bench`; `cargo test --benches` passes nothing: both run it.
    let setup = Setup {
        trace: mooncake_trace(),
        limit: env_or("FIDELITY_LIMIT", 1000),
        workers: env_or("FIDELITY_WORKERS", 4),
        gpu_blocks: env_or("FIDELITY_GPU_BLOCKS", 2048),
        block_size: 512,
        speedup: env_or("FIDELITY_SPEEDUP", 5.0),
    };
    let offline = offline(&setup);
    let live = live(env!("CARGO_BIN_EXE_infera"), &setup);
    print!("{}", table(&setup, &live, &offline));
    let ttft = |a: f64, b: f64| (a - b).abs() / b.max(1e-9) * 100.0;
    println!(
        "targets: hit rate within 2 points: {}; share within the allowance: {}; TTFT p50 within 10 %: {}",
        verdict((live.hit_rate - offline.hit_rate).abs() * 100.0 <= 2.0),
        verdict(share_gap(&live, &offline) <= share_allowance(&offline)),
        verdict(ttft(live.ttft_p50_ms, offline.ttft_p50_ms) <= 10.0),
    );
}

fn verdict(ok: bool) -> &'static str {
    if ok { "met" } else { "missed" }
}
