//! [`GaieConfig`]: the validated configuration of `infera gaie`.
//!
//! Built only by `TryFrom<GaieArgs>`, which checks the tokenizer path (as `infera server` does),
//! discovery (kubernetes needs a label selector, as the Python picker requires; etcd an
//! endpoint), the KV-event transport, the routing weights (finite, ≥ 0), and resolves
//! `--secure-serving` / `--no-secure-serving` over `INFERA_EPP_SECURE`.

use crate::cli::gaie::GaieArgs;
use crate::config::server::tokenizer;
use crate::config::{ConfigError, DiscoveryConfig, KvEventTransport};
use infera_core::policy::PolicyKind;
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

/// The gRPC side: where the gateway and the probes connect.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GrpcConfig {
    /// Bind address.
    pub host: String,
    /// The ext_proc port (with the health service).
    pub grpc_port: u16,
    /// A separate plaintext health port; `None` when 0 or the ext_proc port.
    pub grpc_health_port: Option<u16>,
    /// The port of `x-gateway-destination-endpoint`.
    pub destination_port: u16,
    /// Whether the ext_proc port serves TLS (self-signed).
    pub secure_serving: bool,
}

/// Routing: tokenizer, policy and its weights.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GaieRouterConfig {
    /// `--router-tokenizer-path` as given.
    pub tokenizer_path: PathBuf,
    /// The tokenizer.json file it resolved to (checked readable, not yet loaded).
    pub tokenizer_file: PathBuf,
    /// The policy.
    pub policy: PolicyKind,
    /// Weight of blocks to prefill against load.
    pub kv_overlap_weight: f64,
    /// Prefill-role weight in PD mode; `None` uses `kv_overlap_weight`.
    pub kv_prefill_overlap_weight: Option<f64>,
    /// Decode-role weight in PD mode; `None` uses `kv_overlap_weight`.
    pub kv_decode_overlap_weight: Option<f64>,
    /// The balance charge of `--router-profile`.
    #[serde(default)]
    pub balance_tokens: u32,
}

/// The validated configuration of `infera gaie`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GaieConfig {
    /// The gRPC ports.
    pub grpc: GrpcConfig,
    /// Routing.
    pub router: GaieRouterConfig,
    /// Worker discovery.
    pub discovery: DiscoveryConfig,
    /// How KV events reach the picker.
    pub kv_event_transport: KvEventTransport,
    /// NATS broker URL (for `nats` KV events).
    pub nats_server: String,
}

impl TryFrom<GaieArgs> for GaieConfig {
    type Error = ConfigError;

    fn try_from(args: GaieArgs) -> Result<Self, ConfigError> {
        let env = |key: &str| std::env::var(key).ok();
        Self::from_args(args, &env)
    }
}

impl GaieConfig {
    /// Validates `args`, reading `INFERA_EPP_SECURE` through `env`.
    fn from_args(
        args: GaieArgs,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<Self, ConfigError> {
        let (tokenizer_path, tokenizer_file) = tokenizer(args.router_tokenizer_path)?;
        let discovery = args.discovery.for_router()?;
        args.kv_event_transport.require_built()?;
        let balance_tokens = args.weights.router_profile.balance_tokens();
        let (kv_overlap_weight, kv_prefill_overlap_weight, kv_decode_overlap_weight) =
            args.weights.validated()?;
        let secure_serving = if args.secure_serving {
            true
        } else if args.no_secure_serving {
            false
        } else {
            env("INFERA_EPP_SECURE").is_none_or(|v| !v.eq_ignore_ascii_case("false"))
        };
        Ok(Self {
            grpc: GrpcConfig {
                host: args.host,
                grpc_port: args.grpc_port,
                grpc_health_port: Some(args.grpc_health_port)
                    .filter(|&p| p != 0 && p != args.grpc_port),
                destination_port: args.destination_port,
                secure_serving,
            },
            router: GaieRouterConfig {
                tokenizer_path,
                tokenizer_file,
                policy: args.router_policy,
                kv_overlap_weight,
                kv_prefill_overlap_weight,
                kv_decode_overlap_weight,
                balance_tokens,
            },
            discovery,
            kv_event_transport: args.kv_event_transport,
            nats_server: args.nats_server,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::{Command, parse_from};

    fn args(extra: &[&str]) -> GaieArgs {
        let tokenizer = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../fixtures/tokenizers/deepseek-v4"
        );
        let mut argv = vec!["infera", "gaie", "--router-tokenizer-path", tokenizer];
        argv.extend_from_slice(extra);
        match parse_from(argv).unwrap().command {
            Command::Gaie(args) => args,
            other => panic!("not gaie: {other:?}"),
        }
    }

    #[test]
    fn secure_serving_is_on_unless_turned_off_by_flag_or_environment() {
        let selector = ["--k8s-label-selector", "app=w"];
        let secure = |extra: &[&str], value: Option<&str>| {
            let mut all = selector.to_vec();
            all.extend_from_slice(extra);
            let env = move |key: &str| (key == "INFERA_EPP_SECURE").then_some(value).flatten();
            let env = move |key: &str| env(key).map(str::to_owned);
            GaieConfig::from_args(args(&all), &env)
                .unwrap()
                .grpc
                .secure_serving
        };
        assert!(secure(&[], None));
        assert!(secure(&[], Some("TRUE")));
        assert!(
            secure(&[], Some("0")),
            "only \"false\" turns it off, as in the Python"
        );
        assert!(!secure(&[], Some("False")));
        assert!(!secure(&["--no-secure-serving"], None));
        assert!(secure(&["--secure-serving"], Some("false")));
        assert!(secure(&["--no-secure-serving", "--secure-serving"], None));
    }

    #[test]
    fn kubernetes_discovery_needs_a_label_selector() {
        let error = GaieConfig::from_args(args(&[]), &|_| None).unwrap_err();
        assert_eq!(error.flag, "--k8s-label-selector");
        let config = GaieConfig::from_args(
            args(&[
                "--discovery-backend",
                "etcd",
                "--etcd-endpoint",
                "127.0.0.1:2379",
            ]),
            &|_| None,
        )
        .unwrap();
        assert!(matches!(config.discovery, DiscoveryConfig::Etcd { .. }));
        assert_eq!(config.grpc.grpc_health_port, Some(9003));
    }
}
