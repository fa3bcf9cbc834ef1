//! The tablespace's data path: choosing O_DIRECT or buffered I/O for a device, the container
//! files, a pool of aligned buffers, and the I/O worker threads of a shard.
//!
//! Workers take jobs from the shard's queue a batch at a time (up to [`BATCH`]), build write
//! blocks in pooled aligned buffers, and run the batch through their own io_uring ring
//! (`crate::sys::uring`) or, where the kernel refuses io_uring, through `pread`/`pwrite` one
//! job after another. Which engine runs is decided once at startup and logged.

use super::layout::{BlockParts, UNIT};
use crate::long::WritePermit;
use crate::proto::Namespace;
use crate::sys::aligned::AlignedBuf;
use crate::sys::uring::{Op, Ring};
use bytes::Bytes;
use infera_core::event::Retention;
use rustc_hash::FxHashMap;
use std::collections::VecDeque;
use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use tokio::sync::{OwnedSemaphorePermit, oneshot};

/// Most jobs one worker submits together.
pub const BATCH: usize = 16;
/// Most bytes of blocks to write one worker takes together (one job at least). A worker encodes
/// (copies and checksums) every block of its batch before submitting any, so a small batch
/// starts the disk sooner; reads need no such work and are bounded by [`BATCH`] alone.
pub const BATCH_WRITE_BYTES: u64 = 4 << 20;

/// `--io-mode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IoMode {
    /// O_DIRECT on NVMe, buffered elsewhere (decided from `/sys/block`).
    Auto,
    /// O_DIRECT.
    Direct,
    /// Through the page cache.
    Buffered,
    /// By the file system's type, from the Python kvd's table (its
    /// `--tablespace-auto-detect-fs`; see [`super::fs_defaults`]).
    FileSystem,
}

/// What [`decide`] chose, and why (logged at startup).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IoDecision {
    pub direct: bool,
    pub reason: String,
}

/// A block device under the region, as `/sys/block` describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Device {
    pub name: String,
    pub rotational: bool,
}

const NETWORK_FS: [(i64, &str); 11] = [
    (0x6969, "nfs"),
    (0x517b, "smb"),
    (0xff53_4d42, "cifs"),
    (0xfe53_4d42, "smb2"),
    (0x6573_5546, "fuse"),
    (0x00c3_6400, "ceph"),
    (0x5346_414f, "afs"),
    (0x0102_1997, "9p"),
    (0x0bd0_0bd0, "lustre"),
    (0x0116_1970, "gfs2"),
    (0x7461_636f, "ocfs2"),
];
const MEMORY_FS: [(i64, &str); 2] = [(0x0102_1994, "tmpfs"), (0x794c_7630, "overlayfs")];

/// The pure part of `--io-mode auto`: O_DIRECT only when every device under the file system is
/// NVMe; buffered on network, memory and overlay file systems, rotating disks and anything else.
pub fn classify(fs_magic: i64, devices: &[Device]) -> IoDecision {
    let magic = fs_magic & 0xffff_ffff;
    if let Some((_, name)) = NETWORK_FS.iter().find(|(m, _)| *m == magic) {
        return IoDecision {
            direct: false,
            reason: format!("network file system ({name}): buffered"),
        };
    }
    if let Some((_, name)) = MEMORY_FS.iter().find(|(m, _)| *m == magic) {
        return IoDecision {
            direct: false,
            reason: format!("{name}: buffered"),
        };
    }
    if devices.is_empty() {
        return IoDecision {
            direct: false,
            reason: "no block device found under the file system: buffered".to_owned(),
        };
    }
    let names: Vec<&str> = devices.iter().map(|d| d.name.as_str()).collect();
    if let Some(d) = devices.iter().find(|d| d.rotational) {
        return IoDecision {
            direct: false,
            reason: format!("{} is rotational (or reports itself so): buffered", d.name),
        };
    }
    if devices.iter().all(|d| d.name.starts_with("nvme")) {
        return IoDecision {
            direct: true,
            reason: format!("NVMe ({}): O_DIRECT", names.join(", ")),
        };
    }
    IoDecision {
        direct: false,
        reason: format!("{} is not NVMe: buffered", names.join(", ")),
    }
}

/// Decides the I/O mode for a region directory (see [`classify`]).
pub fn decide(mode: IoMode, dir: &Path) -> IoDecision {
    match mode {
        IoMode::Direct => IoDecision {
            direct: true,
            reason: "--io-mode direct".to_owned(),
        },
        IoMode::Buffered => IoDecision {
            direct: false,
            reason: "--io-mode buffered".to_owned(),
        },
        IoMode::Auto => {
            // `f_type` is i64 on 64-bit Linux, narrower elsewhere.
            #[allow(clippy::unnecessary_cast)]
            let magic = rustix::fs::statfs(dir)
                .map(|s| s.f_type as i64)
                .unwrap_or_default();
            classify(magic, &devices_of(dir))
        }
        IoMode::FileSystem => {
            let fs = super::fs_defaults::fs_type(dir);
            let direct = super::fs_defaults::fs_defaults(&fs).direct;
            let how = if direct { "O_DIRECT" } else { "buffered" };
            IoDecision {
                direct,
                reason: format!("file system {fs} (--tablespace-auto-detect-fs): {how}"),
            }
        }
    }
}

/// The block devices holding `dir` (through device-mapper and md to their members).
pub fn devices_of(dir: &Path) -> Vec<Device> {
    let Ok(stat) = rustix::fs::stat(dir) else {
        return Vec::new();
    };
    let (major, minor) = (
        rustix::fs::major(stat.st_dev),
        rustix::fs::minor(stat.st_dev),
    );
    let Ok(mut node) = std::fs::canonicalize(format!("/sys/dev/block/{major}:{minor}")) else {
        return Vec::new();
    };
    if node.join("partition").exists()
        && let Some(parent) = node.parent()
    {
        node = parent.to_path_buf();
    }
    let mut out = Vec::new();
    members(&node, &mut out, 0);
    out
}

fn members(node: &Path, out: &mut Vec<Device>, depth: usize) {
    let slaves: Vec<PathBuf> = std::fs::read_dir(node.join("slaves"))
        .map(|rd| rd.filter_map(|e| e.ok()).map(|e| e.path()).collect())
        .unwrap_or_default();
    if !slaves.is_empty() && depth < 8 {
        for s in slaves {
            let s = std::fs::canonicalize(&s).unwrap_or(s);
            let disk = if s.join("partition").exists() {
                s.parent().map(Path::to_path_buf).unwrap_or(s)
            } else {
                s
            };
            members(&disk, out, depth + 1);
        }
        return;
    }
    let name = node
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let rotational = std::fs::read_to_string(node.join("queue/rotational"))
        .map(|s| s.trim() == "1")
        .unwrap_or(false);
    out.push(Device { name, rotational });
}

/// The mode of every file of a region: the cached blocks are the engine's data, no one else's.
pub const PRIVATE_FILE: u32 = 0o600;
/// The mode of a region's directory.
pub const PRIVATE_DIR: u32 = 0o700;

/// Creates (or truncates) a region file, mode [`PRIVATE_FILE`], for writing.
///
/// # Errors
/// The file system's error.
pub fn create_private(path: &Path) -> io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(PRIVATE_FILE)
        .open(path)
}

/// Opens (creating and preallocating when needed) `count` container files of `bytes` each,
/// mode [`PRIVATE_FILE`].
///
/// # Errors
/// The file system's error; `EINVAL` on open when it refuses O_DIRECT.
pub fn open_containers(dir: &Path, count: u32, bytes: u64, direct: bool) -> io::Result<Vec<File>> {
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    let mut files = Vec::with_capacity(count as usize);
    for i in 0..count {
        let path = dir.join(format!("container-{i:04}.dat"));
        let mut options = std::fs::OpenOptions::new();
        options
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(PRIVATE_FILE);
        if direct {
            options.custom_flags(rustix::fs::OFlags::DIRECT.bits() as i32);
        }
        let file = options.open(&path)?;
        // A container made by an older build (0644) is narrowed too.
        file.set_permissions(std::fs::Permissions::from_mode(PRIVATE_FILE))?;
        if file.metadata()?.len() != bytes {
            file.set_len(0)?;
            match rustix::fs::fallocate(&file, rustix::fs::FallocateFlags::empty(), 0, bytes) {
                Ok(()) => {}
                Err(e) if e == rustix::io::Errno::OPNOTSUPP => {
                    tracing::warn!(path = %path.display(), "fallocate unsupported; container is sparse");
                    file.set_len(bytes)?;
                }
                Err(e) => return Err(e.into()),
            }
        }
        files.push(file);
    }
    Ok(files)
}

/// Reusable aligned buffers, keyed by capacity (rounded up to [`POOL_GRAIN`]), so a stream of
/// equal-sized blocks reuses the same few buffers and never pays fresh pages again.
#[derive(Debug)]
pub struct BufPool {
    sizes: Mutex<FxHashMap<usize, Vec<AlignedBuf>>>,
    cached: AtomicU64,
    limit: u64,
}

/// Buffer capacities are multiples of this.
pub const POOL_GRAIN: usize = 64 << 10;

impl BufPool {
    /// A pool keeping at most `limit` bytes of idle buffers.
    pub fn new(limit: u64) -> Arc<Self> {
        Arc::new(Self {
            sizes: Mutex::new(FxHashMap::default()),
            cached: AtomicU64::new(0),
            limit,
        })
    }

    fn capacity(len: usize) -> usize {
        len.max(1).div_ceil(POOL_GRAIN) * POOL_GRAIN
    }

    /// A buffer with `len` bytes in use (their content is whatever the last user left).
    pub fn get(self: &Arc<Self>, len: usize) -> PooledBuf {
        let capacity = Self::capacity(len);
        let reused = self
            .sizes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get_mut(&capacity)
            .and_then(Vec::pop);
        let mut buf = match reused {
            Some(b) => {
                self.cached
                    .fetch_sub(b.capacity() as u64, Ordering::Relaxed);
                b
            }
            None => AlignedBuf::new(capacity),
        };
        buf.set_len(len);
        PooledBuf {
            buf: Some(buf),
            pool: self.clone(),
        }
    }

    fn put(&self, buf: AlignedBuf) {
        let size = buf.capacity() as u64;
        if self.cached.load(Ordering::Relaxed) + size > self.limit {
            return;
        }
        self.cached.fetch_add(size, Ordering::Relaxed);
        self.sizes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(buf.capacity())
            .or_default()
            .push(buf);
    }
}

/// A buffer that returns to its pool when dropped.
#[derive(Debug)]
pub struct PooledBuf {
    buf: Option<AlignedBuf>,
    pool: Arc<BufPool>,
}

impl PooledBuf {
    fn inner(&mut self) -> &mut AlignedBuf {
        match self.buf.as_mut() {
            Some(b) => b,
            None => unreachable!("a pooled buffer is present until dropped"),
        }
    }

    /// The bytes in use, mutably.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        self.inner().as_mut_slice()
    }
}

impl AsRef<[u8]> for PooledBuf {
    fn as_ref(&self) -> &[u8] {
        self.buf.as_ref().map_or(&[], AlignedBuf::as_slice)
    }
}

impl Drop for PooledBuf {
    fn drop(&mut self) {
        if let Some(buf) = self.buf.take() {
            self.pool.put(buf);
        }
    }
}

/// Write a block.
#[derive(Debug)]
pub struct WriteJob {
    pub generation: u64,
    pub hash: u128,
    pub class: Retention,
    pub container: u32,
    pub start: u32,
    pub units: u32,
    pub ns: Namespace,
    pub key: Bytes,
    pub metadata: Option<Bytes>,
    pub value: Bytes,
    pub _permit: WritePermit,
    /// Told whether the write landed, for a durable put.
    pub landed: Option<oneshot::Sender<bool>>,
}

/// Read the units of an extent.
#[derive(Debug)]
pub struct ReadJob {
    pub container: u32,
    pub start: u32,
    pub units: u32,
    pub reply: oneshot::Sender<io::Result<PooledBuf>>,
    pub _permit: OwnedSemaphorePermit,
}

/// A unit of work for a worker.
#[derive(Debug)]
pub enum Job {
    Write(WriteJob),
    Read(ReadJob),
}

/// A shard's job queue. Its length is bounded by the shard's write permits and read permits,
/// which callers hold before pushing.
#[derive(Debug, Default)]
pub struct IoQueue {
    state: Mutex<(VecDeque<Job>, bool)>,
    ready: Condvar,
}

impl IoQueue {
    /// Queues a job; gives it back when the queue is closed.
    pub fn push(&self, job: Job) -> Result<(), Box<Job>> {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if s.1 {
            return Err(Box::new(job));
        }
        s.0.push_back(job);
        drop(s);
        self.ready.notify_one();
        Ok(())
    }

    /// Waits for jobs and takes this worker's share of them: at most `max`, at most a
    /// `1/workers` share of the queue (so idle workers get the rest), and at most
    /// [`BATCH_WRITE_BYTES`] of blocks to write (at least one job). `None` once closed and
    /// drained.
    pub fn pop_batch(&self, max: usize, workers: usize) -> Option<Vec<Job>> {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if !s.0.is_empty() {
                let share = s.0.len().div_ceil(workers.max(1)).min(max);
                let mut bytes = 0u64;
                let mut n = 0;
                while n < share && (n == 0 || bytes < BATCH_WRITE_BYTES) {
                    if let Job::Write(w) = &s.0[n] {
                        bytes += u64::from(w.units) * UNIT;
                    }
                    n += 1;
                }
                return Some(s.0.drain(..n).collect());
            }
            if s.1 {
                return None;
            }
            s = self.ready.wait(s).unwrap_or_else(|p| p.into_inner());
        }
    }

    /// Stops accepting jobs and wakes every worker (queued jobs still run).
    pub fn close(&self) {
        self.state.lock().unwrap_or_else(|p| p.into_inner()).1 = true;
        self.ready.notify_all();
    }
}

/// I/O counters shared by a shard's workers.
#[derive(Debug, Default)]
pub struct IoCounters {
    pub reads: AtomicU64,
    pub writes: AtomicU64,
    pub errors: AtomicU64,
    /// Journal `fdatasync`s.
    pub syncs: AtomicU64,
}

/// Called by a worker when a write finished (`true`: all its bytes are in the file).
pub type WriteDone = Arc<dyn Fn(WriteJob, bool) + Send + Sync>;

/// What a worker needs.
#[derive(Clone)]
pub struct WorkerContext {
    pub queue: Arc<IoQueue>,
    pub files: Arc<Vec<File>>,
    pub pool: Arc<BufPool>,
    pub counters: Arc<IoCounters>,
    pub done: WriteDone,
    pub use_uring: bool,
    pub name: String,
    /// Workers sharing the queue.
    pub workers: usize,
}

/// One worker thread's loop; returns when the queue is closed and drained.
pub fn run_worker(ctx: WorkerContext) {
    let mut ring = if ctx.use_uring {
        match Ring::new((BATCH * 2) as u32) {
            Ok(r) => Some(r),
            Err(error) => {
                tracing::warn!(%error, worker = %ctx.name, "io_uring unavailable; this worker uses pread/pwrite");
                None
            }
        }
    } else {
        None
    };
    while let Some(batch) = ctx.queue.pop_batch(BATCH, ctx.workers) {
        run_batch(&ctx, &mut ring, batch);
    }
}

fn run_batch(ctx: &WorkerContext, ring: &mut Option<Ring>, batch: Vec<Job>) {
    let mut bufs: Vec<PooledBuf> = batch
        .iter()
        .map(|job| match job {
            Job::Write(w) => {
                let parts = BlockParts {
                    generation: w.generation,
                    hash: w.hash,
                    class: w.class,
                    ns: &w.ns,
                    key: &w.key,
                    metadata: w.metadata.as_deref().unwrap_or_default(),
                    value: &w.value,
                };
                let mut buf = ctx.pool.get(w.units as usize * UNIT as usize);
                parts.encode_into(buf.as_mut_slice());
                buf
            }
            Job::Read(r) => ctx.pool.get(r.units as usize * UNIT as usize),
        })
        .collect();
    let via_ring = ring.as_mut().map(|r| {
        let mut ops: Vec<Op<'_>> = batch
            .iter()
            .zip(bufs.iter_mut())
            .map(|(job, buf)| match job {
                Job::Write(w) => Op::Write {
                    fd: ctx.files[w.container as usize].as_raw_fd(),
                    offset: u64::from(w.start) * UNIT,
                    buf: buf.as_mut_slice(),
                },
                Job::Read(r) => Op::Read {
                    fd: ctx.files[r.container as usize].as_raw_fd(),
                    offset: u64::from(r.start) * UNIT,
                    buf: buf.as_mut_slice(),
                },
            })
            .collect();
        r.run(&mut ops)
    });
    let results = match via_ring {
        Some(Ok(results)) => results,
        Some(Err(error)) => {
            tracing::error!(%error, worker = %ctx.name, "io_uring failed; falling back to pread/pwrite");
            *ring = None;
            positioned(ctx, &batch, &mut bufs)
        }
        None => positioned(ctx, &batch, &mut bufs),
    };
    for ((job, buf), result) in batch.into_iter().zip(bufs).zip(results) {
        if let Err(error) = &result {
            // Counted every time, logged on the 1st, 2nd, 4th, 8th... so a failing disk is
            // loud without flooding the log.
            let total = ctx.counters.errors.fetch_add(1, Ordering::Relaxed) + 1;
            if total.is_power_of_two() {
                tracing::warn!(%error, worker = %ctx.name, total, "L3 I/O failed");
            }
        }
        match job {
            Job::Write(w) => {
                ctx.counters.writes.fetch_add(1, Ordering::Relaxed);
                (ctx.done)(w, result.is_ok());
            }
            Job::Read(r) => {
                ctx.counters.reads.fetch_add(1, Ordering::Relaxed);
                let _ = r.reply.send(result.map(|()| buf));
            }
        }
    }
}

/// `pread`/`pwrite` until every byte moved, one job after another.
fn positioned(ctx: &WorkerContext, batch: &[Job], bufs: &mut [PooledBuf]) -> Vec<io::Result<()>> {
    batch
        .iter()
        .zip(bufs.iter_mut())
        .map(|(job, buf)| match job {
            Job::Write(w) => {
                let file = &ctx.files[w.container as usize];
                let (data, offset) = (buf.as_mut_slice(), u64::from(w.start) * UNIT);
                let mut done = 0;
                while done < data.len() {
                    done += rustix::io::pwrite(file, &data[done..], offset + done as u64)?;
                }
                Ok(())
            }
            Job::Read(r) => {
                let file = &ctx.files[r.container as usize];
                let (data, offset) = (buf.as_mut_slice(), u64::from(r.start) * UNIT);
                let mut done = 0;
                while done < data.len() {
                    let n = rustix::io::pread(file, &mut data[done..], offset + done as u64)?;
                    if n == 0 {
                        return Err(io::ErrorKind::UnexpectedEof.into());
                    }
                    done += n;
                }
                Ok(())
            }
        })
        .collect()
}

#[cfg(test)]
mod tests;
