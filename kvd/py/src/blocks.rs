//! `BlockCopier`: packs one block of every layer of a host (CPU) paged KV cache into an arena
//! lease, and unpacks a slot back, in Rust: a `memcpy` per contiguous piece, with no Python
//! work per layer. The packed bytes are exactly those of the torch path in
//! `infera_kvd.transfer` (a header, then each layer's block in row-major order), so either side
//! reads what the other wrote.
//!
//! Each layer is registered as a C-contiguous writable buffer (`tensor.view(torch.uint8)
//! .numpy()`), which the copier holds, so its memory lives as long as the copier; a block of a
//! layer is the same `pieces` (offset, length) at `block * block_stride`. Every range is checked
//! against its buffer at registration, and block numbers on every call.

#![allow(unsafe_code)]

use crate::views::{Lease, Slot};
use pyo3::buffer::PyBuffer;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

/// See the module docs.
#[pyclass(frozen, module = "infera_kvd._native")]
#[derive(Debug)]
pub struct BlockCopier {
    layers: Vec<PyBuffer<u8>>,
    block_stride: usize,
    pieces: Vec<(usize, usize)>,
    num_blocks: usize,
    header: Vec<u8>,
    slice_bytes: usize,
}

impl BlockCopier {
    fn total(&self) -> usize {
        self.header.len() + self.layers.len() * self.slice_bytes
    }

    fn check_block(&self, block: usize) -> PyResult<()> {
        if block < self.num_blocks {
            Ok(())
        } else {
            Err(PyValueError::new_err(format!(
                "block {block} is outside the cache's {} blocks",
                self.num_blocks
            )))
        }
    }

    /// Calls `f(layer_ptr_at_piece, packed_offset, len)` for every piece of `block`, in order.
    fn walk(&self, block: usize, mut f: impl FnMut(*mut u8, usize, usize)) {
        let mut at = self.header.len();
        for layer in &self.layers {
            let base = layer.buf_ptr().cast::<u8>();
            for &(offset, len) in &self.pieces {
                f(
                    base.wrapping_add(block * self.block_stride + offset),
                    at,
                    len,
                );
                at += len;
            }
        }
    }
}

#[pymethods]
impl BlockCopier {
    /// `BlockCopier(layers, block_stride, pieces, num_blocks, header)`: `layers` are the
    /// caches as byte buffers; a block is `pieces` `[(offset, length)]` at
    /// `block * block_stride`; `header` starts every packed value.
    #[new]
    fn new(
        layers: Vec<Bound<'_, PyAny>>,
        block_stride: usize,
        pieces: Vec<(usize, usize)>,
        num_blocks: usize,
        header: Vec<u8>,
    ) -> PyResult<Self> {
        let slice_bytes: usize = pieces.iter().map(|p| p.1).sum();
        let reach = pieces
            .iter()
            .map(|&(o, l)| o.saturating_add(l))
            .max()
            .unwrap_or(0)
            .saturating_add(num_blocks.saturating_sub(1).saturating_mul(block_stride));
        let mut buffers = Vec::with_capacity(layers.len());
        for (i, layer) in layers.iter().enumerate() {
            let buffer = PyBuffer::<u8>::get(layer)?;
            if buffer.readonly() || !buffer.is_c_contiguous() {
                return Err(PyValueError::new_err(format!(
                    "layer {i}: the cache must be a writable C-contiguous byte buffer"
                )));
            }
            if buffer.len_bytes() < reach {
                return Err(PyValueError::new_err(format!(
                    "layer {i}: {num_blocks} blocks reach byte {reach}, the buffer holds {}",
                    buffer.len_bytes()
                )));
            }
            buffers.push(buffer);
        }
        if buffers.is_empty() || slice_bytes == 0 {
            return Err(PyValueError::new_err("no layers or an empty block"));
        }
        Ok(Self {
            layers: buffers,
            block_stride,
            pieces,
            num_blocks,
            header,
            slice_bytes,
        })
    }

    /// Bytes of one packed block (header included).
    #[getter]
    fn packed_bytes(&self) -> usize {
        self.total()
    }

    /// Writes block `block` of every layer, after the header, into `lease`; returns the length
    /// to commit.
    fn pack(&self, lease: &Lease, block: usize) -> PyResult<usize> {
        self.check_block(block)?;
        if !lease.is_open() {
            return Err(PyValueError::new_err(
                "the lease was already committed or cancelled",
            ));
        }
        let (dst, capacity) = lease.range();
        let total = self.total();
        if total > capacity {
            return Err(PyValueError::new_err(format!(
                "a packed block of {total} bytes does not fit a lease of {capacity}"
            )));
        }
        // SAFETY: `dst..dst+total` is inside the reserved payload (checked against the lease,
        // which is inside the mapping); every source piece is inside its layer's buffer
        // (checked at registration for every block < num_blocks), and the buffers live as long
        // as `self`. Source (the KV cache) and destination (the arena) do not overlap.
        unsafe {
            std::ptr::copy_nonoverlapping(self.header.as_ptr(), dst, self.header.len());
            self.walk(block, |src, at, len| {
                std::ptr::copy_nonoverlapping(src.cast_const(), dst.add(at), len);
            });
        }
        Ok(total)
    }

    /// Copies a packed value into block `block` of every layer. False — and the block must not
    /// be used — when the value has another length or header, or the slot was rewritten while
    /// it was copied.
    fn unpack(&self, slot: &Slot, block: usize) -> PyResult<bool> {
        self.check_block(block)?;
        let (src, len) = slot.range();
        if len != self.total() {
            return Ok(false);
        }
        // SAFETY: `src..src+len` is the slot's range inside the mapping (or the inline bytes),
        // alive while `slot` is; destinations are inside the layers' buffers (as in `pack`).
        unsafe {
            if std::slice::from_raw_parts(src, self.header.len()) != self.header.as_slice() {
                return Ok(false);
            }
            self.walk(block, |dst, at, len| {
                std::ptr::copy_nonoverlapping(src.add(at), dst, len);
            });
        }
        Ok(slot.is_valid())
    }
}
