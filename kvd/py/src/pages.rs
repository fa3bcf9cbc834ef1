//! `gather` and `scatter`: one value made of, or spread over, ranges of host memory that an
//! engine names by address — SGLang's HiCache host pool (`get_page_buffer_meta`: a page as a
//! list of addresses and lengths, one per layer's K and V in its `layer_first` layout, one per
//! page in `page_first`). A save copies the ranges one after another into an arena lease; a
//! load copies an arena slot back over them; no Python work per range, the GIL released.
//!
//! The addresses come from the engine's own pool, as they do for SGLang's other zero-copy
//! backends (Mooncake, 3FS): the caller vouches that each range is host memory it owns, valid
//! for the call, and that no two destination ranges overlap. Lengths are checked against the
//! lease and the slot.

#![allow(unsafe_code)]

use crate::views::{Lease, Slot};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

/// The total length of `segments`, or an error naming an overflow or a null address.
fn total(segments: &[(usize, usize)]) -> PyResult<usize> {
    let mut sum = 0usize;
    for &(addr, len) in segments {
        if addr == 0 && len > 0 {
            return Err(PyValueError::new_err("a range at address 0"));
        }
        sum = sum
            .checked_add(len)
            .ok_or_else(|| PyValueError::new_err("the ranges' lengths overflow"))?;
    }
    Ok(sum)
}

/// `gather(lease, segments)`: copies each `(address, length)` range of `segments`, in order,
/// into `lease`; returns the length to commit.
#[pyfunction]
pub fn gather(py: Python<'_>, lease: &Lease, segments: Vec<(usize, usize)>) -> PyResult<usize> {
    if !lease.is_open() {
        return Err(PyValueError::new_err(
            "the lease was already committed or cancelled",
        ));
    }
    let need = total(&segments)?;
    let (dst, capacity) = lease.range();
    if need > capacity {
        return Err(PyValueError::new_err(format!(
            "{need} bytes do not fit a lease of {capacity}"
        )));
    }
    let dst = dst as usize;
    py.detach(|| {
        let mut at = 0;
        for (addr, len) in segments {
            // SAFETY: `dst+at..dst+at+len` is inside the reserved payload (`need` ≤ the
            // lease's bounded length, inside the mapping); the source range is the caller's
            // host memory (module docs), which is not the arena.
            unsafe {
                std::ptr::copy_nonoverlapping(addr as *const u8, (dst + at) as *mut u8, len);
            }
            at += len;
        }
    });
    Ok(need)
}

/// `scatter(slot, segments)`: copies `slot`'s bytes over the `(address, length)` ranges of
/// `segments`, in order. False — and the ranges' contents must not be used — when the value's
/// length is not the ranges' total, or the slot was rewritten while it was copied.
#[pyfunction]
pub fn scatter(py: Python<'_>, slot: &Slot, segments: Vec<(usize, usize)>) -> PyResult<bool> {
    let need = total(&segments)?;
    let (src, len) = slot.range();
    if len != need {
        return Ok(false);
    }
    let src = src as usize;
    py.detach(|| {
        let mut at = 0;
        for (addr, len) in segments {
            // SAFETY: `src+at..src+at+len` is inside the slot's range (the lengths sum to its
            // length), alive while `slot` is; the destination is the caller's host memory
            // (module docs), which is not the arena.
            unsafe {
                std::ptr::copy_nonoverlapping((src + at) as *const u8, addr as *mut u8, len);
            }
            at += len;
        }
    });
    Ok(slot.is_valid())
}
