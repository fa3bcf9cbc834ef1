//! Arena ranges as Python buffers.
//!
//! - [`Slot`]: a hit from `Client.lookup` — an arena slot read in place (read-only buffer), or
//!   a value the daemon sent inline. A slot may be rewritten by the daemon at any time (evicted
//!   and reused): copy its bytes out first, then call `valid()`; `False` means the copy may be
//!   torn and must be treated as a miss.
//! - [`Lease`]: a reserved slot from `Client.reserve` (writable buffer) that the caller fills in
//!   place and publishes with `Client.commit` (or drops with `Client.cancel`).
//!
//! Both keep the arena mapping alive (a shared handle), so a buffer never outlives the memory
//! it points to, even across a reconnect.

#![allow(unsafe_code)]

use bytes::Bytes;
use infera_kvd::client::{ClientArena, Hit, Reservation};
use infera_kvd::proto::SharedSlot;
use pyo3::ffi;
use pyo3::prelude::*;
use std::os::raw::c_int;
use std::sync::{Arc, Mutex};

#[derive(Debug)]
enum Source {
    Arena(Arc<ClientArena>, SharedSlot),
    Inline(Bytes),
}

/// See the module docs.
#[pyclass(frozen, module = "infera_kvd._native")]
#[derive(Debug)]
pub struct Slot {
    source: Source,
    retention: Option<&'static str>,
}

impl Slot {
    pub(crate) fn arena(arena: Arc<ClientArena>, slot: SharedSlot) -> Self {
        let retention = slot.retention.map(|r| r.as_str());
        Self {
            source: Source::Arena(arena, slot),
            retention,
        }
    }

    pub(crate) fn inline(hit: Hit) -> Self {
        Self {
            source: Source::Inline(hit.value),
            retention: hit.retention.map(|r| r.as_str()),
        }
    }

    /// The bytes' first address and length (in the arena or the inline value).
    pub(crate) fn range(&self) -> (*const u8, usize) {
        match &self.source {
            Source::Arena(arena, slot) => {
                // In bounds: `lookup` hands out only slots that validated.
                (
                    arena.base().wrapping_add(slot.slot_offset as usize),
                    slot.length as usize,
                )
            }
            Source::Inline(bytes) => (bytes.as_ptr(), bytes.len()),
        }
    }

    /// Whether the slot still holds the value it was looked up for (always for inline values).
    pub fn is_valid(&self) -> bool {
        match &self.source {
            Source::Arena(arena, slot) => arena.is_valid(slot),
            Source::Inline(_) => true,
        }
    }
}

#[pymethods]
impl Slot {
    fn __len__(&self) -> usize {
        self.range().1
    }

    /// True while the slot holds the value it was looked up for; check it after copying out.
    fn valid(&self) -> bool {
        self.is_valid()
    }

    /// Whether the bytes are read in place from the shared arena (False: sent inline).
    #[getter]
    fn in_arena(&self) -> bool {
        matches!(self.source, Source::Arena(..))
    }

    /// The entry's retention class, when the daemon said.
    #[getter]
    fn retention(&self) -> Option<&'static str> {
        self.retention
    }

    fn __repr__(&self) -> String {
        format!(
            "Slot(len={}, in_arena={}, retention={:?})",
            self.range().1,
            self.in_arena(),
            self.retention
        )
    }

    /// Read-only buffer over the bytes.
    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut ffi::Py_buffer,
        flags: c_int,
    ) -> PyResult<()> {
        let (ptr, len) = slf.get().range();
        // SAFETY: `view` is the interpreter's; the range lives as long as `slf` (which the view
        // references: the arena handle or the inline bytes are owned by it). Read-only: a
        // writable request fails with BufferError.
        unsafe { fill(slf.as_any(), view, ptr.cast_mut(), len, true, flags) }
    }

    unsafe fn __releasebuffer__(&self, _view: *mut ffi::Py_buffer) {}
}

/// See the module docs.
#[pyclass(frozen, module = "infera_kvd._native")]
#[derive(Debug)]
pub struct Lease {
    arena: Arc<ClientArena>,
    reservation: Reservation,
    /// The connection generation that took the lease (a lease dies with its connection).
    pub(crate) generation: u64,
    /// Set once committed or cancelled.
    pub(crate) done: Mutex<bool>,
}

impl Lease {
    pub(crate) fn new(arena: Arc<ClientArena>, reservation: Reservation, generation: u64) -> Self {
        Self {
            arena,
            reservation,
            generation,
            done: Mutex::new(false),
        }
    }

    /// The reservation (token, offset, capacity).
    pub fn reservation(&self) -> &Reservation {
        &self.reservation
    }

    /// Whether the lease is neither committed nor cancelled yet.
    pub(crate) fn is_open(&self) -> bool {
        !*self.done.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Marks the lease used; false when it already was.
    pub(crate) fn take(&self) -> bool {
        let mut done = self.done.lock().unwrap_or_else(|p| p.into_inner());
        !std::mem::replace(&mut *done, true)
    }

    /// Copies `data` into the slot (the Rust-side write path).
    ///
    /// # Errors
    /// When `data` is larger than the lease.
    pub fn write(&self, data: &[u8]) -> std::io::Result<()> {
        self.arena.write(
            self.reservation.payload_offset,
            self.reservation.payload_max_size,
            data,
        )
    }

    /// The payload's first address and usable length (0 when it would not fit the mapping).
    pub(crate) fn range(&self) -> (*mut u8, usize) {
        let ptr = self
            .arena
            .base()
            .wrapping_add(self.reservation.payload_offset as usize);
        (ptr.cast_mut(), self.bounded_len())
    }

    fn bounded_len(&self) -> usize {
        let end = self
            .reservation
            .payload_offset
            .saturating_add(self.reservation.payload_max_size);
        if end > self.arena.len() as u64 {
            0
        } else {
            self.reservation.payload_max_size as usize
        }
    }
}

#[pymethods]
impl Lease {
    /// The most bytes the slot takes.
    fn __len__(&self) -> usize {
        self.bounded_len()
    }

    fn __repr__(&self) -> String {
        format!(
            "Lease(capacity={}, token={})",
            self.bounded_len(),
            self.reservation.lease_token
        )
    }

    /// Writable buffer over the reserved payload.
    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut ffi::Py_buffer,
        flags: c_int,
    ) -> PyResult<()> {
        let lease = slf.get();
        let ptr = lease
            .arena
            .base()
            .wrapping_add(lease.reservation.payload_offset as usize);
        // SAFETY: the payload range is inside the mapping (checked by `bounded_len`, else the
        // view is empty), reserved to this client until commit or cancel, and the mapping
        // lives as long as `slf`, which the view references.
        unsafe {
            fill(
                slf.as_any(),
                view,
                ptr.cast_mut(),
                lease.bounded_len(),
                false,
                flags,
            )
        }
    }

    unsafe fn __releasebuffer__(&self, _view: *mut ffi::Py_buffer) {}
}

/// `PyBuffer_FillInfo` for a contiguous byte range owned by `owner`.
///
/// # Safety
/// `view` must be the interpreter's buffer request, and `ptr..ptr+len` must stay valid while
/// `owner` lives.
unsafe fn fill(
    owner: &Bound<'_, PyAny>,
    view: *mut ffi::Py_buffer,
    ptr: *mut u8,
    len: usize,
    readonly: bool,
    flags: c_int,
) -> PyResult<()> {
    let len = isize::try_from(len).unwrap_or(0);
    // SAFETY: per this function's contract; `PyBuffer_FillInfo` takes a new reference to
    // `owner` in `view.obj`, keeping the range alive while the view exists.
    let rc = unsafe {
        ffi::PyBuffer_FillInfo(
            view,
            owner.as_ptr(),
            ptr.cast(),
            len,
            c_int::from(readonly),
            flags,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(PyErr::fetch(owner.py()))
    }
}
