//! Pinning the shared arena for DMA, with whichever GPU runtime the machine has, loaded at run
//! time (never linked, so the extension imports on machines without a GPU):
//! - **CUDA**: `cuMemHostRegister` (portable) through the driver, loaded by `cudarc`;
//! - **HIP** (ROCm): `hipHostRegister` (portable) through `libamdhip64`, opened with
//!   `libloading` (no `hip-sys`, which builds only where ROCm is installed).
//!
//! CUDA is tried first, then HIP. A missing runtime or a refusal leaves the arena in plain host
//! memory: copies still work, only slower; the outcome (which runtime, or why none) is
//! reported, never fatal.

#![allow(unsafe_code)]

use cudarc::driver::sys;
use std::ffi::c_void;

/// A registered range; unregistered on drop.
#[derive(Debug)]
pub enum Pinned {
    Cuda { ptr: usize, device: sys::CUdevice },
    Hip { ptr: usize, hip: Hip },
}

impl Pinned {
    /// The runtime that registered the range: `cuda` or `hip`.
    pub fn runtime(&self) -> &'static str {
        match self {
            Pinned::Cuda { .. } => "cuda",
            Pinned::Hip { .. } => "hip",
        }
    }
}

/// What pinning did: `Ok` with the guard, or why the arena stays in plain host memory.
pub type PinOutcome = Result<Pinned, String>;

/// Registers `len` bytes at `ptr` for DMA with the CUDA driver, else with HIP; the error names
/// why each one did not.
pub fn pin(ptr: *const u8, len: usize) -> PinOutcome {
    pin_cuda(ptr, len)
        .or_else(|cuda| pin_hip(ptr, len).map_err(|hip| format!("CUDA: {cuda}; HIP: {hip}")))
}

fn check(what: &str, result: sys::CUresult) -> Result<(), String> {
    if result == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(format!("{what} failed: {result:?}"))
    }
}

/// Registers with the CUDA driver (device 0's primary context, portable to every context).
fn pin_cuda(ptr: *const u8, len: usize) -> PinOutcome {
    // SAFETY: `is_culib_present` only tries to load the driver library.
    if !unsafe { sys::is_culib_present() } {
        return Err("no CUDA driver (libcuda) on this machine".to_owned());
    }
    let mut count = 0;
    let mut device: sys::CUdevice = 0;
    let mut context: sys::CUcontext = std::ptr::null_mut();
    // SAFETY: the driver is present (checked above, so `culib()` loads it); every out-pointer
    // is a live local; `ptr..ptr+len` is a mapping the caller keeps alive until the guard drops.
    unsafe {
        check("cuInit", sys::cuInit(0))?;
        check("cuDeviceGetCount", sys::cuDeviceGetCount(&mut count))?;
        if count == 0 {
            return Err("the CUDA driver sees no device".to_owned());
        }
        check("cuDeviceGet", sys::cuDeviceGet(&mut device, 0))?;
        check(
            "cuDevicePrimaryCtxRetain",
            sys::cuDevicePrimaryCtxRetain(&mut context, device),
        )?;
        let registered = check("cuCtxSetCurrent", sys::cuCtxSetCurrent(context)).and_then(|()| {
            check(
                "cuMemHostRegister",
                sys::cuMemHostRegister_v2(
                    ptr.cast_mut().cast::<c_void>(),
                    len,
                    sys::CU_MEMHOSTREGISTER_PORTABLE,
                ),
            )
        });
        if let Err(e) = registered {
            sys::cuDevicePrimaryCtxRelease_v2(device);
            return Err(e);
        }
    }
    Ok(Pinned::Cuda {
        ptr: ptr as usize,
        device,
    })
}

/// The HIP runtime's library names, newest first.
const HIP_LIBRARIES: [&str; 3] = ["libamdhip64.so", "libamdhip64.so.6", "libamdhip64.so.5"];
/// `hipHostRegisterPortable`.
const HIP_HOST_REGISTER_PORTABLE: u32 = 0x1;

type HipGetDeviceCount = unsafe extern "C" fn(*mut i32) -> i32;
type HipHostRegister = unsafe extern "C" fn(*mut c_void, usize, u32) -> i32;
type HipHostUnregister = unsafe extern "C" fn(*mut c_void) -> i32;

/// The loaded HIP runtime: the library stays open while a range is registered with it.
#[derive(Debug)]
pub struct Hip {
    library: libloading::Library,
}

impl Hip {
    fn open() -> Result<Self, String> {
        let mut tried = Vec::new();
        for name in HIP_LIBRARIES {
            // SAFETY: loading the HIP runtime runs its initialisers, which is what using it
            // requires; nothing else is loaded under this name.
            match unsafe { libloading::Library::new(name) } {
                Ok(library) => return Ok(Self { library }),
                Err(e) => tried.push(format!("{name}: {e}")),
            }
        }
        Err(format!("no HIP runtime ({})", tried.join("; ")))
    }

    /// `symbol` of the runtime, typed as `T`.
    ///
    /// # Safety
    /// `T` must be the symbol's C signature.
    unsafe fn symbol<T: Copy>(&self, symbol: &[u8]) -> Result<T, String> {
        // SAFETY: the caller names the symbol's signature.
        unsafe { self.library.get::<T>(symbol) }
            .map(|s| *s)
            .map_err(|e| format!("{}: {e}", String::from_utf8_lossy(symbol)))
    }
}

/// Registers with the HIP runtime (portable to every device).
fn pin_hip(ptr: *const u8, len: usize) -> PinOutcome {
    let hip = Hip::open()?;
    // SAFETY: the signatures are HIP's (hip_runtime_api.h); every out-pointer is a live local;
    // `ptr..ptr+len` is a mapping the caller keeps alive until the guard drops.
    unsafe {
        let count_of = hip.symbol::<HipGetDeviceCount>(b"hipGetDeviceCount\0")?;
        let register = hip.symbol::<HipHostRegister>(b"hipHostRegister\0")?;
        let mut count = 0;
        let status = count_of(&mut count);
        if status != 0 || count == 0 {
            return Err(format!(
                "the HIP runtime sees no device (hipGetDeviceCount: status {status}, {count} devices)"
            ));
        }
        let status = register(ptr.cast_mut().cast(), len, HIP_HOST_REGISTER_PORTABLE);
        if status != 0 {
            return Err(format!("hipHostRegister failed: status {status}"));
        }
    }
    Ok(Pinned::Hip {
        ptr: ptr as usize,
        hip,
    })
}

impl Drop for Pinned {
    fn drop(&mut self) {
        match self {
            // SAFETY: `ptr` was registered by `pin_cuda` with the driver that is loaded (it was
            // present then, and a loaded library stays loaded); unregistered once, before the
            // mapping goes.
            Pinned::Cuda { ptr, device } => unsafe {
                sys::cuMemHostUnregister(*ptr as *mut c_void);
                sys::cuDevicePrimaryCtxRelease_v2(*device);
            },
            Pinned::Hip { ptr, hip } => {
                // SAFETY: the signature is HIP's; `ptr` was registered by `pin_hip` with this
                // library, which stays open until after this call.
                unsafe {
                    if let Ok(unregister) = hip.symbol::<HipHostUnregister>(b"hipHostUnregister\0")
                    {
                        unregister(*ptr as *mut c_void);
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_a_gpu_runtime_pinning_says_why_for_each() {
        // On a machine with CUDA or ROCm this pins and unpins a page instead; either way the
        // outcome is reported, never a panic.
        let page = vec![0u8; 4096];
        match pin(page.as_ptr(), page.len()) {
            Ok(pinned) => assert!(["cuda", "hip"].contains(&pinned.runtime())),
            Err(why) => {
                assert!(why.contains("CUDA: ") && why.contains("HIP: "), "{why}");
            }
        }
    }
}
