//! Loopback ports for the servers a test starts, handed out so that two starts cannot collide.
//!
//! Asking the OS for port 0 and passing the number on leaves a window before the server binds
//! it. Two things used to fill that window: a parallel test of the same binary given the same
//! number, and the outgoing connections of every process on the machine (to etcd, NATS, a
//! worker), whose source ports come from the same ephemeral range the OS picks probes from. So
//! ports here come from outside the machine's ephemeral range (read from
//! `net.ipv4.ip_local_port_range`), from a cursor shared by the whole test process (no number is
//! handed out twice by one process), starting at an offset taken from the process id (two test
//! processes at once start far apart); each is checked free before it is handed out.

use super::HarnessError;
use std::net::TcpListener;
use std::sync::Mutex;

/// Linux's default ephemeral range, `low..=high`, where the machine's cannot be read.
const DEFAULT_EPHEMERAL: (u16, u16) = (32_768, 60_999);
/// Single ports start here, below [`DEFAULT_EPHEMERAL`], when the machine's ephemeral range
/// leaves [`MIN_SPAN`] ports there.
const SINGLE_FROM: u16 = 24_000;
/// The fewest single ports worth a range.
const MIN_SPAN: u16 = 4_000;
/// Bases of port triples (`p`, `p + 10000`, `p + 20000`, the mock engine's HTTP and KV-event
/// sockets): `[TRIPLE_FROM, TRIPLE_TO)`, so the triples stay below [`SINGLE_FROM`] and apart
/// from the single ports.
const TRIPLE_FROM: u16 = 1_100;
const TRIPLE_TO: u16 = 4_000;

/// One range's bounds `[from, to)` and where its next search starts; `None` until first used.
static CURSORS: Mutex<[Option<(u16, u16, u16)>; 2]> = Mutex::new([None, None]);

/// A loopback port free right now that no earlier call of this process returned.
pub fn free_port() -> Result<u16, HarnessError> {
    next(0, single_range, &[0])
}

/// A port `p` such that `p`, `p + 10000` and `p + 20000` are free right now, none returned by an
/// earlier call of this process: `infera worker mock --port p` binds all three.
pub fn free_port_triple() -> Result<u16, HarnessError> {
    next(1, || (TRIPLE_FROM, TRIPLE_TO), &[0, 10_000, 20_000])
}

/// The single ports: below the machine's ephemeral range when it leaves room there, else above
/// it, else (a range covering nearly every port) Linux's default gap, where each port is still
/// checked free and the servers retry a port taken before they bind it.
fn single_range() -> (u16, u16) {
    let (low, high) = ephemeral();
    if low >= SINGLE_FROM + MIN_SPAN {
        (SINGLE_FROM, low)
    } else if high < u16::MAX - MIN_SPAN {
        (high + 1, u16::MAX)
    } else {
        (SINGLE_FROM, DEFAULT_EPHEMERAL.0)
    }
}

/// The machine's ephemeral range, `low..=high` (`net.ipv4.ip_local_port_range`).
fn ephemeral() -> (u16, u16) {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|text| parse_range(&text))
        .unwrap_or(DEFAULT_EPHEMERAL)
}

/// `ip_local_port_range`'s two numbers, low and high.
fn parse_range(text: &str) -> Option<(u16, u16)> {
    let mut numbers = text.split_whitespace().map(str::parse::<u16>);
    match (numbers.next(), numbers.next()) {
        (Some(Ok(low)), Some(Ok(high))) if low <= high => Some((low, high)),
        _ => None,
    }
}

/// The next port of range `which` (bounds from `range` on first use) whose `offsets` are all
/// bindable.
fn next(which: usize, range: fn() -> (u16, u16), offsets: &[u16]) -> Result<u16, HarnessError> {
    let mut cursors = CURSORS
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    let (from, to, start) = *cursors[which].get_or_insert_with(|| {
        let (from, to) = range();
        // Spread processes over the range: pids of a test run are close, so scale them.
        let spread = (std::process::id() as u64).wrapping_mul(797) % u64::from(to - from);
        (from, to, from + spread as u16)
    });
    let span = to - from;
    for step in 0..span {
        let port = from + (start - from + step) % span;
        if offsets.iter().all(|&offset| bindable(port + offset)) {
            cursors[which] = Some((from, to, from + (port - from + 1) % span));
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
    fn no_port_is_handed_out_twice_or_while_another_socket_holds_it() {
        let (from, to) = single_range();
        let mut seen = std::collections::HashSet::new();
        for _ in 0..200 {
            let port = free_port().unwrap();
            assert!((from..to).contains(&port), "{port} outside {from}..{to}");
            assert!(seen.insert(port), "{port} handed out twice");
            // Whatever the other tests of this process take meanwhile, a held port is skipped.
            if port + 1 < to {
                let _held = TcpListener::bind(("127.0.0.1", port + 1));
                assert_ne!(free_port().unwrap(), port + 1);
            }
        }
    }

    #[test]
    fn single_ports_stay_out_of_the_ephemeral_range() {
        assert_eq!(parse_range("32768\t60999\n"), Some((32_768, 60_999)));
        assert_eq!(parse_range("60999 32768"), None);
        assert_eq!(parse_range("garbage"), None);
        let (from, to) = single_range();
        let (low, high) = ephemeral();
        assert!(to - from >= MIN_SPAN, "{from}..{to}");
        if low >= SINGLE_FROM + MIN_SPAN || high < u16::MAX - MIN_SPAN {
            assert!(
                to <= low || from > high,
                "{from}..{to} overlaps {low}..={high}"
            );
        }
    }

    #[test]
    fn a_triple_skips_a_base_whose_upper_port_is_taken() {
        let base = free_port_triple().unwrap();
        assert!(base + 20_000 < SINGLE_FROM, "{base}");
        // Hold the next base's third port: the next triple must not be that base.
        let skipped = if base + 1 < TRIPLE_TO {
            base + 1
        } else {
            TRIPLE_FROM
        };
        let _held = TcpListener::bind(("127.0.0.1", skipped + 20_000));
        let next = free_port_triple().unwrap();
        assert_ne!(next, skipped);
        assert_ne!(next, base);
        assert!((TRIPLE_FROM..TRIPLE_TO).contains(&next), "{next}");
    }
}
