//! Crash safety of the L3 tier with a real daemon process (`infera-kvd-testd`) killed with
//! SIGKILL at seeded random points of a write-heavy, pipelined run, then restarted — once as
//! is, once after its journal lost a torn tail and its containers took random bit flips — and
//! finally stopped gracefully. With `--durable-long-writes`, a daemon killed right after its
//! last acknowledgement (many writers at once, so their journal syncs are shared) must return
//! every acknowledged write after the restart.
//!
//! All writes are `long` (written through to L3 in request order, from one connection), so the
//! journal is a prefix of the request history. After each crash every key must return either
//! nothing or *exactly* the value of its last write within one common prefix of that history:
//! never an older value, never another key's bytes, never a torn block. After the graceful
//! stop every key must return its last acknowledged value.

#![allow(clippy::unwrap_used)]

use bytes::Bytes;
use infera_core::event::Retention;
use infera_kvd::proto::{Request, Response};
use infera_kvd::{KvdClient, Namespace, SetItem};
use std::collections::HashMap;
use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

const KEYS: u64 = 64;
const LENS: [usize; 4] = [1000, 16 << 10, 100 << 10, 300 << 10];

/// xorshift64*: the test's only randomness, seeded per round.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// One write: key `key` gets the value of sequence number `seq`.
#[derive(Debug, Clone, Copy)]
struct Write {
    key: u64,
    seq: u64,
    len: usize,
}

fn value(w: &Write) -> Bytes {
    let mut rng = Rng(w.seq.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ (w.key + 1));
    let mut v: Vec<u8> = (0..w.len).map(|_| rng.next() as u8).collect();
    v[..8].copy_from_slice(&w.seq.to_le_bytes());
    v[8] = w.key as u8;
    Bytes::from(v)
}

fn ns() -> Namespace {
    Namespace::new("crash", "")
}

fn key(k: u64) -> Bytes {
    Bytes::copy_from_slice(&k.to_be_bytes())
}

struct Daemon {
    child: Child,
    socket: PathBuf,
}

/// A daemon left running by a failed assertion is killed, so it never outlives the test.
impl Drop for Daemon {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

impl Daemon {
    fn start(dir: &Path, io_mode: &str, uring: bool) -> Self {
        Self::start_with(dir, io_mode, uring, false)
    }

    fn start_with(dir: &Path, io_mode: &str, uring: bool, durable: bool) -> Self {
        let socket = dir.join("kvd.sock");
        let mut child = Command::new(env!("CARGO_BIN_EXE_infera-kvd-testd"))
            .arg(&socket)
            .arg(dir.join("l3"))
            .arg((64u64 << 20).to_string())
            .arg((4u64 << 20).to_string())
            .arg(io_mode)
            .arg(if uring { "1" } else { "0" })
            .arg("40")
            .arg(if durable { "1" } else { "0" })
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        std::io::BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        assert_eq!(line.trim(), "ready", "the test daemon did not start");
        Self { child, socket }
    }

    fn kill9(mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }

    fn terminate(mut self) {
        let pid = self.child.id().to_string();
        assert!(
            Command::new("kill")
                .args(["-TERM", &pid])
                .status()
                .unwrap()
                .success()
        );
        assert!(self.child.wait().unwrap().success());
    }
}

/// Sends `writes` pipelined; reads the acks of the first `acked` of them.
async fn send(c: &mut KvdClient, writes: &[Write], acked: usize) {
    for (i, w) in writes.iter().enumerate() {
        let item = SetItem::new(key(w.key), value(w)).retention(Retention::Long);
        let request = Request::Set { ns: ns(), item };
        c.send(&request, Some(&rmpv::Value::from(i as u64)))
            .await
            .unwrap();
    }
    for _ in 0..acked {
        match c.recv().await.unwrap().response {
            Response::SetAck(ack) => assert!(ack.accepted, "{ack:?}"),
            other => panic!("unexpected {other:?}"),
        }
    }
}

/// What the daemon holds now: key → sequence number of its value (`None`: a miss).
async fn read_back(socket: &Path, history: &[Write]) -> HashMap<u64, Option<u64>> {
    let mut c = KvdClient::connect(socket).await.unwrap();
    let mut out = HashMap::new();
    for k in 0..KEYS + 8 {
        let got = c.get(&ns(), &key(k)).await.unwrap();
        let seq = got.map(|hit| {
            assert!(
                hit.value.len() >= 9,
                "key {k}: a {}-byte value",
                hit.value.len()
            );
            let seq = u64::from_le_bytes(hit.value[..8].try_into().unwrap());
            let w = history
                .iter()
                .find(|w| w.seq == seq)
                .unwrap_or_else(|| panic!("key {k}: a value never written (seq {seq})"));
            assert_eq!(w.key, k, "key {k} returned key {}'s bytes", w.key);
            assert!(
                hit.value == value(w),
                "key {k}: torn or corrupt bytes of seq {seq}"
            );
            seq
        });
        assert!(k < KEYS || seq.is_none(), "key {k} was never written");
        out.insert(k, seq);
    }
    out
}

/// Checks that `state` is the history `base` + `writes[..p]` for one common `p`, up to misses.
fn check_prefix(
    state: &HashMap<u64, Option<u64>>,
    base: &HashMap<u64, Option<u64>>,
    writes: &[Write],
) {
    let (mut lo, mut hi) = (0usize, writes.len());
    for (k, seq) in state {
        let Some(seq) = seq else { continue };
        let mine: Vec<usize> = (0..writes.len()).filter(|i| writes[*i].key == *k).collect();
        match mine.iter().position(|i| writes[*i].seq == *seq) {
            // The value of write `i`: the prefix holds `i` and not the key's next write.
            Some(at) => {
                lo = lo.max(mine[at] + 1);
                if let Some(next) = mine.get(at + 1) {
                    hi = hi.min(*next);
                }
            }
            // The value from before these writes: no write of the key is in the prefix.
            None => {
                assert_eq!(
                    base.get(k).copied().flatten(),
                    Some(*seq),
                    "key {k}: an older value came back"
                );
                if let Some(first) = mine.first() {
                    hi = hi.min(*first);
                }
            }
        }
    }
    assert!(
        lo <= hi,
        "no single prefix explains the recovered state ({lo} > {hi})"
    );
}

fn damage(dir: &Path, rng: &mut Rng) {
    let l3 = dir.join("l3");
    let mut journals: Vec<PathBuf> = std::fs::read_dir(&l3)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.to_string_lossy().contains("journal-"))
        .collect();
    journals.sort();
    if let Some(last) = journals.last() {
        let len = std::fs::metadata(last).unwrap().len();
        let cut = (1 + rng.below(200)).min(len);
        let f = std::fs::OpenOptions::new().write(true).open(last).unwrap();
        f.set_len(len - cut).unwrap();
    }
    for _ in 0..24 {
        let c = l3.join(format!("container-{:04}.dat", rng.below(4)));
        let mut bytes = std::fs::read(&c).unwrap();
        let at = rng.below(bytes.len() as u64 - 64) as usize;
        for b in &mut bytes[at..at + 64] {
            *b ^= 0xa5;
        }
        std::fs::write(&c, bytes).unwrap();
    }
}

fn writes(rng: &mut Rng, from: u64, n: usize) -> Vec<Write> {
    (0..n as u64)
        .map(|i| Write {
            key: rng.below(KEYS),
            seq: from + i,
            len: LENS[rng.below(LENS.len() as u64) as usize],
        })
        .collect()
}

async fn round(seed: u64, io_mode: &str, uring: bool) -> usize {
    let dir = tempfile::tempdir().unwrap();
    let mut rng = Rng(seed);
    let mut history: Vec<Write> = Vec::new();
    let empty: HashMap<u64, Option<u64>> = (0..KEYS + 8).map(|k| (k, None)).collect();

    // A: pipelined writes, SIGKILL mid-stream.
    let daemon = Daemon::start(dir.path(), io_mode, uring);
    let a = writes(&mut rng, 1, 300);
    history.extend(&a);
    let mut c = KvdClient::connect(&daemon.socket).await.unwrap();
    let acked = 50 + rng.below(200) as usize;
    send(&mut c, &a, acked).await;
    daemon.kill9();
    let daemon = Daemon::start(dir.path(), io_mode, uring);
    let after_a = read_back(&daemon.socket, &history).await;
    check_prefix(&after_a, &empty, &a);

    // B: more writes, SIGKILL, then a torn journal tail and flipped container bits.
    let b = writes(&mut rng, 1000, 200);
    history.extend(&b);
    let mut c = KvdClient::connect(&daemon.socket).await.unwrap();
    send(&mut c, &b, rng.below(200) as usize).await;
    daemon.kill9();
    damage(dir.path(), &mut rng);
    let daemon = Daemon::start(dir.path(), io_mode, uring);
    let after_b = read_back(&daemon.socket, &history).await;
    check_prefix(&after_b, &after_a, &b);

    // C: acknowledged writes, then a graceful stop: every last write survives exactly.
    let cw = writes(&mut rng, 2000, 100);
    history.extend(&cw);
    let mut c = KvdClient::connect(&daemon.socket).await.unwrap();
    send(&mut c, &cw, cw.len()).await;
    daemon.terminate();
    let daemon = Daemon::start(dir.path(), io_mode, uring);
    let after_c = read_back(&daemon.socket, &history).await;
    let mut expected = after_b.clone();
    for w in &cw {
        expected.insert(w.key, Some(w.seq));
    }
    assert_eq!(
        after_c, expected,
        "a graceful stop lost acknowledged writes"
    );
    daemon.terminate();
    after_a.values().filter(|s| s.is_some()).count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_daemons_recover_exactly_the_last_committed_values() {
    let mut survived = 0;
    for (seed, mode, uring) in [
        (0x5eed_0001, "buffered", true),
        (0x5eed_0002, "direct", true),
        (0x5eed_0003, "buffered", false),
    ] {
        survived += round(seed, mode, uring).await;
    }
    assert!(
        survived > 0,
        "no key survived any crash: recovery is not exercised"
    );
}

/// Durable mode: 8 connections each write their own keys (pipelined, 4 in flight), every write
/// is acknowledged, then SIGKILL at once: after the restart each key holds exactly its last
/// acknowledged value. Group commit: fewer journal syncs than writes.
async fn durable_round(seed: u64, io_mode: &str) {
    const WRITERS: u64 = 8;
    const PER_WRITER: u64 = 60;
    let dir = tempfile::tempdir().unwrap();
    let daemon = Daemon::start_with(dir.path(), io_mode, true, true);
    let mut rng = Rng(seed);
    let mut plans = Vec::new();
    for w in 0..WRITERS {
        // Writer `w` owns keys w, w + 8, ... < KEYS; 60 writes over its 8 keys.
        let plan: Vec<Write> = (0..PER_WRITER)
            .map(|i| Write {
                key: w + WRITERS * rng.below(KEYS / WRITERS),
                seq: 1 + w * PER_WRITER + i,
                len: LENS[rng.below(2) as usize],
            })
            .collect();
        plans.push(plan);
    }
    let history: Vec<Write> = plans.iter().flatten().copied().collect();
    let socket = daemon.socket.clone();
    let writers = plans.into_iter().map(|plan| {
        let socket = socket.clone();
        tokio::spawn(async move {
            let mut c = KvdClient::connect(&socket).await.unwrap();
            for chunk in plan.chunks(4) {
                send(&mut c, chunk, chunk.len()).await;
            }
        })
    });
    for w in futures::future::join_all(writers).await {
        w.unwrap();
    }
    let mut c = KvdClient::connect(&socket).await.unwrap();
    let syncs = c
        .stats(true)
        .await
        .unwrap()
        .extended
        .unwrap()
        .l3_journal_syncs_total;
    daemon.kill9();
    assert!(
        syncs < WRITERS * PER_WRITER,
        "{syncs} journal syncs for {} durable writes: no group commit",
        WRITERS * PER_WRITER
    );
    let daemon = Daemon::start(dir.path(), io_mode, true);
    let state = read_back(&daemon.socket, &history).await;
    let mut expected: HashMap<u64, Option<u64>> = (0..KEYS + 8).map(|k| (k, None)).collect();
    for w in &history {
        expected.insert(w.key, Some(w.seq));
    }
    assert_eq!(
        state, expected,
        "an acknowledged durable write was lost by kill -9 ({io_mode})"
    );
    daemon.terminate();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn durable_writes_survive_kill_9_once_acknowledged() {
    durable_round(0xd00d_0001, "buffered").await;
    durable_round(0xd00d_0002, "direct").await;
}
