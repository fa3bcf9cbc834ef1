//! Replay predicts the live fleet: the first 300 requests of the bundled Mooncake trace, five
//! times faster than recorded, through `infera up` (4 mock engines) driven by `infera bench`,
//! and through the simulator with the same fleet settings (the mean of several seeds). Asserts
//! the targets on hit rate (within 2 points) and per-worker share (within 5 points, or
//! four of the replay's standard deviations where its seeds spread wider: 300 requests are few,
//! and one live run is one sample, see `share_allowance`); TTFT is printed (a loaded CI
//! machine adds its own scheduling delay to live TTFT; `cargo bench --bench fidelity` measures
//! it in release mode).
#![allow(clippy::unwrap_used)]

mod common;
mod fidelity_harness;

use fidelity_harness::{Setup, live, mooncake_trace, offline, share_allowance, share_gap, table};

#[test]
fn replay_and_live_agree_on_hit_rate_and_share() {
    let setup = Setup {
        trace: mooncake_trace(),
        limit: 300,
        workers: 4,
        gpu_blocks: 2048,
        block_size: 512,
        speedup: 5.0,
    };
    let offline = offline(&setup);
    let live = live(env!("CARGO_BIN_EXE_infera"), &setup);
    println!("{}", table(&setup, &live, &offline));
    assert_eq!(live.requests, setup.limit as u64);
    assert_eq!(offline.requests, setup.limit as u64);
    assert!(
        (live.hit_rate - offline.hit_rate).abs() * 100.0 <= 2.0,
        "hit rate: live {:.3} vs replay {:.3}",
        live.hit_rate,
        offline.hit_rate
    );
    assert!(
        share_gap(&live, &offline) <= share_allowance(&offline),
        "shares: live {:?} vs replay {:?}",
        live.shares,
        offline.shares
    );
}
