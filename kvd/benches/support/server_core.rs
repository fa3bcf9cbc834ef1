//! The store server on a CPU of its own for the L4 throughput table (`l4`), beside the shared
//! run: see [`ServerCore`].

use crate::own_core::{Split, descendants, pin, pin_family};
use rustix::thread::CpuSet;

/// The store server on a CPU of its own: every process the bench started (the server) on the
/// last CPU, the bench's own threads (the clients, kvd's writer) on the others, as on a host
/// whose store runs elsewhere. Both clients then have the same CPUs, which the server does not
/// share; on a shared 2-core machine, the scheduler otherwise decides which client's threads
/// share a core with the server.
pub struct ServerCore {
    all: CpuSet,
}

impl ServerCore {
    /// Splits the CPUs; `None` with a single CPU (or without `/proc`).
    pub fn reserve() -> Option<Self> {
        let Split { all, last, others } = Split::of_this_process()?;
        let mut server = CpuSet::new();
        server.set(last);
        let family = descendants(std::process::id()).ok()?;
        let (bench, servers) = family.split_first()?;
        pin(&[*bench], &others);
        pin(servers, &server);
        Some(Self { all })
    }
}

impl Drop for ServerCore {
    fn drop(&mut self) {
        pin_family(&self.all);
    }
}
