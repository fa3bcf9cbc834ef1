//! The native encoder: our own pre-tokenizer, `ByteLevel` mapping and BPE for the proven
//! DeepSeek-V3 configuration, returning the ids `tokenizers` returns for a gap between added
//! tokens.
//!
//! [`NativeEncoder::build`] accepts a loaded tokenizer only when every assumption of the fast
//! path can be read off the crate's own model: BPE without dropout, `continuing_subword_prefix`,
//! `end_of_word_suffix` or `ignore_merges`; one id per vocabulary string; all 256 `ByteLevel`
//! chars in the vocabulary (so byte fallback and unknown tokens never apply); every merge's
//! parts and result in the vocabulary. Every id we use comes from the crate's own vocabulary
//! (`Model::token_to_id`); the merges come from tokenizer.json in file order, parsed as the
//! crate parses them (it keeps no public accessor for them), and the word table's candidates
//! from tokenizer.json's `model.vocab` (a candidate only enters when its BPE, made of crate ids,
//! yields its id). The pre-tokenizer shape itself is checked by `config.rs` before this is
//! tried. A refusal is reported through `FastPath::Enabled`. Building takes ~0.1 s (most of it
//! the word table, whose BPE runs use the rayon pool).

use serde_json::Value;
use tokenizers::Model;
use tokenizers::models::ModelWrapper;

use super::bpe::{Bpe, Scratch, WORD_MAX};
use super::classes::CharClasses;
use super::pretok::{Pathological, PreTokenizer};

/// Pre-tokenizer tables and BPE tables of one tokenizer; immutable, shared by all threads.
#[derive(Debug)]
pub(crate) struct NativeEncoder {
    classes: CharClasses,
    bpe: Bpe,
}

impl NativeEncoder {
    /// Builds the tables from the loaded model and the tokenizer.json it came from, or says
    /// which assumption does not hold.
    pub(crate) fn build(model: &ModelWrapper, json: &Value) -> Result<Self, String> {
        let ModelWrapper::BPE(model) = model else {
            return Err("the model is not BPE".into());
        };
        if model.dropout.is_some_and(|d| d != 0.0) {
            return Err("BPE dropout is set".into());
        }
        if model.continuing_subword_prefix.is_some() || model.end_of_word_suffix.is_some() {
            return Err("BPE uses a continuing-subword prefix or end-of-word suffix".into());
        }
        if model.ignore_merges {
            return Err("BPE ignore_merges is set".into());
        }
        let vocab = json
            .pointer("/model/vocab")
            .and_then(Value::as_object)
            .ok_or("tokenizer.json has no model.vocab object")?;
        // The crate built its vocabulary from this same object; equal sizes rule out a
        // duplicate-key difference, and every id used below is re-checked against the crate.
        if vocab.len() != model.get_vocab_size() {
            return Err("model.vocab and the loaded vocabulary differ in size".into());
        }
        let mut ids: Vec<u32> = vocab
            .values()
            .filter_map(|v| v.as_u64().and_then(|id| u32::try_from(id).ok()))
            .collect();
        ids.sort_unstable();
        ids.dedup();
        if ids.len() != vocab.len() {
            return Err("two vocabulary strings share an id".into());
        }
        let id_of = |s: &str| {
            model
                .token_to_id(s)
                .ok_or_else(|| format!("{s:?} is not in the vocabulary"))
        };

        let chars = byte_level_chars();
        let mut byte_ids = [0u32; 256];
        let mut buf = [0u8; 4];
        for (b, id) in byte_ids.iter_mut().enumerate() {
            *id = id_of(chars[b].encode_utf8(&mut buf))
                .map_err(|e| format!("the ByteLevel char of byte {b:#04x} is missing: {e}"))?;
        }

        let mut triples = Vec::new();
        let mut joined = String::new();
        for_each_merge(json, |a, b| {
            joined.clear();
            joined.push_str(a);
            joined.push_str(b);
            triples.push((id_of(a)?, id_of(b)?, id_of(&joined)?));
            Ok(())
        })?;
        let mut bpe = Bpe::new(byte_ids, triples);

        let classes = CharClasses::build()?;
        let words = word_candidates(vocab, &chars, &classes);
        bpe.learn_words(&words);

        Ok(Self { classes, bpe })
    }

    /// Appends the ids of `text`, a gap between added tokens (or a safe chunk of one), to `out`.
    ///
    /// # Errors
    /// [`Pathological`] when `text` holds a run on which the crate's regex engine would hit a
    /// limit; `out` then holds a partial result and the caller must use the crate.
    pub(crate) fn encode(&self, text: &str, out: &mut Vec<u32>) -> Result<(), Pathological> {
        let mut scratch = Scratch::default();
        let bytes = text.as_bytes();
        PreTokenizer::new(&self.classes).run(text, |start, end| {
            self.bpe.encode_word(&bytes[start..end], &mut scratch, out)
        })
    }

    /// Pre-token byte ranges of `text` (for tests and diagnostics).
    #[cfg(test)]
    pub(crate) fn pre_tokens(&self, text: &str) -> Result<Vec<(usize, usize)>, Pathological> {
        let mut out = Vec::new();
        PreTokenizer::new(&self.classes).run(text, |s, e| out.push((s, e)))?;
        Ok(out)
    }

    /// Size of the load-time word table.
    #[cfg(test)]
    pub(crate) fn word_table_len(&self) -> usize {
        self.bpe.words()
    }
}

/// Vocabulary tokens that can be a whole pre-token, as `(bytes, id)`: 2..=15 bytes of valid
/// UTF-8 (pre-tokens are cut at char boundaries) that our pre-tokenizer leaves in one piece.
/// Only a speed filter: a token left out is merged at encode time with the same result.
fn word_candidates(
    vocab: &serde_json::Map<String, Value>,
    chars: &[char; 256],
    classes: &CharClasses,
) -> Vec<([u8; WORD_MAX], usize, u32)> {
    let mut byte_of = [None; 0x200];
    for (b, c) in chars.iter().enumerate() {
        byte_of[*c as usize] = Some(b as u8);
    }
    let pre = PreTokenizer::new(classes);
    let mut out = Vec::with_capacity(vocab.len());
    'tokens: for (token, id) in vocab {
        // Each `ByteLevel` char is 1 or 2 UTF-8 bytes.
        if token.len() < 2 || token.len() > 2 * WORD_MAX {
            continue;
        }
        let Some(id) = id.as_u64().and_then(|id| u32::try_from(id).ok()) else {
            continue;
        };
        let mut bytes = [0u8; WORD_MAX];
        let mut len = 0;
        for c in token.chars() {
            let Some(b) = byte_of.get(c as usize).copied().flatten() else {
                continue 'tokens;
            };
            if len == WORD_MAX {
                continue 'tokens;
            }
            bytes[len] = b;
            len += 1;
        }
        let Ok(text) = std::str::from_utf8(&bytes[..len]) else {
            continue;
        };
        let mut pieces = 0;
        if pre.run(text, |_, _| pieces += 1).is_ok() && pieces == 1 && len >= 2 {
            out.push((bytes, len, id));
        }
    }
    out
}

/// GPT-2's byte-to-char table as `ByteLevel` uses it: printable Latin-1 bytes map to
/// themselves, the other 68 bytes, in increasing order, to U+0100, U+0101, ...
pub(crate) fn byte_level_chars() -> [char; 256] {
    let mut out = ['\0'; 256];
    let mut extra = 0x100u32;
    for (b, slot) in out.iter_mut().enumerate() {
        let byte = b as u8;
        if matches!(byte, b'!'..=b'~' | 0xa1..=0xac | 0xae..=0xff) {
            *slot = char::from(byte);
        } else {
            // 0x100..0x144 are all scalar values.
            *slot = char::from_u32(extra).unwrap_or(char::REPLACEMENT_CHARACTER);
            extra += 1;
        }
    }
    out
}

/// Calls `f(left, right)` for `model.merges` of tokenizer.json in rank order, parsed as the
/// crate parses them: either `["a b", ...]` (split at the one space; `#version` lines skipped,
/// without taking a rank) or `[["a", "b"], ...]`.
fn for_each_merge(
    json: &Value,
    mut f: impl FnMut(&str, &str) -> Result<(), String>,
) -> Result<(), String> {
    let list = json
        .pointer("/model/merges")
        .and_then(Value::as_array)
        .ok_or("tokenizer.json has no model.merges list")?;
    for (index, entry) in list.iter().enumerate() {
        let bad = || format!("model.merges[{index}] is not a pair");
        match entry {
            Value::String(line) => {
                if line.starts_with("#version") {
                    continue;
                }
                let mut parts = line.split(' ');
                match (parts.next(), parts.next(), parts.next()) {
                    (Some(a), Some(b), None) => f(a, b)?,
                    _ => return Err(bad()),
                }
            }
            Value::Array(pair) => match pair.as_slice() {
                [Value::String(a), Value::String(b)] => f(a, b)?,
                _ => return Err(bad()),
            },
            _ => return Err(bad()),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::path::Path;
    use std::sync::OnceLock;

    use proptest::prelude::*;
    use tokenizers::pre_tokenizers::byte_level::ByteLevel;
    use tokenizers::{OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer};

    use super::*;

    struct Fixture {
        inner: tokenizers::Tokenizer,
        native: NativeEncoder,
    }

    fn fixture() -> &'static Fixture {
        static FIXTURE: OnceLock<Fixture> = OnceLock::new();
        FIXTURE.get_or_init(|| {
            let path = Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../fixtures/tokenizers/deepseek-v4/tokenizer.json");
            let bytes = std::fs::read(&path).expect("fixture");
            let inner = tokenizers::Tokenizer::from_bytes(&bytes).expect("loads");
            let json: Value = serde_json::from_slice(&bytes).expect("json");
            let native = NativeEncoder::build(inner.get_model(), &json).expect("native builds");
            Fixture { inner, native }
        })
    }

    /// The crate's pre-tokens of `text`: original byte offsets and byte-level strings.
    fn crate_pre_tokens(text: &str) -> Vec<((usize, usize), String)> {
        let pre = fixture()
            .inner
            .get_pre_tokenizer()
            .expect("has a pre-tokenizer");
        let mut pts = PreTokenizedString::from(text);
        pre.pre_tokenize(&mut pts).expect("pre-tokenizes");
        pts.get_splits(OffsetReferential::Original, OffsetType::Byte)
            .into_iter()
            .map(|(s, o, _)| (o, s.to_string()))
            .collect()
    }

    fn assert_same_pre_tokens(text: &str) {
        let chars = byte_level_chars();
        let ours: Vec<((usize, usize), String)> = fixture()
            .native
            .pre_tokens(text)
            .expect("not pathological")
            .into_iter()
            .map(|(s, e)| {
                (
                    (s, e),
                    text.as_bytes()[s..e]
                        .iter()
                        .map(|&b| chars[b as usize])
                        .collect(),
                )
            })
            .collect();
        let theirs = crate_pre_tokens(text);
        if ours != theirs {
            let at = ours
                .iter()
                .zip(&theirs)
                .position(|(a, b)| a != b)
                .unwrap_or(ours.len().min(theirs.len()));
            let show = |v: &[((usize, usize), String)]| {
                v[at.saturating_sub(2)..(at + 3).min(v.len())].to_vec()
            };
            panic!(
                "pre-tokens differ at #{at} for {:?}: ours {:?}, crate {:?}",
                text.chars().take(200).collect::<String>(),
                show(&ours),
                show(&theirs)
            );
        }
    }

    #[test]
    fn byte_level_table_matches_the_crate() {
        // Every byte that can occur in UTF-8: all of 0..0x800 (ASCII, 2-byte leads and all
        // continuation bytes), one char per 3-byte lead, one per 4-byte lead.
        let mut text: String = (0..0x800u32).filter_map(char::from_u32).collect();
        text.extend(
            (0x800..0x1_0000u32)
                .step_by(0x1000)
                .filter_map(|c| char::from_u32(c + 0x100)),
        );
        text.extend(
            (0x1_0000..0x11_0000u32)
                .step_by(0x4_0000)
                .filter_map(char::from_u32),
        );
        let chars = byte_level_chars();
        let ours: String = text.bytes().map(|b| chars[b as usize]).collect();
        let mut pts = PreTokenizedString::from(text.as_str());
        ByteLevel::default()
            .add_prefix_space(false)
            .use_regex(false)
            .pre_tokenize(&mut pts)
            .expect("pre-tokenizes");
        let theirs: String = pts
            .get_splits(OffsetReferential::Original, OffsetType::Byte)
            .into_iter()
            .map(|(s, _, _)| s)
            .collect();
        assert_eq!(ours, theirs);
    }

    #[test]
    fn tables_are_sized_as_expected() {
        // Most of the 128k vocabulary are short tokens that encode to themselves.
        assert!(fixture().native.word_table_len() > 60_000);
    }

    #[test]
    fn pre_tokens_match_on_samples() {
        for text in [
            "",
            "Hello world's  end.\n\n  x",
            "a  12  b\t\t\n\r\n  \u{a0}\u{3000}x",
            "路由器在每个请求到达时都会自行分词，カタカナ゠ひらがな゛ー",
            "naïve café ②③ ¹²³ Ⅻ 1234567 x²",
            "'s 't 're .Net __init__ ->x $$$ ...\n\n\n",
            "\u{1}\u{2}x\u{200b}\u{200d}\u{e000}\u{10ffff}a\u{301}\u{301}",
            "👍🏽 🇺🇸 😀😀 a😀b",
        ] {
            assert_same_pre_tokens(text);
        }
    }

    /// Characters drawn to hit every class boundary of the three regexes.
    fn interesting_char() -> impl Strategy<Value = char> {
        prop_oneof![
            prop::sample::select(vec![
                ' ',
                ' ',
                '\n',
                '\r',
                '\t',
                '\u{b}',
                '\u{c}',
                '\u{85}',
                '\u{a0}',
                '\u{2028}',
                '\u{3000}',
                'a',
                'Z',
                'é',
                'ß',
                'ж',
                '中',
                '一',
                '龥',
                '龦',
                'あ',
                'ア',
                '゠',
                '・',
                'ー',
                '゛',
                '\u{3099}',
                '\u{3040}',
                '\u{30ff}',
                '한',
                '0',
                '9',
                '²',
                '①',
                'Ⅻ',
                '٣',
                '.',
                ',',
                '\'',
                '"',
                '-',
                '_',
                '$',
                '+',
                '<',
                '`',
                '~',
                '!',
                '?',
                '(',
                '）',
                '、',
                '。',
                '«',
                '€',
                '😀',
                '\u{1f3fd}',
                '\u{301}',
                '\u{200b}',
                '\u{200d}',
                '\u{ad}',
                '\u{0}',
                '\u{1}',
                '\u{7f}',
                '\u{e000}',
                '\u{fffe}',
                '\u{10ffff}',
            ]),
            any::<char>(),
        ]
    }

    /// Every code point of planes 0, 1 and 14 (where the class tables vary), every 7th of
    /// planes 2-3 (CJK ideographs) and every 97th elsewhere, in contexts that expose each class
    /// bit: a letter before (`A2` runs, the prefix), a space before (`A2`/`A3`), runs of itself
    /// (`\p{N}{1,3}`, CJK, `\s` runs, gaps), punctuation before (`A1`/`A3`) and `\n` after.
    #[test]
    fn pre_tokens_match_for_every_code_point() {
        let dense = (0..0x2_0000u32).chain(0xe_0000..0xe_1000);
        let cjk = (0x2_0000..0x4_0000u32).step_by(7);
        let sparse = (0x4_0000..0x11_0000u32).step_by(97);
        let chars: Vec<char> = dense
            .chain(cjk)
            .chain(sparse)
            .filter_map(char::from_u32)
            .collect();
        for group in chars.chunks(1024) {
            let mut text = String::new();
            for &c in group {
                text.extend(['a', c, ' ', c, c, c, c, '.', c, '\n']);
            }
            assert_same_pre_tokens(&text);
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        #[test]
        fn pre_tokens_match_the_crate(chars in prop::collection::vec(interesting_char(), 0..60)) {
            let text: String = chars.into_iter().collect();
            assert_same_pre_tokens(&text);
        }
    }
}
