//! A Mooncake Store cluster as an L4 [`RemoteStore`], through a sidecar.
//!
//! The store's only public client is its Python binding (`mooncake.store`, in the PyPI package
//! `mooncake-transfer-engine-non-cuda` or Mooncake's CUDA/ROCm builds); its C API needs a
//! library that no package ships. kvd therefore runs the binding in a child process, the
//! sidecar (`sidecar.py`, built into the binary and started as `<python> -c`), and keeps the
//! daemon free of its threads, allocator and GIL:
//! - **Values never cross a pipe.** kvd maps a memfd (the staging area: two L4 batches, and
//!   at least two largest values), which the sidecar maps through `/proc/<kvd>/fd` and registers with
//!   the store. A put writes the batch's frames there (each checksummed as it is
//!   copied; a large chunk by two threads, as are the copies out) and the sidecar calls
//!   `batch_upsert_from` on them. A get first asks the values' sizes (the store's replica
//!   descriptors), places them in the area and has the store write them there
//!   (`batch_get_into`), chunk by chunk, alternating between its two halves so that the
//!   sidecar reads one chunk while kvd copies the last one out.
//! - **Commands** go over the sidecar's stdin and stdout (framing in `sidecar.py`) under one
//!   lock: the staging area belongs to the commands in flight.
//! - **Failure is a restart.** A call that fails to exchange its frames, or whose future is
//!   dropped mid-call (the L4's deadline), leaves the sidecar in an unknown state: it is
//!   killed, and the next call starts a new one, whose setup fails while the cluster is down.
//!   That is how the L4's breaker probes reconnect. The store's own per-key errors are
//!   answers, not failures of the sidecar: a put the store refused for want of room or a
//!   busy key (`REFUSALS`) is a refused value, any other code an error of the batch.
//! - Store names are the L4's ([`super::name`]) with `cluster_id` as the prefix; `remove`
//!   forces past leases and treats "not found" as done, as the Python kvd's `clear` does.

mod config;

pub use config::{ALLOW_TCP_FALLBACK, MooncakeConfig};

use super::frame::{self, Framed};
use super::remote::{RemoteError, RemoteStore};
use crate::sys::shm::SharedMap;
use bytes::Bytes;
use std::os::fd::AsRawFd;
use std::process::Stdio;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::process::{Child, ChildStdin, ChildStdout, Command};
use tokio::sync::Mutex;

/// The sidecar's source, run with `python -c`.
const SIDECAR: &str = include_str!("sidecar.py");
/// The smallest staging area: two L4 batches of the default size (a memfd's pages are taken
/// only as they are written).
const MIN_STAGING: usize = 64 << 20;
/// The bytes of one pipelined put or get command at most (see [`plan`]): a whole L4 batch of
/// the default size. Each command is a call of the store's client, whose wait spins a CPU (in
/// `wait_for_completion`), so a put staged while the sidecar's last one is in flight gains
/// little on two cores; one call per batch reads faster than 16 MiB commands and writes as fast
/// (measured in `kvd/benches/README.md`, "Command size").
const CHUNK: u64 = 32 << 20;
// A chunk fits in half of the smallest staging area (see [`plan`]).
const _: () = assert!(CHUNK <= MIN_STAGING as u64 / 2);
/// The values of one command at most (a reply of 16 bytes each stays well within a pipe's
/// buffer, so a command sent ahead never waits on an unread reply).
const CHUNK_ITEMS: usize = 1024;
/// The longest reply the sidecar sends (a result pair per name, or an error message).
const MAX_REPLY: usize = 16 << 20;

/// The sidecar's commands (see `sidecar.py`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
enum Op {
    Health = 1,
    Put = 2,
    Get = 3,
    Exists = 4,
    Remove = 5,
    Sizes = 6,
}

/// The sidecar's result for a value the store does not hold.
const MISSING: i64 = -1;
/// The store's answers to a put that it did not keep, though it is up (its `ErrorCode`s):
/// no space (`NO_AVAILABLE_HANDLE`; the master starts evicting), the name exists or is busy
/// (`OBJECT_ALREADY_EXISTS`, `OBJECT_HAS_LEASE`, `OBJECT_HAS_REPLICATION_TASK`,
/// `OBJECT_REPLICA_BUSY`), the tenant's quota reached (`TENANT_QUOTA_EXCEEDED`). Any other
/// error is a failure of the store.
const REFUSALS: [i64; 6] = [-200, -705, -706, -708, -714, -1700];

/// See the module docs.
#[derive(Debug)]
pub struct MooncakeStore {
    config: MooncakeConfig,
    staging_bytes: usize,
    state: Mutex<State>,
}

/// The staging area (made by the first call, kept across sidecar restarts) and the sidecar.
#[derive(Debug, Default)]
struct State {
    staging: Option<SharedMap>,
    sidecar: Option<Sidecar>,
}

#[derive(Debug)]
struct Sidecar {
    _child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl MooncakeStore {
    /// A client of the cluster `config` names, for values of at most `max_value` bytes. The
    /// staging area (two halves, each holding the largest value) and the sidecar are made by
    /// the first call.
    pub fn new(config: MooncakeConfig, max_value: usize) -> Self {
        Self {
            config,
            staging_bytes: max_value.saturating_mul(2).max(MIN_STAGING),
            state: Mutex::new(State::default()),
        }
    }

    async fn start(&self, staging: &SharedMap) -> Result<Sidecar, RemoteError> {
        let c = &self.config;
        let setup = serde_json::json!({
            "master_address": c.master_address,
            "metadata_server": c.metadata_server,
            "protocol": c.protocol,
            "device_name": c.device_name,
            "local_hostname": c.local_hostname,
            "global_segment_size": c.global_segment_size,
            "local_buffer_size": c.local_buffer_size,
            "shm_path": format!("/proc/{}/fd/{}", std::process::id(), staging.fd().as_raw_fd()),
            "shm_bytes": staging.len(),
        });
        let mut child = Command::new(&c.python)
            .arg("-c")
            .arg(SIDECAR)
            .arg(setup.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| {
                RemoteError::Protocol(format!(
                    "cannot start the Mooncake sidecar with {:?} (the python key): {e}",
                    c.python
                ))
            })?;
        if let Some(stderr) = child.stderr.take() {
            tokio::spawn(async move {
                let mut lines = BufReader::new(stderr).lines();
                while let Ok(Some(line)) = lines.next_line().await {
                    if line.starts_with('E') || line.starts_with("Traceback") {
                        tracing::warn!(target: "infera_kvd::l4::mooncake", "{line}");
                    } else {
                        tracing::debug!(target: "infera_kvd::l4::mooncake", "{line}");
                    }
                }
            });
        }
        let (Some(stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
            return Err(RemoteError::Protocol("the sidecar has no pipes".into()));
        };
        let mut sidecar = Sidecar {
            _child: child,
            stdin,
            stdout: BufReader::new(stdout),
        };
        // The first reply says whether the store client was set up.
        sidecar.read_reply(0).await.map_err(|e| match e {
            RemoteError::Io(io) if io.kind() == std::io::ErrorKind::UnexpectedEof => {
                RemoteError::Protocol(format!(
                    "the Mooncake sidecar exited during setup (is the mooncake package \
                     installed for {:?}? its errors are in kvd's log)",
                    c.python
                ))
            }
            other => other,
        })?;
        tracing::info!(master = %c.master_address, "kvd L4: Mooncake sidecar connected");
        Ok(sidecar)
    }

    /// Runs the commands `chunks` of `op`, pipelined: chunk k+1 is staged (`stage`) and sent
    /// before chunk k's reply is read and handed to `collect`, so the caller must place
    /// consecutive chunks in disjoint parts of the staging area ([`plan`] alternates halves).
    /// Everything runs under the lock, while nothing else uses the area.
    async fn run(
        &self,
        op: Op,
        chunks: &[Vec<(&str, u64, u64)>],
        mut stage: impl FnMut(&SharedMap, usize),
        mut collect: impl FnMut(&SharedMap, usize, Vec<(i64, u64)>),
    ) -> Result<(), RemoteError> {
        let mut state = self.state.lock().await;
        let State {
            staging,
            sidecar: slot,
        } = &mut *state;
        let staging = match staging {
            Some(s) => s,
            None => staging.insert(SharedMap::create(
                "infera-kvd-l4-mooncake",
                self.staging_bytes,
            )?),
        };
        // Taken out for the calls: if one fails or the future is dropped, the sidecar is
        // dropped with it (and killed), and the next call starts a fresh one.
        let mut sidecar = match slot.take() {
            Some(s) => s,
            None => self.start(staging).await?,
        };
        if let Some(first) = chunks.first() {
            stage(staging, 0);
            sidecar.send(op, first).await?;
        }
        for (k, chunk) in chunks.iter().enumerate() {
            if let Some(ahead) = chunks.get(k + 1) {
                stage(staging, k + 1);
                sidecar.send(op, ahead).await?;
            }
            let count = if op == Op::Health { 1 } else { chunk.len() };
            let results = sidecar.read_reply(count).await?;
            collect(staging, k, results);
        }
        *slot = Some(sidecar);
        Ok(())
    }

    /// One command that uses no staging area; its results.
    async fn call(
        &self,
        op: Op,
        items: Vec<(&str, u64, u64)>,
    ) -> Result<Vec<(i64, u64)>, RemoteError> {
        let mut out = Vec::new();
        self.run(op, &[items], |_, _| {}, |_, _, results| out = results)
            .await?;
        Ok(out)
    }
}

impl Sidecar {
    async fn send(&mut self, op: Op, items: &[(&str, u64, u64)]) -> Result<(), RemoteError> {
        let mut body =
            Vec::with_capacity(5 + items.iter().map(|(n, ..)| n.len() + 18).sum::<usize>());
        body.push(op as u8);
        body.extend_from_slice(&u32::try_from(items.len()).unwrap_or(u32::MAX).to_le_bytes());
        for (name, offset, len) in items {
            let n = u16::try_from(name.len()).map_err(|_| {
                RemoteError::Protocol(format!("a store name of {} bytes", name.len()))
            })?;
            body.extend_from_slice(&n.to_le_bytes());
            body.extend_from_slice(name.as_bytes());
            body.extend_from_slice(&offset.to_le_bytes());
            body.extend_from_slice(&len.to_le_bytes());
        }
        let len = u32::try_from(body.len())
            .map_err(|_| RemoteError::Protocol("a command over 4 GiB".into()))?;
        self.stdin.write_all(&len.to_le_bytes()).await?;
        self.stdin.write_all(&body).await?;
        self.stdin.flush().await?;
        Ok(())
    }

    async fn read_reply(&mut self, count: usize) -> Result<Vec<(i64, u64)>, RemoteError> {
        let len = self.stdout.read_u32_le().await? as usize;
        if len == 0 || len > MAX_REPLY {
            return Err(RemoteError::Protocol(format!(
                "a sidecar reply of {len} bytes"
            )));
        }
        let mut body = vec![0u8; len];
        self.stdout.read_exact(&mut body).await?;
        match body[0] {
            0 if len == 1 + 16 * count => Ok(body[1..]
                .chunks_exact(16)
                .map(|pair| {
                    let (r, o) = pair.split_at(8);
                    (
                        i64::from_le_bytes(r.try_into().unwrap_or_default()),
                        u64::from_le_bytes(o.try_into().unwrap_or_default()),
                    )
                })
                .collect()),
            0 => Err(RemoteError::Protocol(format!(
                "the sidecar answered {} results for {count} names",
                (len - 1) / 16
            ))),
            _ => Err(RemoteError::Protocol(format!(
                "mooncake: {}",
                String::from_utf8_lossy(&body[1..])
            ))),
        }
    }
}

/// One command's values: `(index, offset in the staging area, length)`.
type Chunk = Vec<(usize, u64, u64)>;

/// Where the values of `lens` (`(index, length)`, in order) go in a staging area of two halves
/// of `half` bytes: chunks of `(index, offset, length)` of at most [`CHUNK`] bytes (or one
/// larger value) and [`CHUNK_ITEMS`] values, consecutive chunks in alternate halves, so one
/// can be staged or copied out while the sidecar works on the other. A value larger than
/// `half` is left out (and named in the second list).
fn plan(lens: impl IntoIterator<Item = (usize, u64)>, half: u64) -> (Vec<Chunk>, Vec<usize>) {
    let (mut chunks, mut too_large) = (Vec::new(), Vec::new());
    let mut chunk: Chunk = Vec::new();
    let mut used = 0u64;
    for (i, len) in lens {
        if len > half {
            too_large.push(i);
            continue;
        }
        if !chunk.is_empty() && (used + len > CHUNK || chunk.len() == CHUNK_ITEMS) {
            chunks.push(std::mem::take(&mut chunk));
            used = 0;
        }
        let start = half * (chunks.len() as u64 % 2);
        chunk.push((i, start + used, len));
        used += len;
    }
    if !chunk.is_empty() {
        chunks.push(chunk);
    }
    (chunks, too_large)
}

/// A chunk of at least this many bytes is copied in or out of the staging area by two threads
/// (see [`in_two`]).
const SPLIT_BYTES: u64 = 2 << 20;

/// Runs `work` over a chunk's values (`(index, offset, length)`, and whatever else `I`
/// carries): when they hold [`SPLIT_BYTES`] or more, split in two at half their bytes, the
/// second part on a scoped thread meanwhile. Returns the outputs in order. The copies into and
/// out of the staging area are what the store's side waits for (staging 15 frames of 1 MiB
/// took 2.5 ms, against 6 ms for the store's put of them), and that side is idle while they
/// run: two threads took 1 MiB puts from 81–84 % to 94–95 % of the binding's (same runs, the
/// two ways' rounds in alternating order).
fn in_two<I: Sync, T: Send>(
    items: &[I],
    len: impl Fn(&I) -> u64,
    work: impl Fn(&[I]) -> T + Sync,
) -> Vec<T> {
    let bytes: u64 = items.iter().map(&len).sum();
    if bytes < SPLIT_BYTES || items.len() < 2 {
        return vec![work(items)];
    }
    let mut before = 0;
    let split = items
        .iter()
        .position(|item| {
            before += len(item);
            before * 2 >= bytes
        })
        .map_or(items.len(), |p| (p + 1).min(items.len() - 1));
    let (mine, theirs) = items.split_at(split);
    std::thread::scope(|scope| {
        let helper = std::thread::Builder::new()
            .name("kvd-l4-copy".into())
            .spawn_scoped(scope, || work(theirs));
        let first = work(mine);
        // No thread to be had: the second part runs here after all. A panic in the helper
        // is the scope's.
        let second = match helper {
            Ok(helper) => helper
                .join()
                .unwrap_or_else(|p| std::panic::resume_unwind(p)),
            Err(_) => work(theirs),
        };
        vec![first, second]
    })
}

/// Copies a put chunk's frames into the staging area ([`in_two`]), sealing those to seal as
/// they go ([`frame::copy_to`]).
fn stage(shm: &SharedMap, chunk: &[(usize, u64, u64)], values: &[(String, Framed)]) {
    in_two(
        chunk,
        |&(_, _, len)| len,
        |part| {
            for &(i, at, _) in part {
                let (framed, at) = (&values[i].1, at as usize);
                frame::copy_to(framed, |off, bytes| shm.write(at + off, bytes));
            }
        },
    );
}

/// Copies a get chunk's values out of the staging area ([`in_two`]), given the sidecar's
/// `(result, offset)` of each: `(index, value)`, `None` for a value the store did not write
/// where and as long as asked (missing, or failed: a miss).
fn copy_out(
    shm: &SharedMap,
    chunk: &[(usize, u64, u64)],
    results: Vec<(i64, u64)>,
) -> Vec<(usize, Option<Bytes>)> {
    let got: Vec<_> = chunk.iter().zip(results).collect();
    let parts = in_two(
        &got,
        |&(&(_, _, len), _)| len,
        |part| {
            part.iter()
                .map(|&(&(i, offset, len), (result, at))| {
                    let value = match result {
                        n if u64::try_from(n) == Ok(len) && at == offset => {
                            Some(Bytes::copy_from_slice(shm.slice(at as usize, len as usize)))
                        }
                        MISSING => None,
                        code => {
                            tracing::debug!(code, "kvd L4: a Mooncake get failed; a miss");
                            None
                        }
                    };
                    (i, value)
                })
                .collect::<Vec<_>>()
        },
    );
    parts.into_iter().flatten().collect()
}

/// Each value's index and frame length, as [`plan`] takes them.
fn frame_lens(values: &[(String, Framed)]) -> impl Iterator<Item = (usize, u64)> + '_ {
    values
        .iter()
        .enumerate()
        .map(|(i, (_, f))| (i, f.len() as u64))
}

/// A plan's chunks as the sidecar's commands, each value named by `name`.
fn commands_of<'a>(
    chunks: &[Chunk],
    name: impl Fn(usize) -> &'a str,
) -> Vec<Vec<(&'a str, u64, u64)>> {
    chunks
        .iter()
        .map(|c| c.iter().map(|&(i, at, len)| (name(i), at, len)).collect())
        .collect()
}

/// Fails on the first result below zero (a store error code).
fn all_ok(op: &str, results: &[(i64, u64)]) -> Result<(), RemoteError> {
    match results.iter().find(|(r, _)| *r < 0) {
        Some((code, _)) => Err(RemoteError::Protocol(format!(
            "mooncake {op}: error {code}"
        ))),
        None => Ok(()),
    }
}

#[async_trait::async_trait]
impl RemoteStore for MooncakeStore {
    fn describe(&self) -> String {
        format!("mooncake://{}", self.config.master_address)
    }

    fn backend(&self) -> &'static str {
        "mooncake"
    }

    /// One sidecar and one staging area serve one call at a time; a whole batch in one call
    /// also lets the store move its values in parallel.
    fn streams(&self) -> usize {
        1
    }

    async fn health(&self) -> Result<(), RemoteError> {
        let results = self.call(Op::Health, Vec::new()).await?;
        all_ok("health_check", &results)
    }

    /// Frames to seal are sealed as they are staged ([`frame::copy_to`]).
    fn seals(&self) -> bool {
        true
    }

    /// Stages the frames chunk by chunk ([`plan`]), each checksummed as it is copied, while
    /// the sidecar writes the previous chunk to the store (`batch_upsert_from`). A value the
    /// store answers with one of its [`REFUSALS`] is refused; another error fails the batch.
    async fn put_batch(&self, values: &[(String, Framed)]) -> Result<Vec<usize>, RemoteError> {
        let half = (self.staging_bytes / 2) as u64;
        let (chunks, too_large) = plan(frame_lens(values), half);
        if let Some(&i) = too_large.first() {
            // Never queued: the L4 refuses values over its maximum, and half the area holds one.
            return Err(RemoteError::Protocol(format!(
                "a value of {} bytes is larger than half the staging area ({half})",
                values[i].1.len()
            )));
        }
        let commands = commands_of(&chunks, |i| values[i].0.as_str());
        let mut refused = Vec::new();
        let mut failed = None;
        self.run(
            Op::Put,
            &commands,
            |shm, k| stage(shm, &chunks[k], values),
            |_, k, results| {
                for (&(i, _, _), &(code, _)) in chunks[k].iter().zip(&results) {
                    match code {
                        0.. => {}
                        code if REFUSALS.contains(&code) => refused.push(i),
                        code => {
                            failed.get_or_insert(RemoteError::Protocol(format!(
                                "mooncake put: error {code}"
                            )));
                        }
                    }
                }
            },
        )
        .await?;
        failed.map_or(Ok(refused), Err)
    }

    /// Asks the values' sizes (one command), then reads them chunk by chunk ([`plan`]),
    /// copying one chunk out while the sidecar reads the next.
    async fn get_batch(&self, names: &[String]) -> Result<Vec<Option<Bytes>>, RemoteError> {
        let mut out: Vec<Option<Bytes>> = vec![None; names.len()];
        if names.is_empty() {
            return Ok(out);
        }
        let asked = names.iter().map(|n| (n.as_str(), 0, 0)).collect();
        let sizes = self.call(Op::Sizes, asked).await?;
        // Missing values are left out, and so are values over half the area: kvd never writes
        // one, so they are not blocks of ours.
        let present = sizes
            .iter()
            .enumerate()
            .filter_map(|(i, &(size, _))| u64::try_from(size).ok().map(|len| (i, len)))
            .filter(|&(_, len)| len > 0);
        let (chunks, _) = plan(present, (self.staging_bytes / 2) as u64);
        let commands = commands_of(&chunks, |i| names[i].as_str());
        self.run(
            Op::Get,
            &commands,
            |_, _| {},
            |shm, k, results| {
                for (i, value) in copy_out(shm, &chunks[k], results) {
                    out[i] = value;
                }
            },
        )
        .await?;
        Ok(out)
    }

    async fn exists_batch(&self, names: &[String]) -> Result<Vec<bool>, RemoteError> {
        let asked = names.iter().map(|n| (n.as_str(), 0, 0)).collect();
        let results = self.call(Op::Exists, asked).await?;
        all_ok("exists", &results)?;
        Ok(results.into_iter().map(|(r, _)| r == 1).collect())
    }

    async fn remove_batch(&self, names: &[String]) -> Result<(), RemoteError> {
        let asked = names.iter().map(|n| (n.as_str(), 0, 0)).collect();
        let results = self.call(Op::Remove, asked).await?;
        all_ok("remove", &results)
    }
}

#[cfg(test)]
mod tests {
    use super::{CHUNK, MISSING, SPLIT_BYTES, frame_lens, plan, stage};
    use crate::l4::frame::{self, FrameInfo, Framed};
    use crate::proto::Namespace;
    use crate::sys::shm::SharedMap;
    use bytes::Bytes;
    use infera_core::event::Retention;

    /// A chunk staged by two threads holds each frame as `encode` makes it, where the plan
    /// put it: frames to seal sealed, another program's value as it is.
    #[test]
    fn a_chunk_staged_by_two_threads_holds_the_encoded_frames() {
        let ns = Namespace::new("m", "");
        let info = FrameInfo {
            class: Retention::Long,
            expires_at: None,
            writer: 1,
            seq: 2,
            written_at: 3,
        };
        let values: Vec<(String, Framed)> = (0..5u8)
            .map(|i| {
                let value = Bytes::from(vec![i; (SPLIT_BYTES / 3) as usize + usize::from(i)]);
                let key = [i];
                let framed = if i == 3 {
                    frame::encode(&ns, &key, &value, info).unwrap()
                } else {
                    frame::encode_unsealed(&ns, &key, &value, info).unwrap()
                };
                (format!("n{i}"), framed)
            })
            .collect();
        let (chunks, _) = plan(frame_lens(&values), CHUNK);
        assert_eq!(chunks.len(), 1, "one chunk over SPLIT_BYTES");
        let shm = SharedMap::create("kvd-test-stage", (2 * CHUNK) as usize).unwrap();
        stage(&shm, &chunks[0], &values);
        for &(i, at, len) in &chunks[0] {
            let f = &values[i].1;
            let sealed = frame::encode(&ns, &[i as u8], &f.body, info).unwrap();
            assert_eq!(
                shm.slice(at as usize, len as usize),
                &frame::joined(&sealed)[..],
                "frame {i}"
            );
        }
    }

    #[test]
    fn the_sidecar_and_kvd_agree_on_the_ops_and_result_codes() {
        let source = super::SIDECAR;
        assert!(source.contains(&format!("MISSING = {MISSING}")));
        assert!(source.contains("HEALTH, PUT, GET, EXISTS, REMOVE, SIZES = 1, 2, 3, 4, 5, 6"));
    }

    #[test]
    fn chunks_alternate_halves_and_leave_out_values_over_half() {
        // Sizes in sixteenths of a chunk.
        const U: u64 = CHUNK / 16;
        let half = 2 * CHUNK;
        let lens = [
            (0, 6 * U),
            (2, 6 * U),
            (3, 6 * U),
            (4, 20 * U),
            (5, 40 * U),
            (6, 1),
        ];
        let (chunks, too_large) = plan(lens, half);
        assert_eq!(
            chunks,
            vec![
                vec![(0, 0, 6 * U), (2, 6 * U, 6 * U)],
                vec![(3, half, 6 * U)],
                vec![(4, 0, 20 * U)],
                vec![(6, half, 1)],
            ],
            "chunks in alternate halves; a larger value alone"
        );
        assert_eq!(too_large, vec![5]);
        for chunk in &chunks {
            let bytes: u64 = chunk.iter().map(|(_, _, n)| n).sum();
            assert!(chunk.len() == 1 || bytes <= CHUNK);
            let (start, end) = (
                chunk[0].1,
                chunk.iter().map(|(_, at, n)| at + n).max().unwrap(),
            );
            assert!(
                start / half == (end - 1) / half,
                "a chunk stays within its half"
            );
        }
    }
}
