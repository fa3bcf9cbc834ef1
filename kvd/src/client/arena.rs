//! [`ClientArena`]: a client's mapping of the daemon's shared arena, and the reader side of
//! the slot seqlock (see [`crate::arena`] for the layout).
//!
//! A read is valid only if the slot header shows the version the daemon announced, even,
//! with the announced length, both before and after the bytes are used; otherwise the slot
//! was rewritten meanwhile (torn) and the read answers `None`, which callers treat as a miss.

use crate::arena::{HEADER_BYTES, read_header};
use crate::proto::SharedSlot;
use crate::sys::shm::SharedMap;
use bytes::Bytes;
use std::io;
use std::os::fd::OwnedFd;

/// See the module docs.
#[derive(Debug)]
pub struct ClientArena {
    map: SharedMap,
    slot_size: u64,
    server_pid: u64,
}

impl ClientArena {
    /// Maps the descriptor received after `hello_ack{shared_arena: [size, slot, pid]}`,
    /// read-write (for `set_reserve` writes), faulting the pages in now.
    ///
    /// # Errors
    /// When the descriptor is smaller than announced or cannot be mapped.
    pub fn open(fd: OwnedFd, info: [u64; 3]) -> io::Result<Self> {
        Ok(Self {
            map: SharedMap::open(fd, info[0] as usize, true, true)?,
            slot_size: info[1],
            server_pid: info[2],
        })
    }

    /// The arena's size.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Whether the arena is empty (never).
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// The slot size announced at `hello` (0 when the daemon had not decided it yet).
    pub fn slot_size(&self) -> u64 {
        self.slot_size
    }

    /// The daemon's pid.
    pub fn server_pid(&self) -> u64 {
        self.server_pid
    }

    fn stable(&self, slot: &SharedSlot) -> bool {
        read_header(&self.map, slot.slot_offset).is_some_and(|(v, len)| {
            v % 2 == 0 && u64::from(v) == slot.version && u64::from(len) == slot.length
        })
    }

    fn in_bounds(&self, slot: &SharedSlot) -> bool {
        slot.slot_offset >= HEADER_BYTES
            && slot
                .slot_offset
                .checked_add(slot.length)
                .is_some_and(|end| end <= self.map.len() as u64)
    }

    /// Runs `f` over the slot's bytes in place (zero-copy) and returns its result if the slot
    /// stayed stable throughout; `None` when torn or out of bounds. `f` may see bytes being
    /// rewritten, so it must not act on them before this returns `Some`.
    pub fn read<R>(&self, slot: &SharedSlot, f: impl FnOnce(&[u8]) -> R) -> Option<R> {
        if !self.in_bounds(slot) || !self.stable(slot) {
            return None;
        }
        let r = f(self
            .map
            .slice(slot.slot_offset as usize, slot.length as usize));
        self.stable(slot).then_some(r)
    }

    /// Whether `slot` lies in the arena and its header still shows the announced version and
    /// length: checked before and after a caller reads the bytes in place through
    /// [`ClientArena::base`] (a reader that raced a rewrite sees `false` afterwards).
    pub fn is_valid(&self, slot: &SharedSlot) -> bool {
        self.in_bounds(slot) && self.stable(slot)
    }

    /// The mapping's first byte, for handing the arena to code that addresses memory by
    /// pointer (a buffer-protocol view, registering the pages with a GPU driver). The pointer
    /// is valid for [`ClientArena::len`] bytes while `self` lives; the slot rules above say
    /// which bytes may be read or written.
    pub fn base(&self) -> *const u8 {
        self.map.slice(0, self.map.len()).as_ptr()
    }

    /// Copies the slot's bytes out; `None` when torn.
    pub fn copy(&self, slot: &SharedSlot) -> Option<Bytes> {
        if !self.in_bounds(slot) || !self.stable(slot) {
            return None;
        }
        let mut out = vec![0u8; slot.length as usize];
        self.map.read_into(slot.slot_offset as usize, &mut out);
        self.stable(slot).then(|| Bytes::from(out))
    }

    /// Writes a value into a reserved slot's payload (`set_reserve`'s `payload_offset`).
    ///
    /// # Errors
    /// `InvalidInput` when it does not fit the payload or the arena.
    pub fn write(&self, payload_offset: u64, max: u64, data: &[u8]) -> io::Result<()> {
        let end = payload_offset.checked_add(data.len() as u64);
        if data.len() as u64 > max || end.is_none_or(|e| e > self.map.len() as u64) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "{} bytes do not fit the reserved slot ({max} bytes)",
                    data.len()
                ),
            ));
        }
        self.map.write(payload_offset as usize, data);
        Ok(())
    }
}
