//! The LMCache L4 settings, as the Python kvd reads them: `--lmcache-config PATH`, a flat YAML
//! file (`key: value` lines, `#` comments, one nested `connector_extra:` block of indented
//! `key: value` pairs, `${VAR}` expanded from the environment, unset variables as empty), and
//! for every key an `INFERA_L4_<KEY>` variable that wins over the file.
//!
//! Keys: `remote_url` (required: `redis://[[user]:password@]host[:port][/db]`, `valkey://…`
//! the same, `lm://host:port`, or `s3://HOST[:PORT][/BUCKET]` (see [`super::s3`]); TLS and
//! sentinel/cluster Redis URLs are refused), `prefix` (`infera`), `connector_extra` (LMCache
//! engine settings: the `s3://` client reads its keys from it, each overridable by
//! `INFERA_L4_<KEY>`; the rest have no use in kvd's native clients, which say so in a
//! warning), `max_value_bytes` (64 MiB), `rpc_timeout_s` (30).
//! Other keys of an LMCache config file (chunk sizes, local tiers, ...) are ignored.

use super::lm::LmStore;
use super::mooncake::{MooncakeConfig, MooncakeStore};
use super::redis::RedisStore;
use super::remote::RemoteStore;
use super::resp::Endpoint;
#[cfg(feature = "s3")]
use super::s3::{S3Config, S3Store};
use super::{L4Options, frame};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

/// Where the store is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RemoteUrl {
    /// Redis or Valkey, LMCache's layout.
    Redis(Endpoint),
    /// An LMCache server.
    Lm { host: String, port: u16 },
    /// A Mooncake Store cluster, through the sidecar ([`super::mooncake`]).
    Mooncake(Box<MooncakeConfig>),
    /// An S3 bucket ([`super::s3`]).
    #[cfg(feature = "s3")]
    S3(Box<S3Config>),
}

/// The resolved settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct L4Config {
    /// `remote_url` with any password replaced by `***`.
    pub remote_url: String,
    pub remote: RemoteUrl,
    pub prefix: String,
    pub connector_extra: Vec<(String, String)>,
    pub max_value_bytes: u64,
    pub rpc_timeout: Duration,
    /// `--l4-required`: a store that does not answer at start stops the daemon.
    pub required: bool,
}

fn expand(text: &str, env: &dyn Fn(&str) -> Option<String>) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find("${") {
        out.push_str(&rest[..at]);
        match rest[at + 2..].find('}') {
            Some(end) => {
                out.push_str(&env(&rest[at + 2..at + 2 + end]).unwrap_or_default());
                rest = &rest[at + 3 + end..];
            }
            None => {
                out.push_str(&rest[at..]);
                rest = "";
            }
        }
    }
    out.push_str(rest);
    out
}

fn unquote(v: &str) -> &str {
    let v = v.trim();
    v.strip_prefix('"')
        .and_then(|v| v.strip_suffix('"'))
        .or_else(|| v.strip_prefix('\'').and_then(|v| v.strip_suffix('\'')))
        .unwrap_or(v)
}

type Flat = (Vec<(String, String)>, Vec<(String, String)>);

/// Parses the flat YAML: top-level pairs and the `connector_extra` block.
fn parse(text: &str, env: &dyn Fn(&str) -> Option<String>) -> Result<Flat, String> {
    let mut top = Vec::new();
    let mut extra = Vec::new();
    let mut block: Option<String> = None;
    for (n, line) in text.lines().enumerate() {
        let body = line.split(" #").next().unwrap_or_default();
        if body.trim().is_empty() || body.trim_start().starts_with('#') {
            continue;
        }
        let (key, value) = body
            .trim()
            .split_once(':')
            .ok_or_else(|| format!("line {}: expected `key: value`, got {line:?}", n + 1))?;
        let (key, value) = (key.trim().to_owned(), expand(unquote(value), env));
        if line.starts_with([' ', '\t']) {
            match block.as_deref() {
                Some("connector_extra") => extra.push((key, value)),
                Some(_) => {}
                None => return Err(format!("line {}: unexpected indentation", n + 1)),
            }
        } else if value.is_empty() {
            block = Some(key);
        } else {
            block = None;
            top.push((key, value));
        }
    }
    Ok((top, extra))
}

fn host_port(text: &str, default: Option<u16>, url: &str) -> Result<(String, u16), String> {
    let (host, port) = match text.rsplit_once(':') {
        Some((h, p)) if !h.ends_with(']') || text.starts_with('[') => (h, Some(p)),
        _ => (text, None),
    };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    if host.is_empty() {
        return Err(format!("{url}: no host"));
    }
    let port = match (port, default) {
        (Some(p), _) => p
            .parse::<u16>()
            .map_err(|_| format!("{url}: bad port {p:?}"))?,
        (None, Some(d)) => d,
        (None, None) => return Err(format!("{url}: a port is required (host:port)")),
    };
    Ok((host.to_owned(), port))
}

/// Parses `remote_url`; also returns it with the password masked.
///
/// # Errors
/// An unsupported scheme or a malformed URL, as one line.
pub fn parse_url(url: &str) -> Result<(RemoteUrl, String), String> {
    let (scheme, rest) = url.split_once("://").ok_or_else(|| {
        format!("{url:?} is not a URL; use redis://host:port, lm://host:port or s3://host/bucket")
    })?;
    match scheme {
        "redis" | "valkey" => {
            let (auth, rest) = match rest.rsplit_once('@') {
                Some((a, r)) => (Some(a), r),
                None => (None, rest),
            };
            let (hostport, db) = match rest.split_once('/') {
                Some((h, d)) if !d.is_empty() => (
                    h,
                    Some(
                        d.parse::<u32>()
                            .map_err(|_| format!("{url}: bad db {d:?}"))?,
                    ),
                ),
                Some((h, _)) => (h, None),
                None => (rest, None),
            };
            let (host, port) = host_port(hostport, Some(6379), scheme)?;
            let (username, password) = match auth.map(|a| a.split_once(':')) {
                Some(Some((u, p))) => ((!u.is_empty()).then(|| u.to_owned()), Some(p.to_owned())),
                Some(None) => (None, auth.map(str::to_owned)),
                None => (None, None),
            };
            let masked = match auth {
                Some(_) => format!("{scheme}://***@{rest}"),
                None => url.to_owned(),
            };
            let ep = Endpoint {
                host,
                port,
                password,
                username,
                db,
            };
            Ok((RemoteUrl::Redis(ep), masked))
        }
        "lm" => {
            let (host, port) = host_port(rest.trim_end_matches('/'), None, url)?;
            Ok((RemoteUrl::Lm { host, port }, url.to_owned()))
        }
        #[cfg(feature = "s3")]
        "s3" => Ok((
            RemoteUrl::S3(Box::new(S3Config::from_url(rest, url)?)),
            url.to_owned(),
        )),
        #[cfg(not(feature = "s3"))]
        "s3" => {
            Err("s3:// needs a build with the `s3` feature (the infera binary's default)".into())
        }
        other => Err(format!(
            "{other}:// is not supported (TLS, sentinel and cluster URLs included); \
             use redis://, valkey://, lm:// or s3://"
        )),
    }
}

/// A flat settings file (see the module docs) with its `INFERA_L4_<KEY>` overrides: what both
/// stores' settings are read from.
pub(super) struct Settings<'a> {
    top: Vec<(String, String)>,
    pub(super) extra: Vec<(String, String)>,
    env: &'a dyn Fn(&str) -> Option<String>,
}

impl<'a> Settings<'a> {
    /// Reads `path` (if any); `env` looks variables up.
    pub(super) fn read(
        path: Option<&Path>,
        env: &'a dyn Fn(&str) -> Option<String>,
    ) -> Result<Self, String> {
        let (top, extra) = match path {
            Some(path) => {
                let text = std::fs::read_to_string(path)
                    .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
                parse(&text, env).map_err(|e| format!("{}: {e}", path.display()))?
            }
            None => Default::default(),
        };
        Ok(Self { top, extra, env })
    }

    /// Completes an `s3://` store's settings: its `connector_extra` keys (see
    /// [`Settings::lookup`]) and the AWS variables; `timeout` bounds a connection.
    #[cfg_attr(
        not(feature = "s3"),
        allow(unused_variables, clippy::unused_self, clippy::unnecessary_wraps)
    )]
    fn settle(&self, remote: RemoteUrl, timeout: Duration) -> Result<RemoteUrl, String> {
        #[cfg(feature = "s3")]
        if let RemoteUrl::S3(mut s3) = remote {
            let extra = |key: &str| self.lookup(&self.extra, key);
            s3.settle(&extra, &|k| self.env(k), timeout)?;
            return Ok(RemoteUrl::S3(s3));
        }
        Ok(remote)
    }

    /// A variable of the environment.
    pub(super) fn env(&self, name: &str) -> Option<String> {
        (self.env)(name).filter(|v| !v.is_empty())
    }

    /// `key`'s value: `INFERA_L4_<KEY>`, else the file's (empty counts as unset).
    pub(super) fn get(&self, key: &str) -> Option<String> {
        self.lookup(&self.top, key)
    }

    /// `key` in `pairs` (the file's top level or its `connector_extra`), `INFERA_L4_<KEY>`
    /// winning; empty counts as unset.
    fn lookup(&self, pairs: &[(String, String)], key: &str) -> Option<String> {
        self.env(&format!("INFERA_L4_{}", key.to_ascii_uppercase()))
            .or_else(|| {
                pairs
                    .iter()
                    .find(|(k, v)| k == key && !v.is_empty())
                    .map(|(_, v)| v.clone())
            })
    }

    /// A store-name prefix under `key`: NUL-free, ASCII, short enough for every store's names.
    pub(super) fn prefix(
        &self,
        key: &str,
        default: Option<&str>,
    ) -> Result<Option<String>, String> {
        let Some(prefix) = self.get(key).or_else(|| default.map(str::to_owned)) else {
            return Ok(None);
        };
        let longest = super::lm::MAX_KEY_LENGTH - super::name("", 0).len();
        if prefix.len() > longest
            || !prefix
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"._-:/".contains(&b))
        {
            return Err(format!(
                "{key} {prefix:?}: 1 to {longest} characters of A-Z a-z 0-9 . _ - : /"
            ));
        }
        Ok(Some(prefix))
    }

    /// A whole number under `key`, from `min` to `max`.
    pub(super) fn count(&self, key: &str, default: u64, min: u64, max: u64) -> Result<u64, String> {
        match self.get(key) {
            Some(v) => v
                .parse::<u64>()
                .ok()
                .filter(|n| (min..=max).contains(n))
                .ok_or_else(|| format!("{key} {v:?}: a whole number from {min} to {max}")),
            None => Ok(default),
        }
    }

    /// `max_value_bytes` (64 MiB).
    pub(super) fn max_value_bytes(&self) -> Result<u64, String> {
        self.count("max_value_bytes", 64 << 20, 1, 1 << 30)
    }

    /// `rpc_timeout_s` (30).
    pub(super) fn rpc_timeout(&self) -> Result<Duration, String> {
        match self.get("rpc_timeout_s") {
            Some(v) => v
                .parse::<f64>()
                .ok()
                .filter(|s| s.is_finite() && *s > 0.0 && *s <= 3600.0)
                .map(Duration::from_secs_f64)
                .ok_or_else(|| format!("rpc_timeout_s {v:?}: seconds, above 0 and at most 3600")),
            None => Ok(Duration::from_secs(30)),
        }
    }
}

impl L4Config {
    /// Reads the LMCache settings from `path` (if any) and the environment (`env` looks
    /// variables up; `INFERA_L4_<KEY>` wins over the file).
    ///
    /// # Errors
    /// One line naming the key (or the file) at fault.
    pub fn from_lmcache(
        path: Option<&Path>,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<Self, String> {
        let settings = Settings::read(path, env)?;
        let url = settings.get("remote_url").ok_or(
            "remote_url is required: set it in --lmcache-config or INFERA_L4_REMOTE_URL \
             (redis://host:port, lm://host:port or s3://host/bucket)",
        )?;
        let (remote, remote_url) = parse_url(&url).map_err(|e| format!("remote_url {e}"))?;
        let rpc_timeout = settings.rpc_timeout()?;
        let remote = settings.settle(remote, rpc_timeout)?;
        Ok(Self {
            remote_url,
            remote,
            prefix: settings
                .prefix("prefix", Some("infera"))?
                .unwrap_or_default(),
            max_value_bytes: settings.max_value_bytes()?,
            rpc_timeout,
            connector_extra: settings.extra,
            required: false,
        })
    }

    /// The L4's behaviour (the queue and batch bounds keep their defaults).
    pub fn options(&self) -> L4Options {
        L4Options {
            prefix: self.prefix.clone(),
            max_value_bytes: self.max_value_bytes + frame::HEADER_BYTES as u64 + 64 * 1024,
            op_timeout: self.rpc_timeout,
            ..L4Options::default()
        }
    }

    /// A client of the configured store.
    pub fn store(&self) -> Arc<dyn RemoteStore> {
        let read: &[&str] = match &self.remote {
            #[cfg(feature = "s3")]
            RemoteUrl::S3(_) => &super::s3::KEYS,
            _ => &[],
        };
        let keys: Vec<&str> = self
            .connector_extra
            .iter()
            .map(|(k, _)| k.as_str())
            .filter(|k| !read.contains(k))
            .collect();
        if !keys.is_empty() {
            tracing::warn!(
                ?keys,
                "kvd's native L4 clients ignore these connector_extra keys"
            );
        }
        let max = self.options().max_value_bytes as usize;
        match &self.remote {
            RemoteUrl::Redis(ep) => Arc::new(RedisStore::new(ep.clone(), max)),
            RemoteUrl::Lm { host, port } => Arc::new(LmStore::new(host.clone(), *port, max)),
            RemoteUrl::Mooncake(config) => Arc::new(MooncakeStore::new((**config).clone(), max)),
            #[cfg(feature = "s3")]
            RemoteUrl::S3(config) => Arc::new(S3Store::new((**config).clone(), max)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let vars: Vec<(String, String)> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| vars.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone())
    }

    #[test]
    fn the_file_is_expanded_and_the_environment_wins() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("lmcache.yaml");
        std::fs::write(
            &path,
            "# LMCache remote\nremote_url: \"redis://${HOST}:6380/2\"\nprefix: team-a\n\
             chunk_size: 256\nconnector_extra:\n  pool: 4\nrpc_timeout_s: 2.5\n",
        )
        .unwrap();
        let config = L4Config::from_lmcache(Some(&path), &env(&[("HOST", "127.0.0.1")])).unwrap();
        assert_eq!(config.prefix, "team-a");
        assert_eq!(config.rpc_timeout, Duration::from_millis(2500));
        assert_eq!(config.connector_extra, vec![("pool".into(), "4".into())]);
        let RemoteUrl::Redis(ep) = &config.remote else {
            panic!("{config:?}")
        };
        assert_eq!(
            (ep.host.as_str(), ep.port, ep.db),
            ("127.0.0.1", 6380, Some(2))
        );
        let config = L4Config::from_lmcache(
            Some(&path),
            &env(&[
                ("INFERA_L4_REMOTE_URL", "lm://127.0.0.1:65432"),
                ("INFERA_L4_PREFIX", "b"),
            ]),
        )
        .unwrap();
        assert_eq!(config.prefix, "b");
        assert_eq!(
            config.remote,
            RemoteUrl::Lm {
                host: "127.0.0.1".into(),
                port: 65432
            }
        );
    }

    #[test]
    fn bad_settings_are_one_line_errors() {
        let none = env(&[]);
        assert!(
            L4Config::from_lmcache(None, &none)
                .unwrap_err()
                .contains("remote_url is required")
        );
        for (url, says) in [
            #[cfg(feature = "s3")]
            ("s3://bucket/x", "s3_region"),
            ("gs://bucket", "not supported"),
            ("rediss://h:1", "not supported"),
            ("lm://h", "a port is required"),
            ("redis://h:notaport", "bad port"),
        ] {
            let e =
                L4Config::from_lmcache(None, &env(&[("INFERA_L4_REMOTE_URL", url)])).unwrap_err();
            assert!(e.contains(says) && !e.contains('\n'), "{url}: {e}");
        }
        let e = L4Config::from_lmcache(
            None,
            &env(&[
                ("INFERA_L4_REMOTE_URL", "redis://h"),
                ("INFERA_L4_PREFIX", "a b"),
            ]),
        )
        .unwrap_err();
        assert!(e.starts_with("prefix"), "{e}");
    }

    #[test]
    fn passwords_are_masked() {
        let (remote, shown) = parse_url("redis://user:secret@127.0.0.1:7000").unwrap();
        assert_eq!(shown, "redis://***@127.0.0.1:7000");
        let RemoteUrl::Redis(ep) = remote else {
            panic!()
        };
        assert_eq!(
            (ep.username.as_deref(), ep.password.as_deref()),
            (Some("user"), Some("secret"))
        );
    }
}
