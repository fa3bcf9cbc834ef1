//! A shard's journal: records are appended in memory under the shard lock (so journal order is
//! index order) and written by one thread, `kvd-l3-s<N>-journal`, every `flush_every`, synced
//! (`fdatasync`) every `sync_every` and on [`Journal::flush`].
//!
//! Segments rotate at each checkpoint ([`Journal::rotate`]): the checkpoint replaces every
//! segment before the new one. Appends are never lost silently: a write error is logged,
//! counted, and returned by the next [`Journal::flush`]; recovery stops at the first record that
//! did not make it whole.

use super::io::IoCounters;
use super::layout::{Record, journal_header};
use std::collections::VecDeque;
use std::fs::File;
use std::io::{self, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// The file name of segment `seq`.
pub fn segment_path(dir: &Path, seq: u64) -> PathBuf {
    dir.join(format!("journal-{seq:012}.log"))
}

/// The segment number in a journal file name.
pub fn segment_of(name: &str) -> Option<u64> {
    name.strip_prefix("journal-")?
        .strip_suffix(".log")?
        .parse()
        .ok()
}

#[derive(Debug, Default)]
struct State {
    chunks: VecDeque<(u64, Vec<u8>)>,
    current: u64,
    appended: u64,
    durable: u64,
    sync_requested: bool,
    closed: bool,
    error: Option<String>,
}

/// See the module docs.
#[derive(Debug)]
pub struct Journal {
    dir: PathBuf,
    shard: u32,
    state: Mutex<State>,
    wake: Condvar,
    synced: Condvar,
    counters: Arc<IoCounters>,
}

impl Journal {
    /// A journal that appends to segment `first` (a new file) in `dir`; `counters` counts its
    /// write failures and its syncs.
    pub fn new(dir: &Path, shard: u32, first: u64, counters: Arc<IoCounters>) -> Arc<Self> {
        Arc::new(Self {
            dir: dir.to_path_buf(),
            shard,
            state: Mutex::new(State {
                current: first,
                ..State::default()
            }),
            wake: Condvar::new(),
            synced: Condvar::new(),
            counters,
        })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Appends a record (written by the journal thread).
    pub fn append(&self, record: &Record) {
        let mut s = self.lock();
        let seg = s.current;
        let before = match s.chunks.back() {
            Some((c, data)) if *c == seg => data.len(),
            _ => {
                s.chunks.push_back((seg, Vec::with_capacity(64 << 10)));
                0
            }
        };
        let Some((_, data)) = s.chunks.back_mut() else {
            return;
        };
        record.encode(data);
        let grown = (data.len() - before) as u64;
        let big = data.len() >= 1 << 20;
        s.appended += grown;
        drop(s);
        if big {
            self.wake.notify_one();
        }
    }

    /// Bytes appended so far (a position [`Journal::flush`] makes durable).
    pub fn appended(&self) -> u64 {
        self.lock().appended
    }

    /// Starts a new segment for later appends; returns its number.
    pub fn rotate(&self) -> u64 {
        let mut s = self.lock();
        s.current += 1;
        s.current
    }

    /// Waits until everything appended before the call is written and synced.
    ///
    /// # Errors
    /// The journal thread's last write error.
    pub fn flush(&self) -> io::Result<()> {
        let mut s = self.lock();
        let target = s.appended;
        s.sync_requested = true;
        self.wake.notify_one();
        while s.durable < target && s.error.is_none() && !s.closed {
            s = self.synced.wait(s).unwrap_or_else(|p| p.into_inner());
        }
        match &s.error {
            Some(e) => Err(io::Error::other(e.clone())),
            None => Ok(()),
        }
    }

    /// Stops the thread after it wrote and synced what is queued.
    pub fn close(&self) {
        self.lock().closed = true;
        self.wake.notify_all();
    }

    /// The journal thread's loop.
    pub fn run(self: Arc<Self>, flush_every: Duration, sync_every: Duration) {
        let mut file: Option<(u64, File)> = None;
        let mut last_sync = Instant::now();
        let mut dirty = false;
        loop {
            let (chunks, target, sync_now, closing) = {
                let mut s = self.lock();
                if s.chunks.is_empty() && !s.sync_requested && !s.closed {
                    s = self
                        .wake
                        .wait_timeout(s, flush_every)
                        .map(|(g, _)| g)
                        .unwrap_or_else(|p| p.into_inner().0);
                }
                let chunks: Vec<(u64, Vec<u8>)> = s.chunks.drain(..).collect();
                let sync_now = s.sync_requested || s.closed;
                s.sync_requested = false;
                (chunks, s.appended, sync_now, s.closed)
            };
            let result = self.write(&mut file, chunks, &mut dirty).and_then(|()| {
                if dirty && (sync_now || last_sync.elapsed() >= sync_every) {
                    if let Some((_, f)) = &file {
                        f.sync_data()?;
                        self.counters.syncs.fetch_add(1, Ordering::Relaxed);
                    }
                    dirty = false;
                    last_sync = Instant::now();
                }
                Ok(())
            });
            let mut s = self.lock();
            match result {
                Ok(()) if !dirty => {
                    s.durable = s.durable.max(target);
                    self.synced.notify_all();
                }
                Ok(()) => {}
                Err(e) => {
                    self.counters.errors.fetch_add(1, Ordering::Relaxed);
                    tracing::error!(error = %e, dir = %self.dir.display(), "L3 journal write failed");
                    s.error = Some(format!(
                        "L3 journal write failed in {}: {e}",
                        self.dir.display()
                    ));
                    self.synced.notify_all();
                }
            }
            if closing && s.chunks.is_empty() {
                s.durable = s.appended;
                self.synced.notify_all();
                return;
            }
        }
    }

    fn write(
        &self,
        file: &mut Option<(u64, File)>,
        chunks: Vec<(u64, Vec<u8>)>,
        dirty: &mut bool,
    ) -> io::Result<()> {
        for (seg, data) in chunks {
            if file.as_ref().is_none_or(|(s, _)| *s != seg) {
                if let Some((_, old)) = file.take()
                    && *dirty
                {
                    old.sync_data()?;
                }
                *file = Some((seg, self.open_segment(seg)?));
            }
            if let Some((_, f)) = file {
                f.write_all(&data)?;
                *dirty = true;
            }
        }
        Ok(())
    }

    fn open_segment(&self, seg: u64) -> io::Result<File> {
        let path = segment_path(&self.dir, seg);
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .mode(super::io::PRIVATE_FILE)
            .open(&path)?;
        if f.metadata()?.len() == 0 {
            f.write_all(&journal_header(self.shard, seg))?;
        }
        Ok(f)
    }
}

#[cfg(test)]
mod tests {
    use super::super::layout::{JOURNAL_HEADER, parse_journal_header};
    use super::*;

    #[test]
    fn records_reach_their_segments_in_order() {
        let dir = tempfile::tempdir().unwrap();
        let j = Journal::new(dir.path(), 3, 7, Arc::default());
        let runner = j.clone();
        let thread = std::thread::spawn(move || {
            runner.run(Duration::from_millis(1), Duration::from_secs(60))
        });
        let ev = |g| Record::Evict {
            generation: g,
            hash: 1,
        };
        j.append(&ev(1));
        j.append(&ev(2));
        assert_eq!(j.rotate(), 8);
        j.append(&ev(3));
        j.flush().unwrap();
        let seven = std::fs::read(segment_path(dir.path(), 7)).unwrap();
        assert_eq!(parse_journal_header(&seven, 3), Some(7));
        let (r1, n1) = Record::decode(&seven[JOURNAL_HEADER..]).unwrap();
        let (r2, _) = Record::decode(&seven[JOURNAL_HEADER + n1..]).unwrap();
        assert_eq!((r1, r2), (ev(1), ev(2)));
        let eight = std::fs::read(segment_path(dir.path(), 8)).unwrap();
        assert_eq!(Record::decode(&eight[JOURNAL_HEADER..]).unwrap().0, ev(3));
        j.close();
        thread.join().unwrap();
        assert_eq!(segment_of("journal-000000000042.log"), Some(42));
        assert_eq!(segment_of("checkpoint"), None);
    }
}
