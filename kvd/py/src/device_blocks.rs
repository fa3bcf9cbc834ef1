//! `DeviceBlockCopier`: [`crate::blocks::BlockCopier`]'s packing for a paged KV cache on a CUDA
//! device. A save queues one device-to-host copy per piece (`cuMemcpyDtoHAsync`) straight into
//! the arena lease on the caller's stream, then waits for that stream; a load queues the
//! host-to-device copies out of the slot the same way. One driver call per piece and one wait
//! per block, no Python or torch work per layer; the copies are DMA when the arena is pinned
//! (see [`crate::pin`]). Ordering on the caller's stream (the engine's current one) puts a
//! save after the kernels that wrote the block and a load before the kernels that read it.
//!
//! CUDA only, through the driver loaded at run time (as for pinning); on other devices
//! `infera_kvd.transfer` keeps the torch path. The copier holds the layer tensors, so the
//! device memory it copies lives as long as it does.

#![allow(unsafe_code)]

use crate::blocks::{Geometry, lease_target, packed_source};
use crate::views::{Lease, Slot};
use cudarc::driver::sys;
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;

fn check(what: &str, result: sys::CUresult) -> Result<(), String> {
    if result == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(format!("{what} failed: {result:?}"))
    }
}

/// See the module docs.
#[pyclass(frozen, module = "infera_kvd._native")]
#[derive(Debug)]
pub struct DeviceBlockCopier {
    /// The layer tensors, held so that their device memory lives as long as the copier.
    _layers: Vec<Py<PyAny>>,
    /// Each layer's device address.
    bases: Vec<usize>,
    geometry: Geometry,
    device: sys::CUdevice,
    /// The device's primary context (torch's), retained; a `CUcontext` as an address.
    context: usize,
}

impl DeviceBlockCopier {
    /// Runs `copy(layer address, packed offset, length)` for every piece of `block`, then waits
    /// for `stream`; with the GIL released.
    fn run(
        &self,
        py: Python<'_>,
        block: usize,
        stream: usize,
        copy: impl Fn(usize, usize, usize, sys::CUstream) -> sys::CUresult + Send + Sync,
    ) -> PyResult<()> {
        py.detach(|| {
            let stream = stream as sys::CUstream;
            // SAFETY: the driver is loaded (checked in `new`), the context is retained until
            // `self` drops, and `copy` names valid ranges (its callers' SAFETY notes).
            unsafe {
                check(
                    "cuCtxSetCurrent",
                    sys::cuCtxSetCurrent(self.context as sys::CUcontext),
                )?;
                self.geometry.walk(&self.bases, block, |layer, at, len| {
                    check("an asynchronous copy", copy(layer, at, len, stream))
                })?;
                check("cuStreamSynchronize", sys::cuStreamSynchronize(stream))
            }
        })
        .map_err(PyRuntimeError::new_err)
    }
}

#[pymethods]
impl DeviceBlockCopier {
    /// `DeviceBlockCopier(layers, block_stride, pieces, num_blocks, header)`: `layers` are
    /// contiguous CUDA tensors on one device; the rest as for `BlockCopier`. A RuntimeError
    /// when the CUDA driver is missing or refuses.
    #[new]
    fn new(
        layers: Vec<Bound<'_, PyAny>>,
        block_stride: usize,
        pieces: Vec<(usize, usize)>,
        num_blocks: usize,
        header: Vec<u8>,
    ) -> PyResult<Self> {
        let geometry = Geometry::new(block_stride, pieces, num_blocks, header)?;
        let mut index = None;
        let mut bases = Vec::with_capacity(layers.len());
        for (i, layer) in layers.iter().enumerate() {
            let cuda: bool = layer.getattr("is_cuda")?.extract()?;
            let contiguous: bool = layer.call_method0("is_contiguous")?.extract()?;
            if !cuda || !contiguous {
                return Err(PyValueError::new_err(format!(
                    "layer {i}: the cache must be a contiguous CUDA tensor"
                )));
            }
            let device: i32 = layer.getattr("device")?.getattr("index")?.extract()?;
            if *index.get_or_insert(device) != device {
                return Err(PyValueError::new_err(format!(
                    "layer {i} is on cuda:{device}, layer 0 on cuda:{}",
                    index.unwrap_or_default()
                )));
            }
            geometry.check_layer(i, layer.getattr("nbytes")?.extract()?)?;
            bases.push(layer.call_method0("data_ptr")?.extract()?);
        }
        let Some(index) = index else {
            return Err(PyValueError::new_err("no layers"));
        };
        // SAFETY: `is_culib_present` only tries to load the driver library.
        if !unsafe { sys::is_culib_present() } {
            return Err(PyRuntimeError::new_err("no CUDA driver (libcuda)"));
        }
        let mut device: sys::CUdevice = 0;
        let mut context: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: the driver is present (so `culib()` loads it); the out-pointers are live
        // locals.
        unsafe {
            check("cuInit", sys::cuInit(0))
                .and_then(|()| check("cuDeviceGet", sys::cuDeviceGet(&mut device, index)))
                .and_then(|()| {
                    check(
                        "cuDevicePrimaryCtxRetain",
                        sys::cuDevicePrimaryCtxRetain(&mut context, device),
                    )
                })
                .map_err(PyRuntimeError::new_err)?;
        }
        Ok(Self {
            _layers: layers.into_iter().map(Bound::unbind).collect(),
            bases,
            geometry,
            device,
            context: context as usize,
        })
    }

    /// Bytes of one packed block (header included).
    #[getter]
    fn packed_bytes(&self) -> usize {
        self.geometry.total(self.bases.len())
    }

    /// Writes block `block` of every layer, after the header, into `lease`, on the CUDA stream
    /// `stream` (a `cudaStream_t` as an int; 0 the legacy default stream); returns the length
    /// to commit once the copies are done.
    fn pack(&self, py: Python<'_>, lease: &Lease, block: usize, stream: usize) -> PyResult<usize> {
        self.geometry.check_block(block)?;
        let total = self.packed_bytes();
        let dst = lease_target(lease, total)? as usize;
        let header = self.geometry.header();
        // SAFETY: the header fits the lease (checked: total ≥ header).
        unsafe { std::ptr::copy_nonoverlapping(header.as_ptr(), dst as *mut u8, header.len()) };
        // SAFETY (of the copies): `dst+at..+len` is inside the lease (the pieces sum to total);
        // each source piece is inside its layer's tensor (checked at registration for every
        // block < num_blocks), alive while `self` holds it.
        self.run(py, block, stream, |layer, at, len, stream| unsafe {
            sys::cuMemcpyDtoHAsync_v2(
                (dst + at) as *mut std::ffi::c_void,
                layer as sys::CUdeviceptr,
                len,
                stream,
            )
        })?;
        Ok(total)
    }

    /// Copies a packed value into block `block` of every layer on the CUDA stream `stream`.
    /// False — and the block must not be used — when the value has another length or header,
    /// or the slot was rewritten while it was copied.
    fn unpack(&self, py: Python<'_>, slot: &Slot, block: usize, stream: usize) -> PyResult<bool> {
        self.geometry.check_block(block)?;
        let Some(src) = packed_source(slot, self.packed_bytes(), self.geometry.header()) else {
            return Ok(false);
        };
        let src = src as usize;
        // SAFETY (of the copies): `src+at..+len` is inside the slot (checked length), alive
        // while `slot` is; destinations are inside the layers' tensors (as in `pack`).
        self.run(py, block, stream, |layer, at, len, stream| unsafe {
            sys::cuMemcpyHtoDAsync_v2(
                layer as sys::CUdeviceptr,
                (src + at) as *const std::ffi::c_void,
                len,
                stream,
            )
        })?;
        Ok(slot.is_valid())
    }
}

impl Drop for DeviceBlockCopier {
    fn drop(&mut self) {
        // SAFETY: retained in `new` with the loaded driver; released once.
        unsafe {
            sys::cuDevicePrimaryCtxRelease_v2(self.device);
        }
    }
}
