//! Retention rules: which class (and TTL) a request's KV blocks get in the simulated kvd tiers.
//!
//! A rule is `COND:CLASS[:ttl=SECONDS]`, where `COND` is `*` or `FIELD OP NUMBER` with `FIELD` one
//! of `input_length`, `output_length`, `blocks` and `OP` one of `<`, `<=`, `>`, `>=`, `==`, `!=`;
//! `CLASS` is `none`, `ephemeral`, `short` or `long`. Rules are tried in order, the first match wins.
//! A trace's own `retention` / `ttl_seconds` columns take precedence over rules; a request no rule
//! matches has no hint (the router scales nothing; the tiers treat it as `long`, PROTOCOLS.md §5).

use infera_core::event::Retention;
use std::fmt;
use std::str::FromStr;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Field {
    InputLength,
    OutputLength,
    Blocks,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Op {
    Lt,
    Le,
    Gt,
    Ge,
    Eq,
    Ne,
}

/// One parsed `--retention-rule`.
#[derive(Debug, Clone, PartialEq)]
pub struct RetentionRule {
    cond: Option<(Field, Op, f64)>,
    pub class: Retention,
    pub ttl_seconds: Option<u32>,
    text: String,
}

/// What a rule looks at.
#[derive(Debug, Clone, Copy)]
pub struct RequestShape {
    pub input_length: u32,
    pub output_length: u32,
    pub blocks: u32,
}

impl RetentionRule {
    pub fn matches(&self, r: &RequestShape) -> bool {
        let Some((field, op, v)) = self.cond else {
            return true;
        };
        let x = match field {
            Field::InputLength => r.input_length,
            Field::OutputLength => r.output_length,
            Field::Blocks => r.blocks,
        } as f64;
        match op {
            Op::Lt => x < v,
            Op::Le => x <= v,
            Op::Gt => x > v,
            Op::Ge => x >= v,
            Op::Eq => x == v,
            Op::Ne => x != v,
        }
    }
}

impl fmt::Display for RetentionRule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

/// A rule that does not parse; the message says what was expected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "invalid retention rule {rule:?}: {problem} (expected COND:CLASS[:ttl=SECONDS], e.g. 'input_length<2048:short' or '*:long:ttl=600')"
)]
pub struct RuleError {
    pub rule: String,
    pub problem: String,
}

impl FromStr for RetentionRule {
    type Err = RuleError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = |problem: &str| RuleError {
            rule: s.to_owned(),
            problem: problem.to_owned(),
        };
        let mut parts = s.split(':');
        let cond_text = parts.next().unwrap_or("").trim();
        let class_text = parts.next().ok_or_else(|| err("missing ':CLASS'"))?.trim();
        let class = Retention::parse(class_text)
            .ok_or_else(|| err("class must be none, ephemeral, short or long"))?;
        let mut ttl_seconds = None;
        for extra in parts {
            let v = extra
                .trim()
                .strip_prefix("ttl=")
                .ok_or_else(|| err("only 'ttl=SECONDS' may follow the class"))?;
            let ttl: u32 = v
                .parse()
                .map_err(|_| err("ttl must be a whole number of seconds"))?;
            if ttl == 0 {
                return Err(err("ttl must be positive"));
            }
            ttl_seconds = Some(ttl);
        }
        let cond = if cond_text == "*" {
            None
        } else {
            let ops = [
                ("<=", Op::Le),
                (">=", Op::Ge),
                ("==", Op::Eq),
                ("!=", Op::Ne),
                ("<", Op::Lt),
                (">", Op::Gt),
            ];
            let (pos, sym, op) = ops
                .iter()
                .filter_map(|(sym, op)| cond_text.find(sym).map(|p| (p, *sym, *op)))
                .min_by_key(|(p, sym, _)| (*p, std::cmp::Reverse(sym.len())))
                .ok_or_else(|| err("condition needs one of < <= > >= == !=, or '*'"))?;
            let field = match cond_text[..pos].trim() {
                "input_length" => Field::InputLength,
                "output_length" => Field::OutputLength,
                "blocks" => Field::Blocks,
                _ => return Err(err("field must be input_length, output_length or blocks")),
            };
            let v: f64 = cond_text[pos + sym.len()..]
                .trim()
                .parse()
                .map_err(|_| err("the value after the operator must be a number"))?;
            Some((field, op, v))
        };
        Ok(Self {
            cond,
            class,
            ttl_seconds,
            text: s.to_owned(),
        })
    }
}

/// The class and TTL of a request: its own columns first, then the first matching rule.
pub fn classify(
    rules: &[RetentionRule],
    own: Option<Retention>,
    own_ttl: Option<u32>,
    shape: &RequestShape,
) -> (Option<Retention>, Option<u32>) {
    if own.is_some() {
        return (own, own_ttl);
    }
    match rules.iter().find(|r| r.matches(shape)) {
        Some(r) => (Some(r.class), own_ttl.or(r.ttl_seconds)),
        None => (None, own_ttl),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(i: u32) -> RequestShape {
        RequestShape {
            input_length: i,
            output_length: 10,
            blocks: i / 512,
        }
    }

    #[test]
    fn parses_and_matches() {
        let r: RetentionRule = "input_length<2048:short".parse().expect("rule");
        assert!(r.matches(&shape(100)));
        assert!(!r.matches(&shape(2048)));
        let r: RetentionRule = "input_length<=2048:none:ttl=60".parse().expect("rule");
        assert!(r.matches(&shape(2048)));
        assert_eq!(r.ttl_seconds, Some(60));
        let r: RetentionRule = "*:long".parse().expect("rule");
        assert!(r.matches(&shape(1)));
        let r: RetentionRule = "blocks >= 4 : ephemeral".parse().expect("rule");
        assert!(r.matches(&shape(4096)));
    }

    #[test]
    fn bad_rules_say_what_is_wrong() {
        for (bad, needle) in [
            ("input_length<2048", "missing ':CLASS'"),
            ("input_length<2048:forever", "class must be"),
            ("prompt<5:short", "field must be"),
            ("input_length~5:short", "condition needs"),
            ("input_length<abc:short", "must be a number"),
            ("*:short:ttl=0", "ttl must be positive"),
            ("*:short:keep", "only 'ttl=SECONDS'"),
        ] {
            let e = bad.parse::<RetentionRule>().expect_err(bad);
            assert!(e.to_string().contains(needle), "{bad}: {e}");
        }
    }

    #[test]
    fn first_match_wins_and_trace_columns_take_precedence() {
        let rules: Vec<RetentionRule> = [
            "input_length<1000:none",
            "input_length<5000:short:ttl=30",
            "*:long",
        ]
        .iter()
        .map(|s| s.parse().expect("rule"))
        .collect();
        assert_eq!(
            classify(&rules, None, None, &shape(10)),
            (Some(Retention::None), None)
        );
        assert_eq!(
            classify(&rules, None, None, &shape(3000)),
            (Some(Retention::Short), Some(30))
        );
        assert_eq!(
            classify(&rules, None, None, &shape(9000)),
            (Some(Retention::Long), None)
        );
        assert_eq!(
            classify(&rules, Some(Retention::Ephemeral), Some(5), &shape(10)),
            (Some(Retention::Ephemeral), Some(5))
        );
        assert_eq!(classify(&[], None, None, &shape(10)), (None, None));
    }
}
