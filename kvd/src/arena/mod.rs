//! The shared arena: a memfd the daemon maps read-write and hands to clients over
//! `SCM_RIGHTS`, cut into fixed-size slots that hold L2 values. A client that mapped it reads a
//! value straight from memory (`get_shared_response` carries only an offset, a length and a
//! version) and writes one straight into memory (`set_reserve` → write → `set_commit`).
//!
//! # Layout
//! ```text
//! arena:  | slot 0 | slot 1 | ... | slot n-1 | unused tail |      n = arena_bytes / slot_size
//! slot:   | u32 LE version | u32 LE length | 8 reserved (0) | payload (slot_size - 16 bytes) |
//!         ^ slot * slot_size                                ^ payload offset (on the wire)
//! ```
//! `slot_size` is `--shared-arena-slot-bytes` when given, else decided by the first write like
//! upstream: `round_up(first_length + 16, 64)` — but only by a write for which at least
//! [`MIN_SLOTS`] slots fit the arena; a larger (or absurd, up to `2^64 - 1`) length is refused
//! as oversize and leaves the size undecided, so one request can neither panic the daemon nor
//! shrink or swell the grid for good. It never changes afterwards (clients cache it from
//! `hello_ack`). Values that do not fit a slot live on the heap and are answered inline.
//!
//! # Versions (a seqlock per slot)
//! The daemon is the only writer of headers. A slot being filled has an odd version; publishing
//! stores the length, then the next even version (release order). A reader loads the version
//! (acquire), requires it even and equal to the one it was told, reads the payload, and loads
//! the version again: any change means a torn read, which the reader retries or treats as a
//! miss. Every reuse of a slot bumps the version, so a stale `(offset, version)` never
//! validates against a new tenant's bytes.
//!
//! # Ownership
//! A slot is `Free`, `Writing` (taken for an inline set or a lease; not yet visible), `Owned`
//! (holds a committed L2 value) or `Retired` (its entry left while the daemon still reads it:
//! an inline reply or an L3 write holds a [`pin`](Arena::pin)); a retired slot is freed when
//! its last pin drops. Leases belong to a connection and die with it. Which entry owns which
//! slot, and eviction by retention class, are the L2 store's business (`crate::store`): the
//! arena only places bytes.
//!
//! # Backing
//! A plain memfd (4 KiB pages, allocated on first touch), or with [`Backing::hugetlb`]
//! (`--shared-arena-hugetlb`) 2 MiB hugepages: `MFD_HUGETLB | MFD_HUGE_2MB`, the size rounded
//! up to 2 MiB. The kernel reserves every hugepage when the arena is mapped, so too few free
//! ones is an error at startup that says how to reserve them; a kernel without hugetlb memfds
//! gets a warning and 4 KiB pages, as in the Python kvd. The daemon takes it from
//! `KvdOptions::arena_backing`; [`Arena::new`] is plain.

mod fdpass;

pub use fdpass::{recv_fd, send_fd};

use crate::proto::SharedSlot;
use crate::stats::ArenaStats;
use crate::sys::shm::SharedMap;
use bytes::Bytes;
use infera_core::event::Retention;
use rustc_hash::FxHashMap;
use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

/// Bytes of the slot header.
pub const HEADER_BYTES: u64 = 16;
/// The hugepage size of a [`Backing::hugetlb`] arena.
pub const HUGE_PAGE_BYTES: u64 = 2 << 20;
const NAME: &str = "infera-kvd-arena";

/// How the arena's memory is backed (see the module docs).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Backing {
    /// 2 MiB hugepages (`--shared-arena-hugetlb`).
    pub hugetlb: bool,
}

/// Slot sizes are multiples of this.
pub const SLOT_ALIGN: u64 = 64;
/// A first write decides the slot size only if at least this many such slots fit the arena.
pub const MIN_SLOTS: u64 = 4;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Free,
    Writing,
    Owned,
    Retired,
}

#[derive(Debug, Clone, Copy)]
struct Meta {
    state: State,
    pins: u32,
    version: u32,
}

/// A `set_reserve` lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lease {
    /// The slot the client writes into.
    pub slot: u32,
    /// The connection that owns it.
    pub conn: u64,
    /// The most bytes the client may commit.
    pub max_len: u64,
}

/// Why no slot could be taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TakeError {
    /// The value (plus header) does not fit the slot size, or the arena holds no slot at all.
    Oversize,
    /// Every slot is in use.
    Full,
}

#[derive(Debug)]
struct Slots {
    slot_size: u64,
    meta: Vec<Meta>,
    free: Vec<u32>,
    owned: u64,
    leases: FxHashMap<u64, Lease>,
    next_token: u64,
    demotions_total: u64,
}

/// See the module docs.
#[derive(Debug)]
pub struct Arena {
    map: SharedMap,
    bytes: u64,
    /// Backed by 2 MiB hugepages.
    hugetlb: bool,
    pid: u32,
    /// `Slots::slot_size`, readable without the lock (set once).
    slot_size: AtomicU64,
    slots: Mutex<Slots>,
}

impl Arena {
    /// Creates an arena of `bytes`, with a fixed `slot_bytes` or (when `None`) a slot size
    /// decided by the first write.
    ///
    /// # Errors
    /// The kernel's error creating or mapping the memfd.
    pub fn new(bytes: u64, slot_bytes: Option<u64>) -> io::Result<Self> {
        Self::with_backing(bytes, slot_bytes, Backing::default())
    }

    /// [`Arena::new`] with the given backing; a hugetlb arena holds `bytes` rounded up to
    /// [`HUGE_PAGE_BYTES`].
    ///
    /// # Errors
    /// As [`Arena::new`]; for a hugetlb arena too few free hugepages, with what to do.
    pub fn with_backing(bytes: u64, slot_bytes: Option<u64>, backing: Backing) -> io::Result<Self> {
        let (map, hugetlb) = match backing.hugetlb.then(|| map_hugetlb(bytes)).flatten() {
            Some(map) => (map?, true),
            None => (SharedMap::create(NAME, bytes as usize)?, false),
        };
        let bytes = map.len() as u64;
        let arena = Self {
            map,
            bytes,
            hugetlb,
            pid: std::process::id(),
            slot_size: AtomicU64::new(0),
            slots: Mutex::new(Slots {
                slot_size: 0,
                meta: Vec::new(),
                free: Vec::new(),
                owned: 0,
                leases: FxHashMap::default(),
                next_token: 1,
                demotions_total: 0,
            }),
        };
        if let Some(size) = slot_bytes {
            let size = size.max(HEADER_BYTES + 1).div_ceil(SLOT_ALIGN) * SLOT_ALIGN;
            arena.init_grid(&mut arena.lock(), size);
        }
        Ok(arena)
    }

    fn lock(&self) -> MutexGuard<'_, Slots> {
        // Slot bookkeeping is updated in single statements; a panic cannot leave it torn.
        self.slots.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn init_grid(&self, s: &mut Slots, slot_size: u64) {
        let count = (self.bytes / slot_size).min(u64::from(u32::MAX - 1)) as u32;
        s.slot_size = slot_size;
        self.slot_size.store(slot_size, Ordering::Release);
        s.meta = vec![
            Meta {
                state: State::Free,
                pins: 0,
                version: 0,
            };
            count as usize
        ];
        s.free = (0..count).rev().collect();
        tracing::info!(
            slot_size,
            slots = count,
            arena_bytes = self.bytes,
            "kvd shared arena slot grid ready"
        );
        if count == 0 {
            tracing::warn!(
                slot_size,
                arena_bytes = self.bytes,
                "the shared arena is smaller than one slot: every value is kept on the heap \
                 and set_reserve is refused; raise --shared-arena-bytes"
            );
        }
    }

    /// Whether the arena is backed by 2 MiB hugepages.
    pub fn hugetlb(&self) -> bool {
        self.hugetlb
    }

    /// The memfd, for `SCM_RIGHTS`.
    pub fn fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.map.fd()
    }

    /// `hello_ack.shared_arena`: `[arena_size, slot_size, server_pid]`.
    pub fn info(&self) -> [u64; 3] {
        [self.bytes, self.slot_size(), u64::from(self.pid)]
    }

    /// The slot size (0 while undecided).
    pub fn slot_size(&self) -> u64 {
        self.slot_size.load(Ordering::Acquire)
    }

    /// The payload offset of `slot`.
    pub fn payload_offset(&self, slot: u32) -> u64 {
        u64::from(slot) * self.slot_size() + HEADER_BYTES
    }

    /// Takes a free slot for a value of `len` bytes and marks it `Writing` (odd version).
    ///
    /// # Errors
    /// [`TakeError::Oversize`] or [`TakeError::Full`].
    pub fn take(&self, len: u64) -> Result<u32, TakeError> {
        let mut s = self.lock();
        let Some(needed) = len.checked_add(HEADER_BYTES) else {
            return Err(TakeError::Oversize);
        };
        if s.slot_size == 0 {
            let size = needed.div_ceil(SLOT_ALIGN).saturating_mul(SLOT_ALIGN);
            if size.saturating_mul(MIN_SLOTS) > self.bytes {
                return Err(TakeError::Oversize);
            }
            self.init_grid(&mut s, size);
        }
        if s.meta.is_empty() || needed > s.slot_size {
            return Err(TakeError::Oversize);
        }
        let slot = s.free.pop().ok_or(TakeError::Full)?;
        let base = u64::from(slot) * s.slot_size;
        let m = &mut s.meta[slot as usize];
        m.state = State::Writing;
        m.version = m
            .version
            .wrapping_add(if m.version.is_multiple_of(2) { 1 } else { 2 });
        self.map.store_u32(base as usize + 4, 0, Ordering::Relaxed);
        self.map
            .store_u32(base as usize, m.version.to_le(), Ordering::Release);
        Ok(slot)
    }

    /// Copies `data` into a `Writing` slot's payload (no lock held).
    pub fn write(&self, slot: u32, data: &[u8]) {
        let offset = self.payload_offset(slot);
        self.map.write(offset as usize, data);
    }

    /// Publishes a `Writing` slot holding `len` bytes: stores the length and the next even
    /// version. Returns that version.
    pub fn publish(&self, slot: u32, len: u64) -> u32 {
        let mut s = self.lock();
        let base = (u64::from(slot) * s.slot_size) as usize;
        let m = &mut s.meta[slot as usize];
        debug_assert_eq!(m.state, State::Writing);
        m.state = State::Owned;
        m.version = m.version.wrapping_add(1);
        let version = m.version;
        s.owned += 1;
        self.map
            .store_u32(base + 4, (len as u32).to_le(), Ordering::Relaxed);
        self.map.store_u32(base, version.to_le(), Ordering::Release);
        version
    }

    /// Gives a slot back: an owned slot is freed (or retired while pinned), a writing one freed.
    pub fn release(&self, slot: u32) {
        let mut s = self.lock();
        let m = &mut s.meta[slot as usize];
        match m.state {
            State::Owned if m.pins > 0 => {
                m.state = State::Retired;
                s.owned -= 1;
            }
            State::Owned => {
                m.state = State::Free;
                s.owned -= 1;
                s.free.push(slot);
            }
            State::Writing => {
                m.state = State::Free;
                s.free.push(slot);
            }
            State::Free | State::Retired => {}
        }
    }

    /// Lends the `len` payload bytes of an owned slot as [`Bytes`]; the slot cannot be reused
    /// until the returned value (and every clone) is dropped. `None` when not owned.
    pub fn pin(self: &Arc<Self>, slot: u32, len: u64) -> Option<Bytes> {
        let offset = {
            let mut s = self.lock();
            let slot_size = s.slot_size;
            let m = s.meta.get_mut(slot as usize)?;
            if m.state != State::Owned {
                return None;
            }
            m.pins += 1;
            u64::from(slot) * slot_size + HEADER_BYTES
        };
        Some(Bytes::from_owner(Pinned {
            arena: self.clone(),
            slot,
            offset: offset as usize,
            len: len as usize,
        }))
    }

    fn unpin(&self, slot: u32) {
        let mut s = self.lock();
        let m = &mut s.meta[slot as usize];
        m.pins -= 1;
        if m.pins == 0 && m.state == State::Retired {
            m.state = State::Free;
            s.free.push(slot);
        }
    }

    /// A copy of an owned slot's payload (to move an entry to the heap).
    pub fn copy_out(&self, slot: u32, len: u64) -> Bytes {
        let offset = self.payload_offset(slot);
        let mut out = vec![0u8; len as usize];
        self.map.read_into(offset as usize, &mut out);
        Bytes::from(out)
    }

    /// What `get_shared_response` says about an owned slot.
    pub fn shared_slot(
        &self,
        slot: u32,
        len: u64,
        version: u32,
        retention: Retention,
    ) -> SharedSlot {
        let slot_size = self.slot_size();
        SharedSlot {
            slot_offset: u64::from(slot) * slot_size + HEADER_BYTES,
            length: len,
            version: u64::from(version),
            retention: Some(retention),
            slot_size,
        }
    }

    /// Records a lease of a `Writing` slot for `conn`; returns its token (never 0).
    pub fn open_lease(&self, conn: u64, slot: u32) -> u64 {
        let mut s = self.lock();
        let token = s.next_token;
        s.next_token += 1;
        let max_len = s.slot_size - HEADER_BYTES;
        s.leases.insert(
            token,
            Lease {
                slot,
                conn,
                max_len,
            },
        );
        token
    }

    /// Ends a lease for commit, checking its owner; the slot stays `Writing` for the caller.
    ///
    /// # Errors
    /// `unknown_lease` or `wrong_owner` (the lease is then left as it was).
    pub fn end_lease(&self, token: u64, conn: u64) -> Result<Lease, &'static str> {
        let mut s = self.lock();
        match s.leases.get(&token) {
            None => Err("unknown_lease"),
            Some(l) if l.conn != conn => Err("wrong_owner"),
            Some(_) => s.leases.remove(&token).ok_or("unknown_lease"),
        }
    }

    /// Cancels a lease of `conn` and frees its slot; false when unknown or not `conn`'s.
    pub fn cancel_lease(&self, token: u64, conn: u64) -> bool {
        match self.end_lease(token, conn) {
            Ok(lease) => {
                self.release(lease.slot);
                true
            }
            Err(_) => false,
        }
    }

    /// Cancels every lease of `conn` (it disconnected); returns how many.
    pub fn cancel_connection(&self, conn: u64) -> usize {
        let doomed: Vec<u64> = self
            .lock()
            .leases
            .iter()
            .filter(|(_, l)| l.conn == conn)
            .map(|(t, _)| *t)
            .collect();
        doomed
            .iter()
            .filter(|t| self.cancel_lease(**t, conn))
            .count()
    }

    /// Counts an entry moved to the heap to free its slot.
    pub fn note_demotion(&self) {
        self.lock().demotions_total += 1;
    }

    /// The arena's counters (`entries` is the number of owned slots).
    pub fn stats(&self) -> ArenaStats {
        let s = self.lock();
        ArenaStats {
            bytes: self.bytes,
            slot_bytes: s.slot_size,
            slots: s.meta.len() as u64,
            entries: s.owned,
            leases: s.leases.len() as u64,
            demotions_total: s.demotions_total,
        }
    }

    /// The header of the slot whose payload starts at `payload_offset`: `(version, length)`.
    pub fn header(&self, payload_offset: u64) -> (u32, u32) {
        read_header(&self.map, payload_offset).unwrap_or((1, 0))
    }
}

/// Reads the slot header before `payload_offset` in any mapping of an arena (the daemon's or a
/// client's): `(version, length)`, or `None` when the offset is not past a header.
pub fn read_header(map: &SharedMap, payload_offset: u64) -> Option<(u32, u32)> {
    let base = payload_offset.checked_sub(HEADER_BYTES)? as usize;
    if !base.is_multiple_of(4) || base + HEADER_BYTES as usize > map.len() {
        return None;
    }
    let version = u32::from_le(map.load_u32(base, Ordering::Acquire));
    let len = u32::from_le(map.load_u32(base + 4, Ordering::Acquire));
    Some((version, len))
}

/// A hugetlb memfd of `bytes` rounded up to [`HUGE_PAGE_BYTES`], mapped; `None` (after a
/// warning) when the kernel offers no hugetlb memfd, to fall back to 4 KiB pages.
fn map_hugetlb(bytes: u64) -> Option<io::Result<SharedMap>> {
    use rustix::fs::MemfdFlags;
    let len = bytes.div_ceil(HUGE_PAGE_BYTES).max(1) * HUGE_PAGE_BYTES;
    let flags = MemfdFlags::CLOEXEC | MemfdFlags::HUGETLB | MemfdFlags::HUGE_2MB;
    let fd = match rustix::fs::memfd_create(NAME, flags) {
        Ok(fd) => fd,
        Err(error) => {
            tracing::warn!(
                %error,
                "--shared-arena-hugetlb: the kernel offers no hugetlb memfd; the shared arena \
                 uses 4 KiB pages"
            );
            return None;
        }
    };
    let mapped = rustix::fs::ftruncate(&fd, len)
        .map_err(io::Error::from)
        .and_then(|()| SharedMap::open(fd, len as usize, true, false));
    Some(match mapped {
        Ok(map) => {
            tracing::info!(arena_bytes = len, "kvd shared arena on 2 MiB hugepages");
            Ok(map)
        }
        Err(error) => Err(hugetlb_error(&error, len, meminfo_value("HugePages_Free"))),
    })
}

/// The error of a hugetlb arena the kernel would not map: how many pages it needs and how
/// many are free (`HugePages_Free`), and how to reserve them.
fn hugetlb_error(error: &io::Error, len: u64, free: Option<u64>) -> io::Error {
    let pages = len / HUGE_PAGE_BYTES;
    let free = free.map_or_else(|| "an unknown number".to_owned(), |n| n.to_string());
    io::Error::new(
        error.kind(),
        format!(
            "--shared-arena-hugetlb: cannot map {pages} 2 MiB hugepages ({error}), {free} \
             free (HugePages_Free); reserve more (sysctl -w vm.nr_hugepages=N) or drop the \
             flag (and INFERA_KVD_ARENA_HUGETLB)"
        ),
    )
}

/// A count from `/proc/meminfo` (e.g. `HugePages_Free`).
fn meminfo_value(key: &str) -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    meminfo_field(&text, key)
}

fn meminfo_field(text: &str, key: &str) -> Option<u64> {
    text.lines().find_map(|line| {
        let (name, value) = line.split_once(':')?;
        (name.trim() == key).then(|| value.split_whitespace().next()?.parse().ok())?
    })
}

/// The owner behind [`Arena::pin`]'s `Bytes`.
#[derive(Debug)]
struct Pinned {
    arena: Arc<Arena>,
    slot: u32,
    offset: usize,
    len: usize,
}

impl AsRef<[u8]> for Pinned {
    fn as_ref(&self) -> &[u8] {
        // The slot is pinned: the daemon neither reuses nor writes it while this lives.
        self.arena.map.slice(self.offset, self.len)
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        self.arena.unpin(self.slot);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_hugetlb_arena_is_whole_hugepages_or_a_clear_error() {
        match Arena::with_backing(3 << 20, None, Backing { hugetlb: true }) {
            Ok(arena) if arena.hugetlb() => {
                assert_eq!(arena.info()[0], 4 << 20, "rounded up to 2 MiB pages");
            }
            // No hugetlb memfd in this kernel: a warning and 4 KiB pages.
            Ok(arena) => assert_eq!(arena.info()[0], 3 << 20),
            Err(error) => {
                let message = error.to_string();
                assert!(
                    message.contains("cannot map 2 2 MiB hugepages"),
                    "{message}"
                );
                assert!(message.contains("vm.nr_hugepages"), "{message}");
            }
        }
        let plain = Arena::with_backing(3 << 20, None, Backing::default()).unwrap();
        assert!(!plain.hugetlb());
        assert_eq!(plain.info()[0], 3 << 20);
    }

    #[test]
    fn the_hugetlb_error_says_what_is_free_and_how_to_reserve() {
        let enomem = io::Error::from_raw_os_error(12);
        let error = hugetlb_error(&enomem, 8 << 20, Some(1));
        assert_eq!(error.kind(), enomem.kind());
        let message = error.to_string();
        assert!(message.starts_with("--shared-arena-hugetlb: cannot map 4 2 MiB hugepages"));
        assert!(message.contains("1 free"), "{message}");
        assert!(message.contains("sysctl -w vm.nr_hugepages=N"), "{message}");
        assert!(
            hugetlb_error(&enomem, 2 << 20, None)
                .to_string()
                .contains("an unknown number")
        );
        let meminfo =
            "HugePages_Total:       4\nHugePages_Free:        3\nHugepagesize:    2048 kB\n";
        assert_eq!(meminfo_field(meminfo, "HugePages_Free"), Some(3));
        assert_eq!(meminfo_field(meminfo, "Hugepagesize"), Some(2048));
        assert_eq!(meminfo_field(meminfo, "HugePages_Rsvd"), None);
    }

    #[test]
    fn slots_cycle_through_versions_and_pins_defer_reuse() {
        let arena = Arc::new(Arena::new(1000, None).unwrap());
        assert_eq!(arena.info()[1], 0, "undecided until the first write");
        let a = arena.take(100).unwrap();
        assert_eq!(arena.slot_size(), 128);
        assert_eq!(arena.take(200), Err(TakeError::Oversize));
        let off = arena.payload_offset(a);
        assert_eq!(arena.header(off).0 % 2, 1, "odd while writing");
        arena.write(a, &[7u8; 100]);
        let v = arena.publish(a, 100);
        assert_eq!(arena.header(off), (v, 100));
        assert_eq!(v % 2, 0);
        let pinned = arena.pin(a, 100).unwrap();
        arena.release(a);
        // 7 slots of 128 in 1000 bytes; `a` is retired, not free.
        let taken: Vec<u32> = (0..6).map(|_| arena.take(1).unwrap()).collect();
        assert!(!taken.contains(&a));
        assert_eq!(arena.take(1), Err(TakeError::Full));
        assert_eq!(&pinned[..], &[7u8; 100][..]);
        drop(pinned);
        let again = arena.take(1).unwrap();
        assert_eq!(again, a, "freed when the last pin dropped");
        assert!(arena.header(off).0 > v, "reuse bumps the version");
    }

    #[test]
    fn absurd_first_lengths_are_oversize_and_leave_the_slot_size_undecided() {
        let arena = Arena::new(1 << 20, None).unwrap();
        for len in [
            u64::MAX,
            u64::MAX - 15,
            u64::MAX - 64,
            1 << 63,
            1 << 20,
            (1 << 18) - 15,
        ] {
            assert_eq!(arena.take(len), Err(TakeError::Oversize), "{len}");
            assert_eq!(arena.slot_size(), 0, "{len} must not decide the slot size");
        }
        assert!(arena.take((1 << 18) - 16).is_ok(), "four slots fit");
        assert_eq!(arena.slot_size(), 1 << 18);
        assert_eq!(arena.take(u64::MAX), Err(TakeError::Oversize));
        assert_eq!(arena.slot_size(), 1 << 18);
    }

    #[test]
    fn leases_belong_to_their_connection() {
        let arena = Arena::new(4096, Some(1000)).unwrap();
        assert_eq!(arena.slot_size(), 1024);
        let slot = arena.take(10).unwrap();
        let token = arena.open_lease(7, slot);
        assert_eq!(arena.end_lease(token, 8), Err("wrong_owner"));
        assert!(!arena.cancel_lease(token, 8));
        assert_eq!(arena.stats().leases, 1);
        assert_eq!(arena.cancel_connection(7), 1);
        assert_eq!(arena.end_lease(token, 7), Err("unknown_lease"));
        assert_eq!(arena.stats().leases, 0);
        let s2 = arena.take(10).unwrap();
        let t2 = arena.open_lease(1, s2);
        assert_eq!(arena.end_lease(t2, 1).unwrap().max_len, 1024 - 16);
    }
}
