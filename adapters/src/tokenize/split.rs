//! Cutting a prompt into independently tokenizable units.
//!
//! Two cuts, each exact with respect to `tokenizers::Tokenizer::encode(text, false)`:
//!
//! 1. **Added tokens.** [`AddedTokenSplitter`] reproduces the crate's `AddedVocabulary`
//!    extraction: first every non-normalized added token is found in the raw text
//!    (leftmost-longest, left to right), then every normalized added token is found inside the
//!    gaps (same rule). With an identity normalizer the "normalized" text of a gap is the gap
//!    itself, so both passes run on the raw text. The crate then pre-tokenizes and tokenizes each
//!    gap on its own, so a gap encoded alone gives the same ids. A gap never contains a whole
//!    added token (a leftmost search from the gap's start would have found it), so encoding a gap
//!    alone finds no added token either.
//! 2. **Safe split points inside a gap** ([`next_cut`], DeepSeek-V3 pre-tokenizer only). See
//!    [`is_safe_split`] for the rule and its proof sketch; property tests in
//!    `adapters/tests/tokenize.rs` check it against the crate on adversarial text.

use std::ops::Range;

use aho_corasick::{AhoCorasick, Anchored, Input, MatchKind, StartKind};

/// One unit of a prompt: an added token (its id is known) or a run of ordinary text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Piece {
    Added(u32),
    Text(Range<usize>),
}

/// Finds added tokens exactly as `tokenizers`' `AddedVocabulary::extract_and_normalize` does
/// for an identity normalizer and tokens without `lstrip`/`rstrip`/`single_word`.
#[derive(Debug)]
pub(crate) struct AddedTokenSplitter {
    raw: Option<Matcher>,
    normalized: Option<Matcher>,
}

/// One leftmost-longest automaton over a set of added tokens, with their ids.
///
/// When the tokens start with at most three distinct bytes (DeepSeek's 1,283 all start with `<`
/// or the first byte of `｜`), the text is scanned for those bytes with `memchr` and the
/// automaton runs anchored at each candidate only: trying candidates left to right and taking
/// the longest match at the first one that has any is the leftmost-longest rule, and it skips
/// the automaton's own prefilter, which stops at every CJK punctuation mark.
#[derive(Debug)]
struct Matcher {
    automaton: AhoCorasick,
    ids: Vec<u32>,
    /// The distinct first bytes of the tokens, when there are at most three.
    starts: Option<Vec<u8>>,
}

impl Matcher {
    /// The leftmost-longest match in `hay` at or after `from`, as (start, end, id).
    fn next(&self, hay: &str, from: usize) -> Option<(usize, usize, u32)> {
        let found = match &self.starts {
            // Empty matches (an empty added token) are skipped rather than looped on.
            None => self
                .automaton
                .find_iter(Input::new(hay).span(from..hay.len()))
                .find(|m| !m.is_empty()),
            Some(starts) => {
                let mut at = from;
                loop {
                    let rest = &hay.as_bytes()[at..];
                    let hit = match starts.as_slice() {
                        [a] => memchr::memchr(*a, rest),
                        [a, b] => memchr::memchr2(*a, *b, rest),
                        [a, b, c] => memchr::memchr3(*a, *b, *c, rest),
                        _ => None,
                    }?;
                    let candidate = at + hit;
                    let input = Input::new(hay)
                        .span(candidate..hay.len())
                        .anchored(Anchored::Yes);
                    if let Some(m) = self.automaton.find(input) {
                        break Some(m);
                    }
                    at = candidate + 1;
                }
            }
        }?;
        Some((
            found.start(),
            found.end(),
            self.ids[found.pattern().as_usize()],
        ))
    }
}

impl AddedTokenSplitter {
    /// Builds the two automata from `(content, id, normalized)` triples.
    pub(crate) fn new(tokens: &[(String, u32, bool)]) -> Result<Self, String> {
        let build = |want_normalized: bool| -> Result<Option<Matcher>, String> {
            let selected: Vec<&(String, u32, bool)> =
                tokens.iter().filter(|t| t.2 == want_normalized).collect();
            if selected.is_empty() {
                return Ok(None);
            }
            let automaton = AhoCorasick::builder()
                .match_kind(MatchKind::LeftmostLongest)
                .start_kind(StartKind::Both)
                .build(selected.iter().map(|t| t.0.as_str()))
                .map_err(|e| format!("cannot build the added-token matcher: {e}"))?;
            let mut starts: Vec<u8> = selected
                .iter()
                .filter_map(|t| t.0.as_bytes().first().copied())
                .collect();
            starts.sort_unstable();
            starts.dedup();
            // An empty token would match anywhere: leave that to the automaton.
            let all_start = selected.iter().all(|t| !t.0.is_empty());
            Ok(Some(Matcher {
                automaton,
                ids: selected.iter().map(|t| t.1).collect(),
                starts: (all_start && starts.len() <= 3).then_some(starts),
            }))
        };
        Ok(Self {
            raw: build(false)?,
            normalized: build(true)?,
        })
    }

    /// Splits `text` into pieces; text pieces are never empty.
    pub(crate) fn split(&self, text: &str) -> Vec<Piece> {
        let mut first = Vec::new();
        find_into(self.raw.as_ref(), text, 0..text.len(), &mut first);
        let Some(normalized) = self.normalized.as_ref() else {
            return first;
        };
        let mut out = Vec::with_capacity(first.len());
        for piece in first {
            match piece {
                Piece::Text(range) => find_into(Some(normalized), text, range, &mut out),
                added => out.push(added),
            }
        }
        out
    }
}

fn find_into(matcher: Option<&Matcher>, text: &str, range: Range<usize>, out: &mut Vec<Piece>) {
    let Some(matcher) = matcher else {
        if !range.is_empty() {
            out.push(Piece::Text(range));
        }
        return;
    };
    let hay = &text[range.clone()];
    let base = range.start;
    let mut cursor = 0;
    while let Some((start, end, id)) = matcher.next(hay, cursor) {
        if cursor < start {
            out.push(Piece::Text(base + cursor..base + start));
        }
        out.push(Piece::Added(id));
        cursor = end;
    }
    if base + cursor < range.end {
        out.push(Piece::Text(base + cursor..range.end));
    }
}

/// Whether cutting `text` at byte `p` (0 < p < len) leaves the DeepSeek-V3 pre-tokenization
/// unchanged, i.e. `pretok(text) == pretok(text[..p]) ++ pretok(text[p..])`.
///
/// The pre-tokenizer is `Split(\p{N}{1,3})`, `Split(CJK run)`, `Split(R)` (all `Isolated`),
/// then `ByteLevel` without regex, where `R` is
/// `[punct][A-Za-z]+ | [^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+ | ?[\p{P}\p{S}]+[\r\n]* |
/// \s*[\r\n]+ | \s+(?!\S) | \s+`. None of the three regexes looks behind, and the only
/// lookahead (`(?!\S)`) is evaluated right after a whitespace run. Two rules are accepted:
///
/// * **A** — `text[p] == '\n'` and the char before is `[A-Za-z0-9]` or a CJK ideograph
///   (U+4E00..=U+9FA5, all `Lo`);
/// * **B** — `text[p] == ' '`, the byte before is `[A-Za-z0-9]` and the byte after is `[A-Za-z]`.
///
/// In both rules neither `text[p-1]` nor `text[p]` can be inside one digit run or one CJK run
/// (for rule A the CJK run ends at `p` because `\n` is not CJK), so stages 1 and 2 either put a
/// boundary at `p` or keep `p` inside a gap that the next stage sees whole, and their matches
/// before `p` are the same with or without the suffix. In stage 3 no match that starts before
/// `p` can contain `text[p]`: the char before `p` is neither whitespace, `\p{P}`, `\p{S}` nor a
/// space, so only a letter/mark run could reach `p`, and neither `\n` nor `' '` is a letter or
/// mark; every lookahead happens at or before `p - 1`. A match does start at `p`: `\s*[\r\n]+`
/// for rule A, `[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+` (space prefix, then a letter) for rule B,
/// and it depends only on `text[p..]`. Hence `p` is a pre-token boundary and both sides
/// pre-tokenize the same alone; BPE runs per pre-token.
pub(crate) fn is_safe_split(text: &str, p: usize) -> bool {
    let bytes = text.as_bytes();
    if p == 0 || p + 1 >= bytes.len() {
        return false;
    }
    match bytes[p] {
        b'\n' => {
            let prev = bytes[p - 1];
            if prev.is_ascii_alphanumeric() {
                return true;
            }
            matches!(text[..p].chars().next_back(), Some('\u{4e00}'..='\u{9fa5}'))
        }
        b' ' => bytes[p - 1].is_ascii_alphanumeric() && bytes[p + 1].is_ascii_alphabetic(),
        _ => false,
    }
}

/// The end of the chunk that starts at `start`: the first safe split point at or after
/// `start + target`, else `end`. Depends only on `text[start..cut + 2]`, so two texts sharing a
/// prefix get identical chunks up to the one holding the first difference.
pub(crate) fn next_cut(text: &str, start: usize, end: usize, target: usize) -> usize {
    let bytes = &text.as_bytes()[..end];
    let mut p = start.saturating_add(target.max(1));
    while p + 1 < end {
        if (bytes[p] == b'\n' || bytes[p] == b' ') && text.is_char_boundary(p) {
            // Judge within the segment: the char after the cut must belong to it.
            if is_safe_split(&text[..end], p) {
                return p;
            }
        }
        p += 1;
    }
    end
}

/// Cuts `range` of `text` into chunks of about `target` bytes at safe split points.
pub(crate) fn chunks(text: &str, range: Range<usize>, target: usize, out: &mut Vec<Range<usize>>) {
    let mut start = range.start;
    while start < range.end {
        let cut = next_cut(text, start, range.end, target);
        out.push(start..cut);
        start = cut;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn safe_split_rules() {
        assert!(is_safe_split("ab\ncd", 2));
        assert!(is_safe_split("中\nx", 3));
        assert!(!is_safe_split("a.\nb", 2));
        assert!(!is_safe_split("a \nb", 2));
        assert!(is_safe_split("ab cd", 2));
        assert!(!is_safe_split("ab 1d", 2));
        assert!(!is_safe_split("a. cd", 2));
        assert!(!is_safe_split("ab\n", 2));
    }

    #[test]
    fn chunks_cover_the_range() {
        let text = "word ".repeat(100);
        let mut out = Vec::new();
        chunks(&text, 0..text.len(), 37, &mut out);
        assert_eq!(out.first().map(|r| r.start), Some(0));
        assert_eq!(out.last().map(|r| r.end), Some(text.len()));
        assert!(out.windows(2).all(|w| w[0].end == w[1].start));
        assert!(out.len() > 5);
    }

    proptest::proptest! {
        /// The first-byte scan finds exactly what the automaton's own leftmost-longest
        /// iteration finds, on text dense with partial and overlapping tokens.
        #[test]
        fn first_byte_scan_matches_the_automaton(
            picks in proptest::collection::vec(0usize..7, 0..60)
        ) {
            const PARTS: [&str; 7] = ["<", "a", "b", ">", "｜", "，", "<｜"];
            let text: String = picks.iter().map(|&i| PARTS[i]).collect();
            let tokens = ["<a>", "<ab>", "<a", "ab", "<｜b｜>", "｜b"];
            let splitter = AddedTokenSplitter::new(
                &tokens.iter().enumerate().map(|(i, t)| ((*t).to_owned(), i as u32, false))
                    .collect::<Vec<_>>(),
            ).expect("matcher");
            let matcher = splitter.raw.as_ref().expect("raw tokens");
            proptest::prop_assert_eq!(matcher.starts.as_deref(), Some(&b"<a\xef"[..]));
            let mut found = Vec::new();
            let mut cursor = 0;
            while let Some(m) = matcher.next(&text, cursor) {
                found.push(m);
                cursor = m.1;
            }
            let reference: Vec<(usize, usize, u32)> = matcher
                .automaton
                .find_iter(text.as_str())
                .map(|m| (m.start(), m.end(), m.pattern().as_u32()))
                .collect();
            proptest::prop_assert_eq!(found, reference);
        }
    }

    #[test]
    fn leftmost_longest_then_normalized() {
        let splitter = AddedTokenSplitter::new(&[
            ("<a>".to_string(), 1, false),
            ("<a>b".to_string(), 2, true),
            ("b".to_string(), 3, true),
        ])
        .expect("matcher");
        // The raw pass takes "<a>" first, so the normalized "<a>b" can never match.
        assert_eq!(
            splitter.split("x<a>by"),
            vec![
                Piece::Text(0..1),
                Piece::Added(1),
                Piece::Added(3),
                Piece::Text(5..6)
            ]
        );
    }
}
