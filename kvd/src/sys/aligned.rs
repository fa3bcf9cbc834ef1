//! [`AlignedBuf`]: a heap buffer whose start, and capacity, are multiples of [`ALIGN`], as
//! O_DIRECT requires. The memory is zeroed once at allocation, so every byte is always
//! initialized; buffers are meant to be pooled and reused (see `tablespace::io`), which also
//! avoids paying the page faults of fresh memory on every block.

use std::alloc::{Layout, alloc_zeroed, dealloc};
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
    /// When the allocator fails (like `Vec`).
    pub fn new(capacity: usize) -> Self {
        let capacity = capacity.max(1).div_ceil(ALIGN) * ALIGN;
        let layout = Self::layout(capacity);
        // SAFETY: the layout has a non-zero size (at least one page).
        let raw = unsafe { alloc_zeroed(layout) };
        let Some(ptr) = NonNull::new(raw) else {
            std::alloc::handle_alloc_error(layout)
        };
        Self {
            ptr,
            len: 0,
            capacity,
        }
    }

    fn layout(capacity: usize) -> Layout {
        match Layout::from_size_align(capacity, ALIGN) {
            Ok(layout) => layout,
            Err(_) => panic!("buffer of {capacity} bytes is too large to allocate"),
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
        // SAFETY: allocated in `new` with exactly this layout and not freed before.
        unsafe { dealloc(self.ptr.as_ptr(), Self::layout(self.capacity)) }
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
    }
}
