//! `infera_kvd._native`: the Python extension over [`infera_kvd::KvdClient`], built by maturin
//! from `kvd/python/` (abi3, CPython >= 3.11) and used by the vLLM connector and the SGLang
//! HiCache backend there.
//!
//! # Map
//! - [`client`]: `Client` — one connection to the daemon with a deadline on every call,
//!   reconnecting after a transport failure (a restarted daemon gives misses, never a hang);
//!   batched `exists`/`get`/`set` with retention and TTL per call; the shared arena's
//!   `lookup` (slots to read in place) and `reserve`/`commit` (slots to write in place).
//! - [`views`]: `Slot` and `Lease`, arena ranges exposed through the buffer protocol, so
//!   `torch.frombuffer`/`numpy.frombuffer` copy straight between the KV cache and the arena.
//! - [`blocks`]: `BlockCopier` — a packed block of every layer of a host KV cache copied into
//!   a lease, or out of a slot, by `memcpy` per contiguous piece (the CPU cache's hot path).
//! - [`pages`]: `gather`/`scatter` — a value copied from, or over, host-memory ranges an engine
//!   names by address (SGLang's HiCache host pool pages, its zero-copy `_v1` interface).
//! - [`pin`]: registering the arena for DMA with the CUDA driver or the HIP runtime (each
//!   loaded at run time); never required, always reported (`Client.arena_info()`).
//!
//! The Rust API ([`client::Core`]) is what the Python methods call with the GIL released; the
//! workspace's tests exercise it without a Python interpreter.

pub mod blocks;
pub mod client;
pub mod device_blocks;
pub mod pages;
pub mod pin;
pub mod views;

use pyo3::prelude::*;

pyo3::create_exception!(
    _native,
    KvdError,
    pyo3::exceptions::PyException,
    "A kvd call failed: the daemon refused it or replied out of protocol."
);
pyo3::create_exception!(
    _native,
    KvdUnavailable,
    KvdError,
    "The daemon could not be reached, or the connection failed or passed its deadline; the \
     next call reconnects."
);

/// The extension module.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<client::Client>()?;
    m.add_class::<views::Slot>()?;
    m.add_class::<views::Lease>()?;
    m.add_class::<blocks::BlockCopier>()?;
    m.add_class::<device_blocks::DeviceBlockCopier>()?;
    m.add_function(wrap_pyfunction!(pages::gather, m)?)?;
    m.add_function(wrap_pyfunction!(pages::scatter, m)?)?;
    m.add("KvdError", m.py().get_type::<KvdError>())?;
    m.add("KvdUnavailable", m.py().get_type::<KvdUnavailable>())?;
    Ok(())
}
