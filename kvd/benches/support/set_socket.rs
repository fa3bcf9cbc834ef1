//! The L2 SET latency as a client sees it: one client SETs 64 KiB `long` blocks over kvd's
//! socket to daemons side by side, one with no L4, one each with an L4 that is healthy, slow
//! (behind [`delayed`], a proxy that holds every byte 50 ms each way) or down (its address
//! answers nothing), and a second with no L4 (A/A: its ratio is the study's own noise), the
//! SETs interleaved among them as in the in-process study
//! (`set_study.rs`, which isolates the SET path's own cost); a round starts once every L4 has
//! written what the last one queued. This is the latency an engine waits for. Target: p99
//! within 10 % of no L4.
//!
//! The daemons run as `infera kvd` does by default: the shared arena as large as the L2
//! budget (`--shared-arena-bytes auto`), so every value lands in an arena slot. Warm-up
//! rounds fill each arena first; the counted rounds then run daemons at capacity, evicting,
//! on memory already touched (a daemon whose memory grows stalls SETs for milliseconds on a
//! VM whose host backs memory at first touch: `kvd/benches/README.md`). The keys of a round
//! come back [`KEY_SETS`] rounds later, by then evicted from L2 but overwriting the store's
//! copies, which bounds what the L4 stores hold. Two ways to SET, each its own table:
//! - the value in the request's frame (`set`), which the daemon copies into a slot;
//! - the value written by the client into a slot it reserved (`put` over the shared arena,
//!   the engine connector's way), the commit then carrying only the key.

use super::set_study::{BUDGET, Cycles, VALUE, percentiles, report, rounds_to_fill};
use bytes::Bytes;
use infera_core::event::Retention;
use infera_kvd::l4::L4Config;
use infera_kvd::long::LongBackendConfig;
use infera_kvd::{KvdClient, KvdOptions, KvdServer, Namespace, SetItem};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// SETs per case and round.
const SETS: usize = 4000;
/// Rounds counted per way to SET; each case's figure is the median over them.
const ROUNDS: usize = 5;
/// Uncounted rounds first: enough to fill every daemon's arena (as large as its budget).
const WARM_UP: usize = rounds_to_fill(SETS);
/// How many rounds' keys are in use: a key comes back once its block has left L2.
const KEY_SETS: usize = WARM_UP + 1;

/// A daemon of the study: its case's name, a client sending values in frames and one
/// writing them into the shared arena.
struct Daemon<'a> {
    name: &'a str,
    framed: KvdClient,
    shared: KvdClient,
}

/// Runs the study on `rt` (the daemons' runtime) with `cases` (a name and the L4 behind the
/// daemon, if any); prints a table per way to SET.
pub fn run(rt: &tokio::runtime::Runtime, cases: Vec<(&str, Option<L4Config>)>) {
    let dir = tempfile::tempdir().unwrap();
    let client_rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut daemons = Vec::new();
    for (i, (name, l4)) in cases.into_iter().enumerate() {
        let path = dir.path().join(format!("kvd-{i}.sock"));
        rt.block_on(async {
            let mut options = KvdOptions::new(&path, BUDGET);
            options.shared_arena_bytes = BUDGET;
            options.long = l4.map(LongBackendConfig::L4);
            let server = KvdServer::bind(options).await.unwrap();
            tokio::spawn(server.serve());
        });
        let (framed, shared) = client_rt.block_on(async {
            let framed = KvdClient::connect(&path).await.unwrap();
            let (shared, ack) = KvdClient::connect_shared(&path, "bench").await.unwrap();
            assert!(ack.shared_arena.is_some(), "the daemon offered no arena");
            (framed, shared)
        });
        daemons.push(Daemon {
            name,
            framed,
            shared,
        });
    }
    let value = Bytes::from(vec![7u8; VALUE]);
    for round in 0..WARM_UP {
        client_rt.block_on(set_round(&mut daemons, round, &value, false));
    }
    for (way, shared) in [
        ("the value in the request", false),
        ("the value written into the shared arena", true),
    ] {
        let mut rows: Vec<_> = daemons
            .iter()
            .map(|d| (d.name, Vec::new(), Vec::new()))
            .collect();
        for round in WARM_UP..WARM_UP + ROUNDS {
            let times = client_rt.block_on(set_round(&mut daemons, round, &value, shared));
            for ((_, p50s, p99s), mut times) in rows.iter_mut().zip(times) {
                let (p50, p99) = percentiles(&mut times);
                p50s.push(p50);
                p99s.push(p99);
            }
        }
        report(
            &format!(
                "SET of 64 KiB long blocks over kvd's socket, one client, {way} ({SETS} per \
                 case and round; medians of {ROUNDS} rounds after {WARM_UP} to warm up)"
            ),
            rows,
        );
    }
}

/// One round of [`SETS`] per daemon, interleaved; waits for every L4 to write what it queued.
/// Each daemon's SET times.
async fn set_round(
    daemons: &mut [Daemon<'_>],
    round: usize,
    value: &Bytes,
    shared: bool,
) -> Vec<Vec<Duration>> {
    let ns = Namespace::new("bench", "");
    let mut times = vec![Vec::with_capacity(SETS); daemons.len()];
    let mut cycles = Cycles::new(daemons.len(), round);
    for i in 0..SETS {
        for &at in cycles.next() {
            let key = format!("s{}-{i}", round % KEY_SETS);
            let d = &mut daemons[at];
            let t = Instant::now();
            let ack = if shared {
                let key = Bytes::from(key);
                d.shared.put(&ns, key, value, Retention::Long, None).await
            } else {
                let item = SetItem::new(key, value.clone()).retention(Retention::Long);
                d.framed.set(&ns, item).await
            };
            times[at].push(t.elapsed());
            assert!(ack.unwrap().accepted);
        }
    }
    for d in daemons.iter_mut() {
        drained(&mut d.framed).await;
    }
    times
}

/// Waits until the daemon's L4 has no put queued (removals of an L4 that is down stay queued).
async fn drained(client: &mut KvdClient) {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let stats = client.stats(true).await.unwrap();
        let queued = stats.extended.map_or(0, |e| e.l4.queued_bytes);
        if queued == 0 {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "L4 still has {queued} bytes queued"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A loopback proxy to `target` on `rt` that delivers every byte `delay` after it arrived, in
/// both directions (latency, not a throughput limit); returns its port.
pub fn delayed(rt: &tokio::runtime::Runtime, target: u16, delay: Duration) -> u16 {
    rt.block_on(async {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = TcpStream::connect(("127.0.0.1", target)).await else {
                    continue;
                };
                let (client_rx, client_tx) = client.into_split();
                let (server_rx, server_tx) = server.into_split();
                tokio::spawn(relay(client_rx, server_tx, delay));
                tokio::spawn(relay(server_rx, client_tx, delay));
            }
        });
        port
    })
}

async fn relay(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    delay: Duration,
) {
    let (tx, mut rx) = tokio::sync::mpsc::channel::<(Instant, Vec<u8>)>(1024);
    tokio::spawn(async move {
        let mut buf = vec![0u8; 256 << 10];
        while let Ok(n @ 1..) = from.read(&mut buf).await {
            if tx.send((Instant::now(), buf[..n].to_vec())).await.is_err() {
                return;
            }
        }
    });
    while let Some((at, chunk)) = rx.recv().await {
        tokio::time::sleep_until((at + delay).into()).await;
        if to.write_all(&chunk).await.is_err() {
            return;
        }
    }
}
