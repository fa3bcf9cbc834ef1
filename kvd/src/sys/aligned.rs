//! [`AlignedBuf`]: a buffer whose start, and capacity, are multiples of [`ALIGN`], as O_DIRECT
//! requires: an anonymous mapping of its own, populated at once, so it starts zeroed by the
//! kernel (every byte is always initialized, and no pass of `memset` is paid for it) and its pages
//! arrive in one call rather than one fault each. (No huge pages: where the kernel compacts
//! memory for them on demand, a fault could stall for milliseconds.)
//! Buffers are meant to be pooled and reused (see `tablespace::io`), which also avoids paying
//! the page faults of fresh memory on every block.

use rustix::mm::{MapFlags, ProtFlags};
use std::alloc::Layout;
use std::ptr::NonNull;

/// The alignment of every buffer, offset and length of the O_DIRECT data path.
pub const ALIGN: usize = 4096;

/// See the module docs. `len` (the bytes in use) never exceeds `capacity`.
#[derive(Debug)]
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
    capacity: usize,
}

// SAFETY: the buffer owns its allocation exclusively (like a `Vec<u8>`); `&AlignedBuf` only
// gives shared reads.
unsafe impl Send for AlignedBuf {}
// SAFETY: as above: no interior mutability.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// A zeroed buffer of at least `capacity` bytes (rounded up to [`ALIGN`], at least one
    /// page), with `len == 0`.
    ///
    /// # Panics
    /// When the kernel refuses the mapping (out of memory, like `Vec`).
    pub fn new(capacity: usize) -> Self {
        let capacity = capacity.max(1).div_ceil(ALIGN) * ALIGN;
        // SAFETY: a fresh private anonymous mapping, not aliasing any Rust object; the kernel
        // picks the (page-aligned) address.
        let mapped = unsafe {
            rustix::mm::mmap_anonymous(
                std::ptr::null_mut(),
                capacity,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::PRIVATE | MapFlags::POPULATE,
            )
        };
        let Some(ptr) = mapped.ok().and_then(|p| NonNull::new(p.cast::<u8>())) else {
            match Layout::from_size_align(capacity, ALIGN) {
                Ok(layout) => std::alloc::handle_alloc_error(layout),
                Err(_) => panic!("buffer of {capacity} bytes is too large to allocate"),
            }
        };
        Self {
            ptr,
            len: 0,
            capacity,
        }
    }

    /// The allocated size.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Sets the bytes in use (all bytes are always initialized).
    ///
    /// # Panics
    /// When `len` exceeds the capacity.
    pub fn set_len(&mut self, len: usize) {
        assert!(len <= self.capacity, "{len} > capacity {}", self.capacity);
        self.len = len;
    }

    /// The whole allocation, for the kernel to fill.
    pub fn full_mut(&mut self) -> &mut [u8] {
        // SAFETY: `ptr` owns `capacity` initialized bytes, borrowed mutably through `self`.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.capacity) }
    }

    /// The bytes in use, mutably.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        let len = self.len;
        &mut self.full_mut()[..len]
    }

    /// The bytes in use.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` owns `capacity >= len` initialized bytes, borrowed through `self`.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl AsRef<[u8]> for AlignedBuf {
    fn as_ref(&self) -> &[u8] {
        self.as_slice()
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: mapped in `new` with exactly this length, owned by this buffer alone and not
        // unmapped before; no borrow of it outlives `self`.
        let _ = unsafe { rustix::mm::munmap(self.ptr.as_ptr().cast(), self.capacity) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_aligned_zeroed_and_bounded() {
        let mut b = AlignedBuf::new(5000);
        assert_eq!(b.capacity(), 8192);
        assert_eq!(b.full_mut().as_ptr() as usize % ALIGN, 0);
        assert!(b.full_mut().iter().all(|x| *x == 0));
        b.set_len(3);
        b.as_mut_slice().copy_from_slice(b"abc");
        assert_eq!(b.as_slice(), b"abc");
        assert!(std::panic::catch_unwind(move || b.set_len(8193)).is_err());
        let mut big = AlignedBuf::new((4 << 20) + 1);
        assert_eq!(big.capacity(), (4 << 20) + ALIGN);
        assert_eq!(big.full_mut().as_ptr() as usize % ALIGN, 0);
        assert!(big.full_mut().iter().all(|x| *x == 0));
    }
}
