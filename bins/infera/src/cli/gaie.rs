//! Flags of `infera gaie` (the Python Infera's `python -m infera.gaie`): the Gateway API
//! Inference Extension's endpoint picker. The names, defaults and environment fallbacks are the
//! Python's; the discovery, policy and KV flags mean what they mean on `infera server`.
//!
//! Only the shape of the command line lives here; `TryFrom<GaieArgs> for GaieConfig` checks the
//! rest.

use crate::config::KvEventTransport;
use clap::Args;
use infera_core::policy::PolicyKind;
use std::path::PathBuf;

const ROUTING: &str = "Routing";

/// Arguments of `infera gaie`.
#[derive(Debug, Clone, Args)]
#[command(
    after_help = "Environment: INFERA_EPP_GRPC_PORT, INFERA_EPP_GRPC_HEALTH_PORT, \
    INFERA_EPP_DEST_PORT, INFERA_EPP_SECURE (anything but \"false\" serves TLS), \
    INFERA_K8S_LABEL_SELECTOR, NATS_SERVER."
)]
pub struct GaieArgs {
    /// Bind address of the ext_proc and health gRPC ports.
    #[arg(long, default_value = "0.0.0.0")]
    pub host: String,

    /// ext_proc gRPC port the gateway connects to (the gRPC health service answers here too).
    #[arg(
        long,
        env = "INFERA_EPP_GRPC_PORT",
        default_value_t = 9002,
        value_name = "PORT"
    )]
    pub grpc_port: u16,

    /// gRPC health-check port, plaintext (grpc.health.v1, service `inference-extension`),
    /// probed by the Kubernetes readiness/liveness gRPC probe; 0 or the --grpc-port serves no
    /// separate one.
    #[arg(
        long,
        env = "INFERA_EPP_GRPC_HEALTH_PORT",
        default_value_t = 9003,
        value_name = "PORT"
    )]
    pub grpc_health_port: u16,

    /// Port of the gateway-routable worker endpoint (the worker Pod's direct-mode frontend,
    /// the InferencePool's target port): the picker answers <pod-ip>:<this> in
    /// x-gateway-destination-endpoint, not the engine port of the worker's registered URL.
    #[arg(
        long,
        env = "INFERA_EPP_DEST_PORT",
        default_value_t = 8000,
        value_name = "PORT"
    )]
    pub destination_port: u16,

    /// Serve the ext_proc port over TLS with an in-memory self-signed certificate (gateways
    /// connect to the endpoint picker over TLS without verifying it). [default: on, unless
    /// INFERA_EPP_SECURE=false]
    #[arg(long, overrides_with = "no_secure_serving")]
    pub secure_serving: bool,

    /// Serve the ext_proc port in plaintext.
    #[arg(long, overrides_with = "secure_serving")]
    pub no_secure_serving: bool,

    #[command(flatten)]
    pub discovery: super::DiscoveryArgs,

    /// Routing policy.
    #[arg(long, value_parser = super::policy_parser(), default_value_t, help_heading = ROUTING)]
    pub router_policy: PolicyKind,

    /// How KV-cache events reach the picker.
    #[arg(long, value_enum, default_value = "nats", help_heading = ROUTING)]
    pub kv_event_transport: KvEventTransport,

    /// NATS broker URL, for --kv-event-transport nats.
    #[arg(
        long,
        env = "NATS_SERVER",
        default_value = "nats://127.0.0.1:4222",
        value_name = "URL",
        help_heading = ROUTING
    )]
    pub nats_server: String,

    /// Tokenizer for prefix hashing (required): a directory containing tokenizer.json, a
    /// tokenizer.json file, or a Hugging Face model id, from the local Hugging Face cache or
    /// downloaded into it (HF_ENDPOINT, HF_TOKEN; not with HF_HUB_OFFLINE). Must match the
    /// workers' model.
    #[arg(long, value_name = "PATH", help_heading = ROUTING)]
    pub router_tokenizer_path: Option<PathBuf>,

    #[command(flatten)]
    pub weights: super::OverlapWeightArgs,

    /// Validate, print the resolved configuration as JSON on stdout and exit.
    #[arg(long)]
    pub check_config: bool,
}
