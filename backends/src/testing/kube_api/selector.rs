//! Label selectors as the Kubernetes API parses them (`labelSelector=` on list and watch).
//!
//! Grammar: requirements separated by commas; each is `key`, `!key`, `key=value`,
//! `key==value`, `key!=value`, `key in (v1,v2)` or `key notin (v1,v2)`. `!=` and `notin` also
//! match objects without the label. An empty selector matches everything.

use serde_json::Value;

#[derive(Debug, Clone, PartialEq)]
enum Requirement {
    Exists(String),
    NotExists(String),
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
}

/// A parsed label selector.
#[derive(Debug, Clone, Default, PartialEq)]
pub(super) struct Selector(Vec<Requirement>);

impl Selector {
    /// Parses `text`; the error is the message the API server's 400 carries.
    pub(super) fn parse(text: &str) -> Result<Self, String> {
        let mut requirements = Vec::new();
        for part in split_top_level(text)? {
            let part = part.trim();
            if part.is_empty() {
                if text.trim().is_empty() {
                    continue;
                }
                return Err(format!(
                    "unable to parse requirement: empty requirement in {text:?}"
                ));
            }
            requirements.push(parse_requirement(part)?);
        }
        Ok(Self(requirements))
    }

    /// Whether an object with these `metadata.labels` matches.
    pub(super) fn matches(&self, object: &Value) -> bool {
        let labels = object
            .pointer("/metadata/labels")
            .and_then(Value::as_object);
        let label = |key: &str| labels.and_then(|l| l.get(key)).and_then(Value::as_str);
        self.0.iter().all(|requirement| match requirement {
            Requirement::Exists(key) => label(key).is_some(),
            Requirement::NotExists(key) => label(key).is_none(),
            Requirement::In(key, values) => {
                label(key).is_some_and(|v| values.iter().any(|x| x == v))
            }
            Requirement::NotIn(key, values) => {
                !label(key).is_some_and(|v| values.iter().any(|x| x == v))
            }
        })
    }
}

/// Splits at commas outside parentheses.
fn split_top_level(text: &str) -> Result<Vec<&str>, String> {
    let mut parts = Vec::new();
    let mut depth = 0usize;
    let mut start = 0;
    for (i, c) in text.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => {
                depth = depth
                    .checked_sub(1)
                    .ok_or_else(|| format!("unbalanced ')' in selector {text:?}"))?;
            }
            ',' if depth == 0 => {
                parts.push(&text[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    if depth != 0 {
        return Err(format!("unbalanced '(' in selector {text:?}"));
    }
    parts.push(&text[start..]);
    Ok(parts)
}

fn parse_requirement(part: &str) -> Result<Requirement, String> {
    if let Some(key) = part.strip_prefix('!') {
        return Ok(Requirement::NotExists(key_of(key.trim())?));
    }
    for (word, negated) in [(" notin ", true), (" in ", false)] {
        if let Some(at) = part.find(word) {
            let key = key_of(part[..at].trim())?;
            let set = part[at + word.len()..].trim();
            let inner = set
                .strip_prefix('(')
                .and_then(|s| s.strip_suffix(')'))
                .ok_or_else(|| {
                    format!("unable to parse requirement {part:?}: expected (values)")
                })?;
            let values = inner
                .split(',')
                .map(|v| value_of(v.trim()))
                .collect::<Result<Vec<_>, _>>()?;
            return Ok(if negated {
                Requirement::NotIn(key, values)
            } else {
                Requirement::In(key, values)
            });
        }
    }
    if let Some((key, value)) = part.split_once("!=") {
        return Ok(Requirement::NotIn(
            key_of(key.trim())?,
            vec![value_of(value.trim())?],
        ));
    }
    if let Some((key, value)) = part.split_once("==").or_else(|| part.split_once('=')) {
        return Ok(Requirement::In(
            key_of(key.trim())?,
            vec![value_of(value.trim())?],
        ));
    }
    Ok(Requirement::Exists(key_of(part)?))
}

fn key_of(key: &str) -> Result<String, String> {
    let valid = !key.is_empty()
        && key.len() <= 316
        && key
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-' | '/'));
    if valid {
        Ok(key.to_owned())
    } else {
        Err(format!("invalid label key {key:?}"))
    }
}

fn value_of(value: &str) -> Result<String, String> {
    let valid = value.len() <= 63
        && value
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'));
    if valid {
        Ok(value.to_owned())
    } else {
        Err(format!("invalid label value {value:?}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labelled(labels: Value) -> Value {
        serde_json::json!({"metadata": {"labels": labels}})
    }

    #[test]
    fn equality_and_set_requirements_match_as_the_api_does() {
        let pod = labelled(serde_json::json!({"app": "infera-worker", "engine": "vllm"}));
        let bare = labelled(serde_json::json!({}));
        let cases = [
            ("", true, true),
            ("app=infera-worker", true, false),
            ("app==infera-worker,engine", true, false),
            ("engine!=sglang", true, true),
            ("engine in (vllm, sglang)", true, false),
            ("engine notin (sglang)", true, true),
            ("!engine", false, true),
            ("app=other", false, false),
        ];
        for (text, on_pod, on_bare) in cases {
            let selector = Selector::parse(text).unwrap();
            assert_eq!(selector.matches(&pod), on_pod, "{text} on pod");
            assert_eq!(selector.matches(&bare), on_bare, "{text} on bare");
        }
    }

    #[test]
    fn malformed_selectors_are_refused() {
        for text in ["app=(x", "a b=c", "app=", "x in y", ","] {
            let parsed = Selector::parse(text);
            if text == "app=" {
                assert!(parsed.is_ok(), "an empty value is valid");
            } else {
                assert!(parsed.is_err(), "{text:?} must be refused");
            }
        }
    }
}
