//! Think times of recorded session turns, so that `infera replay` and `infera bench` can play a
//! recorded trace as sessions ([`crate::sim::Playback::Sessions`]).
//!
//! When a row with a `session_id` is written, the recorder remembers when that request finished
//! (the router's `RequestFinished` time). The session's next row gets `think_time_us` = its
//! arrival minus that finish when it arrived after the previous turn finished (its client waited
//! for the answer); a turn sent while its predecessor was still running gets none and replays at
//! its recorded arrival. Rows are stamped in arrival order, segment after segment.
//!
//! Bounds: a session is forgotten [`SESSION_MEMORY_US`] after its last finish (its next turn,
//! if any, replays on the timeline), and at most [`MAX_SESSIONS`] sessions are remembered at once
//! (new sessions past that are not, until older ones are forgotten).

use crate::trace::TraceRequest;
use std::collections::HashMap;

/// How long a session's last finish is remembered.
pub const SESSION_MEMORY_US: u64 = 3_600_000_000;
/// The most sessions remembered at once.
pub const MAX_SESSIONS: usize = 100_000;

/// Each open session's last finish time.
#[derive(Debug, Default)]
pub(super) struct SessionClock {
    last_finish_us: HashMap<String, u64>,
}

impl SessionClock {
    /// Stamps `think_time_us` on rows given in arrival order with their finish times, and
    /// remembers each session's last finish.
    pub(super) fn stamp<'a>(&mut self, rows: impl Iterator<Item = (&'a mut TraceRequest, u64)>) {
        for (req, finish_us) in rows {
            let Some(session) = req.session_id.as_deref() else {
                continue;
            };
            let full = self.last_finish_us.len() >= MAX_SESSIONS;
            match self.last_finish_us.get_mut(session) {
                Some(last) => {
                    if req.arrival_us >= *last {
                        req.think_time_us = Some(req.arrival_us - *last);
                    }
                    *last = (*last).max(finish_us);
                }
                None if !full => {
                    self.last_finish_us.insert(session.to_owned(), finish_us);
                }
                None => {}
            }
        }
    }

    /// Forgets sessions whose last turn finished more than [`SESSION_MEMORY_US`] before `now_us`.
    pub(super) fn forget_idle(&mut self, now_us: u64) {
        let horizon = now_us.saturating_sub(SESSION_MEMORY_US);
        self.last_finish_us.retain(|_, at| *at >= horizon);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(session: Option<&str>, arrival_us: u64) -> TraceRequest {
        TraceRequest {
            arrival_us,
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
            think_time_us: None,
            lora: None,
            cache_salt: None,
            images: Vec::new(),
            tenant: None,
            priority: None,
        }
    }

    #[test]
    fn a_turn_after_its_predecessors_answer_gets_the_gap_as_think_time() {
        let mut clock = SessionClock::default();
        // (row, finish): a's second turn waits 300 us after the first's answer; its third is
        // sent while the second runs; b has one turn; rows without a session are left alone.
        let mut rows = [
            (req(Some("a"), 0), 1_000),
            (req(Some("b"), 100), 500),
            (req(None, 200), 300),
            (req(Some("a"), 1_300), 2_000),
            (req(Some("a"), 1_900), 2_500),
        ];
        clock.stamp(rows.iter_mut().map(|(r, f)| (r, *f)));
        let think: Vec<Option<u64>> = rows.iter().map(|(r, _)| r.think_time_us).collect();
        assert_eq!(think, [None, None, None, Some(300), None]);

        // The next segment continues the sessions; idle ones are forgotten.
        let mut next = [
            (req(Some("a"), 2_600), 3_000),
            (req(Some("b"), 2_700), 2_800),
        ];
        clock.forget_idle(500 + SESSION_MEMORY_US + 1);
        clock.stamp(next.iter_mut().map(|(r, f)| (r, *f)));
        assert_eq!(next[0].0.think_time_us, Some(100), "a: after 2,500");
        assert_eq!(next[1].0.think_time_us, None, "b was forgotten");
    }
}
