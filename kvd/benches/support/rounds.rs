//! The L4 throughput benches' rounds (`l4`, `l4_mooncake`, `l4_s3`): the blocks' keys, and a
//! put round (one put per block through the write-behind queue, then a flush).

use bytes::Bytes;
use infera_core::event::Retention;
use infera_kvd::Namespace;
use infera_kvd::l4::L4;
use infera_kvd::long::{LongBlock, LongStore, WritePermit};
use infera_kvd::store::key_hash;

/// `n` keys `k<tag><i>` with their hashes in `ns`.
pub fn keys(ns: &Namespace, tag: &str, n: usize) -> Vec<(Bytes, u128)> {
    (0..n)
        .map(|i| {
            let k = Bytes::from(format!("k{tag}{i}"));
            let h = key_hash(ns, &k);
            (k, h)
        })
        .collect()
}

/// Puts each of `blocks` under its key as a `long` block, then waits until all landed.
pub async fn put_round(l4: &L4, ns: &Namespace, keys: &[(Bytes, u128)], blocks: &[Bytes]) {
    for ((k, h), v) in keys.iter().zip(blocks) {
        let block = LongBlock {
            hash: *h,
            ns: ns.clone(),
            key: k.clone(),
            value: v.clone(),
            metadata: None,
            class: Retention::Long,
            expires_at: None,
        };
        l4.put(block, WritePermit::unbounded(), 1, false).unwrap();
    }
    l4.flush().await.unwrap();
}
