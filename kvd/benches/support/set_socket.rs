//! The L2 SET latency as a client sees it: one client SETs 64 KiB `long` blocks over kvd's
//! socket to four daemons side by side, one with no L4 and one each with an L4 that is
//! healthy, slow (behind [`delayed`], a proxy that holds every byte 50 ms each way) or down
//! (its address answers nothing), the SETs interleaved among them as in the in-process study
//! (`set_study.rs`, which isolates the SET path's own cost); a round starts once every L4 has
//! written what the last one queued. This is the latency an engine waits for. Target: p99
//! within 10 % of no L4. Each SET's frame lands in fresh memory (the L2s fill): on a VM whose
//! host backs memory only at first touch, a fault of a 2 MiB huge page stalls a SET for
//! milliseconds, and every case pays such stalls alike (`kvd/benches/README.md`).

use super::set_study::{Cycles, percentiles, report};
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
/// Rounds; each case's figure is the median over them.
const ROUNDS: usize = 5;

/// Runs the study on `rt` (the daemons' runtime) with `cases` (a name and the L4 behind the
/// daemon, if any); prints a table.
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
            let mut options = KvdOptions::new(&path, 1 << 30);
            options.long = l4.map(LongBackendConfig::L4);
            let server = KvdServer::bind(options).await.unwrap();
            tokio::spawn(server.serve());
        });
        let client = client_rt.block_on(KvdClient::connect(&path)).unwrap();
        daemons.push((name, client, Vec::new(), Vec::new()));
    }
    let ns = Namespace::new("bench", "");
    let value = Bytes::from(vec![7u8; 64 << 10]);
    for round in 0..ROUNDS {
        let mut times = vec![Vec::with_capacity(SETS); daemons.len()];
        client_rt.block_on(async {
            let mut cycles = Cycles::new(daemons.len(), round);
            for i in 0..SETS {
                for &at in cycles.next() {
                    let item = SetItem::new(format!("s{round}-{i}"), value.clone())
                        .retention(Retention::Long);
                    let t = Instant::now();
                    assert!(daemons[at].1.set(&ns, item).await.unwrap().accepted);
                    times[at].push(t.elapsed());
                }
            }
            for (_, client, _, _) in &mut daemons {
                drained(client).await;
            }
        });
        for ((_, _, p50s, p99s), mut times) in daemons.iter_mut().zip(times) {
            let (p50, p99) = percentiles(&mut times);
            p50s.push(p50);
            p99s.push(p99);
        }
    }
    let rows = daemons
        .into_iter()
        .map(|(name, _, p50s, p99s)| (name, p50s, p99s))
        .collect();
    report(
        &format!(
            "SET of 64 KiB long blocks over kvd's socket, one client ({SETS} per case and round; \
             medians of {ROUNDS} rounds)"
        ),
        rows,
    );
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
