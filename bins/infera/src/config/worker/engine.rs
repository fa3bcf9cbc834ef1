//! [`EngineKind`], the one place that knows each engine's spelling of its flags, and the
//! readers of forwarded engine arguments that use it.

use crate::config::{DiscoveryBackend, RequestTransport};
use serde::{Deserialize, Serialize};
use std::fmt;

/// The engine a worker runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EngineKind {
    /// vLLM (`vllm serve`).
    Vllm,
    /// SGLang (`python3 -m sglang.launch_server`).
    Sglang,
    /// AMD ATOM (`python3 -m atom.entrypoints.openai_server`).
    Atom,
    /// Infera's GPU-free simulated engine, run in process.
    Mock,
}

impl EngineKind {
    /// The engine's own spelling of the model flag; the other spelling is accepted as an alias.
    pub fn model_flag(self) -> &'static str {
        match self {
            Self::Vllm | Self::Atom => "--model",
            Self::Sglang | Self::Mock => "--model-path",
        }
    }

    /// The alternative spelling of the model flag.
    pub fn model_alias(self) -> &'static str {
        match self {
            Self::Vllm | Self::Atom => "--model-path",
            Self::Sglang | Self::Mock => "--model",
        }
    }

    /// The engine's spelling of its HTTP port flag. ATOM's own `--port` is the internal
    /// torch-distributed port, so for ATOM `--port` is forwarded, not read as the HTTP port.
    pub fn port_flag(self) -> &'static str {
        match self {
            Self::Atom => "--server-port",
            Self::Vllm | Self::Sglang | Self::Mock => "--port",
        }
    }

    /// The alternative spelling of the HTTP port flag, where it does not clash with the engine.
    pub fn port_alias(self) -> Option<&'static str> {
        match self {
            Self::Atom => None,
            Self::Vllm | Self::Sglang | Self::Mock => Some("--server-port"),
        }
    }

    /// The HTTP port the engine uses when none is given.
    pub fn default_port(self) -> u16 {
        match self {
            Self::Sglang => 30000,
            Self::Vllm | Self::Atom | Self::Mock => 8000,
        }
    }

    /// How the worker registers without `--discovery-backend`: ATOM's launcher always
    /// registers in etcd; the others default to the worker Pod's annotation.
    pub fn default_discovery_backend(self) -> DiscoveryBackend {
        match self {
            Self::Atom => DiscoveryBackend::Etcd,
            Self::Vllm | Self::Sglang | Self::Mock => DiscoveryBackend::Kubernetes,
        }
    }

    /// How the router reaches the worker without `--request-transport`: ATOM's launcher
    /// registers the default of the worker record, HTTP; the others default to NATS.
    pub fn default_request_transport(self) -> RequestTransport {
        match self {
            Self::Atom => RequestTransport::Http,
            Self::Vllm | Self::Sglang | Self::Mock => RequestTransport::Nats,
        }
    }

    /// Whether KV events are published without `--enable-kv-events` / `--no-enable-kv-events`:
    /// off for ATOM (it has no native event stream; its launcher publishes only when asked).
    pub fn default_kv_events(self) -> bool {
        !matches!(self, Self::Atom)
    }

    /// The engine's long flags, where its own parser reads an unambiguous prefix of one as that
    /// flag (SGLang's argparse); `None` where only exact spellings count (the Python launchers
    /// read vLLM and ATOM arguments with `allow_abbrev=False`).
    pub fn abbreviable_flags(self) -> Option<&'static [&'static str]> {
        match self {
            Self::Sglang => Some(crate::worker::sglang_flags::FLAGS),
            Self::Vllm | Self::Atom | Self::Mock => None,
        }
    }

    /// The command that starts the engine (before its arguments); `None` for the mock.
    pub fn default_command(self) -> Option<&'static str> {
        match self {
            Self::Vllm => Some("vllm serve"),
            Self::Sglang => Some("python3 -m sglang.launch_server"),
            Self::Atom => Some("python3 -m atom.entrypoints.openai_server"),
            Self::Mock => None,
        }
    }

    /// Spellings of the engine's KV block size flag.
    pub fn block_size_flags(self) -> &'static [&'static str] {
        match self {
            Self::Vllm | Self::Atom => &["--block-size"],
            Self::Sglang => &["--page-size"],
            Self::Mock => &[],
        }
    }

    /// Spellings of the engine's tensor-parallel size flag.
    pub fn tensor_parallel_flags(self) -> &'static [&'static str] {
        match self {
            Self::Vllm | Self::Atom => &["--tensor-parallel-size", "-tp"],
            Self::Sglang => &["--tp-size", "--tensor-parallel-size"],
            Self::Mock => &[],
        }
    }

    /// Spellings of the engine's data-parallel size flag.
    pub fn data_parallel_flags(self) -> &'static [&'static str] {
        match self {
            Self::Vllm | Self::Atom => &["--data-parallel-size", "-dp"],
            Self::Sglang => &["--dp-size", "--data-parallel-size"],
            Self::Mock => &[],
        }
    }

    /// Engine flags known to take a value. When splitting the command line, the token after
    /// one of these always stays with it, even if it looks like one of Infera's flags; an
    /// unknown engine flag keeps the next token only if that is not an Infera flag.
    pub fn value_flags(self) -> &'static [&'static str] {
        match self {
            Self::Vllm => &[
                "--block-size",
                "--tensor-parallel-size",
                "-tp",
                "--data-parallel-size",
                "-dp",
                "--pipeline-parallel-size",
                "-pp",
                "--data-parallel-rank",
                "--kv-transfer-config",
                "--kv-events-config",
                "--served-model-name",
                "--tokenizer",
                "--chat-template",
                "--seed",
                "--max-model-len",
                "--gpu-memory-utilization",
                "--kv-cache-dtype",
                "--dtype",
                "--quantization",
                "--max-num-seqs",
                "--max-num-batched-tokens",
            ],
            Self::Sglang => &[
                "--page-size",
                "--tp-size",
                "--tensor-parallel-size",
                "--dp-size",
                "--data-parallel-size",
                "--disaggregation-mode",
                "--disaggregation-bootstrap-port",
                "--disaggregation-transfer-backend",
                "--kv-events-config",
                "--served-model-name",
                "--tokenizer-path",
                "--chat-template",
                "--random-seed",
                "--context-length",
                "--mem-fraction-static",
                "--kv-cache-dtype",
                "--dtype",
                "--quantization",
                "--attention-backend",
                "--speculative-algorithm",
            ],
            Self::Atom => &[
                "--block-size",
                "--tensor-parallel-size",
                "-tp",
                "--data-parallel-size",
                "-dp",
                "--kv-transfer-config",
                "--port",
                "--kv_cache_dtype",
                "--max-model-len",
                "--gpu-memory-utilization",
            ],
            Self::Mock => &[],
        }
    }
}

impl fmt::Display for EngineKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Vllm => "vllm",
            Self::Sglang => "sglang",
            Self::Atom => "atom",
            Self::Mock => "mock",
        })
    }
}

/// The last value given to any spelling in `flags` (`--flag V` or `--flag=V`) among forwarded
/// engine arguments, with the spelling that gave it. A flag with no value after it (the last
/// token) gives none. Exact spellings only; see [`engine_flag_value`] for reading arguments as
/// the engine does.
pub(crate) fn last_flag_value<'a, 'f>(
    args: &'a [String],
    flags: &[&'f str],
) -> Option<(&'f str, &'a str)> {
    flag_value_as(args, flags, None)
}

/// [`last_flag_value`] as `engine`'s own parser reads its arguments: for SGLang a token that is
/// an unambiguous prefix of one of its long flags (argparse's `allow_abbrev`, judged among all
/// of SGLang's flags: see [`crate::worker::sglang_flags`]) counts as that flag, so `--dp 8` and
/// `--dp=8` give `--dp-size` 8, while an ambiguous prefix gives nothing (SGLang refuses it). A
/// token that is exactly one of the engine's other flags is that flag, never a prefix of ours.
pub(crate) fn engine_flag_value<'a, 'f>(
    engine: EngineKind,
    args: &'a [String],
    flags: &[&'f str],
) -> Option<(&'f str, &'a str)> {
    flag_value_as(args, flags, engine.abbreviable_flags())
}

/// Whether `engine`'s parser reads any of `args` as one of `flags` (as [`engine_flag_value`],
/// for flags that take no value too).
pub(crate) fn engine_flag_given(engine: EngineKind, args: &[String], flags: &[&str]) -> bool {
    let known = engine.abbreviable_flags();
    args.iter()
        .any(|token| spelled(token, flags, known).is_some())
}

/// The flag of `flags` that `token` names, with the value it carries after `=`.
fn spelled<'t, 'f>(
    token: &'t str,
    flags: &[&'f str],
    abbreviable: Option<&'static [&'static str]>,
) -> Option<(&'f str, Option<&'t str>)> {
    let (name, inline) = match token.split_once('=') {
        Some((name, value)) => (name, Some(value)),
        None => (token, None),
    };
    if let Some(&flag) = flags.iter().find(|flag| **flag == name) {
        return Some((flag, inline));
    }
    let full = crate::worker::sglang_flags::resolve(abbreviable?, name)?;
    flags
        .iter()
        .find(|flag| **flag == full)
        .map(|&flag| (flag, inline))
}

fn flag_value_as<'a, 'f>(
    args: &'a [String],
    flags: &[&'f str],
    abbreviable: Option<&'static [&'static str]>,
) -> Option<(&'f str, &'a str)> {
    let mut found = None;
    let mut tokens = args.iter().peekable();
    while let Some(token) = tokens.next() {
        match spelled(token, flags, abbreviable) {
            Some((flag, Some(value))) => found = Some((flag, value)),
            Some((flag, None)) => {
                if let Some(value) = tokens.peek() {
                    found = Some((flag, value.as_str()));
                }
            }
            None => {}
        }
    }
    found
}
