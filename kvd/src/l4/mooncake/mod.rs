//! A Mooncake Store cluster as an L4 [`RemoteStore`], through a sidecar.
//!
//! The store's only public client is its Python binding (`mooncake.store`, in the PyPI package
//! `mooncake-transfer-engine-non-cuda` or Mooncake's CUDA/ROCm builds); its C API needs a
//! library that no package ships. kvd therefore runs the binding in a child process, the
//! sidecar (`sidecar.py`, built into the binary and started as `<python> -c`), and keeps the
//! daemon free of its threads, allocator and GIL:
//! - **Values never cross a pipe.** kvd maps a memfd (the staging area, at least one L4 batch
//!   or one largest value), which the sidecar maps through `/proc/<kvd>/fd` and registers with
//!   the store. A put writes the batch's frames there and the sidecar calls
//!   `batch_upsert_from` on them; for a get the sidecar reads the values' sizes from their
//!   replica descriptors and has the store write them there (`batch_get_into`), back to back,
//!   and kvd copies them out. Values that do not fit one reply are asked for again in the next.
//! - **Commands** go over the sidecar's stdin and stdout (framing in `sidecar.py`), one at a
//!   time: the staging area belongs to the command in flight.
//! - **Failure is a restart.** A call that fails to exchange its frames, or whose future is
//!   dropped mid-call (the L4's deadline), leaves the sidecar in an unknown state: it is
//!   killed, and the next call starts a new one, whose setup fails while the cluster is down.
//!   That is how the L4's breaker probes reconnect. The store's own per-key errors are
//!   answers, not failures.
//! - Store names are the L4's ([`super::name`]) with `cluster_id` as the prefix; `remove`
//!   forces past leases and treats "not found" as done, as the Python kvd's `clear` does.

mod config;

pub use config::{ALLOW_TCP_FALLBACK, MooncakeConfig};

use super::frame::Framed;
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
/// The smallest staging area: two L4 batches of the default size, so that a batched read of
/// 4 MiB blocks is one call (a memfd's pages are taken only as they are written).
const MIN_STAGING: usize = 64 << 20;
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
}

/// The sidecar's result for a get whose value is not in the store, and for one that did not fit
/// this reply.
const MISSING: i64 = -1;
const NO_ROOM: i64 = -2;

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
    /// staging area and the sidecar are made by the first call.
    pub fn new(config: MooncakeConfig, max_value: usize) -> Self {
        Self {
            config,
            staging_bytes: max_value.max(MIN_STAGING),
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

    /// Runs one command with the staging area prepared by `stage` and read by `collect`
    /// (both under the lock, while nothing else uses the area).
    async fn call<T>(
        &self,
        op: Op,
        items: &[(&str, u64, u64)],
        stage: impl FnOnce(&SharedMap),
        collect: impl FnOnce(&SharedMap, Vec<(i64, u64)>) -> T,
    ) -> Result<T, RemoteError> {
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
        // Taken out for the call: if the call fails or its future is dropped, the sidecar is
        // dropped with it (and killed), and the next call starts a fresh one.
        let mut sidecar = match slot.take() {
            Some(s) => s,
            None => self.start(staging).await?,
        };
        stage(staging);
        sidecar.send(op, items).await?;
        let count = if op == Op::Health { 1 } else { items.len() };
        let results = sidecar.read_reply(count).await?;
        let out = collect(staging, results);
        *slot = Some(sidecar);
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
        let results = self.call(Op::Health, &[], |_| {}, |_, r| r).await?;
        all_ok("health_check", &results)
    }

    async fn put_batch(&self, items: &[(String, Framed)]) -> Result<(), RemoteError> {
        let room = self.staging_bytes;
        let mut rest = items;
        while !rest.is_empty() {
            // As many as fit the staging area (a value larger than it is never queued: the
            // area is at least the largest value).
            let mut used = 0usize;
            let mut placed = Vec::new();
            for (name, framed) in rest {
                let len = framed.len();
                if used + len > room && !placed.is_empty() {
                    break;
                }
                if len > room {
                    return Err(RemoteError::Protocol(format!(
                        "a value of {len} bytes is larger than the staging area ({room})"
                    )));
                }
                placed.push((name.as_str(), used as u64, len as u64));
                used += len;
            }
            let batch = &rest[..placed.len()];
            let results = self
                .call(
                    Op::Put,
                    &placed,
                    |shm| {
                        for ((_, framed), (_, at, _)) in batch.iter().zip(&placed) {
                            let at = *at as usize;
                            shm.write(at, &framed.head);
                            shm.write(at + framed.head.len(), &framed.body);
                        }
                    },
                    |_, r| r,
                )
                .await?;
            all_ok("put", &results)?;
            rest = &rest[placed.len()..];
        }
        Ok(())
    }

    async fn get_batch(&self, names: &[String]) -> Result<Vec<Option<Bytes>>, RemoteError> {
        let mut out: Vec<Option<Bytes>> = vec![None; names.len()];
        let mut pending: Vec<usize> = (0..names.len()).collect();
        while !pending.is_empty() {
            let items: Vec<(&str, u64, u64)> =
                pending.iter().map(|&i| (names[i].as_str(), 0, 0)).collect();
            let results = self
                .call(
                    Op::Get,
                    &items,
                    |_| {},
                    |shm, results| {
                        results
                            .into_iter()
                            .map(|(len, at)| match len {
                                n if n > 0
                                    && (at as usize)
                                        .checked_add(n as usize)
                                        .is_some_and(|end| end <= shm.len()) =>
                                {
                                    Ok(Some(Bytes::copy_from_slice(
                                        shm.slice(at as usize, n as usize),
                                    )))
                                }
                                NO_ROOM => Err(()),
                                MISSING => Ok(None),
                                code => {
                                    tracing::debug!(code, "kvd L4: a Mooncake get failed; a miss");
                                    Ok(None)
                                }
                            })
                            .collect::<Vec<_>>()
                    },
                )
                .await?;
            let mut again = Vec::new();
            for (i, result) in pending.iter().zip(results) {
                match result {
                    Ok(value) => out[*i] = value,
                    Err(()) => again.push(*i),
                }
            }
            if again.len() == pending.len() {
                // Not even the first fitted: larger than the staging area, so not one of ours.
                break;
            }
            pending = again;
        }
        Ok(out)
    }

    async fn exists_batch(&self, names: &[String]) -> Result<Vec<bool>, RemoteError> {
        let items: Vec<(&str, u64, u64)> = names.iter().map(|n| (n.as_str(), 0, 0)).collect();
        let results = self.call(Op::Exists, &items, |_| {}, |_, r| r).await?;
        all_ok("exists", &results)?;
        Ok(results.into_iter().map(|(r, _)| r == 1).collect())
    }

    async fn remove_batch(&self, names: &[String]) -> Result<(), RemoteError> {
        let items: Vec<(&str, u64, u64)> = names.iter().map(|n| (n.as_str(), 0, 0)).collect();
        let results = self.call(Op::Remove, &items, |_| {}, |_, r| r).await?;
        all_ok("remove", &results)
    }
}

#[cfg(test)]
mod tests {
    use super::MISSING;

    #[test]
    fn the_sidecar_and_kvd_agree_on_the_result_codes() {
        let source = super::SIDECAR;
        assert!(source.contains(&format!("MISSING, NO_ROOM = {MISSING}, {}", super::NO_ROOM)));
        assert!(source.contains("HEALTH, PUT, GET, EXISTS, REMOVE = 1, 2, 3, 4, 5"));
    }
}
