//! `infera replay --tenant-scale NAME=FACTOR`: one tenant's traffic scaled, the others' kept, so
//! the replay answers what the others' latency becomes when that tenant sends more (or less).
//!
//! The unit scaled is a conversation (a session's turns together) or a request without a
//! session. Above 1, each unit gets `⌊FACTOR⌋ − 1` copies, and one more with probability the
//! fraction (decided by a hash of the unit, so a run is reproducible); copy `c` of every unit is
//! shifted by `c / (copies + 1)` of the tenant's mean gap between requests, so the copies fill
//! the gaps instead of arriving together. A copy is a new prompt of the same shape: its block ids
//! are the original's XOR a constant of `c`, which keeps the prefixes its rank's copies share
//! with each other (a system prompt stays shared among them) and shares none with the original;
//! its request and session ids get `~c`. Below 1, a unit is kept with probability the factor.

use super::{Trace, TraceRequest};
use infera_core::ids::SessionKey;

/// A stable 64-bit hash of `text` (XXH3, as the router keys sessions).
fn hash(text: &str) -> u64 {
    SessionKey::of(text).0
}

impl Trace {
    /// Scales `tenant`'s requests by `factor` (see the module docs) and notes it.
    pub fn scale_tenant(&mut self, tenant: &str, factor: f64) {
        let ours = |r: &TraceRequest| r.tenant.as_deref() == Some(tenant);
        let count = self.requests.iter().filter(|r| ours(r)).count();
        if count == 0 || factor == 1.0 {
            self.notes.push(format!(
                "--tenant-scale {tenant}={factor}: no change ({count} requests)"
            ));
            return;
        }
        // A unit's draw in [0, 1): the same for every turn of a session.
        let draw = |r: &TraceRequest| {
            let unit = r.session_id.as_deref().unwrap_or(&r.request_id);
            (hash(unit) % 1_000_000) as f64 / 1_000_000.0
        };
        let before = self.requests.len();
        if factor < 1.0 {
            self.requests.retain(|r| !ours(r) || draw(r) < factor);
        } else {
            let arrivals = self
                .requests
                .iter()
                .filter(|r| ours(r))
                .map(|r| r.arrival_us);
            let (first, last) = arrivals.fold((u64::MAX, 0), |(a, b), t| (a.min(t), b.max(t)));
            let mean_gap = (last - first) as f64 / count as f64;
            let whole = factor.floor() as u64;
            let mut copies = Vec::new();
            for r in self.requests.iter().filter(|r| ours(r)) {
                let n = whole - 1 + u64::from(draw(r) < factor.fract());
                for c in 1..=n {
                    let shift = (c as f64 * mean_gap / (n + 1) as f64) as u64;
                    copies.push(copy(r, c, shift));
                }
            }
            self.requests.extend(copies);
            // Stable: the originals keep their order among equal arrivals.
            self.requests.sort_by_key(|r| r.arrival_us);
        }
        self.notes.push(format!(
            "--tenant-scale {tenant}={factor}: {count} of its requests became {}",
            count as i64 + self.requests.len() as i64 - before as i64
        ));
    }
}

/// Copy `c` of `r`, `shift` µs later (see the module docs).
fn copy(r: &TraceRequest, c: u64, shift: u64) -> TraceRequest {
    let salt = hash(&format!("copy {c}")) | 1;
    TraceRequest {
        arrival_us: r.arrival_us + shift,
        request_id: format!("{}~{c}", r.request_id),
        block_hashes: r.block_hashes.iter().map(|h| h ^ salt).collect(),
        // The tokens would no longer match the blocks.
        token_ids: None,
        session_id: r.session_id.as_ref().map(|s| format!("{s}~{c}")),
        ..r.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn trace() -> Trace {
        let req = |i: u64, tenant: &str, session: Option<String>| TraceRequest {
            arrival_us: i * 1_000,
            request_id: format!("{tenant}-{i}"),
            model: "m".into(),
            input_length: 64,
            output_length: 4,
            block_size: 16,
            // A shared system block, then the request's own.
            block_hashes: vec![7, 100 + i, 200 + i, 300 + i],
            session_id: session,
            tenant: Some(tenant.to_owned()),
            ..TraceRequest::default()
        };
        let mut requests = Vec::new();
        for i in 0..200 {
            requests.push(req(i, "a", Some(format!("s{}", i % 40))));
            requests.push(req(i, "b", None));
        }
        Trace {
            requests,
            source: "test".into(),
            notes: Vec::new(),
        }
    }

    fn of<'a>(t: &'a Trace, tenant: &str) -> Vec<&'a TraceRequest> {
        t.requests
            .iter()
            .filter(|r| r.tenant.as_deref() == Some(tenant))
            .collect()
    }

    #[test]
    fn doubling_a_tenant_adds_a_new_prompt_of_the_same_shape_per_request() {
        let mut t = trace();
        t.scale_tenant("a", 2.0);
        let a = of(&t, "a");
        assert_eq!(a.len(), 400);
        assert_eq!(of(&t, "b").len(), 200, "the other tenant is untouched");
        assert!(
            t.requests
                .windows(2)
                .all(|w| w[0].arrival_us <= w[1].arrival_us)
        );
        let copies: Vec<&&TraceRequest> =
            a.iter().filter(|r| r.request_id.ends_with("~1")).collect();
        assert_eq!(copies.len(), 200);
        // Each copy shares its system block with the other copies, nothing with the originals.
        let first: std::collections::HashSet<u64> =
            copies.iter().map(|r| r.block_hashes[0]).collect();
        assert_eq!(first.len(), 1);
        assert!(!first.contains(&7));
        let originals: std::collections::HashSet<u64> = a
            .iter()
            .filter(|r| !r.request_id.contains('~'))
            .flat_map(|r| r.block_hashes.iter().copied())
            .collect();
        assert!(
            copies
                .iter()
                .all(|r| r.block_hashes.iter().all(|h| !originals.contains(h)))
        );
        // Copies are sessions of their own, and fill the gaps between the tenant's requests.
        assert!(
            copies
                .iter()
                .all(|r| r.session_id.as_deref().is_some_and(|s| s.ends_with("~1")))
        );
        let original = a.iter().find(|r| r.request_id == "a-10").unwrap();
        let copy = a.iter().find(|r| r.request_id == "a-10~1").unwrap();
        assert!(copy.arrival_us > original.arrival_us);
        assert!(copy.arrival_us < original.arrival_us + 1_000);
    }

    #[test]
    fn fractions_keep_or_add_whole_sessions_reproducibly() {
        let mut half = trace();
        half.scale_tenant("a", 0.5);
        let kept = of(&half, "a");
        assert!((60..=140).contains(&kept.len()), "{}", kept.len());
        // A session is kept whole or dropped whole: 5 turns each.
        let mut sessions = std::collections::HashMap::<&str, usize>::new();
        for r in &kept {
            *sessions
                .entry(r.session_id.as_deref().unwrap())
                .or_default() += 1;
        }
        assert!(sessions.values().all(|n| *n == 5), "{sessions:?}");
        let mut again = trace();
        again.scale_tenant("a", 0.5);
        assert_eq!(again, half, "reproducible");

        let mut more = trace();
        more.scale_tenant("a", 1.5);
        let added = of(&more, "a").len() - 200;
        assert!((60..=140).contains(&added), "{added}");
        assert_eq!(added % 5, 0, "whole sessions");
        assert!(
            more.notes
                .iter()
                .any(|n| n.contains("200 of its requests became"))
        );
    }
}
