//! Packing one block of every layer of a paged KV cache into an arena lease, and unpacking a
//! slot back, in Rust, with no Python work per layer: [`BlockCopier`] for host (CPU) caches, a
//! `memcpy` per contiguous piece, and [`crate::device_blocks::DeviceBlockCopier`] for CUDA
//! caches. The packed bytes are exactly those of the torch path in `infera_kvd.transfer` (a
//! header, then each layer's block in row-major order), so either side reads what the other
//! wrote.
//!
//! Both share a [`Geometry`]: a block of a layer is the same `pieces` (offset, length) at
//! `block * block_stride` from the layer's base. Every range is checked against its layer at
//! registration, and block numbers on every call.
//!
//! `BlockCopier` holds each layer as a C-contiguous writable buffer (`tensor.view(torch.uint8)
//! .numpy()`), so its memory lives as long as the copier.

#![allow(unsafe_code)]

use crate::views::{Lease, Slot};
use pyo3::buffer::PyBuffer;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use std::convert::Infallible;

/// Where a block's bytes are in every layer and in the packed value. See the module docs.
#[derive(Debug)]
pub struct Geometry {
    block_stride: usize,
    pieces: Vec<(usize, usize)>,
    num_blocks: usize,
    header: Vec<u8>,
    /// One layer's bytes of one block.
    slice_bytes: usize,
    /// The bytes of a layer that its blocks reach.
    reach: usize,
}

impl Geometry {
    /// A block is `pieces` `[(offset, length)]` at `block * block_stride`, in `num_blocks`
    /// blocks; `header` starts every packed value.
    pub fn new(
        block_stride: usize,
        pieces: Vec<(usize, usize)>,
        num_blocks: usize,
        header: Vec<u8>,
    ) -> PyResult<Self> {
        let slice_bytes: usize = pieces.iter().map(|p| p.1).sum();
        if slice_bytes == 0 {
            return Err(PyValueError::new_err("an empty block"));
        }
        let reach = pieces
            .iter()
            .map(|&(o, l)| o.saturating_add(l))
            .max()
            .unwrap_or(0)
            .saturating_add(num_blocks.saturating_sub(1).saturating_mul(block_stride));
        Ok(Self {
            block_stride,
            pieces,
            num_blocks,
            header,
            slice_bytes,
            reach,
        })
    }

    /// Checks that layer `i`, of `len` bytes, holds every block.
    pub fn check_layer(&self, i: usize, len: usize) -> PyResult<()> {
        if len < self.reach {
            return Err(PyValueError::new_err(format!(
                "layer {i}: {} blocks reach byte {}, the layer holds {len}",
                self.num_blocks, self.reach
            )));
        }
        Ok(())
    }

    /// Bytes of one packed block of `layers` layers (header included).
    pub fn total(&self, layers: usize) -> usize {
        self.header.len() + layers * self.slice_bytes
    }

    pub fn header(&self) -> &[u8] {
        &self.header
    }

    pub fn check_block(&self, block: usize) -> PyResult<()> {
        if block < self.num_blocks {
            Ok(())
        } else {
            Err(PyValueError::new_err(format!(
                "block {block} is outside the cache's {} blocks",
                self.num_blocks
            )))
        }
    }

    /// Calls `f(layer address of the piece, packed offset, length)` for every piece of `block`
    /// in the layers at `bases`, in packed order; stops at the first error.
    pub fn walk<E>(
        &self,
        bases: &[usize],
        block: usize,
        mut f: impl FnMut(usize, usize, usize) -> Result<(), E>,
    ) -> Result<(), E> {
        let mut at = self.header.len();
        for base in bases {
            for &(offset, len) in &self.pieces {
                f(base + block * self.block_stride + offset, at, len)?;
                at += len;
            }
        }
        Ok(())
    }
}

/// The writable range of an open `lease` that a packed value of `total` bytes goes to.
pub fn lease_target(lease: &Lease, total: usize) -> PyResult<*mut u8> {
    if !lease.is_open() {
        return Err(PyValueError::new_err(
            "the lease was already committed or cancelled",
        ));
    }
    let (dst, capacity) = lease.range();
    if total > capacity {
        return Err(PyValueError::new_err(format!(
            "a packed block of {total} bytes does not fit a lease of {capacity}"
        )));
    }
    Ok(dst)
}

/// The bytes of `slot` when they are a packed value of `total` bytes under `header`.
pub fn packed_source(slot: &Slot, total: usize, header: &[u8]) -> Option<*const u8> {
    let (src, len) = slot.range();
    // SAFETY: `src..src+len` is the slot's range inside the mapping (or its inline bytes),
    // alive while `slot` is, and the header is within it (len == total ≥ header).
    (len == total && unsafe { std::slice::from_raw_parts(src, header.len()) } == header)
        .then_some(src)
}

/// See the module docs.
#[pyclass(frozen, module = "infera_kvd._native")]
#[derive(Debug)]
pub struct BlockCopier {
    /// Held so that the layers' memory lives as long as the copier.
    _layers: Vec<PyBuffer<u8>>,
    bases: Vec<usize>,
    geometry: Geometry,
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
        let geometry = Geometry::new(block_stride, pieces, num_blocks, header)?;
        let mut buffers = Vec::with_capacity(layers.len());
        for (i, layer) in layers.iter().enumerate() {
            let buffer = PyBuffer::<u8>::get(layer)?;
            if buffer.readonly() || !buffer.is_c_contiguous() {
                return Err(PyValueError::new_err(format!(
                    "layer {i}: the cache must be a writable C-contiguous byte buffer"
                )));
            }
            geometry.check_layer(i, buffer.len_bytes())?;
            buffers.push(buffer);
        }
        if buffers.is_empty() {
            return Err(PyValueError::new_err("no layers"));
        }
        Ok(Self {
            bases: buffers.iter().map(|b| b.buf_ptr() as usize).collect(),
            _layers: buffers,
            geometry,
        })
    }

    /// Bytes of one packed block (header included).
    #[getter]
    fn packed_bytes(&self) -> usize {
        self.geometry.total(self.bases.len())
    }

    /// Writes block `block` of every layer, after the header, into `lease`; returns the length
    /// to commit.
    fn pack(&self, lease: &Lease, block: usize) -> PyResult<usize> {
        self.geometry.check_block(block)?;
        let total = self.packed_bytes();
        let dst = lease_target(lease, total)?;
        let header = self.geometry.header();
        // SAFETY: `dst..dst+total` is inside the reserved payload (checked against the lease,
        // which is inside the mapping); every source piece is inside its layer's buffer
        // (checked at registration for every block < num_blocks), and the buffers live as long
        // as `self`. Source (the KV cache) and destination (the arena) do not overlap.
        unsafe {
            std::ptr::copy_nonoverlapping(header.as_ptr(), dst, header.len());
            let Ok(()) = self
                .geometry
                .walk::<Infallible>(&self.bases, block, |src, at, len| {
                    std::ptr::copy_nonoverlapping(src as *const u8, dst.add(at), len);
                    Ok(())
                });
        }
        Ok(total)
    }

    /// Copies a packed value into block `block` of every layer. False — and the block must not
    /// be used — when the value has another length or header, or the slot was rewritten while
    /// it was copied.
    fn unpack(&self, slot: &Slot, block: usize) -> PyResult<bool> {
        self.geometry.check_block(block)?;
        let Some(src) = packed_source(slot, self.packed_bytes(), self.geometry.header()) else {
            return Ok(false);
        };
        // SAFETY: `src..src+total` is the slot's range (checked), alive while `slot` is;
        // destinations are inside the layers' buffers (as in `pack`).
        unsafe {
            let Ok(()) = self
                .geometry
                .walk::<Infallible>(&self.bases, block, |dst, at, len| {
                    std::ptr::copy_nonoverlapping(src.add(at), dst as *mut u8, len);
                    Ok(())
                });
        }
        Ok(slot.is_valid())
    }
}
