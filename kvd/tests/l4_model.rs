//! Model-based test of the tiered store over an L4 whose remote store misbehaves: an in-memory
//! [`RemoteStore`] that can fail, time out (after applying a write, as a lost reply does), store
//! torn or foreign values while reporting success, refuse puts (a full store: up, answering,
//! keeping the keys' older values), and have its values overwritten behind kvd's back
//! (garbage, or another key's block). Random writes of every class with and without
//! TTLs, reads, prefetches, clears, time steps and restarts of the daemon (L2 empty again, the
//! store kept) run against a reference that knows, per key, the last accepted value.
//!
//! Checked after every read: the value is the last accepted one for that key or nothing —
//! never an older value, never another key's bytes, never a torn or foreign value.

#![allow(clippy::unwrap_used)]

use bytes::Bytes;
use infera_core::event::Retention;
use infera_kvd::l4::frame::{self, Framed};
use infera_kvd::l4::{L4, L4Options, RemoteError, RemoteStore, name};
use infera_kvd::long::LongStore;
use infera_kvd::stats::LongStats;
use infera_kvd::store::{Store, key_hash};
use infera_kvd::{Namespace, SetItem};
use proptest::prelude::*;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

const PREFIX: &str = "model";
const TIMEOUT: Duration = Duration::from_secs(1);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    None,
    Error,
    Timeout,
    Torn,
    Foreign,
    /// Puts are answered and refused, every older value kept (a full store).
    Refuse,
}

/// The misbehaving store.
#[derive(Debug)]
struct Faulty {
    data: Mutex<HashMap<String, Bytes>>,
    fault: Mutex<Fault>,
    /// Health checks asked for.
    probes: AtomicU64,
}

impl Faulty {
    fn fault(&self) -> Fault {
        *self.fault.lock().unwrap()
    }

    async fn stall(&self) {
        tokio::time::sleep(TIMEOUT * 5).await;
    }

    fn error() -> RemoteError {
        RemoteError::Protocol("injected".to_owned())
    }
}

#[async_trait::async_trait]
impl RemoteStore for Faulty {
    fn describe(&self) -> String {
        "faulty://".to_owned()
    }

    fn backend(&self) -> &'static str {
        "faulty"
    }

    async fn health(&self) -> Result<(), RemoteError> {
        self.probes.fetch_add(1, Ordering::Relaxed);
        match self.fault() {
            Fault::Error => Err(Self::error()),
            Fault::Timeout => {
                self.stall().await;
                Ok(())
            }
            _ => Ok(()),
        }
    }

    async fn put_batch(&self, items: &[(String, Framed)]) -> Result<Vec<usize>, RemoteError> {
        let fault = self.fault();
        match fault {
            Fault::Error => return Err(Self::error()),
            Fault::Refuse => return Ok((0..items.len()).collect()),
            _ => {}
        }
        {
            let mut data = self.data.lock().unwrap();
            for (n, f) in items {
                let whole = frame::joined(f);
                let stored = match fault {
                    Fault::Torn => whole.slice(..whole.len() / 2),
                    Fault::Foreign => Bytes::from_static(b"someone else's value"),
                    _ => whole,
                };
                data.insert(n.clone(), stored);
            }
        }
        if fault == Fault::Timeout {
            self.stall().await;
        }
        Ok(Vec::new())
    }

    async fn get_batch(&self, names: &[String]) -> Result<Vec<Option<Bytes>>, RemoteError> {
        match self.fault() {
            Fault::Error => return Err(Self::error()),
            Fault::Timeout => self.stall().await,
            _ => {}
        }
        let data = self.data.lock().unwrap();
        Ok(names.iter().map(|n| data.get(n).cloned()).collect())
    }

    async fn exists_batch(&self, names: &[String]) -> Result<Vec<bool>, RemoteError> {
        match self.fault() {
            Fault::Error => return Err(Self::error()),
            Fault::Timeout => self.stall().await,
            _ => {}
        }
        let data = self.data.lock().unwrap();
        Ok(names.iter().map(|n| data.contains_key(n)).collect())
    }

    async fn remove_batch(&self, names: &[String]) -> Result<(), RemoteError> {
        let fault = self.fault();
        if fault == Fault::Error {
            return Err(Self::error());
        }
        {
            let mut data = self.data.lock().unwrap();
            for n in names {
                data.remove(n);
            }
        }
        if fault == Fault::Timeout {
            self.stall().await;
        }
        Ok(())
    }
}

#[derive(Debug, Clone)]
enum Op {
    Set {
        ns: u8,
        key: u8,
        len: usize,
        class: Retention,
        ttl_ms: Option<u64>,
    },
    Get {
        ns: u8,
        key: u8,
    },
    Prefetch {
        ns: u8,
        keys: Vec<u8>,
    },
    Clear(u8),
    Advance(u64),
    Fault(Fault),
    /// Overwrites a key's stored value with garbage.
    Corrupt {
        ns: u8,
        key: u8,
    },
    /// Copies one key's stored value under another key's name.
    Collide {
        ns: u8,
        from: u8,
        to: u8,
    },
    Restart,
}

fn op() -> impl Strategy<Value = Op> {
    let class = prop::sample::select(Retention::ALL.to_vec());
    let fault = prop::sample::select(vec![
        Fault::None,
        Fault::None,
        Fault::Error,
        Fault::Timeout,
        Fault::Torn,
        Fault::Foreign,
        Fault::Refuse,
    ]);
    prop_oneof![
        10 => (0u8..2, 0u8..16, 16usize..6_000, class, prop::option::weighted(0.15, 1u64..60))
            .prop_map(|(ns, key, len, class, ttl_ms)| Op::Set { ns, key, len, class, ttl_ms }),
        8 => (0u8..2, 0u8..16).prop_map(|(ns, key)| Op::Get { ns, key }),
        1 => (0u8..2, prop::collection::vec(0u8..16, 1..6))
            .prop_map(|(ns, keys)| Op::Prefetch { ns, keys }),
        1 => (0u8..3).prop_map(Op::Clear),
        1 => (1u64..40).prop_map(Op::Advance),
        2 => fault.prop_map(Op::Fault),
        1 => (0u8..2, 0u8..16).prop_map(|(ns, key)| Op::Corrupt { ns, key }),
        1 => (0u8..2, 0u8..16, 0u8..16).prop_map(|(ns, from, to)| Op::Collide { ns, from, to }),
        1 => Just(Op::Restart),
    ]
}

fn namespace(i: u8) -> Namespace {
    Namespace::new("m", if i == 0 { "" } else { "fp8" })
}

fn stored_name(ns: u8, key: u8) -> String {
    name(PREFIX, key_hash(&namespace(ns), &[key]))
}

/// Bytes that name their key and write, so a wrong read is visible.
fn value(ns: u8, key: u8, seq: u32, len: usize) -> Bytes {
    let mut v = vec![key; len.max(16)];
    v[..4].copy_from_slice(&seq.to_le_bytes());
    v[4] = ns;
    v[5] = key;
    Bytes::from(v)
}

#[derive(Debug, Clone)]
struct Known {
    value: Bytes,
    class: Retention,
    expires_at: Option<u64>,
}

fn options() -> L4Options {
    L4Options {
        prefix: PREFIX.to_owned(),
        queue_bytes: 24 << 10,
        op_timeout: TIMEOUT,
        batch_items: 4,
        breaker_failures: 2,
        retry_interval: Duration::from_millis(200),
        ..L4Options::default()
    }
}

async fn open(remote: &Arc<Faulty>) -> (Store, Arc<L4>) {
    let l4 = Arc::new(L4::open(remote.clone(), options(), false).await.unwrap());
    let long: Arc<dyn LongStore> = l4.clone();
    (Store::new(24 << 10, None, Some(long)), l4)
}

/// Heals the store and waits (on the paused clock) until every queued write has landed.
async fn settle(remote: &Faulty, l4: &L4) {
    *remote.fault.lock().unwrap() = Fault::None;
    for _ in 0..100 {
        // Bounded: a write the writer lost track of would leave the flush waiting forever.
        if let Ok(Ok(())) = tokio::time::timeout(Duration::from_secs(10), l4.flush()).await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("the L4 queue never drained: {:?}", l4.l4_stats());
}

struct Run {
    remote: Arc<Faulty>,
    store: Store,
    l4: Arc<L4>,
    known: HashMap<(u8, u8), Known>,
    now: u64,
    seq: u32,
    /// Values a clear hid: a clear lasts for the daemon's run (the store is shared and not
    /// enumerated), so after a restart such a value, not since overwritten, may read again.
    cleared: HashMap<(u8, u8), Known>,
    /// The counters of the L4s closed by restarts.
    closed: LongStats,
}

impl Run {
    fn check(
        &self,
        ns: u8,
        key: u8,
        got: Option<infera_kvd::store::Got>,
    ) -> Result<(), TestCaseError> {
        if let Some(infera_kvd::store::Got::Bytes(v, class)) = got {
            let k = self.known.get(&(ns, key));
            prop_assert!(k.is_some(), "a value for a key never written (or cleared)");
            let k = k.unwrap();
            prop_assert_eq!(&v[..6], &k.value[..6], "not the last accepted value");
            prop_assert_eq!(&v, &k.value);
            prop_assert_eq!(class, k.class);
            prop_assert!(
                k.expires_at.is_none_or(|t| t > self.now),
                "returned past its TTL"
            );
        }
        Ok(())
    }

    async fn step(&mut self, op: Op) -> Result<(), TestCaseError> {
        match op {
            Op::Set {
                ns,
                key,
                len,
                class,
                ttl_ms,
            } => {
                self.seq += 1;
                let v = value(ns, key, self.seq, len);
                let mut item = SetItem::new(vec![key], v.clone()).retention(class);
                if let Some(ms) = ttl_ms {
                    item = item.ttl_seconds(ms as f64 / 1000.0);
                }
                let ack = self.store.set(&namespace(ns), &item, self.now).await;
                // A refused write (a downgrade, or no room without displacing a higher class)
                // changes nothing.
                if ack.accepted {
                    let expires_at = ttl_ms.map(|ms| self.now + ms);
                    self.known.insert(
                        (ns, key),
                        Known {
                            value: v,
                            class,
                            expires_at,
                        },
                    );
                    self.cleared.remove(&(ns, key));
                }
            }
            Op::Get { ns, key } => {
                let k = Bytes::from(vec![key]);
                let got = self.store.get(&namespace(ns), &k, self.now, false).await;
                self.check(ns, key, got)?;
            }
            Op::Prefetch { ns, keys } => {
                let ks: Vec<Bytes> = keys.iter().map(|k| Bytes::from(vec![*k])).collect();
                self.store.prefetch(&namespace(ns), &ks, self.now).await;
                for key in keys {
                    let k = Bytes::from(vec![key]);
                    let got = self.store.get(&namespace(ns), &k, self.now, false).await;
                    self.check(ns, key, got)?;
                }
            }
            Op::Clear(which) => {
                let ns = if which == 2 {
                    Namespace::new("", "")
                } else {
                    namespace(which)
                };
                self.store.clear(&ns);
                let hit = |n: u8| which == 2 || n == which;
                let gone: Vec<(u8, u8)> = self
                    .known
                    .keys()
                    .filter(|(n, _)| hit(*n))
                    .copied()
                    .collect();
                for k in gone {
                    let v = self.known.remove(&k).unwrap();
                    self.cleared.insert(k, v);
                }
            }
            Op::Advance(ms) => {
                // The writer's time passes too (the clock is paused): it sends what is queued
                // to the store as it is now.
                tokio::time::sleep(Duration::from_millis(ms)).await;
                self.now += ms;
            }
            Op::Fault(fault) => *self.remote.fault.lock().unwrap() = fault,
            Op::Corrupt { ns, key } => {
                let mut data = self.remote.data.lock().unwrap();
                if let Some(v) = data.get_mut(&stored_name(ns, key)) {
                    *v = Bytes::from(vec![0x5a; v.len()]);
                }
            }
            Op::Collide { ns, from, to } => {
                let mut data = self.remote.data.lock().unwrap();
                if let Some(v) = data.get(&stored_name(ns, from)).cloned() {
                    data.insert(stored_name(ns, to), v);
                }
            }
            Op::Restart => {
                settle(&self.remote, &self.l4).await;
                self.l4.close().await.unwrap();
                self.closed = self.closed.merge(&self.store.stats().long);
                self.known.extend(self.cleared.drain());
                (self.store, self.l4) = open(&self.remote).await;
            }
        }
        Ok(())
    }
}

async fn run(ops: Vec<Op>) -> Result<Run, TestCaseError> {
    let remote = Arc::new(Faulty {
        data: Mutex::new(HashMap::new()),
        fault: Mutex::new(Fault::None),
        probes: AtomicU64::new(0),
    });
    let (store, l4) = open(&remote).await;
    let mut run = Run {
        remote,
        store,
        l4,
        known: HashMap::new(),
        now: 1_000_000,
        seq: 0,
        cleared: HashMap::new(),
        closed: LongStats::default(),
    };
    for op in ops {
        run.step(op).await?;
    }
    Ok(run)
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]
    #[test]
    fn reads_return_the_last_accepted_value_or_nothing_whatever_the_store_does(
        ops in prop::collection::vec(op(), 1..150),
    ) {
        runtime().block_on(async { run(ops).await.map(|_| ()) })?;
    }
}

/// The model above only means something if its runs reach every path: a long deterministic
/// run must hit L4, refuse bad values, drop writes, open the breaker and close it again.
#[test]
fn a_long_run_exercises_every_path() {
    use proptest::strategy::ValueTree;
    use proptest::test_runner::TestRunner;
    let mut runner = TestRunner::deterministic();
    let ops: Vec<Op> = (0..4000)
        .map(|_| op().new_tree(&mut runner).unwrap().current())
        .collect();
    runtime().block_on(async {
        let run = run(ops).await.unwrap();
        let s = run.closed.merge(&run.store.stats().long).l4;
        assert!(s.hits_total > 20, "{s:?}");
        assert!(s.rejected_total > 5, "{s:?}");
        assert!(s.dropped_total > 5, "{s:?}");
        assert!(s.refused_total > 5, "{s:?}");
        assert!(s.timeouts_total > 0 && s.errors_total > 0, "{s:?}");
        assert!(s.puts_total > 50 && s.removes_total > 5, "{s:?}");
        assert!(s.breaker_opens_total > 0 && s.reconnects_total > 0, "{s:?}");
    });
}

/// A store that stays down is probed less and less often (a probe may start a process: a new
/// Mooncake sidecar), and still found within the longest wait once it answers again.
#[test]
fn an_open_breaker_backs_off_and_still_finds_the_store_back() {
    runtime().block_on(async {
        let remote = Arc::new(Faulty {
            data: Mutex::new(HashMap::new()),
            fault: Mutex::new(Fault::Error),
            probes: AtomicU64::new(0),
        });
        let l4 = L4::open(remote.clone(), options(), false).await.unwrap();
        assert!(!l4.is_up(), "down at start");
        tokio::time::sleep(Duration::from_secs(120)).await;
        // The check at start, then waits of 0.2 s doubling up to 30 s: about 11 in 120 s,
        // where one every 0.2 s would be 600.
        let probes = remote.probes.load(Ordering::Relaxed);
        assert!((8..=14).contains(&probes), "{probes} probes");
        *remote.fault.lock().unwrap() = Fault::None;
        let mut up = l4.watch_up();
        tokio::time::timeout(Duration::from_secs(31), up.wait_for(|u| *u))
            .await
            .expect("the breaker closes within the longest wait")
            .unwrap();
    });
}
