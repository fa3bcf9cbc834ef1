//! The inventory flags: `--kv-events-endpoint` (default `tcp://*:5590`, `off` to disable) and
//! `--kv-events-replay-endpoint` (default: the events endpoint's host and port + 1, or port 0
//! when the events port is 0; `off` for none). Both must be `tcp://HOST:PORT`, the only
//! endpoints a router subscribes to (`infera_core::kv_events::kvd::link_of`).
//! `--kv-events-advertise-host` names the host advertised in their place (a Pod's node).

use super::*;
use crate::wiring::Backend;

/// Where kvd publishes its inventory as KV events (PROTOCOLS.md §6, "Inventory events").
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KvEventsConfig {
    /// The PUB endpoint to bind (port 0: a free port, advertised as bound).
    pub endpoint: String,
    /// The ROUTER replay endpoint to bind; `None`: no replay socket.
    pub replay_endpoint: Option<String>,
    /// `--kv-events-advertise-host`: the host advertised in place of the bound one.
    #[serde(default)]
    pub advertise_host: Option<String>,
}

/// The value that turns either flag off.
const OFF: &str = "off";

/// Checks the inventory flags; `None` when publishing is off.
pub(super) fn kv_events(args: &KvdArgs) -> Result<Option<KvEventsConfig>, ConfigError> {
    let endpoint = args.kv_events_endpoint.trim();
    if endpoint.eq_ignore_ascii_case(OFF) {
        if args.kv_events_replay_endpoint.is_some() {
            tracing::warn!(
                "--kv-events-replay-endpoint has no effect with --kv-events-endpoint off"
            );
        }
        return Ok(None);
    }
    Backend::Zmq.require("--kv-events-endpoint", endpoint)?;
    let (host, port) = tcp("--kv-events-endpoint", endpoint)?;
    let replay_endpoint = match args.kv_events_replay_endpoint.as_deref().map(str::trim) {
        Some(off) if off.eq_ignore_ascii_case(OFF) => None,
        Some(replay) => {
            let (_, replay_port) = tcp("--kv-events-replay-endpoint", replay)?;
            if port != 0 && replay_port == port {
                return Err(ConfigError::new(
                    "--kv-events-replay-endpoint",
                    format!("{replay} is the events endpoint's port; choose another, or off"),
                ));
            }
            Some(replay.to_owned())
        }
        None if port == 0 => Some(format!("tcp://{host}:0")),
        None => match port.checked_add(1) {
            Some(next) => Some(format!("tcp://{host}:{next}")),
            None => {
                return Err(ConfigError::new(
                    "--kv-events-replay-endpoint",
                    format!(
                        "has no default for --kv-events-endpoint {endpoint} (port + 1 is past \
                         65535); give one, or off"
                    ),
                ));
            }
        },
    };
    let advertise_host = match args.kv_events_advertise_host.as_deref().map(str::trim) {
        Some(h) if h.is_empty() || h.contains([':', '/']) && !h.starts_with('[') => {
            return Err(ConfigError::new(
                "--kv-events-advertise-host",
                format!("{h:?}: expected a host name or address, without scheme or port"),
            ));
        }
        other => other.map(str::to_owned),
    };
    Ok(Some(KvEventsConfig {
        endpoint: endpoint.to_owned(),
        replay_endpoint,
        advertise_host,
    }))
}

/// `tcp://HOST:PORT` split into its host and port.
fn tcp<'a>(flag: &'static str, endpoint: &'a str) -> Result<(&'a str, u16), ConfigError> {
    let bad = || {
        ConfigError::new(
            flag,
            format!(
                "{endpoint}: expected tcp://HOST:PORT (e.g. tcp://*:5590, or tcp://127.0.0.1:0 \
                 for a free port), or off"
            ),
        )
    };
    let rest = endpoint.strip_prefix("tcp://").ok_or_else(bad)?;
    let (host, port) = rest.rsplit_once(':').ok_or_else(bad)?;
    if host.is_empty() {
        return Err(bad());
    }
    Ok((host, port.parse().map_err(|_| bad())?))
}

#[cfg(test)]
mod tests {
    use crate::cli::{Cli, Command};
    use crate::config::kvd::{KvEventsConfig, KvdConfig};
    use clap::Parser;

    fn parse(extra: &[&str]) -> Result<Option<KvEventsConfig>, String> {
        let mut argv = vec!["infera", "kvd"];
        argv.extend_from_slice(extra);
        match Cli::try_parse_from(argv)
            .map_err(|e| e.to_string())?
            .command
        {
            Command::Kvd(args) => KvdConfig::try_from(args)
                .map(|c| c.kv_events)
                .map_err(|e| e.to_string()),
            other => panic!("parsed as {other:?}"),
        }
    }

    fn events(endpoint: &str, replay: Option<&str>) -> Option<KvEventsConfig> {
        Some(KvEventsConfig {
            endpoint: endpoint.to_owned(),
            replay_endpoint: replay.map(str::to_owned),
            advertise_host: None,
        })
    }

    #[test]
    fn the_advertised_host_is_a_bare_host() {
        let got = parse(&["--kv-events-advertise-host", "10.1.2.3"]).unwrap();
        assert_eq!(got.unwrap().advertise_host.as_deref(), Some("10.1.2.3"));
        let err = parse(&["--kv-events-advertise-host", "tcp://10.1.2.3:1"]).unwrap_err();
        assert!(err.contains("--kv-events-advertise-host"), "{err}");
    }

    #[test]
    fn the_default_publishes_on_5590_with_replay_on_the_next_port() {
        assert_eq!(parse(&[]), Ok(events("tcp://*:5590", Some("tcp://*:5591"))));
        assert_eq!(
            parse(&["--kv-events-endpoint", "tcp://10.0.0.7:6000"]),
            Ok(events("tcp://10.0.0.7:6000", Some("tcp://10.0.0.7:6001")))
        );
    }

    #[test]
    fn port_zero_asks_for_free_ports_and_off_turns_either_off() {
        assert_eq!(
            parse(&["--kv-events-endpoint", "tcp://127.0.0.1:0"]),
            Ok(events("tcp://127.0.0.1:0", Some("tcp://127.0.0.1:0")))
        );
        assert_eq!(parse(&["--kv-events-endpoint", "off"]), Ok(None));
        assert_eq!(
            parse(&["--kv-events-replay-endpoint", "OFF"]),
            Ok(events("tcp://*:5590", None))
        );
        assert_eq!(
            parse(&["--kv-events-replay-endpoint", "tcp://*:7000"]),
            Ok(events("tcp://*:5590", Some("tcp://*:7000")))
        );
    }

    #[test]
    fn endpoints_that_cannot_work_are_refused_naming_the_flag() {
        for (args, flag) in [
            (
                &["--kv-events-endpoint", "ipc:///tmp/kvd"][..],
                "--kv-events-endpoint",
            ),
            (
                &["--kv-events-endpoint", "tcp://:5590"],
                "--kv-events-endpoint",
            ),
            (
                &["--kv-events-endpoint", "tcp://*:http"],
                "--kv-events-endpoint",
            ),
            (
                &["--kv-events-endpoint", "tcp://*:65535"],
                "--kv-events-replay-endpoint",
            ),
            (
                &["--kv-events-replay-endpoint", "tcp://*:5590"],
                "--kv-events-replay-endpoint",
            ),
            (
                &["--kv-events-replay-endpoint", "5591"],
                "--kv-events-replay-endpoint",
            ),
        ] {
            let error = parse(args).unwrap_err();
            assert!(error.starts_with(flag), "{args:?}: {error}");
        }
    }
}
