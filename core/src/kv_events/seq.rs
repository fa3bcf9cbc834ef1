//! Gap and restart detection over an engine's ZeroMQ sequence numbers.
//!
//! vLLM and SGLang number each published batch (the 8-byte big-endian frame between topic and
//! payload) from 0 per engine process. Per stream (worker, dp rank), after seeing `n` the next
//! batch should be `n + 1`:
//!
//! - the first number seen on a stream is accepted as it is (a subscriber may join late);
//! - `n + 1` is in order;
//! - anything higher is a [`SeqStatus::Gap`]: the batches in between were lost (replay them from
//!   the engine's replay socket, or drop the worker's blocks and resync);
//! - anything lower (typically 0 again) is a [`SeqStatus::Restart`]: a new engine process whose
//!   cache starts empty.
//!
//! Either way the tracker then expects the number after the one just seen.

use std::ops::RangeInclusive;

/// How one sequence number relates to the stream so far.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SeqStatus {
    /// The expected number (or the first one seen).
    InOrder,
    /// Numbers were skipped: `missing` were never received.
    Gap { missing: RangeInclusive<u64> },
    /// The number went back: the engine restarted (or its numbering was reset).
    Restart { expected: u64, got: u64 },
}

/// The sequence state of one stream.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StreamSeq {
    /// The number expected next; `None` before the first.
    expected: Option<u64>,
}

impl StreamSeq {
    /// Records `seq` and says how it relates to the stream.
    pub fn observe(&mut self, seq: u64) -> SeqStatus {
        let status = match self.expected {
            None => SeqStatus::InOrder,
            Some(e) if seq == e => SeqStatus::InOrder,
            Some(e) if seq > e => SeqStatus::Gap {
                missing: e..=seq - 1,
            },
            Some(e) => SeqStatus::Restart {
                expected: e,
                got: seq,
            },
        };
        self.expected = seq.checked_add(1);
        status
    }

    /// The number expected next, if any was seen.
    pub fn expected(&self) -> Option<u64> {
        self.expected
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn in_order_then_gap_then_restart() {
        let mut s = StreamSeq::default();
        assert_eq!(s.observe(0), SeqStatus::InOrder);
        assert_eq!(s.observe(1), SeqStatus::InOrder);
        assert_eq!(s.observe(2), SeqStatus::InOrder);
        assert_eq!(s.observe(5), SeqStatus::Gap { missing: 3..=4 });
        assert_eq!(s.observe(6), SeqStatus::InOrder);
        assert_eq!(
            s.observe(0),
            SeqStatus::Restart {
                expected: 7,
                got: 0
            }
        );
        assert_eq!(s.observe(1), SeqStatus::InOrder);
    }

    #[test]
    fn a_late_joiner_accepts_its_first_number() {
        let mut s = StreamSeq::default();
        assert_eq!(s.observe(500), SeqStatus::InOrder);
        assert_eq!(s.expected(), Some(501));
        assert_eq!(s.observe(502), SeqStatus::Gap { missing: 501..=501 });
    }

    #[test]
    fn a_repeated_number_is_a_restart() {
        let mut s = StreamSeq::default();
        s.observe(3);
        assert_eq!(
            s.observe(3),
            SeqStatus::Restart {
                expected: 4,
                got: 3
            }
        );
    }
}
