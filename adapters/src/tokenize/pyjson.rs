//! The `tojson` filter as Hugging Face's chat-template environment defines it: Python's
//! `json.dumps(x, ensure_ascii=False, indent=indent, sort_keys=sort_keys)`, so a template that
//! writes tool definitions or tool-call arguments with `| tojson` renders the bytes the engine
//! renders. (minijinja's own `tojson` writes compact, HTML-escaped JSON: a different prompt.)
//!
//! Python's defaults: items separated by `", "` and keys by `": "` on one line; with `indent`,
//! one item per line, items separated by `","`; non-ASCII text as is; maps in insertion order
//! unless `sort_keys`.

use minijinja::value::{Kwargs, Value, ValueKind};
use minijinja::{Error, ErrorKind};
use std::fmt::Write as _;

/// The filter: `x | tojson`, `x | tojson(indent=4)`, `x | tojson(sort_keys=true)`.
pub(crate) fn tojson(value: &Value, kwargs: Kwargs) -> Result<String, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    // `ensure_ascii` and `separators` are accepted with Python's defaults only.
    let ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    kwargs.assert_all_used()?;
    if ascii == Some(true) {
        return Err(Error::new(
            ErrorKind::InvalidOperation,
            "tojson(ensure_ascii=true) is not supported by the router's renderer",
        ));
    }
    let mut out = String::new();
    let style = Style {
        indent,
        sort_keys: sort_keys.unwrap_or(false),
    };
    write(&mut out, value, &style, 0)?;
    Ok(out)
}

struct Style {
    indent: Option<usize>,
    sort_keys: bool,
}

fn write(out: &mut String, value: &Value, style: &Style, depth: usize) -> Result<(), Error> {
    match value.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number => number(out, value),
        ValueKind::String => string(out, value.as_str().unwrap_or_default()),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = value.try_iter()?.collect();
            container(out, '[', ']', items.len(), style, depth, |out, i| {
                write(out, &items[i], style, depth + 1)
            })?;
        }
        ValueKind::Map => {
            let mut keys: Vec<Value> = value.try_iter()?.collect();
            if style.sort_keys {
                keys.sort();
            }
            container(out, '{', '}', keys.len(), style, depth, |out, i| {
                let key = &keys[i];
                match key.as_str() {
                    Some(k) => string(out, k),
                    None => string(out, &key.to_string()),
                }
                out.push_str(": ");
                write(out, &value.get_item(key)?, style, depth + 1)
            })?;
        }
        _ => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("tojson cannot write a {} value", value.kind()),
            ));
        }
    }
    Ok(())
}

/// `len` items between `open` and `close`, as Python lays them out.
fn container(
    out: &mut String,
    open: char,
    close: char,
    len: usize,
    style: &Style,
    depth: usize,
    mut item: impl FnMut(&mut String, usize) -> Result<(), Error>,
) -> Result<(), Error> {
    out.push(open);
    if len == 0 {
        out.push(close);
        return Ok(());
    }
    for i in 0..len {
        match style.indent {
            Some(n) => {
                if i > 0 {
                    out.push(',');
                }
                out.push('\n');
                out.extend(std::iter::repeat_n(' ', n * (depth + 1)));
            }
            None if i > 0 => out.push_str(", "),
            None => {}
        }
        item(out, i)?;
    }
    if let Some(n) = style.indent {
        out.push('\n');
        out.extend(std::iter::repeat_n(' ', n * depth));
    }
    out.push(close);
    Ok(())
}

/// A number as Python prints it: integers as they are, floats by `repr` (`1.0`, `0.5`,
/// `1e+16`).
fn number(out: &mut String, value: &Value) {
    if value.is_integer() {
        let _ = write!(out, "{value}");
        return;
    }
    let f = f64::try_from(value.clone()).unwrap_or(f64::NAN);
    if !f.is_finite() {
        out.push_str(if f.is_nan() {
            "NaN"
        } else if f > 0.0 {
            "Infinity"
        } else {
            "-Infinity"
        });
        return;
    }
    // Python switches to exponent notation outside [1e-4, 1e16).
    let magnitude = f.abs();
    if magnitude != 0.0 && !(1e-4..1e16).contains(&magnitude) {
        let text = format!("{f:e}");
        let (mantissa, exponent) = text.split_once('e').unwrap_or((&text, "0"));
        let exponent: i32 = exponent.parse().unwrap_or(0);
        let sign = if exponent < 0 { '-' } else { '+' };
        let _ = write!(out, "{mantissa}e{sign}{:02}", exponent.abs());
    } else {
        let _ = write!(out, "{f:?}");
    }
}

/// A JSON string with Python's escapes (`ensure_ascii=False`): quotes, backslashes and control
/// characters only.
fn string(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render(source: &str, value: &str) -> String {
        let mut env = minijinja::Environment::new();
        env.add_filter("tojson", tojson);
        let parsed: Value = serde_json::from_str(value).expect("json");
        env.render_str(source, minijinja::context! { x => parsed })
            .expect("renders")
    }

    #[test]
    fn writes_what_python_json_dumps_writes() {
        // Each expected string is what `json.dumps(json.loads(value), ensure_ascii=False)` and
        // its `indent=2` / `sort_keys=True` forms print.
        let value = r#"{"name": "get_weather", "b": [1, 2.5, true, null], "a": {"é": "x\"y\n"}, "e": [], "f": {}}"#;
        assert_eq!(
            render("{{ x | tojson }}", value),
            r#"{"name": "get_weather", "b": [1, 2.5, true, null], "a": {"é": "x\"y\n"}, "e": [], "f": {}}"#
        );
        assert_eq!(
            render("{{ x | tojson(sort_keys=true) }}", value),
            r#"{"a": {"é": "x\"y\n"}, "b": [1, 2.5, true, null], "e": [], "f": {}, "name": "get_weather"}"#
        );
        assert_eq!(
            render("{{ x.b | tojson(indent=2) }}", value),
            "[\n  1,\n  2.5,\n  true,\n  null\n]"
        );
        assert_eq!(
            render(
                "{{ x | tojson }}",
                "[1.0, 1e16, 0.0001, 0.00001, -3, 12345678901234]"
            ),
            "[1.0, 1e+16, 0.0001, 1e-05, -3, 12345678901234]"
        );
    }
}
