//! Loopback ports for the servers a test starts, handed out so that two starts cannot collide.
//!
//! Asking the OS for port 0 and passing the number on leaves a window before the server binds
//! it. Two things used to fill that window: a parallel test of the same binary given the same
//! number, and the outgoing connections of every process on the machine (to etcd, NATS, a
//! worker), whose source ports come from the same ephemeral range the OS picks probes from. So
//! ports here come from below the ephemeral range, from a cursor shared by the whole test
//! process (no number is handed out twice by one process), starting at an offset taken from the
//! process id (two test processes at once start far apart); each is checked free before it is
//! handed out.

use super::HarnessError;
use std::net::TcpListener;
use std::sync::Mutex;

/// Single ports: `[SINGLE_FROM, EPHEMERAL_FROM)`.
const SINGLE_FROM: u16 = 24_000;
/// The lowest ephemeral port on Linux by default (`net.ipv4.ip_local_port_range`).
const EPHEMERAL_FROM: u16 = 32_768;
/// Bases of port triples (`p`, `p + 10000`, `p + 20000`, the mock engine's HTTP and KV-event
/// sockets): `[TRIPLE_FROM, TRIPLE_TO)`, so the triples stay below [`SINGLE_FROM`] and apart
/// from the single ports.
const TRIPLE_FROM: u16 = 1_100;
const TRIPLE_TO: u16 = 4_000;

/// Where each range's next search starts: `None` until the first call.
static CURSORS: Mutex<[Option<u16>; 2]> = Mutex::new([None, None]);

/// A loopback port free right now that no earlier call of this process returned.
pub fn free_port() -> Result<u16, HarnessError> {
    next(0, SINGLE_FROM, EPHEMERAL_FROM, &[0])
}

/// A port `p` such that `p`, `p + 10000` and `p + 20000` are free right now, none returned by an
/// earlier call of this process: `infera worker mock --port p` binds all three.
pub fn free_port_triple() -> Result<u16, HarnessError> {
    next(1, TRIPLE_FROM, TRIPLE_TO, &[0, 10_000, 20_000])
}

/// The next port of range `which` (`[from, to)`) whose `offsets` are all bindable.
fn next(which: usize, from: u16, to: u16, offsets: &[u16]) -> Result<u16, HarnessError> {
    let span = to - from;
    let mut cursors = CURSORS
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    let start = *cursors[which].get_or_insert_with(|| {
        // Spread processes over the range: pids of a test run are close, so scale them.
        let spread = (std::process::id() as u64).wrapping_mul(797) % u64::from(span);
        from + spread as u16
    });
    for step in 0..span {
        let port = from + (start - from + step) % span;
        if offsets.iter().all(|&offset| bindable(port + offset)) {
            cursors[which] = Some(from + (port - from + 1) % span);
            return Ok(port);
        }
    }
    Err(HarnessError::io(
        format!("finding a free loopback port in {from}..{to}"),
        std::io::Error::from(std::io::ErrorKind::AddrInUse),
    ))
}

fn bindable(port: u16) -> bool {
    TcpListener::bind(("127.0.0.1", port)).is_ok()
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn no_port_is_handed_out_twice_and_each_is_bindable() {
        let mut seen = std::collections::HashSet::new();
        for _ in 0..200 {
            let port = free_port().unwrap();
            assert!((SINGLE_FROM..EPHEMERAL_FROM).contains(&port), "{port}");
            assert!(seen.insert(port), "{port} handed out twice");
            TcpListener::bind(("127.0.0.1", port)).unwrap();
        }
    }

    #[test]
    fn a_triple_skips_a_base_whose_upper_port_is_taken() {
        let base = free_port_triple().unwrap();
        assert!(base + 20_000 < SINGLE_FROM, "{base}");
        // Hold the next base's third port: the next triple must not be that base.
        let _held = TcpListener::bind(("127.0.0.1", base + 1 + 20_000)).unwrap();
        let next = free_port_triple().unwrap();
        assert_ne!(next, base + 1);
        assert_ne!(next, base);
        for offset in [0, 10_000, 20_000] {
            TcpListener::bind(("127.0.0.1", next + offset)).unwrap();
        }
    }
}
