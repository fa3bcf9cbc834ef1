//! Which event log to open: the closed config enum and its one conversion from the server's
//! `--event-log` flag.
//!
//! | flag value | log |
//! |---|---|
//! | `memory` | `infera_core::log::MemoryLog` (nothing survives a restart) |
//! | `nats://HOST:PORT[?stream=NAME&max_age=7d&max_bytes=8GiB&replicas=1]` | [`super::JetStreamLog`] |
//! | `sqlite:PATH` (or `sqlite://PATH`) | [`super::SqliteLog`], the file created if missing |
//! | `postgres://USER[:PASSWORD]@HOST[:PORT]/DB` (or `postgresql://…`) | [`super::PostgresLog`] |
//!
//! `max_age` takes seconds or a number with `s`, `m`, `h` or `d`; `0` means unlimited.
//! `max_bytes` takes bytes or a number with `KiB`, `MiB`, `GiB`, `TiB` (or `K`, `M`, `G`, `T`);
//! `0` means unlimited.

use serde::{Deserialize, Serialize};
use std::path::PathBuf;
use std::time::Duration;

/// Stream name used when `?stream=` is not given.
pub const DEFAULT_STREAM: &str = "INFERA_LOG";
/// Default bound on the age of the oldest envelope a JetStream log keeps.
pub const DEFAULT_MAX_AGE: Duration = Duration::from_secs(7 * 24 * 3600);
/// Default bound on the bytes a JetStream log keeps.
pub const DEFAULT_MAX_BYTES: u64 = 8 << 30;

/// The accepted forms, for error messages.
const FORMS: &str = "expected `memory`, `nats://HOST:PORT[?stream=NAME&max_age=7d&max_bytes=8GiB]`, \
                     `sqlite:PATH` or `postgres://USER@HOST[:PORT]/DB`";

/// An event log backend and its settings.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum EventLogConfig {
    /// In-process only.
    Memory,
    /// A JetStream stream on a NATS server.
    Jetstream(JetStreamLogConfig),
    /// An SQLite file.
    Sqlite(SqliteLogConfig),
    /// A PostgreSQL database.
    Postgres(PostgresLogConfig),
}

/// Where and how a [`super::JetStreamLog`] keeps its stream.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JetStreamLogConfig {
    /// NATS server URL (`nats://host:port`).
    pub url: String,
    /// Stream name (`[A-Za-z0-9_-]+`); the subject is `infera.log.<stream>` and the snapshot
    /// object store bucket `<stream>_snapshots`.
    pub stream: String,
    /// Envelopes older than this are discarded by the server (`None`: no age bound).
    #[serde(default, with = "opt_secs")]
    pub max_age: Option<Duration>,
    /// The oldest envelopes are discarded once the stream holds more (`None`: no size bound).
    #[serde(default)]
    pub max_bytes: Option<u64>,
    /// JetStream replicas of the stream and the snapshot bucket (1 on a single server).
    #[serde(default = "one")]
    pub replicas: usize,
}

fn one() -> usize {
    1
}

impl JetStreamLogConfig {
    /// The defaults for a server at `url`: stream [`DEFAULT_STREAM`], bounded by
    /// [`DEFAULT_MAX_AGE`] and [`DEFAULT_MAX_BYTES`].
    pub fn new(url: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            stream: DEFAULT_STREAM.to_owned(),
            max_age: Some(DEFAULT_MAX_AGE),
            max_bytes: Some(DEFAULT_MAX_BYTES),
            replicas: 1,
        }
    }

    /// The subject every envelope is published on.
    pub fn subject(&self) -> String {
        format!("infera.log.{}", self.stream)
    }

    /// The object store bucket that holds the snapshot.
    pub fn snapshot_bucket(&self) -> String {
        format!("{}_snapshots", self.stream)
    }
}

/// An SQLite event store.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SqliteLogConfig {
    /// The database file (created with its directory's permissions if missing).
    pub path: PathBuf,
}

/// A PostgreSQL event store.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PostgresLogConfig {
    /// `postgres://user[:password]@host[:port]/database[?options]`.
    pub url: String,
}

/// A `--event-log` value that is not one of the accepted forms.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid event log {spec:?}: {reason}; {FORMS}")]
pub struct InvalidEventLogSpec {
    /// The value as given (passwords removed).
    pub spec: String,
    /// What is wrong with it.
    pub reason: String,
}

impl std::str::FromStr for EventLogConfig {
    type Err = InvalidEventLogSpec;

    fn from_str(spec: &str) -> Result<Self, Self::Err> {
        let invalid = |reason: String| InvalidEventLogSpec {
            spec: redact(spec),
            reason,
        };
        let spec = spec.trim();
        if spec == "memory" {
            return Ok(EventLogConfig::Memory);
        }
        if let Some(rest) = spec.strip_prefix("nats://") {
            return parse_nats(rest)
                .map(EventLogConfig::Jetstream)
                .map_err(invalid);
        }
        if let Some(path) = spec
            .strip_prefix("sqlite://")
            .or_else(|| spec.strip_prefix("sqlite:"))
        {
            if path.is_empty() {
                return Err(invalid("the SQLite path is empty".to_owned()));
            }
            if path == ":memory:" || path.starts_with(":memory:") {
                return Err(invalid(
                    "an in-memory SQLite database keeps nothing; use `memory` instead".to_owned(),
                ));
            }
            return Ok(EventLogConfig::Sqlite(SqliteLogConfig {
                path: PathBuf::from(path),
            }));
        }
        if spec.starts_with("postgres://") || spec.starts_with("postgresql://") {
            let after = spec.split_once("://").map(|(_, r)| r).unwrap_or_default();
            let host_part = after.split(['/', '?']).next().unwrap_or_default();
            let socket = spec.contains("?host=") || spec.contains("&host=");
            if !socket && host_part.rsplit('@').next().unwrap_or_default().is_empty() {
                return Err(invalid("the PostgreSQL URL names no host".to_owned()));
            }
            return Ok(EventLogConfig::Postgres(PostgresLogConfig {
                url: spec.to_owned(),
            }));
        }
        Err(invalid("unknown kind of event log".to_owned()))
    }
}

fn parse_nats(rest: &str) -> Result<JetStreamLogConfig, String> {
    let (authority, query) = rest.split_once('?').unwrap_or((rest, ""));
    let authority = authority.trim_end_matches('/');
    if authority.is_empty() {
        return Err("the NATS URL names no host".to_owned());
    }
    if authority.contains('/') {
        return Err(format!(
            "a NATS URL has no path ({authority:?}); name the stream with ?stream=NAME"
        ));
    }
    let mut config = JetStreamLogConfig::new(format!("nats://{authority}"));
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (key, value) = pair
            .split_once('=')
            .ok_or_else(|| format!("query parameter {pair:?} has no value"))?;
        match key {
            "stream" => {
                validate_name(value)?;
                config.stream = value.to_owned();
            }
            "max_age" => {
                let age = parse_duration(value)?;
                config.max_age = (!age.is_zero()).then_some(age);
            }
            "max_bytes" => {
                let bytes = parse_bytes(value)?;
                config.max_bytes = (bytes > 0).then_some(bytes);
            }
            "replicas" => {
                config.replicas = value
                    .parse()
                    .ok()
                    .filter(|n| (1..=5).contains(n))
                    .ok_or_else(|| format!("replicas={value:?} is not a number from 1 to 5"))?;
            }
            other => {
                return Err(format!(
                    "unknown query parameter {other:?} (known: stream, max_age, max_bytes, replicas)"
                ));
            }
        }
    }
    Ok(config)
}

/// Checks a stream name: JetStream forbids `.`, `*`, `>`, whitespace and path separators; we
/// also keep it usable in a subject token and a bucket name.
pub(crate) fn validate_name(name: &str) -> Result<(), String> {
    let ok = !name.is_empty()
        && name.len() <= 200
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
    if ok {
        Ok(())
    } else {
        Err(format!(
            "stream name {name:?} must be 1 to 200 characters of A-Z, a-z, 0-9, `_` and `-`"
        ))
    }
}

fn parse_duration(value: &str) -> Result<Duration, String> {
    let bad = || format!("max_age={value:?} is not a duration like 3600, 90m, 24h or 7d");
    let (digits, unit) = split_number(value);
    let n: u64 = digits.parse().map_err(|_| bad())?;
    let secs = match unit {
        "" | "s" => Some(n),
        "m" => n.checked_mul(60),
        "h" => n.checked_mul(3600),
        "d" => n.checked_mul(86_400),
        _ => None,
    };
    secs.map(Duration::from_secs).ok_or_else(bad)
}

fn parse_bytes(value: &str) -> Result<u64, String> {
    let bad = || format!("max_bytes={value:?} is not a size like 1073741824, 512MiB or 8GiB");
    let (digits, unit) = split_number(value);
    let n: u64 = digits.parse().map_err(|_| bad())?;
    let shift = match unit {
        "" | "B" => 0,
        "K" | "KiB" => 10,
        "M" | "MiB" => 20,
        "G" | "GiB" => 30,
        "T" | "TiB" => 40,
        _ => return Err(bad()),
    };
    n.checked_mul(1 << shift)
        .filter(|b| i64::try_from(*b).is_ok())
        .ok_or_else(bad)
}

fn split_number(value: &str) -> (&str, &str) {
    let end = value
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(value.len());
    value.split_at(end)
}

/// `spec` with any URL password replaced by `***`, for messages and logs.
pub(crate) fn redact(spec: &str) -> String {
    let Some((scheme, rest)) = spec.split_once("://") else {
        return spec.to_owned();
    };
    let authority_end = rest.find(['/', '?']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(authority_end);
    match authority.rsplit_once('@') {
        Some((userinfo, host)) => match userinfo.split_once(':') {
            Some((user, _password)) => format!("{scheme}://{user}:***@{host}{tail}"),
            None => spec.to_owned(),
        },
        None => spec.to_owned(),
    }
}

mod opt_secs {
    use serde::{Deserialize, Deserializer, Serializer};
    use std::time::Duration;

    pub fn serialize<S: Serializer>(value: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
        match value {
            Some(d) => s.serialize_some(&d.as_secs()),
            None => s.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
        Ok(Option::<u64>::deserialize(d)?.map(Duration::from_secs))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(spec: &str) -> Result<EventLogConfig, InvalidEventLogSpec> {
        spec.parse()
    }

    #[test]
    fn parses_every_kind() {
        assert_eq!(parse("memory"), Ok(EventLogConfig::Memory));
        assert_eq!(
            parse("nats://127.0.0.1:4222"),
            Ok(EventLogConfig::Jetstream(JetStreamLogConfig::new(
                "nats://127.0.0.1:4222"
            )))
        );
        assert_eq!(
            parse("sqlite:/var/lib/infera/events.db"),
            Ok(EventLogConfig::Sqlite(SqliteLogConfig {
                path: "/var/lib/infera/events.db".into()
            }))
        );
        assert_eq!(
            parse("sqlite://rel/events.db"),
            Ok(EventLogConfig::Sqlite(SqliteLogConfig {
                path: "rel/events.db".into()
            }))
        );
        let pg = "postgres://infera:secret@db:5432/events?sslmode=require";
        assert_eq!(
            parse(pg),
            Ok(EventLogConfig::Postgres(PostgresLogConfig {
                url: pg.into()
            }))
        );
    }

    #[test]
    fn nats_options_set_the_stream_and_its_bounds() {
        let Ok(EventLogConfig::Jetstream(c)) =
            parse("nats://nats:4222?stream=prod-eu_1&max_age=24h&max_bytes=512MiB&replicas=3")
        else {
            panic!("expected a JetStream config");
        };
        assert_eq!(c.url, "nats://nats:4222");
        assert_eq!(c.stream, "prod-eu_1");
        assert_eq!(c.subject(), "infera.log.prod-eu_1");
        assert_eq!(c.snapshot_bucket(), "prod-eu_1_snapshots");
        assert_eq!(c.max_age, Some(Duration::from_secs(86_400)));
        assert_eq!(c.max_bytes, Some(512 << 20));
        assert_eq!(c.replicas, 3);
        let Ok(EventLogConfig::Jetstream(c)) = parse("nats://n:1?max_age=0&max_bytes=0") else {
            panic!("expected a JetStream config");
        };
        assert_eq!((c.max_age, c.max_bytes), (None, None));
    }

    #[test]
    fn rejects_bad_values_with_the_reason() {
        for (spec, needle) in [
            ("", "unknown kind"),
            ("mysql://db/x", "unknown kind"),
            ("nats://", "no host"),
            ("nats://h:1/path", "no path"),
            ("nats://h:1?stream=a.b", "stream name"),
            ("nats://h:1?max_age=soon", "max_age"),
            ("nats://h:1?max_bytes=9ZB", "max_bytes"),
            ("nats://h:1?replicas=9", "replicas"),
            ("nats://h:1?color=red", "unknown query parameter"),
            ("nats://h:1?stream", "no value"),
            ("sqlite:", "empty"),
            ("sqlite::memory:", "use `memory`"),
            ("postgres:///db", "no host"),
        ] {
            let err = parse(spec).expect_err(spec);
            let text = err.to_string();
            assert!(text.contains(needle), "{spec}: {text}");
            assert!(text.contains("expected `memory`"), "{spec}: {text}");
        }
    }

    #[test]
    fn passwords_never_reach_messages() {
        assert_eq!(
            redact("postgres://u:hunter2@db:5432/x?a=b"),
            "postgres://u:***@db:5432/x?a=b"
        );
        assert_eq!(redact("postgres://u@db/x"), "postgres://u@db/x");
        assert_eq!(redact("sqlite:/x"), "sqlite:/x");
        let err = parse("postgres://u:hunter2@/x").expect_err("no host");
        assert!(!err.to_string().contains("hunter2"), "{err}");
    }

    #[test]
    fn config_round_trips_through_serde_and_rejects_unknown_fields() {
        let config = EventLogConfig::Jetstream(JetStreamLogConfig::new("nats://n:1"));
        let json = serde_json::to_value(&config).expect("ser");
        assert_eq!(json["kind"], "jetstream");
        assert_eq!(json["max_age"], 7 * 86_400);
        let back: EventLogConfig = serde_json::from_value(json).expect("de");
        assert_eq!(back, config);
        let bad = serde_json::json!({"kind": "sqlite", "path": "x", "colour": 1});
        assert!(serde_json::from_value::<EventLogConfig>(bad).is_err());
    }
}
