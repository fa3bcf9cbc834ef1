//! [`SharedMap`]: a `memfd` mapped `MAP_SHARED`, the backing of the shared arena. The daemon
//! creates it ([`SharedMap::create`]); a client maps the descriptor it received over
//! `SCM_RIGHTS` ([`SharedMap::open`]). Other processes read and write the same pages, so:
//! - 32-bit header words are accessed only as atomics ([`SharedMap::load_u32`],
//!   [`SharedMap::store_u32`]), which is what makes the seqlock of the slot header well defined;
//! - payload bytes are copied in and out through raw pointers ([`SharedMap::write`],
//!   [`SharedMap::read_into`]); a reader that raced a writer copies garbage, which the seqlock
//!   version check then rejects;
//! - [`SharedMap::slice`] lends a plain `&[u8]` only for ranges the protocol guarantees nobody
//!   writes while it is borrowed (a committed slot the daemon has pinned, or a slot a reader
//!   validates before and after use).
//!
//! Every offset is bounds-checked; out-of-range access panics rather than touching memory
//! outside the mapping.

use rustix::fs::MemfdFlags;
use rustix::mm::{MapFlags, ProtFlags};
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, Ordering};

/// See the module docs.
#[derive(Debug)]
pub struct SharedMap {
    ptr: NonNull<u8>,
    len: usize,
    fd: OwnedFd,
}

// SAFETY: the mapping is plain shared memory, valid until `Drop`; all access goes through the
// methods below (atomics for header words, bounds-checked raw copies for payloads).
unsafe impl Send for SharedMap {}
// SAFETY: as above; concurrent use from several threads is the purpose of the type.
unsafe impl Sync for SharedMap {}

impl SharedMap {
    /// Creates a zero-filled memfd of `len` bytes named `name` (visible in `/proc/PID/fd`) and
    /// maps it read-write.
    ///
    /// # Errors
    /// The kernel's error for `memfd_create`, `ftruncate` or `mmap` (e.g. `ENOMEM`).
    pub fn create(name: &str, len: usize) -> io::Result<Self> {
        if len == 0 {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "empty arena"));
        }
        let fd = rustix::fs::memfd_create(name, MemfdFlags::CLOEXEC)?;
        rustix::fs::ftruncate(&fd, len as u64)?;
        Self::map(fd, len, true, false)
    }

    /// Maps a received arena descriptor of `len` bytes; `writable` for `set_reserve` writers,
    /// `populate` to fault every page in now (`MAP_POPULATE`) instead of on first touch.
    ///
    /// # Errors
    /// `InvalidData` when the descriptor is smaller than `len`; the kernel's `mmap` error.
    pub fn open(fd: OwnedFd, len: usize, writable: bool, populate: bool) -> io::Result<Self> {
        let size = rustix::fs::fstat(&fd)?.st_size;
        if size < 0 || (size as u64) < len as u64 || len == 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("the arena descriptor holds {size} bytes, the daemon announced {len}"),
            ));
        }
        Self::map(fd, len, writable, populate)
    }

    fn map(fd: OwnedFd, len: usize, writable: bool, populate: bool) -> io::Result<Self> {
        let prot = if writable {
            ProtFlags::READ | ProtFlags::WRITE
        } else {
            ProtFlags::READ
        };
        let mut flags = MapFlags::SHARED;
        if populate {
            flags |= MapFlags::POPULATE;
        }
        // SAFETY: a fresh mapping chosen by the kernel (null hint), so it aliases no Rust
        // object; `fd` is a valid descriptor of at least `len` bytes (checked by the callers).
        let raw = unsafe { rustix::mm::mmap(std::ptr::null_mut(), len, prot, flags, &fd, 0)? };
        let ptr = NonNull::new(raw.cast::<u8>())
            .ok_or_else(|| io::Error::other("mmap returned a null mapping"))?;
        Ok(Self { ptr, len, fd })
    }

    /// The mapping's length.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the mapping is empty (never, by construction).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The memfd, to pass over `SCM_RIGHTS`.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    fn check(&self, offset: usize, len: usize) {
        let end = offset.checked_add(len);
        assert!(
            end.is_some_and(|e| e <= self.len),
            "arena access [{offset}, +{len}) outside its {} bytes",
            self.len
        );
    }

    fn word(&self, offset: usize) -> &AtomicU32 {
        self.check(offset, 4);
        assert!(offset.is_multiple_of(4), "unaligned arena word at {offset}");
        // SAFETY: in bounds and 4-aligned (checked; the mapping is page-aligned); the pages
        // live as long as `self`; `AtomicU32` has the layout of `u32` and tolerates concurrent
        // access, including from other processes.
        unsafe { &*self.ptr.as_ptr().add(offset).cast::<AtomicU32>() }
    }

    /// Reads the 32-bit word at `offset` (4-aligned).
    pub fn load_u32(&self, offset: usize, order: Ordering) -> u32 {
        self.word(offset).load(order)
    }

    /// Writes the 32-bit word at `offset` (4-aligned).
    pub fn store_u32(&self, offset: usize, value: u32, order: Ordering) {
        self.word(offset).store(value, order);
    }

    /// Copies `data` to `offset`.
    pub fn write(&self, offset: usize, data: &[u8]) {
        self.check(offset, data.len());
        // SAFETY: the destination is in bounds (checked). The only slices of this mapping ever
        // lent are of committed, pinned slots, which are never a write destination, so `data`
        // cannot overlap it.
        unsafe {
            std::ptr::copy_nonoverlapping(data.as_ptr(), self.ptr.as_ptr().add(offset), data.len());
        }
        std::sync::atomic::fence(Ordering::Release);
    }

    /// Copies `out.len()` bytes from `offset` into `out`.
    pub fn read_into(&self, offset: usize, out: &mut [u8]) {
        self.check(offset, out.len());
        std::sync::atomic::fence(Ordering::Acquire);
        // SAFETY: the source is in bounds (checked); `out` is an exclusive borrow, so it is
        // not part of this shared mapping's range being read.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.ptr.as_ptr().add(offset),
                out.as_mut_ptr(),
                out.len(),
            );
        }
    }

    /// Lends `len` bytes at `offset` (see the module docs for when this is appropriate).
    pub fn slice(&self, offset: usize, len: usize) -> &[u8] {
        self.check(offset, len);
        // SAFETY: in bounds (checked) and alive as long as `self`. Per the protocol no writer
        // touches the range while it is lent; a misbehaving client process can only change the
        // bytes the daemon then copies, never memory outside the mapping.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().add(offset), len) }
    }
}

impl Drop for SharedMap {
    fn drop(&mut self) {
        // SAFETY: the exact range mapped in `map`, unmapped once; no borrow of it can outlive
        // `self` (every lent slice borrows `self`).
        if let Err(error) = unsafe { rustix::mm::munmap(self.ptr.as_ptr().cast(), self.len) } {
            tracing::warn!(%error, "cannot unmap the shared arena");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn two_mappings_of_one_memfd_share_bytes() {
        let a = SharedMap::create("kvd-test", 8192).unwrap();
        let fd = a.fd().try_clone_to_owned().unwrap();
        let b = SharedMap::open(fd, 8192, false, true).unwrap();
        a.write(100, b"hello");
        a.store_u32(64, 7, Ordering::Release);
        let mut out = [0u8; 5];
        b.read_into(100, &mut out);
        assert_eq!(&out, b"hello");
        assert_eq!(b.load_u32(64, Ordering::Acquire), 7);
        assert_eq!(b.slice(100, 5), b"hello");
        assert!(std::panic::catch_unwind(|| a.slice(8190, 4)).is_err());
        let small = a.fd().try_clone_to_owned().unwrap();
        assert!(SharedMap::open(small, 1 << 20, false, false).is_err());
    }
}
