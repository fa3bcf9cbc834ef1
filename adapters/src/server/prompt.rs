//! The `prompt` of a completions request, read by one streaming visitor from any serde
//! deserializer (the raw body text, or a `serde_json::Value` for prewarm): token ids go straight
//! into a `Vec<u32>`, nothing else of the array is kept. Given the number of ids the text can
//! hold at most ([`PromptSeed`]), the ids are allocated once instead of growing by doubling
//! (whose last copy held 3× the ids at once).
//!
//! Accepted shapes, as OpenAI's: a string; an array of token ids; an array holding one string
//! or one array of token ids. An empty array, several prompts, a token id that is not a `u32`
//! or any other value are refused with a message naming what was wrong; values quoted in a
//! message are cut to [`QUOTE_MAX`] characters.

use super::http::Input;
use serde::Deserialize;
use serde::de::{self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use std::fmt;

/// The most characters of a client value quoted in an error message.
pub(super) const QUOTE_MAX: usize = 64;

const SHAPE: &str =
    "`prompt` must be a string, a list of token ids, or a list holding one of those";

/// A prompt, or the message that says why it is not one.
#[derive(Debug)]
pub(super) struct Prompt(pub Result<Input, String>);

/// One element of the prompt array.
enum Elem {
    Id(u32),
    /// A number that is not a token id, as JSON prints it.
    BadNumber(String),
    Text(String),
    /// A nested array: its ids, or the message about its first bad element.
    Ids(Result<Vec<u32>, String>),
    /// Anything else.
    Other,
}

fn quote(text: String) -> String {
    match text.char_indices().nth(QUOTE_MAX) {
        Some((cut, _)) => format!("{}…", &text[..cut]),
        None => text,
    }
}

fn float_text(f: f64) -> String {
    serde_json::Number::from_f64(f).map_or_else(|| f.to_string(), |n| n.to_string())
}

impl<'de> Deserialize<'de> for Prompt {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        PromptSeed(0).deserialize(d)
    }
}

/// Reads a [`Prompt`] whose token ids number at most `.0` (0: unknown), e.g. one more than
/// the commas of its JSON text.
#[derive(Debug, Clone, Copy)]
pub(super) struct PromptSeed(pub usize);

impl<'de> DeserializeSeed<'de> for PromptSeed {
    type Value = Prompt;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Prompt, D::Error> {
        d.deserialize_any(PromptVisitor(self.0))
    }
}

/// At most how many ids to allocate ahead: a wrong hint costs no more than this.
const HINT_MAX: usize = 64 << 20;

fn with_hint(hint: usize) -> Vec<u32> {
    Vec::with_capacity(hint.min(HINT_MAX))
}

struct PromptVisitor(usize);

impl<'de> Visitor<'de> for PromptVisitor {
    type Value = Prompt;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a prompt")
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Prompt, E> {
        Ok(Prompt(Ok(Input::Text(v.to_owned()))))
    }

    fn visit_string<E: de::Error>(self, v: String) -> Result<Prompt, E> {
        Ok(Prompt(Ok(Input::Text(v))))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Prompt, A::Error> {
        // Allocated at the first id: a prompt of one nested array never needs it.
        let mut ids = Vec::new();
        let mut first_bad: Option<(usize, String)> = None;
        let mut first: Option<Elem> = None;
        let mut all_numbers = true;
        let mut len = 0usize;
        // Only the first element may be the nested array of ids worth the hint.
        while let Some(elem) = seq.next_element_seed(ElemSeed(if len == 0 { self.0 } else { 0 }))? {
            match elem {
                Elem::Id(t) if all_numbers && first_bad.is_none() => {
                    if ids.capacity() == 0 {
                        ids = with_hint(self.0);
                    }
                    ids.push(t);
                }
                Elem::Id(_) => {}
                Elem::BadNumber(text) => {
                    first_bad.get_or_insert((len, text));
                }
                other => {
                    all_numbers = false;
                    ids = Vec::new();
                    if len == 0 {
                        first = Some(other);
                    }
                }
            }
            len += 1;
        }
        let result = match (len, all_numbers) {
            (0, _) => Err("`prompt` must not be empty".to_owned()),
            (_, true) => match first_bad {
                Some((i, text)) => Err(format!(
                    "`prompt[{i}]` must be a token id, got {}",
                    quote(text)
                )),
                None => Ok(Input::Tokens(ids)),
            },
            (1, false) => match first {
                Some(Elem::Text(s)) => Ok(Input::Text(s)),
                Some(Elem::Ids(ids)) => ids.map(Input::Tokens),
                _ => Err(SHAPE.to_owned()),
            },
            _ => Err("`prompt` holds several prompts; send one prompt per request".to_owned()),
        };
        Ok(Prompt(result))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Prompt, A::Error> {
        while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
        Ok(Prompt(Err(SHAPE.to_owned())))
    }

    fn visit_bool<E: de::Error>(self, _: bool) -> Result<Prompt, E> {
        Ok(Prompt(Err(SHAPE.to_owned())))
    }

    fn visit_u64<E: de::Error>(self, _: u64) -> Result<Prompt, E> {
        Ok(Prompt(Err(SHAPE.to_owned())))
    }

    fn visit_i64<E: de::Error>(self, _: i64) -> Result<Prompt, E> {
        Ok(Prompt(Err(SHAPE.to_owned())))
    }

    fn visit_f64<E: de::Error>(self, _: f64) -> Result<Prompt, E> {
        Ok(Prompt(Err(SHAPE.to_owned())))
    }

    fn visit_unit<E: de::Error>(self) -> Result<Prompt, E> {
        Ok(Prompt(Err(SHAPE.to_owned())))
    }
}

/// Reads one [`Elem`]; a nested array allocates `.0` ids ahead.
#[derive(Clone, Copy)]
struct ElemSeed(usize);

impl<'de> DeserializeSeed<'de> for ElemSeed {
    type Value = Elem;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Elem, D::Error> {
        d.deserialize_any(ElemVisitor(self.0))
    }
}

struct ElemVisitor(usize);

impl<'de> Visitor<'de> for ElemVisitor {
    type Value = Elem;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a token id, a string or an array")
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Elem, E> {
        Ok(u32::try_from(v).map_or_else(|_| Elem::BadNumber(v.to_string()), Elem::Id))
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Elem, E> {
        Ok(u32::try_from(v).map_or_else(|_| Elem::BadNumber(v.to_string()), Elem::Id))
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Elem, E> {
        Ok(Elem::BadNumber(float_text(v)))
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Elem, E> {
        Ok(Elem::Text(v.to_owned()))
    }

    fn visit_string<E: de::Error>(self, v: String) -> Result<Elem, E> {
        Ok(Elem::Text(v))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Elem, A::Error> {
        let mut ids = with_hint(self.0);
        let mut bad: Option<String> = None;
        let mut i = 0usize;
        while let Some(id) = seq.next_element::<InnerId>()? {
            match id {
                InnerId(Ok(t)) if bad.is_none() => ids.push(t),
                InnerId(Ok(_)) => {}
                InnerId(Err(text)) => {
                    bad.get_or_insert_with(|| {
                        format!("`prompt[{i}]` must be a token id, got {}", quote(text))
                    });
                }
            }
            i += 1;
        }
        Ok(Elem::Ids(bad.map_or(Ok(ids), Err)))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Elem, A::Error> {
        while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
        Ok(Elem::Other)
    }

    fn visit_bool<E: de::Error>(self, _: bool) -> Result<Elem, E> {
        Ok(Elem::Other)
    }

    fn visit_unit<E: de::Error>(self) -> Result<Elem, E> {
        Ok(Elem::Other)
    }
}

/// One element of a nested token-id array: the id, or the element as JSON prints it.
struct InnerId(Result<u32, String>);

impl<'de> Deserialize<'de> for InnerId {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(InnerVisitor)
    }
}

struct InnerVisitor;

impl<'de> Visitor<'de> for InnerVisitor {
    type Value = InnerId;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a token id")
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<InnerId, E> {
        Ok(InnerId(u32::try_from(v).map_err(|_| v.to_string())))
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<InnerId, E> {
        Ok(InnerId(u32::try_from(v).map_err(|_| v.to_string())))
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<InnerId, E> {
        Ok(InnerId(Err(float_text(v))))
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<InnerId, E> {
        Ok(InnerId(Err(
            serde_json::to_string(v).unwrap_or_else(|_| v.to_owned())
        )))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<InnerId, A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(InnerId(Err("an array".to_owned())))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<InnerId, A::Error> {
        while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
        Ok(InnerId(Err("an object".to_owned())))
    }

    fn visit_bool<E: de::Error>(self, v: bool) -> Result<InnerId, E> {
        Ok(InnerId(Err(v.to_string())))
    }

    fn visit_unit<E: de::Error>(self) -> Result<InnerId, E> {
        Ok(InnerId(Err("null".to_owned())))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn from_text(text: &str) -> Result<Input, String> {
        Prompt::deserialize(&mut serde_json::Deserializer::from_str(text))
            .map(|p| p.0)
            .map_err(|e| e.to_string())?
    }

    fn from_value(value: serde_json::Value) -> Result<Input, String> {
        Prompt::deserialize(&value)
            .map(|p| p.0)
            .map_err(|e| e.to_string())?
    }

    fn ids(r: Result<Input, String>) -> Vec<u32> {
        match r {
            Ok(Input::Tokens(t)) => t,
            other => panic!("not token ids: {:?}", other.err()),
        }
    }

    #[test]
    fn every_accepted_shape_reads_the_same_from_text_and_from_a_tree() {
        for (text, want) in [
            ("[1, 2, 3]", vec![1, 2, 3]),
            ("[[4,5]]", vec![4, 5]),
            ("[4294967295]", vec![u32::MAX]),
        ] {
            assert_eq!(ids(from_text(text)), want);
            assert_eq!(ids(from_value(serde_json::from_str(text).unwrap())), want);
        }
        for text in [r#""hi""#, r#"["hi"]"#, r#""h\u00e9""#] {
            assert!(matches!(from_text(text), Ok(Input::Text(_))), "{text}");
        }
        assert!(matches!(from_value(json!(["hé"])), Ok(Input::Text(t)) if t == "hé"));
    }

    #[test]
    fn refusals_name_what_was_wrong() {
        for (text, needle) in [
            ("[]", "must not be empty"),
            ("[1, -1, 2.5]", "`prompt[1]` must be a token id, got -1"),
            ("[2.5]", "`prompt[0]` must be a token id, got 2.5"),
            ("[4294967296]", "got 4294967296"),
            ("[[1, \"a\"]]", "`prompt[1]` must be a token id, got \"a\""),
            ("[1, \"a\"]", "several prompts"),
            (r#"["a", "b"]"#, "several prompts"),
            ("[{}]", "must be a string, a list of token ids"),
            ("3", "must be a string, a list of token ids"),
            ("null", "must be a string, a list of token ids"),
            ("{\"a\": [1]}", "must be a string, a list of token ids"),
        ] {
            let e = from_text(text).expect_err(text);
            assert!(e.contains(needle), "{text}: {e}");
            let v = from_value(serde_json::from_str(text).unwrap()).expect_err(text);
            assert_eq!(v, e, "{text}: a tree and the text read the same");
        }
        let long = format!("[[\"{}\"]]", "x".repeat(1000));
        assert!(from_text(&long).expect_err("long").len() < 200);
    }
}
