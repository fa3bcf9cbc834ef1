//! Deciding, from tokenizer.json, which exact speed-ups are valid.
//!
//! * [`FastPath::Native`]: identity normalizer, BPE without dropout, added tokens without
//!   `lstrip`/`rstrip`/`single_word`, and exactly the DeepSeek-V3 pre-tokenizer
//!   ([`DEEPSEEK_V3_PRE_TOKENIZER`]) for which the intra-segment split rule is proven
//!   (`split::is_safe_split`) and our own pre-tokenizer is written (`pretok.rs`). Segments are
//!   cut at added tokens and at safe split points and encoded by `native.rs`. [`analyze`] only
//!   proposes it: the tokenizer falls to [`FastPath::Enabled`] if the model's own checks in
//!   `native.rs` fail.
//! * [`FastPath::Enabled`]: the same cuts and cache, but chunks are encoded by the crate.
//! * [`FastPath::SegmentsOnly`]: the same, but another pre-tokenizer built only from
//!   per-split stages (`Split`, `Digits`, `ByteLevel` without prefix space). Segments between
//!   added tokens are cached and encoded in parallel; long segments are not cut.
//! * [`FastPath::Disabled`]: anything else; every call goes to the plain `tokenizers` encode.

use std::fmt;

use serde_json::Value;

/// The pre-tokenizer of DeepSeek V3/V4 tokenizer.json, as JSON; the split rule in
/// `split::is_safe_split` is proven for exactly this configuration.
pub(crate) const DEEPSEEK_V3_PRE_TOKENIZER: &str = r##"{"type": "Sequence", "pretokenizers": [{"type": "Split", "pattern": {"Regex": "\\p{N}{1,3}"}, "behavior": "Isolated", "invert": false}, {"type": "Split", "pattern": {"Regex": "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+"}, "behavior": "Isolated", "invert": false}, {"type": "Split", "pattern": {"Regex": "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+"}, "behavior": "Isolated", "invert": false}, {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false}]}"##;

/// Which exact speed-ups this tokenizer allows; log it at startup.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FastPath {
    /// Everything below plus our own pre-tokenizer and BPE instead of the crate's encode.
    Native,
    /// Added-token segmentation, caching, and cutting long segments at proven-safe points;
    /// chunks are encoded by the crate. `reason` says why the native encoder is off.
    Enabled { reason: String },
    /// Added-token segmentation and caching only; `reason` says why long segments are not cut.
    SegmentsOnly { reason: String },
    /// Plain `tokenizers` encode for every call; `reason` names the unsupported config.
    Disabled { reason: String },
}

impl FastPath {
    /// Whether any speed-up is active.
    pub fn is_enabled(&self) -> bool {
        !matches!(self, FastPath::Disabled { .. })
    }
}

impl fmt::Display for FastPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FastPath::Native => f.write_str(
                "native (own pre-tokenizer and BPE, added-token segments, cache, safe splits)",
            ),
            FastPath::Enabled { reason } => write!(
                f,
                "enabled (added-token segments, cache, safe splits; crate BPE: {reason})"
            ),
            FastPath::SegmentsOnly { reason } => {
                write!(f, "segments and cache only: {reason}")
            }
            FastPath::Disabled { reason } => write!(f, "disabled, plain tokenizers: {reason}"),
        }
    }
}

/// Inspects the parsed tokenizer.json. `encode_special_tokens` comes from the loaded tokenizer.
pub(crate) fn analyze(json: &Value, encode_special_tokens: bool) -> FastPath {
    match check_common(json, encode_special_tokens) {
        Err(reason) => FastPath::Disabled { reason },
        Ok(()) => check_pre_tokenizer(json.get("pre_tokenizer").unwrap_or(&Value::Null)),
    }
}

fn check_common(json: &Value, encode_special_tokens: bool) -> Result<(), String> {
    if encode_special_tokens {
        return Err("encode_special_tokens is set".into());
    }
    match json.get("normalizer") {
        None | Some(Value::Null) => {}
        Some(n) if is_identity_normalizer(n) => {}
        Some(n) => return Err(format!("normalizer {} is not the identity", type_of(n))),
    }
    let model = json.get("model").unwrap_or(&Value::Null);
    if model.get("type").and_then(Value::as_str) != Some("BPE") {
        return Err(format!("model type {} is not BPE", type_of(model)));
    }
    if !matches!(model.get("dropout"), None | Some(Value::Null)) {
        return Err("BPE dropout makes encoding random".into());
    }
    let added = json.get("added_tokens").and_then(Value::as_array);
    for token in added.into_iter().flatten() {
        let flag = |name: &str| token.get(name).and_then(Value::as_bool).unwrap_or(false);
        if flag("lstrip") || flag("rstrip") || flag("single_word") {
            let content = token.get("content").and_then(Value::as_str).unwrap_or("");
            return Err(format!(
                "added token {content:?} uses lstrip/rstrip/single_word"
            ));
        }
        if token
            .get("content")
            .and_then(Value::as_str)
            .unwrap_or("")
            .is_empty()
        {
            return Err("an added token has empty content".into());
        }
    }
    Ok(())
}

fn is_identity_normalizer(n: &Value) -> bool {
    n.get("type").and_then(Value::as_str) == Some("Sequence")
        && n.get("normalizers")
            .and_then(Value::as_array)
            .is_some_and(|list| list.iter().all(is_identity_normalizer))
}

fn check_pre_tokenizer(pre: &Value) -> FastPath {
    let expected: Result<Value, _> = serde_json::from_str(DEEPSEEK_V3_PRE_TOKENIZER);
    if expected.as_ref().is_ok_and(|e| e == pre) {
        return FastPath::Native;
    }
    let stages: Vec<&Value> = match pre.get("type").and_then(Value::as_str) {
        Some("Sequence") => pre
            .get("pretokenizers")
            .and_then(Value::as_array)
            .map(|v| v.iter().collect())
            .unwrap_or_default(),
        _ => vec![pre],
    };
    for stage in &stages {
        let local = match stage.get("type").and_then(Value::as_str) {
            Some("Split") | Some("Digits") => true,
            Some("ByteLevel") => {
                stage.get("add_prefix_space").and_then(Value::as_bool) == Some(false)
            }
            _ => false,
        };
        if !local {
            return FastPath::Disabled {
                reason: format!(
                    "pre-tokenizer stage {} is not known to be local",
                    type_of(stage)
                ),
            };
        }
    }
    FastPath::SegmentsOnly {
        reason: "pre-tokenizer is not the verified DeepSeek-V3 pattern".into(),
    }
}

fn type_of(v: &Value) -> String {
    v.get("type")
        .and_then(Value::as_str)
        .unwrap_or("(none)")
        .to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn embedded_pattern_parses() {
        assert!(serde_json::from_str::<Value>(DEEPSEEK_V3_PRE_TOKENIZER).is_ok());
    }

    #[test]
    fn lowercase_normalizer_disables() {
        let json = serde_json::json!({
            "normalizer": {"type": "Lowercase"},
            "model": {"type": "BPE", "dropout": null},
        });
        assert!(matches!(analyze(&json, false), FastPath::Disabled { .. }));
    }

    #[test]
    fn metaspace_disables_and_split_is_segments_only() {
        let mut json = serde_json::json!({
            "normalizer": null,
            "model": {"type": "BPE", "dropout": null},
            "pre_tokenizer": {"type": "Metaspace", "prepend_scheme": "first"},
        });
        assert!(matches!(analyze(&json, false), FastPath::Disabled { .. }));
        json["pre_tokenizer"] = serde_json::json!({"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": "\\s+"}, "behavior": "Isolated", "invert": false},
            {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false}
        ]});
        assert!(matches!(
            analyze(&json, false),
            FastPath::SegmentsOnly { .. }
        ));
        assert!(matches!(analyze(&json, true), FastPath::Disabled { .. }));
    }
}
