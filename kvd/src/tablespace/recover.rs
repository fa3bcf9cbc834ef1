//! Rebuilding a shard's index after a restart or a crash: the newest valid checkpoint, then the
//! journal segments from the one it names, in order, up to the first record that is torn or
//! corrupt (that segment is cut there and every later one removed, so the next recovery reads
//! the same prefix). No data block is read: each read verifies its block later (key hash,
//! generation, length, checksum, full key), which is what keeps a journal that outran its data,
//! or data that outran its journal, from ever returning wrong bytes.
//!
//! The result is a consistent prefix of the shard's history, minus entries that expired, point
//! at unknown namespaces or at space outside the region, or overlap a newer entry.

use super::alloc::Allocator;
use super::journal::{segment_of, segment_path};
use super::layout::{
    Checkpoint, Geometry, JOURNAL_HEADER, PutRecord, Record, parse_journal_header,
};
use crate::proto::Namespace;
use rustc_hash::FxHashMap;
use std::io;
use std::path::Path;

/// What recovery found.
#[derive(Debug)]
pub struct Recovered {
    /// Live entries, least recently used first.
    pub entries: Vec<PutRecord>,
    pub namespaces: Vec<(u32, Namespace)>,
    pub next_generation: u64,
    /// The segment new records go to.
    pub next_segment: u64,
    pub allocator: Allocator,
    /// Records replayed from the journal.
    pub replayed: u64,
    /// Entries dropped (expired, orphaned, out of range or overlapping).
    pub dropped: u64,
}

/// The checkpoint's file name.
pub const CHECKPOINT: &str = "checkpoint";

/// Recovers shard `shard` of geometry `geo` from `dir` at wall-clock `now` (ms).
///
/// # Errors
/// Only when the directory cannot be listed or a segment cannot be read or cut; damaged
/// content is dropped (and logged), never an error.
pub fn recover(dir: &Path, geo: &Geometry, now: u64) -> io::Result<Recovered> {
    let shard = geo.shard;
    let checkpoint = match std::fs::read(dir.join(CHECKPOINT)) {
        Ok(bytes) => Checkpoint::decode(&bytes, shard).or_else(|| {
            tracing::warn!(dir = %dir.display(), "the L3 checkpoint is damaged; replaying the journal alone");
            None
        }),
        Err(e) if e.kind() == io::ErrorKind::NotFound => None,
        Err(e) => return Err(e),
    };
    let mut segments: Vec<u64> = std::fs::read_dir(dir)?
        .filter_map(|e| e.ok())
        .filter_map(|e| segment_of(&e.file_name().to_string_lossy()))
        .collect();
    segments.sort_unstable();
    let replay_from = checkpoint.as_ref().map_or(0, |c| c.replay_from);

    let mut namespaces: FxHashMap<u32, Namespace> = FxHashMap::default();
    let journal_bytes: u64 = segments
        .iter()
        .filter(|s| **s >= replay_from)
        .filter_map(|s| std::fs::metadata(segment_path(dir, *s)).ok())
        .map(|m| m.len())
        .sum();
    let expected =
        checkpoint.as_ref().map_or(0, |c| c.entries.len()) + (journal_bytes / 69) as usize;
    let mut live = Live::with_capacity(expected);
    let mut next_generation = 1;
    if let Some(c) = &checkpoint {
        namespaces.extend(c.namespaces.iter().cloned());
        for e in &c.entries {
            live.put(*e);
        }
        next_generation = c.next_generation;
    }
    let mut replayed = 0u64;
    let mut stop = false;
    for &seq in &segments {
        let path = segment_path(dir, seq);
        if seq < replay_from || stop {
            // Covered by the checkpoint, or after a damaged record: never replayed.
            std::fs::remove_file(&path)?;
            continue;
        }
        let bytes = std::fs::read(&path)?;
        if parse_journal_header(&bytes, shard) != Some(seq) {
            tracing::warn!(path = %path.display(), "L3 journal segment without a valid header; replay stops here");
            std::fs::remove_file(&path)?;
            stop = true;
            continue;
        }
        let mut at = JOURNAL_HEADER;
        while at < bytes.len() {
            let Some((record, used)) = Record::decode(&bytes[at..]) else {
                tracing::warn!(
                    path = %path.display(),
                    offset = at,
                    "L3 journal ends in a torn or corrupt record; replay stops here"
                );
                std::fs::OpenOptions::new()
                    .write(true)
                    .open(&path)?
                    .set_len(at as u64)?;
                stop = true;
                break;
            };
            at += used;
            replayed += 1;
            match record {
                Record::Put(p) => {
                    next_generation = next_generation.max(p.generation + 1);
                    live.put(p);
                }
                Record::Evict { generation, hash } => live.evict(generation, hash),
                Record::Namespace { id, ns } => {
                    namespaces.insert(id, ns);
                }
            }
        }
    }

    let before = live.at.len();
    // In put order: least recently used first.
    let mut entries: Vec<PutRecord> = live
        .entries
        .into_iter()
        .flatten()
        .filter(|p| p.expires_at.is_none_or(|t| t > now))
        .filter(|p| namespaces.contains_key(&p.ns))
        .collect();
    let extents: Vec<(u32, u32, u32)> = entries
        .iter()
        .map(|p| (p.container, p.start, p.units))
        .collect();
    let priority: Vec<u64> = entries.iter().map(|p| p.generation).collect();
    let units = geo.container_units();
    let conflicts = Allocator::conflicts(&extents, &priority, geo.containers, units);
    if !conflicts.is_empty() {
        let mut doomed = conflicts.into_iter().peekable();
        let mut i = 0;
        entries.retain(|_| {
            let gone = doomed.next_if_eq(&i).is_some();
            i += 1;
            !gone
        });
    }
    let used = entries
        .iter()
        .map(|p| (p.container, p.start, p.units))
        .collect();
    let mut namespaces: Vec<(u32, Namespace)> = namespaces.into_iter().collect();
    namespaces.sort_unstable_by_key(|(id, _)| *id);
    Ok(Recovered {
        dropped: (before - entries.len()) as u64,
        entries,
        namespaces,
        next_generation,
        next_segment: segments
            .last()
            .map_or(replay_from, |s| (s + 1).max(replay_from)),
        allocator: Allocator::with_used(geo.containers, units, used),
        replayed,
    })
}

/// The live entries during replay, in put order: a vector with holes where an entry was
/// replaced or evicted, and each key hash's position in it — so the result needs no sort, and
/// the map holds positions, not records.
struct Live {
    entries: Vec<Option<PutRecord>>,
    at: FxHashMap<u128, usize>,
}

impl Live {
    fn with_capacity(n: usize) -> Self {
        let mut at = FxHashMap::default();
        at.reserve(n);
        Self {
            entries: Vec::with_capacity(n),
            at,
        }
    }

    /// `p` replaces whatever its key held.
    fn put(&mut self, p: PutRecord) {
        if let Some(old) = self.at.insert(p.hash, self.entries.len()) {
            self.entries[old] = None;
        }
        self.entries.push(Some(p));
    }

    /// Removes the entry for `hash` if it is still generation `generation`.
    fn evict(&mut self, generation: u64, hash: u128) {
        if let Some(&i) = self.at.get(&hash)
            && self.entries[i].is_some_and(|p| p.generation == generation)
        {
            self.entries[i] = None;
            self.at.remove(&hash);
        }
    }
}
