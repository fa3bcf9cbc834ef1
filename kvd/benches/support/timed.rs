//! Timed L4 rounds for the benches that set kvd beside a store's own client (`l4_mooncake`,
//! `l4_s3`): medians of put rounds and of batched reads.

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

/// kvd's put and get throughput, bytes per second, for `blocks` under `keys`: the medians of
/// `rounds` put rounds ([`rounds::put_round`]) and as many batched reads of them all.
pub fn throughput(
    rt: &tokio::runtime::Runtime,
    l4: &L4,
    ns: &Namespace,
    keys: &[(Bytes, u128)],
    blocks: &[Bytes],
    rounds: usize,
) -> (f64, f64) {
    let (mut puts, mut gets) = (Vec::new(), Vec::new());
    for _ in 0..rounds {
        let start = Instant::now();
        rt.block_on(rounds::put_round(l4, ns, keys, blocks));
        puts.push(start.elapsed().as_secs_f64());
        let start = Instant::now();
        let hits = rt.block_on(l4.get_many(ns, keys, 1));
        gets.push(start.elapsed().as_secs_f64());
        assert!(hits.iter().all(Option::is_some), "every block reads back");
    }
    let bytes = blocks.iter().map(Bytes::len).sum::<usize>() as f64;
    (bytes / median(puts), bytes / median(gets))
}
