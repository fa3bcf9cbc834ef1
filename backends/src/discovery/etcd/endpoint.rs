//! etcd endpoint grammar: what `--etcd-endpoint` accepts, normalised to client URLs.
//!
//! The forms are those of the Python Infera (`_normalize_endpoint` in
//! `infera/common/discovery.py`), plus a comma-separated list of them:
//!
//! | written                   | means                       |
//! |---------------------------|-----------------------------|
//! | `host:port`               | `http://host:port`          |
//! | `host`                    | `http://host:2379`          |
//! | `http://host[:port]`      | plain text; port 80 if none |
//! | `https://host[:port]`     | TLS; port 443 if none       |
//! | `a,b,…`                   | several members, in order   |
//!
//! A host is a DNS name, an IPv4 address or a bracketed IPv6 address (`[::1]:2379`). A trailing
//! `/` after a URL is dropped (as the Python does); paths, queries, user info and other schemes
//! are refused, because a gRPC client cannot honour them.

use std::fmt;
use std::net::Ipv6Addr;
use thiserror::Error;

/// The port of a bare host, etcd's client port.
pub const DEFAULT_PORT: u16 = 2379;

/// A malformed endpoint; the message names the value and what to write instead.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("etcd endpoint {input:?}: {reason}")]
pub struct EndpointError {
    input: String,
    reason: String,
}

impl EndpointError {
    fn new(input: &str, reason: impl Into<String>) -> Self {
        Self {
            input: input.to_owned(),
            reason: reason.into(),
        }
    }
}

/// One etcd member's client URL.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct EtcdEndpoint {
    tls: bool,
    /// A name, an IPv4 address, or an IPv6 address in brackets.
    host: String,
    port: u16,
}

impl EtcdEndpoint {
    /// Parses one endpoint in any form of the module table (not a list).
    ///
    /// # Errors
    /// [`EndpointError`] naming the input and the problem.
    pub fn parse(input: &str) -> Result<Self, EndpointError> {
        let text = input.trim();
        if text.is_empty() {
            return Err(EndpointError::new(
                input,
                "is empty; expected host:port, host, or http(s)://host:port",
            ));
        }
        let lower = text.to_ascii_lowercase();
        let (tls, rest, default_port) = if lower.starts_with("http://") {
            (false, text["http://".len()..].trim_end_matches('/'), 80)
        } else if lower.starts_with("https://") {
            (true, text["https://".len()..].trim_end_matches('/'), 443)
        } else if let Some((scheme, _)) = text.split_once("://") {
            return Err(EndpointError::new(
                input,
                format!("scheme {scheme:?} is not supported; use http:// or https://"),
            ));
        } else {
            (false, text, DEFAULT_PORT)
        };
        if let Some(bad) = rest.chars().find(|c| matches!(c, '/' | '?' | '#' | '@')) {
            return Err(EndpointError::new(
                input,
                format!(
                    "contains {bad:?}: paths, queries and user info are not supported; \
                     give only scheme, host and port"
                ),
            ));
        }
        let (host, port) = split_host_port(input, rest)?;
        Ok(Self {
            tls,
            host,
            port: port.unwrap_or(default_port),
        })
    }

    /// Parses a comma-separated list of endpoints (one endpoint is a list of one).
    ///
    /// # Errors
    /// [`EndpointError`] for an empty list or entry, a malformed entry, or an entry given twice.
    pub fn parse_list(input: &str) -> Result<Vec<Self>, EndpointError> {
        if input.trim().is_empty() {
            return Self::parse(input).map(|endpoint| vec![endpoint]);
        }
        let mut endpoints: Vec<Self> = Vec::new();
        for entry in input.split(',') {
            if entry.trim().is_empty() {
                return Err(EndpointError::new(
                    input,
                    "has an empty entry; separate endpoints with single commas",
                ));
            }
            let endpoint = Self::parse(entry)?;
            if endpoints.contains(&endpoint) {
                return Err(EndpointError::new(input, format!("lists {endpoint} twice")));
            }
            endpoints.push(endpoint);
        }
        Ok(endpoints)
    }

    /// Whether the member is reached over TLS (`https://`).
    pub fn tls(&self) -> bool {
        self.tls
    }

    /// The host as written in the URL (IPv6 in brackets).
    pub fn host(&self) -> &str {
        &self.host
    }

    /// The port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The client URL, e.g. `http://127.0.0.1:2379`.
    pub fn url(&self) -> String {
        self.to_string()
    }
}

impl fmt::Display for EtcdEndpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let scheme = if self.tls { "https" } else { "http" };
        write!(f, "{scheme}://{}:{}", self.host, self.port)
    }
}

impl std::str::FromStr for EtcdEndpoint {
    type Err = EndpointError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s)
    }
}

/// Splits `host[:port]` (IPv6 in brackets) and checks both parts.
fn split_host_port(input: &str, text: &str) -> Result<(String, Option<u16>), EndpointError> {
    let (host, port) = if let Some(bracketed) = text.strip_prefix('[') {
        let (address, after) = bracketed.split_once(']').ok_or_else(|| {
            EndpointError::new(input, "has an IPv6 address without its closing ']'")
        })?;
        if address.parse::<Ipv6Addr>().is_err() {
            return Err(EndpointError::new(
                input,
                format!("[{address}] is not an IPv6 address"),
            ));
        }
        let port = match after {
            "" => None,
            _ => Some(after.strip_prefix(':').ok_or_else(|| {
                EndpointError::new(input, "expected ':port' after the IPv6 address")
            })?),
        };
        (format!("[{address}]"), port)
    } else {
        match text.matches(':').count() {
            0 => (text.to_owned(), None),
            1 => {
                let (host, port) = text.split_once(':').unwrap_or((text, ""));
                check_host(input, host)?;
                (host.to_owned(), Some(port))
            }
            _ => {
                return Err(EndpointError::new(
                    input,
                    "has several ':'; write IPv6 addresses in brackets, e.g. [::1]:2379",
                ));
            }
        }
    };
    check_host(input, &host)?;
    let port = port.map(|port| parse_port(input, port)).transpose()?;
    Ok((host, port))
}

fn check_host(input: &str, host: &str) -> Result<(), EndpointError> {
    if host.is_empty() {
        return Err(EndpointError::new(input, "has no host"));
    }
    if host.starts_with('[') {
        return Ok(());
    }
    match host
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '-' | '.' | '_')))
    {
        Some(bad) => Err(EndpointError::new(
            input,
            format!("host {host:?} contains {bad:?}; expected a DNS name or an IP address"),
        )),
        None => Ok(()),
    }
}

fn parse_port(input: &str, port: &str) -> Result<u16, EndpointError> {
    match port.parse::<u16>() {
        Ok(port) if port > 0 => Ok(port),
        _ => Err(EndpointError::new(
            input,
            format!("port {port:?} is not a number from 1 to 65535"),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn url(input: &str) -> String {
        EtcdEndpoint::parse(input)
            .unwrap_or_else(|e| panic!("{input}: {e}"))
            .url()
    }

    fn error(input: &str) -> String {
        match EtcdEndpoint::parse_list(input) {
            Ok(endpoints) => panic!("{input:?} parsed as {endpoints:?}"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn the_python_forms_mean_what_they_mean_there() {
        assert_eq!(url("127.0.0.1:2379"), "http://127.0.0.1:2379");
        assert_eq!(url("etcd-0.etcd"), "http://etcd-0.etcd:2379");
        assert_eq!(url("  etcd:12379 "), "http://etcd:12379");
        assert_eq!(url("http://etcd:2379"), "http://etcd:2379");
        assert_eq!(url("http://etcd:2379/"), "http://etcd:2379");
        assert_eq!(
            url("HTTPS://etcd.example.com:2379"),
            "https://etcd.example.com:2379"
        );
        // A URL without a port keeps the scheme's port, as httpx (the Python client) does.
        assert_eq!(url("http://etcd"), "http://etcd:80");
        assert_eq!(url("https://etcd"), "https://etcd:443");
        assert_eq!(url("[::1]:2379"), "http://[::1]:2379");
        assert_eq!(url("[fd00::5]"), "http://[fd00::5]:2379");
        assert_eq!(url("https://[::1]:2379"), "https://[::1]:2379");
        assert!(EtcdEndpoint::parse("https://e:1").expect("tls").tls());
        assert!(!EtcdEndpoint::parse("e:1").expect("plain").tls());
    }

    #[test]
    fn a_comma_separated_list_keeps_its_order() {
        let endpoints =
            EtcdEndpoint::parse_list("etcd-0:2379, https://etcd-1:2379,etcd-2").expect("list");
        let urls: Vec<_> = endpoints.iter().map(EtcdEndpoint::url).collect();
        assert_eq!(
            urls,
            [
                "http://etcd-0:2379",
                "https://etcd-1:2379",
                "http://etcd-2:2379"
            ]
        );
        assert_eq!(EtcdEndpoint::parse_list("e").expect("one").len(), 1);
    }

    #[test]
    fn malformed_values_are_refused_with_what_to_write() {
        for (input, says) in [
            ("", "is empty"),
            ("   ", "is empty"),
            ("a,,b", "empty entry"),
            ("a,", "empty entry"),
            ("a:1,http://a:1", "twice"),
            ("grpc://etcd:2379", "scheme \"grpc\" is not supported"),
            ("unix:///run/etcd.sock", "is not supported"),
            ("http://etcd:2379/v3", "paths"),
            ("http://user:pw@etcd:2379", "user info"),
            ("etcd:port", "port \"port\" is not a number"),
            ("etcd:0", "from 1 to 65535"),
            ("etcd:70000", "from 1 to 65535"),
            ("etcd:", "port \"\""),
            (":2379", "has no host"),
            ("http://", "has no host"),
            ("::1", "in brackets"),
            ("[::1", "closing ']'"),
            ("[not-v6]:1", "is not an IPv6 address"),
            ("[::1]2379", "expected ':port'"),
            ("etcd host:2379", "contains ' '"),
        ] {
            let message = error(input);
            assert!(message.contains(says), "{input:?}: {message}");
            assert!(message.starts_with("etcd endpoint "), "{message}");
        }
    }
}
