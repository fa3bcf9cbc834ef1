//! Timed L4 rounds for the benches that set kvd beside a store's own client (`l4`, `l4_mooncake`,
//! `l4_s3`).

use crate::rounds;
use bytes::Bytes;
use infera_kvd::Namespace;
use infera_kvd::l4::L4;
use infera_kvd::long::LongStore;
use std::time::Instant;

/// The median of `v`.
pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// One kvd round of `blocks` under `keys`: the seconds of a put round
/// ([`rounds::put_round`]) and of one batched read of them all.
pub fn round(
    rt: &tokio::runtime::Runtime,
    l4: &L4,
    ns: &Namespace,
    keys: &[(Bytes, u128)],
    blocks: &[Bytes],
) -> (f64, f64) {
    let start = Instant::now();
    rt.block_on(rounds::put_round(l4, ns, keys, blocks));
    let put = start.elapsed().as_secs_f64();
    let start = Instant::now();
    let hits = rt.block_on(l4.get_many(ns, keys, 1));
    let get = start.elapsed().as_secs_f64();
    assert!(hits.iter().all(Option::is_some), "every block reads back");
    (put, get)
}
