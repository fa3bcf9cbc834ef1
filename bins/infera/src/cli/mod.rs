//! The `infera` command line: the clap definitions of every subcommand and [`parse_from`].
//!
//! `infera worker vllm|sglang|atom` cannot be parsed by clap alone, because unknown arguments
//! belong to the engine and may be interleaved with Infera's. [`parse_from`] first splits such
//! a command line with [`passthrough::split`], which reads the subcommand's own clap
//! definition, then parses Infera's part with clap and stores the engine's part in the parsed
//! arguments. Every other command line is parsed by clap directly.

pub mod bench;
pub mod gaie;
pub mod kvd;
pub mod passthrough;
pub mod replay;
pub mod server;
pub mod synth;
pub mod trace;
pub mod worker;

use crate::config::DiscoveryBackend;
use crate::up_cmd;
use clap::{Args, CommandFactory, Parser, Subcommand};
use infera_core::policy::{POLICIES, PolicyKind};
use std::ffi::OsString;

/// Help heading of the discovery flags.
const DISCOVERY: &str = "Discovery";

/// Help heading of the routing flags.
const ROUTING: &str = "Routing";

/// `--router-policy`: a name registered in core's [`POLICIES`], with its help line.
pub(crate) fn policy_parser() -> impl clap::builder::TypedValueParser<Value = PolicyKind> {
    use clap::builder::{PossibleValue, PossibleValuesParser, TypedValueParser as _};
    PossibleValuesParser::new(
        POLICIES
            .iter()
            .map(|p| PossibleValue::new(p.name).help(p.about)),
    )
    .try_map(|name| PolicyKind::parse(&name))
}

/// The KV-aware policy's overlap weights, shared by the server and `infera gaie`.
#[derive(Debug, Clone, Args)]
pub struct OverlapWeightArgs {
    /// Infera extension: the defaults of the router's tunables that are not given. python: the
    /// Python Infera's, --kv-overlap-weight 1.0 and no balance charge (78–90 % of the best on
    /// the conversation, Mooncake and high-load agentic traces of the routing-quality suite);
    /// infera: --kv-overlap-weight 16 and --router-balance-tokens 512, at least 98 % of each
    /// trace's own best with no worker above 1.16× the mean share (docs/benchmarks.md).
    #[arg(
        long,
        value_enum,
        env = "INFERA_ROUTER_PROFILE",
        default_value = "python",
        help_heading = ROUTING
    )]
    pub router_profile: crate::config::RouterProfile,

    /// KV-aware: cache locality vs load balance (weight of the blocks a worker would have to
    /// prefill; 0 = pure load balancing). [default: 1.0] (16 with --router-profile infera)
    #[arg(
        long,
        value_name = "WEIGHT",
        allow_negative_numbers = true,
        help_heading = ROUTING
    )]
    pub kv_overlap_weight: Option<f64>,

    /// KV-aware PD: prefill-side weight (typical 20.0); overrides the global weight.
    /// [default: unset]
    #[arg(long, value_name = "WEIGHT", allow_negative_numbers = true, help_heading = ROUTING)]
    pub kv_prefill_overlap_weight: Option<f64>,

    /// KV-aware PD: decode-side weight (typical 2.0); overrides the global weight.
    /// [default: unset]
    #[arg(long, value_name = "WEIGHT", allow_negative_numbers = true, help_heading = ROUTING)]
    pub kv_decode_overlap_weight: Option<f64>,
}

/// How the server and `infera gaie` find the workers (flattened into both; a worker's
/// launcher has its own spelling of them).
#[derive(Debug, Clone, Args)]
pub struct DiscoveryArgs {
    /// How workers are discovered.
    #[arg(long, value_enum, default_value = "kubernetes", help_heading = DISCOVERY)]
    pub discovery_backend: DiscoveryBackend,

    /// etcd endpoint(s): host:port, host (port 2379), http(s)://host:port, or a comma-separated
    /// list of members to fail over along; required for --discovery-backend etcd.
    #[arg(long, value_name = "ENDPOINT", help_heading = DISCOVERY)]
    pub etcd_endpoint: Option<String>,

    /// etcd key prefix the fleet registers under.
    #[arg(
        long,
        default_value = "/infera/workers/",
        value_name = "PREFIX",
        help_heading = DISCOVERY
    )]
    pub etcd_prefix: String,

    /// Worker-Pod label selector; required with kubernetes discovery.
    /// [default: $INFERA_K8S_LABEL_SELECTOR]
    #[arg(
        long,
        env = "INFERA_K8S_LABEL_SELECTOR",
        value_name = "SELECTOR",
        help_heading = DISCOVERY
    )]
    pub k8s_label_selector: Option<String>,

    /// Namespace to watch (kubernetes discovery). [default: the Pod's own namespace]
    #[arg(long, value_name = "NAMESPACE", help_heading = DISCOVERY)]
    pub k8s_namespace: Option<String>,
}

/// Infera: KV-aware routing control plane for LLM serving fleets.
#[derive(Debug, Parser)]
#[command(name = "infera", version, about, propagate_version = true)]
pub struct Cli {
    /// The program to run.
    #[command(subcommand)]
    pub command: Command,
}

/// The programs of the `infera` binary.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// OpenAI-compatible HTTP server and KV-aware router.
    Server(Box<server::ServerArgs>),
    /// Launch one engine and join it to the fleet.
    #[command(subcommand)]
    Worker(worker::WorkerCommand),
    /// KV-cache daemon: host RAM (L2) and NVMe (L3) tiers behind a Unix socket.
    Kvd(kvd::KvdArgs),
    /// Gateway API Inference Extension endpoint picker: an Envoy ext_proc gRPC server that
    /// picks each request's worker with the router and answers it in headers.
    Gaie(gaie::GaieArgs),
    /// Replay a recorded or public trace offline through the real router code.
    Replay(replay::ReplayArgs),
    /// Convert or inspect traces.
    Trace(trace::TraceArgs),
    /// Play a trace against a live OpenAI endpoint on its own timeline; report TTFT, ITL,
    /// throughput and the server-reported hit rate.
    Bench(bench::BenchArgs),
    /// Start a local fleet in one process: the server and N mock engines on loopback ports.
    Up(up_cmd::UpArgs),
    /// The GPU-free mock engine alone, taking a vLLM / SGLang / ATOM command line (a stand-in
    /// engine for `infera worker … --engine-cmd "infera mock-engine"`).
    MockEngine(crate::worker::mock::MockEngineArgs),
}

/// Parses a full command line (program name first).
///
/// # Errors
/// The clap error for a usage error, `--help` or `--version`; [`clap::Error::exit`] prints it
/// and exits with its code (2 for usage errors, 0 for help and version).
pub fn parse_from<I, T>(argv: I) -> Result<Cli, clap::Error>
where
    I: IntoIterator<Item = T>,
    T: Into<OsString>,
{
    let argv: Vec<OsString> = argv.into_iter().map(Into::into).collect();
    let engine = match (argv.get(1), argv.get(2)) {
        (Some(first), Some(second)) if first == "worker" => second
            .to_str()
            .and_then(worker::WorkerCommand::forwarding_engine),
        _ => None,
    };
    let Some(engine) = engine else {
        return Cli::try_parse_from(argv);
    };
    let mut command = Cli::command();
    command.build();
    let split = match command
        .find_subcommand("worker")
        .and_then(|worker| worker.find_subcommand(engine.to_string()))
    {
        Some(subcommand) => passthrough::split(subcommand, engine, &argv[3..])?,
        None => return Cli::try_parse_from(argv),
    };
    let mut cli = Cli::try_parse_from(argv[..3].iter().cloned().chain(split.ours))?;
    if let Command::Worker(worker) = &mut cli.command
        && let Some(engine_args) = worker.engine_args_mut()
    {
        *engine_args = split.engine;
    }
    Ok(cli)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_clap_definition_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn worker_engine_args_are_stored_after_parsing() {
        let cli = parse_from([
            "infera",
            "worker",
            "vllm",
            "--model",
            "m",
            "--enforce-eager",
        ])
        .unwrap();
        let Command::Worker(mut worker) = cli.command else {
            panic!("not a worker");
        };
        assert_eq!(
            worker.engine_args_mut().map(|args| args.clone()),
            Some(vec!["--enforce-eager".to_owned()])
        );
    }

    #[test]
    fn mock_rejects_unknown_flags() {
        let error = parse_from([
            "infera",
            "worker",
            "mock",
            "--model-path",
            "m",
            "--tp-size",
            "2",
        ])
        .unwrap_err();
        assert_eq!(error.kind(), clap::error::ErrorKind::UnknownArgument);
    }

    #[test]
    fn help_and_version_are_clap_errors_with_exit_code_0() {
        let error = parse_from(["infera", "worker", "sglang", "--help"]).unwrap_err();
        assert_eq!(error.kind(), clap::error::ErrorKind::DisplayHelp);
        assert_eq!(error.exit_code(), 0);
        let error = parse_from(["infera", "--version"]).unwrap_err();
        assert_eq!(error.kind(), clap::error::ErrorKind::DisplayVersion);
    }
}
