//! `infera kvd` killed with SIGKILL under write load, then started again on the same L3 region.
//!
//! Eight writers each own 32 keys and write `long` 16 KiB values in rounds; a value names its
//! key and its round, so any read tells exactly which write it came from. The daemon is killed
//! when a third of the writes have ended and restarted at once; a write in flight then fails
//! (a clear client error), and its writer reconnects (retrying while the daemon recovers) and
//! goes on. At the end every key is read back through a fresh connection: the last
//! acknowledged value is right; an older round whose later acknowledged writes all came before
//! the kill is the documented loss (a crash may lose the last journal flush interval); anything
//! else (another key's bytes, a round never written, an acknowledged post-restart write lost) is
//! wrong.

use crate::load::{DEADLINE, Tally};
use bytes::Bytes;
use infera_core::event::Retention;
use infera_kvd::{KvdClient, Namespace, SetItem};
use std::io::BufRead as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

const WRITERS: u64 = 8;
const KEYS_PER_WRITER: u64 = 32;
const ROUNDS: u64 = 12;
const LEN: usize = 16 << 10;

/// The kvd row: the tally of writes and reads, and the writes lost within the guarantee.
pub struct KvdOutcome {
    pub tally: Tally,
    pub lost_within_guarantee: usize,
}

struct Daemon(Child);

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn start(socket: &Path, region: &Path) -> Daemon {
    let mut child = Command::new(env!("CARGO_BIN_EXE_infera"))
        .args(["kvd", "--socket"])
        .arg(socket)
        .args([
            "--max-bytes",
            "64MiB",
            "--long-bytes",
            "256MiB",
            "--long-path",
        ])
        .arg(region)
        .env_remove("RUST_LOG")
        .stderr(Stdio::piped())
        .spawn()
        .expect("kvd starts");
    let mut log = std::io::BufReader::new(child.stderr.take().expect("stderr"));
    let mut line = String::new();
    loop {
        line.clear();
        let read = log.read_line(&mut line).expect("kvd's log");
        assert!(read > 0, "kvd exited before listening");
        if line.contains("kvd listening") {
            break;
        }
    }
    // Keep draining the log so the daemon never blocks on a full pipe.
    std::thread::spawn(move || std::io::copy(&mut log, &mut std::io::sink()));
    Daemon(child)
}

/// Connects, retrying while the daemon restarts (as an engine's client would), within
/// [`DEADLINE`].
async fn reconnect(socket: &Path) -> Result<KvdClient, infera_kvd::ClientError> {
    let started = std::time::Instant::now();
    loop {
        match KvdClient::connect(socket).await {
            Ok(client) => return Ok(client),
            Err(e) if started.elapsed() > DEADLINE => return Err(e),
            Err(_) => tokio::time::sleep(std::time::Duration::from_millis(20)).await,
        }
    }
}

fn value(key: u64, round: u64) -> Bytes {
    let mut v = vec![(key as u8) ^ (round as u8); LEN];
    v[..8].copy_from_slice(&key.to_le_bytes());
    v[8..16].copy_from_slice(&round.to_le_bytes());
    Bytes::from(v)
}

fn ns() -> Namespace {
    Namespace::new("chaos", "")
}

/// What a writer knows of one key: its last acknowledged round and whether that ack came
/// after the kill.
#[derive(Clone, Copy, Default)]
struct Acked {
    round: Option<u64>,
    after_kill: bool,
}

pub async fn run() -> KvdOutcome {
    let dir = tempfile::tempdir().expect("tempdir");
    let socket: PathBuf = dir.path().join("kvd.sock");
    let region = dir.path().join("l3");
    std::fs::create_dir(&region).expect("region dir");
    let daemon = Arc::new(std::sync::Mutex::new(Some(start(&socket, &region))));
    let killed = Arc::new(AtomicBool::new(false));
    let ended = Arc::new(AtomicUsize::new(0));
    let total = (WRITERS * KEYS_PER_WRITER * ROUNDS) as usize;

    // The fault: kill -9 at a third of the writes, then start again on the same region.
    let fault = {
        let (daemon, killed, ended, socket, region) = (
            daemon.clone(),
            killed.clone(),
            ended.clone(),
            socket.clone(),
            region.clone(),
        );
        std::thread::spawn(move || {
            while ended.load(Ordering::Relaxed) < total / 3 {
                std::thread::yield_now();
            }
            let mut slot = daemon.lock().expect("daemon lock");
            drop(slot.take());
            killed.store(true, Ordering::SeqCst);
            *slot = Some(start(&socket, &region));
        })
    };

    let writers: Vec<_> = (0..WRITERS)
        .map(|w| {
            let (socket, killed, ended) = (socket.clone(), killed.clone(), ended.clone());
            tokio::spawn(async move {
                let mut tally = Tally::default();
                let mut acked = vec![Acked::default(); KEYS_PER_WRITER as usize];
                let mut client: Option<KvdClient> = None;
                for round in 0..ROUNDS {
                    for k in 0..KEYS_PER_WRITER {
                        let key = w * KEYS_PER_WRITER + k;
                        let after_kill = killed.load(Ordering::SeqCst);
                        let write = async {
                            if client.is_none() {
                                client = Some(reconnect(&socket).await?);
                            }
                            let c = client.as_mut().expect("connected");
                            let item = SetItem {
                                key: Bytes::copy_from_slice(&key.to_be_bytes()),
                                value: value(key, round),
                                retention: Retention::Long,
                                metadata: None,
                                ttl_seconds: None,
                            };
                            c.set(&ns(), item).await
                        };
                        match tokio::time::timeout(DEADLINE, write).await {
                            Ok(Ok(ack)) if ack.accepted => {
                                tally.answered += 1;
                                acked[k as usize] = Acked {
                                    round: Some(round),
                                    after_kill,
                                };
                            }
                            // A refusal names its reason; a broken connection is an error the
                            // client sees at once. Both are clear failures.
                            Ok(Ok(_)) | Ok(Err(_)) => {
                                tally.failed += 1;
                                client = None;
                            }
                            Err(_) => {
                                tally.hung += 1;
                                client = None;
                            }
                        }
                        tally.sent += 1;
                        ended.fetch_add(1, Ordering::Relaxed);
                    }
                }
                (tally, acked)
            })
        })
        .collect();
    let mut tally = Tally::default();
    let mut acked = Vec::new();
    for writer in writers {
        let (t, a) = writer.await.expect("a writer panicked");
        tally.sent += t.sent;
        tally.answered += t.answered;
        tally.failed += t.failed;
        tally.hung += t.hung;
        acked.extend(a);
    }
    fault.join().expect("the fault thread");

    // Read every key back.
    let mut lost_within_guarantee = 0;
    let mut reader = KvdClient::connect(&socket).await.expect("reader connects");
    for (key, acked) in acked.iter().enumerate() {
        let key = key as u64;
        let got = reader
            .get(&ns(), &key.to_be_bytes())
            .await
            .expect("the read");
        let round = got.as_ref().and_then(|hit| {
            let v = &hit.value;
            let named_key = u64::from_le_bytes(v.get(..8)?.try_into().ok()?);
            let round = u64::from_le_bytes(v.get(8..16)?.try_into().ok()?);
            (named_key == key && v.len() == LEN && *v == value(key, round)).then_some(round)
        });
        let right = match (acked.round, round) {
            (_, None) if got.is_some() => false,
            (Some(want), Some(r)) if r >= want => true,
            (None, _) => true,
            // Older than the last acknowledged write, or gone: within the guarantee only when
            // that write was acknowledged before the kill.
            (Some(_), _) if !acked.after_kill => {
                lost_within_guarantee += 1;
                true
            }
            _ => false,
        };
        if !right {
            tally.wrong += 1;
            if tally.examples.len() < 3 {
                tally.examples.push(format!(
                    "key {key}: acknowledged round {:?}, read {round:?}",
                    acked.round
                ));
            }
        }
    }
    drop(daemon.lock().expect("daemon lock").take());
    KvdOutcome {
        tally,
        lost_within_guarantee,
    }
}
