//! The binary's one wiring module: the only source of the `infera` binary that names a backend
//! (its tests and benches use the backends' harness directly). Validated configuration goes in,
//! core's ports come out (`Arc<dyn Port>`); every command takes its backends from here.
//!
//! | what | port or handle | chosen by | file |
//! |---|---|---|---|
//! | the NATS connection, shared by a command's NATS ports | [`NatsLink`] | any `nats` transport | [`nats`] |
//! | fleet watch (server, gaie) | `Discovery` → `DiscoveryStream` | `--discovery-backend etcd\|kubernetes` | [`discovery`] |
//! | registration (worker) | `Registrar` | `--discovery-backend etcd\|kubernetes` | [`discovery`] |
//! | requests to workers (server) | `RequestTransport` | `--request-transport http\|nats` | [`server`] |
//! | KV events from workers (server, gaie) | `KvEventSource` | `--kv-event-transport zmq\|nats` | [`server`] |
//! | durable router events (server) | `EventLog` | `--event-log` | [`server`] |
//! | requests from the server (worker) | [`Responder`] | `--request-transport nats` | [`nats`] |
//! | the mock's KV events (worker) | [`mock_kv_sink`] | `--kv-event-transport zmq\|nats` | [`mock_kv`] |
//! | an engine's KV events onto NATS (worker) | [`KvRelay`] | `--kv-event-transport nats` | [`kv_relay`] |
//! | kvd's inventory as KV events (kvd) | `InventorySink` | `--kv-events-endpoint` | [`kvd_inventory`] |
//!
//! # Cargo features
//! The binary's features `etcd`, `kubernetes`, `nats`, `zmq` and `sql` (all default) turn on the
//! backends' features of the same names. A flag that names a backend compiled out is refused when
//! the configuration is validated, by [`Backend::require`], in one line naming the flag and the
//! feature; the constructors here refuse it too (for a configuration built another way), never
//! with a panic. The backends' test harness (`testsuite`) is a dev-dependency only: no
//! production build contains it.
//! `xtask layers` fails when a file of the binary outside this module names `infera_backends`.

mod discovery;
mod kv_relay;
mod kvd_inventory;
mod mock_kv;
mod nats;
mod server;

pub use discovery::{describe, registrar, scaler, validate_etcd_endpoint, watch};
pub use infera_backends::log::{
    EventLogConfig, InvalidEventLogSpec, JetStreamLogConfig, SqliteLogConfig,
};
pub use kv_relay::KvRelay;
pub use kvd_inventory::kvd_inventory;
pub use mock_kv::mock_kv_sink;
pub use nats::{NatsLink, Responder};
pub use server::{ServerPorts, kv_event_source, kvd_event_source, open_event_log, server_ports};

use crate::config::ConfigError;

/// A backend family, built when the binary's Cargo feature of the same name is on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// etcd discovery.
    Etcd,
    /// Kubernetes discovery.
    Kubernetes,
    /// NATS: request transport, KV events, the JetStream event log.
    Nats,
    /// ZeroMQ KV events.
    Zmq,
    /// SQLite and PostgreSQL event logs.
    Sql,
}

impl Backend {
    /// Whether this build contains it.
    pub const fn built(self) -> bool {
        match self {
            Backend::Etcd => cfg!(feature = "etcd"),
            Backend::Kubernetes => cfg!(feature = "kubernetes"),
            Backend::Nats => cfg!(feature = "nats"),
            Backend::Zmq => cfg!(feature = "zmq"),
            Backend::Sql => cfg!(feature = "sql"),
        }
    }

    /// The Cargo feature that builds it (the same name on the binary and on `infera-backends`).
    pub const fn feature(self) -> &'static str {
        match self {
            Backend::Etcd => "etcd",
            Backend::Kubernetes => "kubernetes",
            Backend::Nats => "nats",
            Backend::Zmq => "zmq",
            Backend::Sql => "sql",
        }
    }

    /// Its name in messages.
    const fn name(self) -> &'static str {
        match self {
            Backend::Etcd => "etcd",
            Backend::Kubernetes => "Kubernetes",
            Backend::Nats => "NATS",
            Backend::Zmq => "ZeroMQ",
            Backend::Sql => "SQL",
        }
    }

    /// Refuses `flag value` when this backend, which it selects, is not in this build.
    ///
    /// # Errors
    /// [`Backend::not_built`].
    pub fn require(self, flag: &'static str, value: &str) -> Result<(), ConfigError> {
        if self.built() {
            Ok(())
        } else {
            Err(self.not_built(flag, value))
        }
    }

    /// The error for `flag value`, which selects this backend, in a build without it:
    /// `--flag value: this infera was built without X support (Cargo feature "x"); rebuild with
    /// --features x`.
    pub fn not_built(self, flag: &'static str, value: &str) -> ConfigError {
        let feature = self.feature();
        ConfigError::new(
            flag,
            format!(
                "{value}: this infera was built without {} support (Cargo feature \
                 \"{feature}\"); rebuild with --features {feature}",
                self.name()
            ),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_backend_compiled_out_is_one_line_naming_the_flag_and_the_feature() {
        let error = Backend::Kubernetes.not_built("--discovery-backend", "kubernetes");
        assert_eq!(
            error.to_string(),
            "--discovery-backend kubernetes: this infera was built without Kubernetes support \
             (Cargo feature \"kubernetes\"); rebuild with --features kubernetes"
        );
        let error = Backend::Sql.not_built("--event-log", "sqlite");
        assert_eq!(error.flag, "--event-log");
        assert!(error.reason.contains("--features sql"), "{error}");
    }

    #[test]
    fn require_refuses_exactly_the_backends_this_build_lacks() {
        let all = [
            (Backend::Etcd, cfg!(feature = "etcd")),
            (Backend::Kubernetes, cfg!(feature = "kubernetes")),
            (Backend::Nats, cfg!(feature = "nats")),
            (Backend::Zmq, cfg!(feature = "zmq")),
            (Backend::Sql, cfg!(feature = "sql")),
        ];
        for (backend, in_this_build) in all {
            let required = backend.require("--flag", backend.feature());
            assert_eq!(required.is_ok(), in_this_build, "{backend:?}: {required:?}");
            if let Err(error) = required {
                assert!(error.reason.contains(backend.feature()), "{error}");
            }
        }
    }
}
