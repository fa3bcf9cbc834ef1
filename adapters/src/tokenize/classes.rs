//! Character classes of the DeepSeek-V3 pre-tokenizer, one bit set per code point.
//!
//! Owns the answer to "which of the regex classes does this char belong to" for the native
//! pre-tokenizer (`pretok.rs`). The sets are not hand-written: each bit is the set that
//! `regex-syntax` (the parser behind the `fancy-regex` delegates that `tokenizers` runs for these
//! patterns, same crate version through Cargo's unification, same default Unicode config) builds
//! for the class expression copied verbatim from the pattern. So `\p{L}`, `\p{N}`, `\s`, ... mean
//! exactly what they mean to the crate, down to the Unicode version of the tables.
//!
//! Layout: a two-level table. `index[cp >> 8]` names a 256-entry block in `blocks`; identical
//! blocks are stored once (most of the code space is unassigned and shares one block). Block 0
//! always holds U+0000..=U+00FF, so an ASCII byte is looked up as `blocks[b]`.
//!
//! Invariants checked at build time (the pre-tokenizer's reasoning relies on them; a violation
//! makes [`CharClasses::build`] fail and the tokenizer stays on the crate): `N`, `CJK` and `WS`
//! are pairwise disjoint, `N` chars are in no stage-3 class but `PREFIX`, `CRLF` and `SPACE` are
//! subsets of `WS`, and `APUNCT`/`ALPHA` are ASCII.

use regex_syntax::hir::{Class, HirKind};

/// `\p{N}` (stage 1, `\p{N}{1,3}`).
pub(crate) const N: u16 = 1 << 0;
/// `[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]` (stage 2).
pub(crate) const CJK: u16 = 1 << 1;
/// The ASCII punctuation class that opens the first stage-3 alternative.
pub(crate) const APUNCT: u16 = 1 << 2;
/// `[A-Za-z]`.
pub(crate) const ALPHA: u16 = 1 << 3;
/// `[^\r\n\p{L}\p{P}\p{S}]`, the optional prefix of a letter run.
pub(crate) const PREFIX: u16 = 1 << 4;
/// `[\p{L}\p{M}]`.
pub(crate) const LM: u16 = 1 << 5;
/// The literal space of ` ?[\p{P}\p{S}]+`.
pub(crate) const SPACE: u16 = 1 << 6;
/// `[\p{P}\p{S}]`.
pub(crate) const PS: u16 = 1 << 7;
/// `[\r\n]`.
pub(crate) const CRLF: u16 = 1 << 8;
/// `\s` (`\S` is its complement).
pub(crate) const WS: u16 = 1 << 9;

/// Each class bit with the regex source it stands for, as the pattern in tokenizer.json spells
/// it (JSON escapes resolved: `\r`/`\n` are the raw control characters there too).
const SOURCES: &[(u16, &str)] = &[
    (N, r"\p{N}"),
    (CJK, "[\u{4e00}-\u{9fa5}\u{3040}-\u{309f}\u{30a0}-\u{30ff}]"),
    (APUNCT, r##"[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~]"##),
    (ALPHA, "[A-Za-z]"),
    (PREFIX, "[^\r\n\\p{L}\\p{P}\\p{S}]"),
    (LM, r"[\p{L}\p{M}]"),
    (SPACE, " "),
    (PS, r"[\p{P}\p{S}]"),
    (CRLF, "[\r\n]"),
    (WS, r"\s"),
];

const CODE_POINTS: usize = 0x11_0000;
const BLOCK: usize = 256;

/// Class bits for every code point; cheap to copy around by reference, immutable after build.
#[derive(Debug)]
pub(crate) struct CharClasses {
    index: Vec<u16>,
    blocks: Vec<u16>,
}

impl CharClasses {
    /// Builds the table from `regex-syntax`'s view of each class (a few milliseconds).
    pub(crate) fn build() -> Result<Self, String> {
        let mut flat = vec![0u16; CODE_POINTS];
        for &(bit, source) in SOURCES {
            for (start, end) in class_ranges(source)? {
                for slot in &mut flat[start as usize..=end as usize] {
                    *slot |= bit;
                }
            }
        }
        check_invariants(&flat)?;

        let mut index = Vec::with_capacity(CODE_POINTS / BLOCK);
        let mut blocks: Vec<u16> = Vec::new();
        let mut seen: rustc_hash::FxHashMap<&[u16], u16> = rustc_hash::FxHashMap::default();
        for block in flat.chunks(BLOCK) {
            let next = (blocks.len() / BLOCK) as u16;
            let id = *seen.entry(block).or_insert_with(|| {
                blocks.extend_from_slice(block);
                next
            });
            index.push(id);
        }
        Ok(Self { index, blocks })
    }

    /// The class bits of `c`.
    #[inline]
    pub(crate) fn of(&self, c: u32) -> u16 {
        let block = self.index[(c as usize) >> 8] as usize;
        self.blocks[block * BLOCK + (c as usize & (BLOCK - 1))]
    }

    /// The class bits and UTF-8 length of the char starting at byte `i` of `text`, which must be
    /// the bytes of a `str` with `i` on a char boundary.
    #[inline]
    pub(crate) fn at(&self, text: &[u8], i: usize) -> (u16, usize) {
        let b0 = text[i];
        if b0 < 0x80 {
            return (self.blocks[b0 as usize], 1);
        }
        let cont = |k: usize| u32::from(text[i + k] & 0x3f);
        let (c, len) = if b0 < 0xe0 {
            ((u32::from(b0 & 0x1f) << 6) | cont(1), 2)
        } else if b0 < 0xf0 {
            ((u32::from(b0 & 0x0f) << 12) | (cont(1) << 6) | cont(2), 3)
        } else {
            (
                (u32::from(b0 & 0x07) << 18) | (cont(1) << 12) | (cont(2) << 6) | cont(3),
                4,
            )
        };
        (self.of(c), len)
    }
}

/// The inclusive code point ranges of one class expression, as `regex-syntax` parses it.
fn class_ranges(source: &str) -> Result<Vec<(u32, u32)>, String> {
    let hir = regex_syntax::parse(source)
        .map_err(|e| format!("cannot parse pre-tokenizer class {source:?}: {e}"))?;
    match hir.kind() {
        HirKind::Class(Class::Unicode(class)) => Ok(class
            .ranges()
            .iter()
            .map(|r| (u32::from(r.start()), u32::from(r.end())))
            .collect()),
        HirKind::Literal(literal) => {
            let text = std::str::from_utf8(&literal.0)
                .map_err(|e| format!("pre-tokenizer literal {source:?}: {e}"))?;
            let mut chars = text.chars();
            match (chars.next(), chars.next()) {
                (Some(c), None) => Ok(vec![(u32::from(c), u32::from(c))]),
                _ => Err(format!("pre-tokenizer literal {source:?} is not one char")),
            }
        }
        other => Err(format!(
            "pre-tokenizer class {source:?} parsed to {other:?}, not a class"
        )),
    }
}

fn check_invariants(flat: &[u16]) -> Result<(), String> {
    let stage3 = APUNCT | ALPHA | LM | SPACE | PS | CRLF | WS;
    for (cp, &bits) in flat.iter().enumerate() {
        let fail = |what: &str| Err(format!("U+{cp:04X} breaks a class invariant: {what}"));
        if bits & N != 0 && (bits & (CJK | stage3) != 0 || bits & PREFIX == 0) {
            return fail("a \\p{N} char is CJK, in a stage-3 run class or not a prefix");
        }
        if bits & CJK != 0 && bits & WS != 0 {
            return fail("a CJK char is whitespace");
        }
        if bits & (CRLF | SPACE) != 0 && bits & WS == 0 {
            return fail("\\r, \\n or space is not \\s");
        }
        if bits & (APUNCT | ALPHA) != 0 && cp >= 0x80 {
            return fail("an ASCII class holds a non-ASCII char");
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn classes() -> CharClasses {
        CharClasses::build().expect("tables build")
    }

    #[test]
    fn spot_checks() {
        let t = classes();
        let of = |c: char| t.of(u32::from(c));
        assert_eq!(of('a'), ALPHA | LM);
        assert_eq!(of('7'), N | PREFIX);
        assert_eq!(of(' '), SPACE | WS | PREFIX);
        assert_eq!(of('\n'), CRLF | WS);
        assert_eq!(of('\t'), WS | PREFIX);
        assert_eq!(of('\''), APUNCT | PS);
        assert_eq!(of('$'), APUNCT | PS);
        assert_eq!(of('中'), CJK | LM);
        assert_eq!(of('゠'), CJK | PS);
        assert_eq!(of('\u{309b}'), CJK | PS);
        assert_eq!(of('\u{3099}'), CJK | LM | PREFIX);
        assert_eq!(of('\u{301}'), LM | PREFIX);
        assert_eq!(of('²'), N | PREFIX);
        assert_eq!(of('\u{a0}'), WS | PREFIX);
        assert_eq!(of('😀'), PS);
        assert_eq!(of('\u{200b}'), PREFIX);
        assert_eq!(of('\u{10ffff}'), PREFIX);
    }

    #[test]
    fn decoding_matches_char_lookup() {
        let t = classes();
        let text = "a\u{7f}\u{80}é中😀\u{10ffff}\u{ffff}";
        for (i, c) in text.char_indices() {
            assert_eq!(t.at(text.as_bytes(), i), (t.of(u32::from(c)), c.len_utf8()));
        }
    }
}
