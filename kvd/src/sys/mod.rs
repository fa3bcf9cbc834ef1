//! The only place in the crate with `unsafe` code: the shared-memory mapping of the arena
//! ([`shm`]), page-aligned buffers for O_DIRECT ([`aligned`]) and the io_uring submission loop
//! ([`uring`]). Each block says, in a `// SAFETY:` line, why it is sound; everything outside
//! this module uses the safe wrappers.
#![allow(unsafe_code)]

pub mod aligned;
pub mod shm;
pub mod uring;
