//! Syncing a [`Shard`] and checkpointing its index: a walk of the index in chunks, so the data
//! path waits at most one chunk's copy (see [`Shard::checkpoint`]).

use super::{CHECKPOINT_CHUNK, Shard};
use crate::proto::Namespace;
use crate::tablespace::layout::{Checkpoint, PutRecord};
use crate::tablespace::recover::CHECKPOINT;
use std::fs::File;
use std::io;

impl Shard {
    /// Syncs the containers (buffered mode) and the journal.
    pub fn sync(&self) -> io::Result<()> {
        if !self.direct {
            for f in self.files.iter() {
                f.sync_data()?;
            }
        }
        self.journal.flush()
    }

    /// Writes a checkpoint of the index and removes the journal segments it replaces
    /// (blocking). The index is copied [`CHECKPOINT_CHUNK`] entries per hold of the shard lock,
    /// yielding the CPU in between, so puts and gets wait at most one chunk's copy, never the
    /// whole walk (see [`Shard::checkpoint_in_chunks`]).
    ///
    /// # Errors
    /// The I/O error; the previous checkpoint and the journal then stay in force.
    pub fn checkpoint(&self) -> io::Result<()> {
        self.checkpoint_in_chunks(CHECKPOINT_CHUNK, |_| std::thread::yield_now())
    }

    /// [`Shard::checkpoint`], copying `chunk` entries per hold of the lock and calling
    /// `between(n)` after the `n`th chunk with the lock released (where tests change the index).
    ///
    /// Why a walk in chunks is a valid checkpoint: one short hold rotates the journal and notes
    /// the first generation not yet given out, and the namespaces. Every change after that is
    /// in the new segment, which recovery replays over the checkpoint. The walk then keeps only
    /// entries of older generations: each existed at the rotation and keeps its slab position
    /// until removed, so it is copied once if still held when its chunk is walked, and if it left
    /// before, its eviction is in the replayed segment (which also ignores evictions of entries
    /// the checkpoint lacks). Newer entries are skipped: their puts are all in the replayed
    /// segment. The recency stamps sort the copy back into least-recently-used order.
    pub(super) fn checkpoint_in_chunks(
        &self,
        chunk: usize,
        mut between: impl FnMut(usize),
    ) -> io::Result<()> {
        let _only = self.checkpointing.lock().unwrap_or_else(|p| p.into_inner());
        let (segment, first_new, namespaces, slots) = {
            let st = self.lock();
            let segment = self.journal.rotate();
            let mut namespaces: Vec<(u32, Namespace)> =
                st.ns_names.iter().map(|(i, n)| (*i, n.clone())).collect();
            namespaces.sort_unstable_by_key(|(i, _)| *i);
            (segment, st.next_generation, namespaces, st.index.slots())
        };
        let mut entries: Vec<(u64, PutRecord)> = Vec::with_capacity(slots);
        for (n, at) in (0..slots).step_by(chunk.max(1)).enumerate() {
            {
                let st = self.lock();
                let held = st
                    .index
                    .slot_range(at..(at + chunk).min(slots))
                    .filter(|(_, _, _, s)| s.generation < first_new)
                    .map(|(hash, class, stamp, s)| {
                        let record = PutRecord {
                            generation: s.generation,
                            hash,
                            ns: s.ns,
                            class,
                            expires_at: s.expires_at,
                            container: s.container,
                            start: s.start,
                            units: s.units,
                            value_len: s.value_len,
                        };
                        (stamp, record)
                    });
                entries.extend(held);
            }
            between(n);
        }
        entries.sort_unstable_by_key(|(stamp, _)| *stamp);
        let cp = Checkpoint {
            replay_from: segment,
            next_generation: first_new,
            namespaces,
            entries: entries.into_iter().map(|(_, e)| e).collect(),
        };
        self.sync()?;
        let bytes = cp.encode(self.id);
        let tmp = self.dir.join("checkpoint.tmp");
        {
            let mut f = crate::tablespace::io::create_private(&tmp)?;
            io::Write::write_all(&mut f, &bytes)?;
            f.sync_all()?;
        }
        std::fs::rename(&tmp, self.dir.join(CHECKPOINT))?;
        File::open(&self.dir)?.sync_all()?;
        for entry in std::fs::read_dir(&self.dir)?.filter_map(|e| e.ok()) {
            let name = entry.file_name();
            if crate::tablespace::journal::segment_of(&name.to_string_lossy())
                .is_some_and(|s| s < segment)
            {
                std::fs::remove_file(entry.path())?;
            }
        }
        Ok(())
    }
}
