//! The L3 tablespace: preallocated container files on local devices, one shard per directory
//! (`--long-path DIR`, or `--long-paths A,B,...` striped: a key goes to shard
//! `(hash >> 64) % shards`), each with its own journal, index and I/O workers
//! (`--long-workers-per-shard`).
//!
//! # A shard's directory
//! ```text
//! tablespace.meta            geometry (shard, shards, container size and count) + checksum
//! container-0000.dat ...     preallocated (fallocate), blocks at 4 KiB units (layout.rs)
//! journal-000000000007.log   every put and every eviction since the checkpoint
//! checkpoint                 the index as of a journal segment boundary (copied a chunk at a
//!                            time; replaying the journal from that boundary completes it)
//! ```
//! The directory is mode 0700 and every file in it 0600 (narrowed at open when an older build
//! left them wider): the blocks are the engine's KV cache, readable by no other user.
//!
//! A region whose meta file disagrees with the flags (another size or stripe count) is
//! reinitialized with a warning: the blocks are a cache, and reading them under another
//! geometry would be wrong.
//!
//! # Guarantees
//! - Only `short` and `long` blocks are stored; a put never evicts a higher class.
//! - A read returns the bytes last put under that exact key, or nothing: each block carries its
//!   key hash, generation, lengths, namespace, key and an xxh3 checksum, all verified on read.
//! - Every put and every eviction is journaled before any later change of the index, so
//!   recovery (`recover.rs`) rebuilds a consistent prefix of the history; it reads no data, so
//!   a restart with a million entries takes about as long as reading 56 MB.
//! - I/O is O_DIRECT or buffered per `--io-mode` (auto: decided from `/sys/block`, logged),
//!   through io_uring when the kernel allows it and `pread`/`pwrite` otherwise (logged).
//! - The Python kvd's `--tablespace-auto-detect-fs` is [`IoMode::FileSystem`] and
//!   [`TablespaceConfig::sync_by_file_system`]: I/O mode and group-commit window from the file
//!   system's type (`fs_defaults.rs`).

mod alloc;
mod fs_defaults;
mod io;
mod journal;
mod layout;
mod recover;
mod shard;

pub use fs_defaults::{FsDefaults, fs_defaults, fs_type};
pub use io::{Device, IoDecision, IoMode, classify, decide, devices_of};
pub use layout::UNIT;

use crate::inventory::Inventory;
use crate::long::{LongBlock, LongHit, LongOpenError, LongRejected, LongStore, Put, WritePermit};
use crate::proto::Namespace;
use crate::stats::LongStats;
use infera_core::event::Retention;
use io::{BufPool, IoCounters, IoQueue, WorkerContext};
use journal::Journal;
use layout::Geometry;
use shard::{Parts, Shard};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use tokio::sync::Semaphore;

/// Settings of the tablespace (from `--long-path(s)`, `--long-bytes`, `--io-mode`,
/// `--long-workers-per-shard`).
#[derive(Debug, Clone, PartialEq)]
pub struct TablespaceConfig {
    /// One directory per shard.
    pub paths: Vec<PathBuf>,
    /// The region's total size, split evenly across shards.
    pub bytes: u64,
    pub io_mode: IoMode,
    /// I/O worker threads per shard.
    pub workers_per_shard: u32,
    /// Size of one container file (the region is cut into as many as fit).
    pub container_bytes: u64,
    /// How often the journal thread writes appended records.
    pub journal_flush: Duration,
    /// How often the journal is synced (`fdatasync`) in the background.
    pub journal_sync: Duration,
    /// Use io_uring where the kernel allows it.
    pub io_uring: bool,
    /// Most bytes of writes queued at once (back-pressure on L3 writers).
    pub queue_bytes: u64,
    /// Acknowledge a put only once its block is written and its journal record synced
    /// (`--durable-long-writes`; see [`crate::long::Durable`]).
    pub durable_writes: bool,
    /// Take the group-commit window from the file system of the first directory at open
    /// ([`fs_defaults`]; the Python kvd's `--tablespace-auto-detect-fs` without
    /// `--tablespace-flush-interval-ms`), as [`TablespaceConfig::set_flush_interval`] would.
    pub sync_by_file_system: bool,
}

impl TablespaceConfig {
    /// Defaults for everything but the shard directories and the size.
    pub fn new(paths: Vec<PathBuf>, bytes: u64) -> Self {
        Self {
            paths,
            bytes,
            io_mode: IoMode::Auto,
            workers_per_shard: 8,
            container_bytes: 1 << 30,
            journal_flush: Duration::from_millis(5),
            journal_sync: Duration::from_millis(200),
            io_uring: true,
            queue_bytes: 256 << 20,
            durable_writes: false,
            sync_by_file_system: false,
        }
    }

    /// The Python kvd's group-commit window (`--tablespace-flush-interval-ms`): zero, its
    /// inline fsync, makes every put acknowledged only once durable ([`Self::durable_writes`]);
    /// otherwise the journal is written at least and synced exactly that often, so a crash
    /// loses at most about one window of acknowledged writes.
    pub fn set_flush_interval(&mut self, window: Duration) {
        if window.is_zero() {
            self.durable_writes = true;
        } else {
            self.journal_sync = window;
            self.journal_flush = self.journal_flush.min(window);
        }
    }
}

/// See the module docs.
#[derive(Debug)]
pub struct Tablespace {
    shards: Vec<Arc<Shard>>,
    writes: Arc<Semaphore>,
    write_units: u32,
    durable: bool,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

fn wall_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or_default()
}

fn io_error(path: &Path) -> impl FnOnce(std::io::Error) -> LongOpenError + '_ {
    move |source| LongOpenError::Io {
        path: path.to_path_buf(),
        source,
    }
}

impl Tablespace {
    /// Opens (creating or recovering) every shard; blocking.
    ///
    /// # Errors
    /// [`LongOpenError::Invalid`] for sizes that cannot hold a container, or O_DIRECT refused
    /// under `--io-mode direct`; [`LongOpenError::Io`] when a directory cannot be used.
    pub fn open(config: &TablespaceConfig) -> Result<Self, LongOpenError> {
        let n = config.paths.len() as u32;
        if n == 0 {
            return Err(LongOpenError::Invalid(
                "the L3 region needs a directory".to_owned(),
            ));
        }
        let by_file_system;
        let config = if config.sync_by_file_system {
            by_file_system = sync_by_file_system(config);
            &by_file_system
        } else {
            config
        };
        // Equal containers of at most `container_bytes` that together fill the shard.
        let shard_bytes = config.bytes / u64::from(n) / UNIT * UNIT;
        let max_container = config.container_bytes.max(UNIT);
        let containers = shard_bytes.div_ceil(max_container).max(1);
        let container_bytes = shard_bytes / containers / UNIT * UNIT;
        if container_bytes < UNIT {
            return Err(LongOpenError::Invalid(format!(
                "--long-bytes {} is too small for {n} shard(s): each needs at least {UNIT} bytes",
                config.bytes
            )));
        }
        let containers = containers as u32;
        let write_units = (config.queue_bytes / UNIT).clamp(1, u64::from(u32::MAX >> 4)) as u32;
        let uring = config.io_uring
            && match crate::sys::uring::Ring::new(4) {
                Ok(_) => true,
                Err(error) => {
                    tracing::warn!(%error, "io_uring is not available; L3 uses pread/pwrite");
                    false
                }
            };
        let pool = BufPool::new(512 << 20);
        let mut ts = Self {
            shards: Vec::new(),
            writes: Arc::new(Semaphore::new(write_units as usize)),
            write_units,
            durable: config.durable_writes,
            threads: Mutex::new(Vec::new()),
        };
        for (i, dir) in config.paths.iter().enumerate() {
            let geometry = Geometry {
                shard: i as u32,
                shards: n,
                container_bytes,
                containers,
            };
            let shard = open_shard(config, dir, geometry, uring)?;
            ts.spawn_threads(config, &shard, &pool);
            ts.shards.push(shard);
        }
        Ok(ts)
    }

    fn spawn_threads(&self, config: &TablespaceConfig, shard: &Arc<Shard>, pool: &Arc<BufPool>) {
        let mut threads = self.threads.lock().unwrap_or_else(|p| p.into_inner());
        let journal = shard.journal.clone();
        let (flush, sync) = (config.journal_flush, config.journal_sync);
        let spawned = std::thread::Builder::new()
            .name(format!("kvd-l3-s{}-journal", shard.id))
            .spawn(move || journal.run(flush, sync));
        match spawned {
            Ok(t) => threads.push(t),
            Err(error) => tracing::error!(%error, "cannot start the L3 journal thread"),
        }
        let weak: Weak<Shard> = Arc::downgrade(shard);
        let stats = shard.stats();
        for w in 0..config.workers_per_shard.max(1) {
            let weak = weak.clone();
            let ctx = WorkerContext {
                queue: shard.queue.clone(),
                files: shard.files.clone(),
                pool: pool.clone(),
                counters: shard.io_counters(),
                // A durable put whose shard is gone hears `false` from its dropped sender.
                done: Arc::new(move |job, ok| {
                    if let Some(shard) = weak.upgrade() {
                        shard.write_done(job, ok);
                    }
                }),
                use_uring: stats.io_uring,
                name: format!("s{}w{w}", shard.id),
                workers: config.workers_per_shard.max(1) as usize,
            };
            let spawned = std::thread::Builder::new()
                .name(format!("kvd-l3-s{}-w{w}", shard.id))
                .spawn(move || io::run_worker(ctx));
            match spawned {
                Ok(t) => threads.push(t),
                Err(error) => tracing::error!(%error, "cannot start an L3 I/O worker"),
            }
        }
    }

    fn shard(&self, hash: u128) -> &Arc<Shard> {
        &self.shards[((hash >> 64) as u64 % self.shards.len() as u64) as usize]
    }

    fn units(&self, bytes: u64) -> u32 {
        (bytes.saturating_add(UNIT) / UNIT).min(u64::from(self.write_units)) as u32
    }

    fn stop_threads(&self) {
        for s in &self.shards {
            s.queue.close();
            s.journal.close();
        }
    }
}

impl Drop for Tablespace {
    /// Without [`LongStore::close`] (a crash-like stop, e.g. in tests): queued writes still run
    /// and appended journal records are still written, then the threads end; waiting for them
    /// means a reopen of the same region never races a thread of this one.
    fn drop(&mut self) {
        self.stop_threads();
        let threads = std::mem::take(&mut *self.threads.lock().unwrap_or_else(|p| p.into_inner()));
        for t in threads {
            let _ = t.join();
        }
    }
}

/// `config` with the group-commit window of its first directory's file system.
fn sync_by_file_system(config: &TablespaceConfig) -> TablespaceConfig {
    let mut resolved = config.clone();
    resolved.sync_by_file_system = false;
    let fs = fs_type(&config.paths[0]);
    let window = fs_defaults(&fs).flush_interval;
    resolved.set_flush_interval(window);
    tracing::info!(
        file_system = %fs,
        dir = %config.paths[0].display(),
        flush_interval_ms = window.as_millis() as u64,
        durable_writes = resolved.durable_writes,
        journal_sync_ms = resolved.journal_sync.as_millis() as u64,
        "L3 group commit from the file system (--tablespace-auto-detect-fs)"
    );
    resolved
}

fn open_shard(
    config: &TablespaceConfig,
    dir: &Path,
    geometry: Geometry,
    uring: bool,
) -> Result<Arc<Shard>, LongOpenError> {
    let started = Instant::now();
    {
        use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(io::PRIVATE_DIR)
            .create(dir)
            .map_err(io_error(dir))?;
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(io::PRIVATE_DIR))
            .map_err(io_error(dir))?;
        for entry in std::fs::read_dir(dir).map_err(io_error(dir))? {
            let path = entry.map_err(io_error(dir))?.path();
            if is_ours(&path.file_name().unwrap_or_default().to_string_lossy()) {
                std::fs::set_permissions(&path, std::fs::Permissions::from_mode(io::PRIVATE_FILE))
                    .map_err(io_error(&path))?;
            }
        }
    }
    let meta_path = dir.join("tablespace.meta");
    let stored = std::fs::read(&meta_path).ok().map(|b| Geometry::decode(&b));
    match stored {
        Some(Some(g)) if g == geometry => {}
        found => {
            if found.is_some() {
                tracing::warn!(
                    dir = %dir.display(),
                    "the L3 region was created with another size or stripe count; \
                     reinitializing it (its cached blocks are dropped)"
                );
            }
            wipe(dir).map_err(io_error(dir))?;
            std::io::Write::write_all(
                &mut io::create_private(&meta_path).map_err(io_error(dir))?,
                &geometry.encode(),
            )
            .map_err(io_error(dir))?;
        }
    }
    let decision = decide(config.io_mode, dir);
    let files = match io::open_containers(
        dir,
        geometry.containers,
        geometry.container_bytes,
        decision.direct,
    ) {
        Ok(files) => (files, decision),
        Err(e)
            if decision.direct
                && e.raw_os_error() == Some(rustix::io::Errno::INVAL.raw_os_error()) =>
        {
            if config.io_mode == IoMode::Direct {
                return Err(LongOpenError::Invalid(format!(
                    "--io-mode direct: the file system at {} refuses O_DIRECT; use --io-mode \
                     buffered or auto",
                    dir.display()
                )));
            }
            tracing::warn!(dir = %dir.display(), "O_DIRECT refused by the file system; L3 uses buffered I/O");
            let files =
                io::open_containers(dir, geometry.containers, geometry.container_bytes, false)
                    .map_err(io_error(dir))?;
            (
                files,
                IoDecision {
                    direct: false,
                    reason: "O_DIRECT refused by the file system: buffered".to_owned(),
                },
            )
        }
        Err(e) => return Err(io_error(dir)(e)),
    };
    let (files, decision) = files;
    let recovered = recover::recover(dir, &geometry, wall_ms()).map_err(io_error(dir))?;
    let counters = Arc::new(IoCounters::default());
    let journal = Journal::new(
        dir,
        geometry.shard,
        recovered.next_segment,
        counters.clone(),
    );
    tracing::info!(
        dir = %dir.display(),
        shard = geometry.shard,
        containers = geometry.containers,
        container_bytes = geometry.container_bytes,
        entries = recovered.entries.len(),
        replayed = recovered.replayed,
        dropped = recovered.dropped,
        direct_io = decision.direct,
        io_mode = %decision.reason,
        engine = if uring { "io_uring" } else { "pread/pwrite" },
        recovery_ms = started.elapsed().as_millis() as u64,
        "kvd L3 shard ready"
    );
    Ok(Arc::new(Shard::new(Parts {
        id: geometry.shard,
        dir: dir.to_path_buf(),
        geometry,
        recovered,
        journal,
        queue: Arc::new(IoQueue::default()),
        files: Arc::new(files),
        io: counters,
        read_permits: (config.workers_per_shard.max(1) as usize) * io::BATCH,
        direct: decision.direct,
        uring,
    })))
}

/// Removes a region's files (not the directory, nor anything that is not ours).
fn wipe(dir: &Path) -> std::io::Result<()> {
    for entry in std::fs::read_dir(dir)?.filter_map(|e| e.ok()) {
        if is_ours(&entry.file_name().to_string_lossy()) {
            std::fs::remove_file(entry.path())?;
        }
    }
    Ok(())
}

/// Whether `name` is one of a region's files.
fn is_ours(name: &str) -> bool {
    name == "tablespace.meta"
        || name == recover::CHECKPOINT
        || name == "checkpoint.tmp"
        || (name.starts_with("container-") && name.ends_with(".dat"))
        || journal::segment_of(name).is_some()
}

#[async_trait::async_trait]
impl LongStore for Tablespace {
    fn kind(&self) -> &'static str {
        "tablespace"
    }

    fn class_of(&self, hash: u128, now: u64) -> Option<Retention> {
        self.shard(hash).class_of(hash, now)
    }

    fn is_current(&self, hash: u128, generation: u64) -> bool {
        self.shard(hash).is_current(hash, generation)
    }

    fn durable_writes(&self) -> bool {
        self.durable
    }

    async fn write_permits(&self, sizes: &[u64]) -> Vec<WritePermit> {
        // One round asks for at most a quarter of the queue (or the first write alone, which
        // `units` caps at the whole queue), all at once.
        let round = (self.write_units / 4).max(1);
        let mut units = Vec::new();
        let mut total = 0u32;
        for &bytes in sizes {
            let u = self.units(bytes);
            if !units.is_empty() && total.saturating_add(u) > round {
                break;
            }
            units.push(u);
            total = total.saturating_add(u);
        }
        match self.writes.clone().acquire_many_owned(total).await {
            Ok(mut all) => units
                .iter()
                .map(|&u| match all.split(u as usize) {
                    Some(p) => WritePermit::new(p),
                    None => WritePermit::unbounded(),
                })
                .collect(),
            Err(_) => units.iter().map(|_| WritePermit::unbounded()).collect(),
        }
    }

    fn try_write_permit(&self, bytes: u64) -> Option<WritePermit> {
        self.writes
            .clone()
            .try_acquire_many_owned(self.units(bytes))
            .ok()
            .map(WritePermit::new)
    }

    fn put(
        &self,
        block: LongBlock,
        permit: WritePermit,
        now: u64,
        spill: bool,
    ) -> Result<Put, LongRejected> {
        let shard = self.shard(block.hash);
        let (generation, landing) = shard.put(block, permit, now, spill, self.durable)?;
        Ok(Put {
            generation,
            durable: landing.map(|landing| shard.clone().durable(landing)),
        })
    }

    fn remove(&self, hash: u128) {
        self.shard(hash).remove(hash);
    }

    fn record_inventory(&self, inventory: &Inventory) {
        for shard in &self.shards {
            shard.set_inventory(inventory);
        }
    }

    async fn get(&self, ns: &Namespace, key: &[u8], hash: u128, now: u64) -> Option<LongHit> {
        self.shard(hash).get(ns, key, hash, now).await
    }

    fn clear(&self, ns: &Namespace) -> u64 {
        self.shards.iter().map(|s| s.clear(ns)).sum()
    }

    fn sweep(&self, now: u64) -> usize {
        self.shards.iter().map(|s| s.sweep(now)).sum()
    }

    fn stats(&self) -> LongStats {
        self.shards
            .iter()
            .fold(LongStats::default(), |acc, s| acc.merge(&s.stats()))
    }

    async fn flush(&self) -> std::io::Result<()> {
        // Holding every write permit means every queued write has completed.
        let all = self.writes.acquire_many(self.write_units).await;
        drop(all);
        let shards = self.shards.clone();
        tokio::task::spawn_blocking(move || shards.iter().try_for_each(|s| s.sync()))
            .await
            .map_err(std::io::Error::other)?
    }

    async fn checkpoint(&self) -> std::io::Result<()> {
        let shards = self.shards.clone();
        tokio::task::spawn_blocking(move || shards.iter().try_for_each(|s| s.checkpoint()))
            .await
            .map_err(std::io::Error::other)?
    }

    async fn close(&self) -> std::io::Result<()> {
        let flushed = self.flush().await;
        let checkpointed = self.checkpoint().await;
        self.stop_threads();
        let threads: Vec<JoinHandle<()>> =
            std::mem::take(&mut *self.threads.lock().unwrap_or_else(|p| p.into_inner()));
        tokio::task::spawn_blocking(move || {
            for t in threads {
                let _ = t.join();
            }
        })
        .await
        .map_err(std::io::Error::other)?;
        flushed.and(checkpointed)
    }
}
