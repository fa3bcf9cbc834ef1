//! Tenants of a shared fleet: who sends a request (its API key), what it may use, and how it
//! shares a saturated fleet with the others.
//!
//! - [`Tenants`]: the key file (`--api-keys`, JSON, format in `docs/tenants.md`) parsed into
//!   tenants with their weight, priorities and [`Limits`]; a presented key is looked up by its
//!   SHA-256 digest and the digests compared in constant time, so neither a key nor its prefix
//!   leaks through timing, and the file may hold digests instead of keys.
//! - [`limits`]: per-tenant token buckets and the concurrency count.
//! - [`queue`]: the fair order in which waiting requests leave the router's queue.
//!
//! Without a key file there are no tenants: every request is the anonymous tenant's, with no
//! limits, weight 1 and whatever priority it asks for.

pub mod limits;
pub mod queue;

pub use limits::{Limit, Limits, Permit, Refusal, Standing, Usage};

use crate::clock::Micros;
use rustc_hash::FxHashMap;
use sha2::{Digest as _, Sha256};
use std::sync::Arc;

/// The name requests without a key file are queued under.
pub const ANONYMOUS: &str = "anonymous";

/// One tenant. See the module docs.
#[derive(Debug)]
pub struct Tenant {
    pub name: Arc<str>,
    /// Its share of a saturated fleet against the others' (at least 1).
    pub weight: u32,
    /// The priority of a request that names none.
    pub default_priority: i32,
    /// The most urgent priority it may ask for (lower is more urgent, as vLLM's `priority`);
    /// a request asking for more is queued at this one.
    pub priority_floor: i32,
    pub limits: Limits,
    /// What it has used, kept across reloads of the key file.
    pub usage: Arc<Usage>,
}

impl Tenant {
    /// The anonymous tenant of a server without a key file.
    pub fn anonymous() -> Arc<Self> {
        Arc::new(Tenant {
            name: Arc::from(ANONYMOUS),
            weight: 1,
            default_priority: 0,
            priority_floor: i32::MIN,
            limits: Limits::default(),
            usage: Usage::new(&Limits::default()),
        })
    }

    /// The priority a request of this tenant is queued at, when it asked for `asked`.
    pub fn priority(&self, asked: Option<i32>) -> i32 {
        asked
            .unwrap_or(self.default_priority)
            .max(self.priority_floor)
    }
}

/// The key file's shape.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct KeyFile {
    tenants: Vec<TenantEntry>,
}

#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct TenantEntry {
    name: String,
    keys: Vec<String>,
    #[serde(default = "one")]
    weight: u32,
    #[serde(default)]
    default_priority: i32,
    #[serde(default)]
    priority_floor: i32,
    #[serde(default)]
    limits: Limits,
}

fn one() -> u32 {
    1
}

/// A key file that cannot be used, and why.
#[derive(Debug, thiserror::Error)]
pub enum KeyFileError {
    #[error("the key file is not valid: {0}")]
    Syntax(#[from] serde_json::Error),
    #[error("tenant {name:?}: {problem}")]
    Tenant { name: String, problem: String },
    #[error("a key is listed for both {first:?} and {second:?}")]
    SharedKey { first: String, second: String },
}

/// Every tenant of a key file, by the digest of each of its keys. See the module docs.
#[derive(Debug, Default)]
pub struct Tenants {
    by_digest: FxHashMap<[u8; 32], Arc<Tenant>>,
    tenants: Vec<Arc<Tenant>>,
}

impl Tenants {
    /// Parses a key file. A tenant that `previous` also has keeps its usage (with the new
    /// limits applied at `now`), so a reload neither forgives nor double-counts anything.
    ///
    /// # Errors
    /// Malformed JSON, an unknown field, a bad name, weight or key, a key given twice.
    pub fn parse(
        text: &str,
        previous: Option<&Tenants>,
        now: Micros,
    ) -> Result<Self, KeyFileError> {
        let file: KeyFile = serde_json::from_str(text)?;
        let mut out = Tenants::default();
        let mut owner: FxHashMap<[u8; 32], String> = FxHashMap::default();
        for entry in file.tenants {
            let problem = |problem: String| KeyFileError::Tenant {
                name: entry.name.clone(),
                problem,
            };
            check_name(&entry.name).map_err(problem)?;
            if entry.weight == 0 {
                return Err(problem("`weight` must be at least 1".into()));
            }
            if entry.keys.is_empty() {
                return Err(problem("`keys` lists no key".into()));
            }
            if entry.default_priority < entry.priority_floor {
                return Err(problem(format!(
                    "`default_priority` {} is more urgent than `priority_floor` {}",
                    entry.default_priority, entry.priority_floor
                )));
            }
            if out.tenants.iter().any(|t| *t.name == *entry.name) {
                return Err(problem("the name is used twice".into()));
            }
            let usage = match previous.and_then(|p| p.named(&entry.name)) {
                Some(old) => {
                    old.usage.retune(&entry.limits, now);
                    Arc::clone(&old.usage)
                }
                None => Usage::new(&entry.limits),
            };
            let tenant = Arc::new(Tenant {
                name: Arc::from(entry.name.as_str()),
                weight: entry.weight,
                default_priority: entry.default_priority,
                priority_floor: entry.priority_floor,
                limits: entry.limits,
                usage,
            });
            for key in &entry.keys {
                let digest = key_digest(key).map_err(problem)?;
                if let Some(first) = owner.insert(digest, entry.name.clone()) {
                    return Err(KeyFileError::SharedKey {
                        first,
                        second: entry.name.clone(),
                    });
                }
                out.by_digest.insert(digest, Arc::clone(&tenant));
            }
            out.tenants.push(tenant);
        }
        Ok(out)
    }

    /// The tenant whose key `presented` is.
    pub fn find(&self, presented: &[u8]) -> Option<&Arc<Tenant>> {
        let digest: [u8; 32] = Sha256::digest(presented).into();
        // The map is keyed by the digest, which an attacker cannot steer; the final compare
        // runs in constant time all the same.
        let (stored, tenant) = self.by_digest.get_key_value(&digest)?;
        constant_time_eq(stored, &digest).then_some(tenant)
    }

    /// The tenant called `name`.
    pub fn named(&self, name: &str) -> Option<&Arc<Tenant>> {
        self.tenants.iter().find(|t| &*t.name == name)
    }

    /// Every tenant, in file order.
    pub fn all(&self) -> &[Arc<Tenant>] {
        &self.tenants
    }
}

fn check_name(name: &str) -> Result<(), String> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b));
    if ok {
        Ok(())
    } else {
        Err(
            "a name is 1 to 64 characters of letters, digits, `.`, `_` and `-` \
             (it is a metric label)"
                .into(),
        )
    }
}

/// A key as the file gives it: `sha256:<64 hex digits>` (the digest of the key), or the key.
fn key_digest(key: &str) -> Result<[u8; 32], String> {
    if let Some(hex) = key.strip_prefix("sha256:") {
        let bytes = hex.as_bytes();
        if bytes.len() != 64 {
            return Err("a `sha256:` key is followed by 64 hex digits".into());
        }
        let mut out = [0u8; 32];
        for (i, pair) in bytes.chunks_exact(2).enumerate() {
            let text = std::str::from_utf8(pair).map_err(|e| e.to_string())?;
            out[i] = u8::from_str_radix(text, 16)
                .map_err(|_| "a `sha256:` key is followed by 64 hex digits".to_owned())?;
        }
        return Ok(out);
    }
    if key.len() < 16 || !key.bytes().all(|b| b.is_ascii_graphic()) {
        return Err("a key is at least 16 printable ASCII characters without spaces".into());
    }
    Ok(Sha256::digest(key.as_bytes()).into())
}

fn constant_time_eq(a: &[u8; 32], b: &[u8; 32]) -> bool {
    let diff = a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y));
    std::hint::black_box(diff) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    const FILE: &str = r#"{"tenants": [
        {"name": "search", "keys": ["sk-search-0123456789"], "weight": 4,
         "priority_floor": -5, "limits": {"requests_per_minute": 60}},
        {"name": "batch", "keys": ["sha256:d8ef2a9a2de3ab8ef3bba0ab3d1ed36e2ca2ba23c9e0eb5ef4a3ac94f0e3ae48"],
         "default_priority": 10, "priority_floor": 10}
    ]}"#;

    #[test]
    fn keys_and_digests_find_their_tenant_and_nothing_else_does() {
        let t = Tenants::parse(FILE, None, 0).unwrap();
        let search = t.find(b"sk-search-0123456789").unwrap();
        assert_eq!(&*search.name, "search");
        assert_eq!(search.weight, 4);
        assert!(t.find(b"sk-search-012345678").is_none());
        assert!(t.find(b"").is_none());
        let digest_of = |k: &str| {
            Sha256::digest(k.as_bytes())
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect::<String>()
        };
        let text = FILE.replace(
            "d8ef2a9a2de3ab8ef3bba0ab3d1ed36e2ca2ba23c9e0eb5ef4a3ac94f0e3ae48",
            &digest_of("sk-batch-abcdefghij"),
        );
        let t = Tenants::parse(&text, None, 0).unwrap();
        assert_eq!(&*t.find(b"sk-batch-abcdefghij").unwrap().name, "batch");
    }

    #[test]
    fn priorities_are_clamped_to_the_floor() {
        let t = Tenants::parse(FILE, None, 0).unwrap();
        let search = t.named("search").unwrap();
        assert_eq!(search.priority(None), 0);
        assert_eq!(search.priority(Some(-100)), -5);
        assert_eq!(search.priority(Some(3)), 3);
        assert_eq!(t.named("batch").unwrap().priority(Some(-1)), 10);
        assert_eq!(Tenant::anonymous().priority(Some(-100)), -100);
    }

    #[test]
    fn a_reload_keeps_what_a_tenant_used() {
        let first = Tenants::parse(FILE, None, 0).unwrap();
        let search = first.named("search").unwrap();
        for _ in 0..60 {
            search.usage.admit(0, 0, 1).unwrap();
        }
        let second = Tenants::parse(FILE, Some(&first), 0).unwrap();
        let again = second.find(b"sk-search-0123456789").unwrap();
        assert!(
            again.usage.admit(0, 0, 1).is_err(),
            "the minute is still spent"
        );
    }

    #[test]
    fn bad_files_say_what_is_wrong() {
        let err = |text: &str| Tenants::parse(text, None, 0).unwrap_err().to_string();
        assert!(err("{").contains("not valid"));
        assert!(
            err(r#"{"tenants": [{"name": "a b", "keys": ["sk-0123456789abcdef"]}]}"#)
                .contains("metric label")
        );
        assert!(err(r#"{"tenants": [{"name": "a", "keys": ["short"]}]}"#).contains("16"));
        assert!(err(r#"{"tenants": [{"name": "a", "keys": []}]}"#).contains("no key"));
        assert!(
            err(r#"{"tenants": [{"name": "a", "keys": ["sk-0123456789abcdef"], "weight": 0}]}"#)
                .contains("weight")
        );
        assert!(
            err(
                r#"{"tenants": [{"name": "a", "keys": ["sk-0123456789abcdef"]},
                                  {"name": "b", "keys": ["sk-0123456789abcdef"]}]}"#
            )
            .contains("both \"a\" and \"b\"")
        );
        assert!(err(r#"{"tenants": [{"name": "a", "keys": ["sk-0123456789abcdef"], "limits": {"rpm": 1}}]}"#)
            .contains("unknown field"));
        assert!(err(r#"{"tenants": [{"name": "a", "keys": ["sha256:zz"]}]}"#).contains("64 hex"));
    }

    #[test]
    fn digests_compare_equal_only_when_equal() {
        let a = [7u8; 32];
        let mut b = a;
        assert!(constant_time_eq(&a, &b));
        b[31] ^= 1;
        assert!(!constant_time_eq(&a, &b));
    }
}
