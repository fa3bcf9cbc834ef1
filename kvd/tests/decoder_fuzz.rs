//! Property test of the request decoder (the daemon's only parser of untrusted bytes): over
//! arbitrary bytes and over valid frames of every op with random mutations (overwritten bytes,
//! cut tails, inserted bytes, lying length fields), `decode_request` never panics, allocates at
//! most a small multiple of the frame (a counting allocator measures the peak on this thread),
//! answers errors with a code and a non-empty message, and refuses batches past the limit.
//! Sized to run in seconds.

#![allow(clippy::unwrap_used)]

use bytes::Bytes;
use infera_core::event::Retention;
use infera_kvd::proto::{Limits, Request, decode_request};
use infera_kvd::{Namespace, SetItem};
use proptest::prelude::*;
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

/// Counts this thread's live and peak heap bytes while `COUNTING` is set.
struct Counting;

thread_local! {
    static COUNTING: Cell<bool> = const { Cell::new(false) };
    static LIVE: Cell<isize> = const { Cell::new(0) };
    static PEAK: Cell<isize> = const { Cell::new(0) };
}

fn note(delta: isize) {
    let _ = COUNTING.try_with(|on| {
        if on.get() {
            let live = LIVE.with(|l| {
                l.set(l.get() + delta);
                l.get()
            });
            PEAK.with(|p| p.set(p.get().max(live)));
        }
    });
}

// The one way to measure what decoding allocates: a counting allocator (test-only).
// SAFETY: forwards to the system allocator; the bookkeeping touches only const-initialized
// thread-locals, which never allocate.
#[allow(unsafe_code)]
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note(layout.size() as isize);
        // SAFETY: the caller's layout contract is passed through unchanged.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        note(-(layout.size() as isize));
        // SAFETY: as above; `ptr` came from `System.alloc` with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note(new_size as isize - layout.size() as isize);
        // SAFETY: as above.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// Bytes a decoded frame may hold at its peak: 48 per frame byte (a `batch_set` item of three
/// one-byte fields decodes to one 120-byte `SetItem`), plus the fixed field table.
fn budget(frame: usize) -> isize {
    (48 * frame + (16 << 10)) as isize
}

const LIMITS: Limits = Limits { max_keys: 512 };

/// Decodes `frame`, checking the properties; returns whether it decoded to a request.
fn check(frame: &[u8]) -> Result<bool, TestCaseError> {
    let frame = Bytes::copy_from_slice(frame);
    LIVE.with(|l| l.set(0));
    PEAK.with(|p| p.set(0));
    COUNTING.with(|c| c.set(true));
    let decoded = decode_request(&frame, LIMITS);
    COUNTING.with(|c| c.set(false));
    let peak = PEAK.with(Cell::get);
    prop_assert!(
        peak <= budget(frame.len()),
        "decoding {} bytes peaked at {peak} bytes",
        frame.len()
    );
    Ok(match decoded {
        Err(error) => {
            prop_assert!(!error.code().is_empty() && !error.to_string().is_empty());
            false
        }
        Ok(d) => match d.request {
            Err(error) => {
                prop_assert!(!error.code.is_empty() && error.message.len() > 10);
                false
            }
            Ok(request) => {
                let n = match &request {
                    Request::BatchGet { keys, .. }
                    | Request::Exists { keys, .. }
                    | Request::PrefetchHint { keys, .. } => keys.len(),
                    Request::BatchSet { items, .. } => items.len(),
                    _ => 0,
                };
                prop_assert!(n <= LIMITS.max_keys);
                true
            }
        },
    })
}

fn body(request: &Request) -> Vec<u8> {
    let all: Vec<u8> = request
        .encode(Some(&rmpv::Value::from(7)))
        .iter()
        .flat_map(|p| p.to_vec())
        .collect();
    all[4..].to_vec()
}

fn blob(max: usize) -> impl Strategy<Value = Bytes> {
    prop::collection::vec(any::<u8>(), 0..max).prop_map(Bytes::from)
}

fn request() -> impl Strategy<Value = Request> {
    let ns = ("[a-z]{0,8}", "[a-z0-9]{0,4}")
        .prop_map(|(m, c)| Namespace::new(m, c))
        .boxed();
    let class = prop::sample::select(Retention::ALL.to_vec());
    let item = (blob(16), blob(300), class, prop::option::of(0.0f64..100.0))
        .prop_map(|(k, v, class, ttl)| {
            let item = SetItem::new(k, v).retention(class);
            match ttl {
                Some(t) => item.ttl_seconds(t),
                None => item,
            }
        })
        .boxed();
    prop_oneof![
        (ns.clone(), blob(16)).prop_map(|(ns, key)| Request::Get { ns, key }),
        (ns.clone(), prop::collection::vec(blob(16), 0..600))
            .prop_map(|(ns, keys)| Request::BatchGet { ns, keys }),
        (ns.clone(), prop::collection::vec(blob(4), 0..40))
            .prop_map(|(ns, keys)| Request::Exists { ns, keys }),
        (ns.clone(), item.clone()).prop_map(|(ns, item)| Request::Set { ns, item }),
        (ns.clone(), prop::collection::vec(item, 0..40))
            .prop_map(|(ns, items)| Request::BatchSet { ns, items }),
        any::<u64>().prop_map(|size| Request::SetReserve { size }),
        (
            ns.clone(),
            prop::collection::vec(blob(8), 0..20),
            any::<u64>()
        )
            .prop_map(|(ns, keys, deadline_ms)| Request::PrefetchHint {
                ns,
                keys,
                deadline_ms
            }),
        ns.prop_map(|ns| Request::Clear { ns }),
        any::<bool>().prop_map(|extended| Request::Stats { extended }),
    ]
}

/// One change to a valid frame.
#[derive(Debug, Clone)]
enum Mutation {
    /// Overwrite the byte at this fraction of the frame.
    Set(f64, u8),
    /// Write a big-endian u32 (a lying array/str/bin length) there.
    Length(f64, u32),
    /// Insert a byte there.
    Insert(f64, u8),
    /// Cut the frame there.
    Cut(f64),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        (0.0f64..1.0, any::<u8>()).prop_map(|(at, b)| Mutation::Set(at, b)),
        (
            0.0f64..1.0,
            prop_oneof![Just(u32::MAX), Just(1 << 20), any::<u32>()]
        )
            .prop_map(|(at, n)| Mutation::Length(at, n)),
        (0.0f64..1.0, any::<u8>()).prop_map(|(at, b)| Mutation::Insert(at, b)),
        (0.0f64..1.0).prop_map(Mutation::Cut),
    ]
}

fn apply(frame: &mut Vec<u8>, m: &Mutation) {
    let at = |f: f64, len: usize| ((f * len as f64) as usize).min(len);
    match *m {
        Mutation::Set(f, b) => {
            if !frame.is_empty() {
                let i = at(f, frame.len() - 1);
                frame[i] = b;
            }
        }
        Mutation::Length(f, n) => {
            if frame.len() >= 5 {
                let i = at(f, frame.len() - 5);
                frame[i] = 0xdd; // array32, then the lying count
                frame[i + 1..i + 5].copy_from_slice(&n.to_be_bytes());
            }
        }
        Mutation::Insert(f, b) => {
            let i = at(f, frame.len());
            frame.insert(i, b);
        }
        Mutation::Cut(f) => {
            let i = at(f, frame.len());
            frame.truncate(i);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1500, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_bytes_never_panic_nor_overspend(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        check(&bytes)?;
    }

    #[test]
    fn valid_frames_decode_and_mutated_ones_fail_cleanly(
        request in request(),
        mutations in prop::collection::vec(mutation(), 0..4),
    ) {
        let mut frame = body(&request);
        let decoded = check(&frame)?;
        let n = match &request {
            Request::BatchGet { keys, .. } => keys.len(),
            _ => 0,
        };
        prop_assert_eq!(decoded, n <= LIMITS.max_keys, "the unmutated frame decodes unless over the limit");
        for m in &mutations {
            apply(&mut frame, m);
        }
        check(&frame)?;
    }
}

/// The counter sees decoding, and a lookup batch costs one 32-byte handle per key: about
/// 11 bytes per frame byte for one-byte keys (3 bytes each on the wire), no copies.
#[test]
fn a_batch_of_one_byte_keys_costs_its_handles_only() {
    let keys: Vec<Bytes> = (0..=255u8).map(|b| Bytes::from(vec![b])).collect();
    let frame = body(&Request::BatchGet {
        ns: Namespace::new("m", ""),
        keys,
    });
    LIVE.with(|l| l.set(0));
    PEAK.with(|p| p.set(0));
    COUNTING.with(|c| c.set(true));
    let decoded = decode_request(&Bytes::from(frame.clone()), LIMITS).unwrap();
    COUNTING.with(|c| c.set(false));
    let peak = PEAK.with(Cell::get) as usize;
    assert!(matches!(decoded.request, Ok(Request::BatchGet { ref keys, .. }) if keys.len() == 256));
    assert!(peak >= 256 * 32, "the handles are counted: {peak}");
    assert!(
        peak <= 12 * frame.len() + 4096,
        "{peak} bytes for a {}-byte frame",
        frame.len()
    );
}
