//! Session playback: which requests wait for a predecessor instead of arriving on the timeline.
//!
//! A trace row that has a `session_id` and a `think_time_us` is a turn of a conversation whose
//! client waited for the previous turn's answer (the previous row of the same session, in file
//! order) and then thought for `think_time_us` before sending it. Under [`Playback::Sessions`]
//! such a turn leaves the client `think_time_us / speedup` after its predecessor finished in the
//! simulation (its answer's last token, front end included), not at its recorded `arrival_us`: a
//! slow answer delays the rest of the conversation, as it would live, and a turn can never
//! overtake the answer it replies to. Every other row (first turns, rows without a session or a
//! think time) keeps its recorded arrival. [`Playback::Timeline`] plays every row at its
//! recorded arrival (open loop), as traces without think times always are.
//!
//! Invariant: each request has at most one successor and at most one predecessor, and the
//! predecessor comes earlier in the trace, so every chain starts at a request on the timeline and
//! every request arrives exactly once.

use crate::trace::TraceRequest;
use rustc_hash::FxHashMap;

/// How request arrivals are timed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Playback {
    /// Session turns with a think time leave after their predecessor finished plus the think
    /// time; every other request at its recorded arrival.
    #[default]
    Sessions,
    /// Every request at its recorded arrival (open loop).
    Timeline,
}

impl Playback {
    pub fn as_str(self) -> &'static str {
        match self {
            Playback::Sessions => "sessions",
            Playback::Timeline => "timeline",
        }
    }
}

/// The closed-loop links of one trace under one [`Playback`] (used by the simulator and by
/// `infera bench`).
#[derive(Debug, Clone)]
pub struct SessionLinks {
    /// The next turn of each request's session that waits for it.
    next: Vec<Option<usize>>,
    /// Whether each request waits for its predecessor (is off the timeline).
    follows: Vec<bool>,
}

impl SessionLinks {
    pub fn new(requests: &[TraceRequest], playback: Playback) -> Self {
        let n = requests.len();
        let mut next = vec![None; n];
        let mut follows = vec![false; n];
        if playback == Playback::Sessions {
            let mut last: FxHashMap<&str, usize> = FxHashMap::default();
            for (i, r) in requests.iter().enumerate() {
                let Some(session) = r.session_id.as_deref() else {
                    continue;
                };
                if r.think_time_us.is_some()
                    && let Some(&prev) = last.get(session)
                {
                    next[prev] = Some(i);
                    follows[i] = true;
                }
                last.insert(session, i);
            }
        }
        Self { next, follows }
    }

    /// Whether request `i` is released by its predecessor rather than by the timeline.
    pub fn follows(&self, i: usize) -> bool {
        self.follows.get(i).copied().unwrap_or(false)
    }

    /// The turn that request `i`'s completion releases.
    pub fn next(&self, i: usize) -> Option<usize> {
        self.next.get(i).copied().flatten()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(session: Option<&str>, think: Option<u64>) -> TraceRequest {
        TraceRequest {
            arrival_us: 0,
            request_id: "r".into(),
            model: "m".into(),
            input_length: 16,
            output_length: 1,
            block_size: 16,
            block_hashes: vec![1],
            token_ids: None,
            session_id: session.map(str::to_owned),
            retention: None,
            ttl_seconds: None,
            think_time_us: think,
            lora: None,
            cache_salt: None,
            images: Vec::new(),
            tenant: None,
            priority: None,
        }
    }

    #[test]
    fn turns_with_think_time_follow_the_previous_row_of_their_session() {
        let trace = [
            row(Some("a"), None),
            row(Some("b"), None),
            row(Some("a"), Some(5)),
            row(None, Some(5)),
            row(Some("b"), None),
            row(Some("a"), Some(7)),
        ];
        let links = SessionLinks::new(&trace, Playback::Sessions);
        let follows: Vec<bool> = (0..6).map(|i| links.follows(i)).collect();
        assert_eq!(follows, [false, false, true, false, false, true]);
        let next: Vec<Option<usize>> = (0..6).map(|i| links.next(i)).collect();
        assert_eq!(next, [Some(2), None, Some(5), None, None, None]);

        let open = SessionLinks::new(&trace, Playback::Timeline);
        assert!((0..6).all(|i| !open.follows(i) && open.next(i).is_none()));
    }
}
