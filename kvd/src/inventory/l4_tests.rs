//! What the L4 records: a queued put stored, kvd's removals removed, a put the store refused
//! removed once the refusal lands.

use super::*;
use crate::l4::frame::{self, Framed};
use crate::l4::{L4, L4Options, RemoteError, RemoteStore};
use crate::long::LongStore;
use crate::proto::SetItem;
use crate::store::Store;
use bytes::Bytes;
use infera_core::event::Retention;
use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

/// An in-memory store that answers every call, and refuses puts while told to (a full store).
#[derive(Debug, Default)]
struct Memory {
    data: Mutex<HashMap<String, Bytes>>,
    refuse: AtomicBool,
}

impl Memory {
    fn data(&self) -> std::sync::MutexGuard<'_, HashMap<String, Bytes>> {
        self.data.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[async_trait::async_trait]
impl RemoteStore for Memory {
    fn describe(&self) -> String {
        "memory://".to_owned()
    }

    fn backend(&self) -> &'static str {
        "memory"
    }

    async fn health(&self) -> Result<(), RemoteError> {
        Ok(())
    }

    async fn put_batch(&self, items: &[(String, Framed)]) -> Result<Vec<usize>, RemoteError> {
        if self.refuse.load(Ordering::Relaxed) {
            return Ok((0..items.len()).collect());
        }
        let mut data = self.data();
        for (name, framed) in items {
            data.insert(name.clone(), frame::joined(framed));
        }
        Ok(Vec::new())
    }

    async fn get_batch(&self, names: &[String]) -> Result<Vec<Option<Bytes>>, RemoteError> {
        let data = self.data();
        Ok(names.iter().map(|n| data.get(n).cloned()).collect())
    }

    async fn exists_batch(&self, names: &[String]) -> Result<Vec<bool>, RemoteError> {
        let data = self.data();
        Ok(names.iter().map(|n| data.contains_key(n)).collect())
    }

    async fn remove_batch(&self, names: &[String]) -> Result<(), RemoteError> {
        let mut data = self.data();
        for name in names {
            data.remove(name);
        }
        Ok(())
    }
}

fn ns() -> Namespace {
    Namespace::new("m", "")
}

fn inv(key: &str) -> u64 {
    inventory_hash("m", "", key.as_bytes()).0
}

/// The waiting changes, L2's then L4's (only the order within a tier is defined).
fn changes(recorder: &Recorder) -> Vec<(Tier, ChangeKind, u64)> {
    let mut out = Vec::new();
    recorder.drain(&mut out);
    out.sort_by_key(|c| c.tier as u8);
    out.into_iter().map(|c| (c.tier, c.kind, c.hash)).collect()
}

#[tokio::test]
async fn l4_puts_are_stored_and_kvds_removals_and_refusals_removed() {
    let remote = Arc::new(Memory::default());
    let l4 = Arc::new(
        L4::open(remote.clone(), L4Options::default(), true)
            .await
            .unwrap_or_else(|e| panic!("{e}")),
    );
    let long: Arc<dyn LongStore> = l4.clone();
    let recorder = Arc::new(Recorder::default());
    let store = Store::new(1 << 20, None, Some(long))
        .with_inventory(Inventory::recording(recorder.clone()));
    changes(&recorder);
    let long_item = |key: &str| SetItem::new(key.as_bytes().to_vec(), vec![1u8; 64]);
    let k1 = long_item("k1").retention(Retention::Long);
    assert!(store.set(&ns(), &k1, 1).await.accepted);
    // A `short` write keeps the block in RAM only and removes any L4 copy of its key.
    let k2 = long_item("k2").retention(Retention::Short);
    assert!(store.set(&ns(), &k2, 1).await.accepted);
    use ChangeKind::{Removed, Stored};
    assert_eq!(
        changes(&recorder),
        vec![
            (Tier::Host, Stored, inv("k1")),
            (Tier::Host, Stored, inv("k2")),
            (Tier::External, Stored, inv("k1")),
            (Tier::External, Removed, inv("k2")),
        ]
    );
    // The store answers the put of k3 and does not keep it: removed once that lands.
    l4.flush().await.unwrap_or_else(|e| panic!("{e}"));
    remote.refuse.store(true, Ordering::Relaxed);
    let k3 = long_item("k3").retention(Retention::Long);
    assert!(store.set(&ns(), &k3, 1).await.accepted);
    l4.flush().await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        changes(&recorder),
        vec![
            (Tier::Host, Stored, inv("k3")),
            (Tier::External, Stored, inv("k3")),
            (Tier::External, Removed, inv("k3")),
        ]
    );
    l4.close().await.unwrap_or_else(|e| panic!("{e}"));
}
