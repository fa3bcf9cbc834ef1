//! Timed L4 rounds for the benches that set kvd beside a store's own client (`l4`, `l4_mooncake`,
//! `l4_s3`).

use crate::rounds;
use bytes::Bytes;
use infera_kvd::Namespace;
use infera_kvd::l4::L4;
use infera_kvd::long::LongStore;
use std::collections::HashMap;
use std::time::Instant;

/// Each timed way's seconds per round, by name (kvd's, the other client's); a way's rate is
/// its bytes over its median round.
#[derive(Default)]
pub struct Times(HashMap<String, Vec<f64>>);

impl Times {
    pub fn push(&mut self, way: &str, secs: f64) {
        self.0.entry(way.to_owned()).or_default().push(secs);
    }

    /// Times `f` as one round of `way`; returns its output.
    pub fn time<T>(&mut self, way: &str, f: impl FnOnce() -> T) -> T {
        let start = Instant::now();
        let out = f();
        self.push(way, start.elapsed().as_secs_f64());
        out
    }

    /// Bytes per second of `way`: `bytes` over its median round.
    pub fn rate(&self, way: &str, bytes: f64) -> f64 {
        let mut v = self.0[way].clone();
        v.sort_by(f64::total_cmp);
        bytes / v[v.len() / 2]
    }
}

/// One kvd round of `blocks` under `keys`, timed into `times` as `<way> put` (a put round,
/// [`rounds::put_round`]) and `<way> get` (one batched read of them all).
pub fn round(
    rt: &tokio::runtime::Runtime,
    l4: &L4,
    ns: &Namespace,
    keys: &[(Bytes, u128)],
    blocks: &[Bytes],
    times: &mut Times,
    way: &str,
) {
    times.time(&format!("{way} put"), || {
        rt.block_on(rounds::put_round(l4, ns, keys, blocks));
    });
    let hits = times.time(&format!("{way} get"), || {
        rt.block_on(l4.get_many(ns, keys, 1))
    });
    assert!(hits.iter().all(Option::is_some), "every block reads back");
}
