//! The DeepSeek-V3 pre-tokenizer without a regex engine: text in, pre-token byte ranges out.
//!
//! tokenizer.json runs three `Split` stages (all `Isolated`), each on every piece the previous
//! stage produced, then `ByteLevel` (a byte-to-char mapping, no regex):
//!
//! 1. `\p{N}{1,3}`: each run of `\p{N}` chars becomes pieces of 3, 3, ..., then the rest.
//! 2. `[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+`: maximal CJK runs become pieces.
//! 3. `R = A1|A2|A3|A4|A5|A6` with
//!    `A1 = [ascii punct][A-Za-z]+`, `A2 = [^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+`,
//!    `A3 =  ?[\p{P}\p{S}]+[\r\n]*`, `A4 = \s*[\r\n]+`, `A5 = \s+(?!\S)`, `A6 = \s+`,
//!    run by `fancy-regex` with backtracking (leftmost-first) semantics; the text between two
//!    matches (a "gap") is a pre-token too.
//!
//! Stage 1 and 2 pieces are recognised from the class bits (`classes.rs`): `\p{N}`, CJK and
//! "other" chars are disjoint, so a piece boundary lies exactly where a char's `N`/`CJK` bits
//! differ from its neighbour's, plus every third char of an `N` run. A stage-1 piece holds only
//! `\p{N}` chars, which are in no stage-3 class but the `A2` prefix; as no letter follows inside
//! the piece, stage 3 leaves it whole. Inside a CJK or "other" piece, [`PreTokenizer::match_at`]
//! decides the anchored match at a position the way the backtracking engine does, alternative by
//! alternative, with the piece end as the end of the haystack (the only place that matters is
//! the lookahead `(?!\S)`, which succeeds at the piece end). Since `R` never looks behind, a
//! search from position `i` finds the first position `j >= i` where an anchored match exists.
//!
//! **Engine limits.** `fancy-regex` gives up on a search after 1,000,000 backtracks (6 per
//! position that matches nothing) or 1,000,000 stack entries (one per char of a `\s` run tried
//! by `A5`), and `tokenizers` then silently makes the rest of the piece one pre-token. We do not
//! model that: a gap of [`MAX_GAP_CHARS`] chars or a whitespace run of [`MAX_WS_CHARS`] chars
//! (well below both limits) returns [`Pathological`], and the caller hands the whole request to
//! the crate.

use super::classes::{ALPHA, APUNCT, CJK, CRLF, CharClasses, LM, N, PREFIX, PS, SPACE, WS};

/// Longest run of positions without a match that we encode ourselves.
pub(crate) const MAX_GAP_CHARS: usize = 100_000;
/// Longest whitespace run that we encode ourselves.
pub(crate) const MAX_WS_CHARS: usize = 100_000;

/// The input is close to a `fancy-regex` engine limit; encode it with the crate instead.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Pathological;

/// Stage-1/2 piece bits: a char belongs to the piece of another iff these bits are equal.
const PIECE: u16 = N | CJK;

/// Borrowed view of the class table for one text.
#[derive(Debug, Clone, Copy)]
pub(crate) struct PreTokenizer<'a> {
    classes: &'a CharClasses,
}

impl<'a> PreTokenizer<'a> {
    pub(crate) fn new(classes: &'a CharClasses) -> Self {
        Self { classes }
    }

    /// Calls `emit(start, end)` for every pre-token of `text`, in order; the ranges tile `text`.
    pub(crate) fn run(
        &self,
        text: &str,
        mut emit: impl FnMut(usize, usize),
    ) -> Result<(), Pathological> {
        let bytes = text.as_bytes();
        let n = bytes.len();
        let mut i = 0;
        // Start and char count of the pending gap, which always lies in the current piece.
        let mut gap: Option<(usize, usize)> = None;
        while i < n {
            let (c0, l0) = self.classes.at(bytes, i);
            if c0 & N != 0 {
                // A stage-1 piece: up to three `\p{N}` chars, never split further.
                let mut j = i + l0;
                let mut count = 1;
                while count < 3 && j < n {
                    let (c, l) = self.classes.at(bytes, j);
                    if c & N == 0 {
                        break;
                    }
                    j += l;
                    count += 1;
                }
                emit(i, j);
                i = j;
                continue;
            }
            let piece = c0 & PIECE;
            if let Some(end) = self.match_at(bytes, i, c0, l0, piece)? {
                if let Some((start, _)) = gap.take() {
                    emit(start, i);
                }
                emit(i, end);
                i = end;
                continue;
            }
            let (start, chars) = gap.get_or_insert((i, 0));
            *chars += 1;
            if *chars >= MAX_GAP_CHARS {
                return Err(Pathological);
            }
            let start = *start;
            i += l0;
            if i >= n || self.classes.at(bytes, i).0 & PIECE != piece {
                emit(start, i);
                gap = None;
            }
        }
        Ok(())
    }

    /// End of the char run from byte `j` whose chars are all in `want` and in `piece`.
    #[inline]
    fn run_end(&self, bytes: &[u8], mut j: usize, want: u16, piece: u16) -> usize {
        while j < bytes.len() {
            let (c, l) = self.classes.at(bytes, j);
            if c & want == 0 || c & PIECE != piece {
                break;
            }
            j += l;
        }
        j
    }

    /// The end of the stage-3 match anchored at `i` (char class `c0`, length `l0`), if any,
    /// with the haystack ending where `piece` ends.
    #[inline]
    fn match_at(
        &self,
        bytes: &[u8],
        i: usize,
        c0: u16,
        l0: usize,
        piece: u16,
    ) -> Result<Option<usize>, Pathological> {
        let i1 = i + l0;
        // The next char's classes, or none at the end of the piece.
        let (c1, l1) = if i1 < bytes.len() {
            let (c, l) = self.classes.at(bytes, i1);
            if c & PIECE == piece { (c, l) } else { (0, 0) }
        } else {
            (0, 0)
        };
        // A1: [ascii punct][A-Za-z]+
        if c0 & APUNCT != 0 && c1 & ALPHA != 0 {
            return Ok(Some(self.run_end(bytes, i1 + l1, ALPHA, piece)));
        }
        // A2: the optional prefix is tried taken first, then skipped.
        if c0 & PREFIX != 0 && c1 & LM != 0 {
            return Ok(Some(self.run_end(bytes, i1 + l1, LM, piece)));
        }
        if c0 & LM != 0 {
            return Ok(Some(self.run_end(bytes, i1, LM, piece)));
        }
        // A3: the optional space first, then [\p{P}\p{S}]+ and [\r\n]*, all greedy.
        if c0 & SPACE != 0 && c1 & PS != 0 {
            let j = self.run_end(bytes, i1 + l1, PS, piece);
            return Ok(Some(self.run_end(bytes, j, CRLF, piece)));
        }
        if c0 & PS != 0 {
            let j = self.run_end(bytes, i1, PS, piece);
            return Ok(Some(self.run_end(bytes, j, CRLF, piece)));
        }
        if c0 & WS == 0 {
            return Ok(None);
        }
        // The whitespace run [i, end), its last char's start, and the end of its last \r or \n.
        let mut end = i;
        let mut last = i;
        let mut crlf_end = None;
        let mut chars = 0;
        while end < bytes.len() {
            let (c, l) = self.classes.at(bytes, end);
            if c & WS == 0 || c & PIECE != piece {
                break;
            }
            if c & CRLF != 0 {
                crlf_end = Some(end + l);
            }
            last = end;
            end += l;
            chars += 1;
        }
        if chars >= MAX_WS_CHARS {
            return Err(Pathological);
        }
        // A4: \s* backs off until [\r\n]+ matches, i.e. up to the run's last \r or \n.
        if let Some(e) = crlf_end {
            return Ok(Some(e));
        }
        // A5: \s+(?!\S) holds at the end of the piece; before a \S it gives back one char.
        let at_piece_end = end >= bytes.len() || self.classes.at(bytes, end).0 & PIECE != piece;
        if at_piece_end {
            return Ok(Some(end));
        }
        if chars >= 2 {
            return Ok(Some(last));
        }
        // A6: \s+
        Ok(Some(end))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split(text: &str) -> Vec<&str> {
        let classes = CharClasses::build().expect("tables build");
        let mut out = Vec::new();
        PreTokenizer::new(&classes)
            .run(text, |s, e| out.push(&text[s..e]))
            .expect("not pathological");
        out
    }

    #[test]
    fn english_and_code() {
        assert_eq!(
            split("Hello world's  end.\n\n  x"),
            ["Hello", " world", "'s", " ", " end", ".\n\n", " ", " x"]
        );
        assert_eq!(
            split("fn f(x: u32) {}"),
            ["fn", " f", "(x", ":", " u", "32", ")", " {}"]
        );
    }

    #[test]
    fn digits_cjk_and_piece_ends() {
        assert_eq!(split("1234567"), ["123", "456", "7"]);
        assert_eq!(split("ab中文cd"), ["ab", "中文", "cd"]);
        // The whitespace run ends at a piece boundary, so (?!\S) holds there.
        assert_eq!(split("a  12"), ["a", "  ", "12"]);
        assert_eq!(split("a  b"), ["a", " ", " b"]);
        assert_eq!(split("\u{1}\u{2}x\u{1}"), ["\u{1}", "\u{2}x", "\u{1}"]);
    }

    #[test]
    fn pathological_runs_are_refused() {
        let classes = CharClasses::build().expect("tables build");
        let pre = PreTokenizer::new(&classes);
        let gap = "\u{1}".repeat(MAX_GAP_CHARS);
        assert_eq!(pre.run(&gap, |_, _| {}), Err(Pathological));
        let spaces = " ".repeat(MAX_WS_CHARS);
        assert_eq!(pre.run(&spaces, |_, _| {}), Err(Pathological));
        let fine = "\u{1}".repeat(MAX_GAP_CHARS - 1);
        assert_eq!(pre.run(&fine, |_, _| {}), Ok(()));
    }
}
