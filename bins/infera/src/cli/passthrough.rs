//! Splitting a worker's command line between Infera's flags and the engine's.
//!
//! The split is driven by the clap [`Command`] of the engine's subcommand itself: every long
//! name, alias and short name of its arguments, and whether each takes a value. Rules, applied
//! left to right:
//! - `--` ends Infera's flags: everything after it goes to the engine, `--` itself does not.
//! - An Infera flag (`--name`, `--name=value`, `-h`) goes to Infera; if it takes a value and
//!   none is attached, the next token is its value whatever it looks like, and the pair is
//!   rewritten as `--name=value` so clap reads a value starting with `-` as a value.
//! - Anything else goes to the engine, in order. An engine flag listed in
//!   [`EngineKind::value_flags`] keeps the next token as its value even if that token looks
//!   like an Infera flag; an unknown engine flag keeps a following plain token (it is
//!   forwarded next anyway), but a following Infera flag is read as Infera's. Pass such values
//!   as `--engine-flag=value`, or after `--`, to remove any doubt.

use crate::config::worker::EngineKind;
use clap::Command;
use clap::error::ErrorKind;
use std::collections::HashMap;
use std::ffi::OsString;

/// A worker command line, split.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Split {
    /// Infera's arguments, for clap.
    pub ours: Vec<OsString>,
    /// The engine's arguments, in their original order.
    pub engine: Vec<String>,
}

/// Infera's flags of one subcommand: name → whether it takes a value.
#[derive(Debug, Default)]
struct OurFlags {
    long: HashMap<String, bool>,
    short: HashMap<char, bool>,
}

impl OurFlags {
    fn of(command: &Command) -> Self {
        let mut flags = Self::default();
        for arg in command.get_arguments().filter(|arg| !arg.is_positional()) {
            let takes_value = arg.get_action().takes_values();
            let longs = arg
                .get_long()
                .into_iter()
                .chain(arg.get_all_aliases().unwrap_or_default());
            for long in longs {
                flags.long.insert(long.to_owned(), takes_value);
            }
            let shorts = arg
                .get_short()
                .into_iter()
                .chain(arg.get_all_short_aliases().unwrap_or_default());
            for short in shorts {
                flags.short.insert(short, takes_value);
            }
        }
        flags
    }

    /// For an Infera flag token: its name as written (`--name` or `-c`) and whether it takes a
    /// value; `None` for anything else.
    fn lookup<'t>(&self, token: &'t str) -> Option<(&'t str, bool)> {
        if let Some(body) = token.strip_prefix("--") {
            let name = body.split_once('=').map_or(body, |(name, _)| name);
            let takes_value = *self.long.get(name)?;
            return Some((&token[..2 + name.len()], takes_value));
        }
        let mut chars = token.strip_prefix('-')?.chars();
        let short = chars.next()?;
        let rest = chars.as_str();
        if rest.is_empty() || rest.starts_with('=') {
            let takes_value = *self.short.get(&short)?;
            return Some((&token[..2], takes_value));
        }
        None
    }
}

/// Splits `args` (the tokens after `infera worker <engine>`) between Infera's flags, as
/// defined by `command`, and the engine's.
///
/// # Errors
/// A clap error (exit code 2) if a token is not valid UTF-8.
pub fn split(
    command: &Command,
    engine: EngineKind,
    args: &[OsString],
) -> Result<Split, clap::Error> {
    let tokens = args
        .iter()
        .map(|token| {
            token.to_str().ok_or_else(|| {
                command.clone().error(
                    ErrorKind::InvalidUtf8,
                    format!("argument {token:?} is not valid UTF-8"),
                )
            })
        })
        .collect::<Result<Vec<&str>, _>>()?;
    let ours = OurFlags::of(command);
    let engine_value_flags = engine.value_flags();
    let mut split = Split::default();
    let mut index = 0;
    while let Some(&token) = tokens.get(index) {
        index += 1;
        if token == "--" {
            split
                .engine
                .extend(tokens[index..].iter().map(|&t| t.to_owned()));
            break;
        }
        if let Some((name, takes_value)) = ours.lookup(token) {
            let attached = token.len() > name.len();
            match tokens.get(index) {
                Some(value) if takes_value && !attached => {
                    split.ours.push(format!("{name}={value}").into());
                    index += 1;
                }
                _ => split.ours.push(token.into()),
            }
            continue;
        }
        split.engine.push(token.to_owned());
        if engine_value_flags.contains(&token)
            && let Some(&value) = tokens.get(index)
        {
            split.engine.push(value.to_owned());
            index += 1;
        }
    }
    Ok(split)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::Cli;
    use clap::CommandFactory;

    fn split_for(engine: &str, argv: &[&str]) -> Split {
        let mut command = Cli::command();
        command.build();
        let subcommand = command
            .find_subcommand("worker")
            .and_then(|worker| worker.find_subcommand(engine))
            .unwrap();
        let kind = crate::cli::worker::WorkerCommand::forwarding_engine(engine).unwrap();
        let args: Vec<OsString> = argv.iter().map(OsString::from).collect();
        split(subcommand, kind, &args).unwrap()
    }

    fn ours(split: &Split) -> Vec<&str> {
        split
            .ours
            .iter()
            .map(|token| token.to_str().unwrap())
            .collect()
    }

    #[test]
    fn infera_flags_are_taken_and_the_rest_forwarded_in_order() {
        let split = split_for(
            "vllm",
            &[
                "--model-path",
                "m",
                "--tensor-parallel-size",
                "2",
                "--port",
                "8001",
                "--enable-prefix-caching",
                "--kv-transfer-config",
                r#"{"kv_role":"kv_producer"}"#,
                "--no-enable-kv-events",
            ],
        );
        assert_eq!(
            ours(&split),
            ["--model-path=m", "--port=8001", "--no-enable-kv-events"]
        );
        assert_eq!(
            split.engine,
            [
                "--tensor-parallel-size",
                "2",
                "--enable-prefix-caching",
                "--kv-transfer-config",
                r#"{"kv_role":"kv_producer"}"#,
            ]
        );
    }

    #[test]
    fn equals_forms_stay_whole() {
        let split = split_for(
            "sglang",
            &["--model=m", "--page-size=16", "--host=::", "--tp-size=2"],
        );
        assert_eq!(ours(&split), ["--model=m", "--host=::"]);
        assert_eq!(split.engine, ["--page-size=16", "--tp-size=2"]);
    }

    #[test]
    fn a_known_engine_flag_keeps_a_value_that_looks_like_ours() {
        let split = split_for("vllm", &["--served-model-name", "--port", "--model", "m"]);
        assert_eq!(split.engine, ["--served-model-name", "--port"]);
        assert_eq!(ours(&split), ["--model=m"]);
    }

    #[test]
    fn our_value_is_taken_even_if_it_looks_like_a_flag() {
        let split = split_for("vllm", &["--advertise-host", "-weird", "--seed", "-1"]);
        assert_eq!(ours(&split), ["--advertise-host=-weird"]);
        assert_eq!(split.engine, ["--seed", "-1"]);
    }

    #[test]
    fn double_dash_forwards_everything_after_it() {
        let split = split_for(
            "atom",
            &["--model", "m", "--", "--model", "x", "--host", "h"],
        );
        assert_eq!(ours(&split), ["--model=m"]);
        assert_eq!(split.engine, ["--model", "x", "--host", "h"]);
    }

    #[test]
    fn atom_port_is_the_engines_and_server_port_is_ours() {
        let split = split_for(
            "atom",
            &["--port", "29500", "--server-port", "8001", "-tp", "8"],
        );
        assert_eq!(ours(&split), ["--server-port=8001"]);
        assert_eq!(split.engine, ["--port", "29500", "-tp", "8"]);
    }

    #[test]
    fn help_is_ours() {
        assert_eq!(ours(&split_for("vllm", &["-h"])), ["-h"]);
        assert_eq!(ours(&split_for("vllm", &["--help"])), ["--help"]);
    }

    #[test]
    fn multi_value_engine_flags_keep_their_values_in_order() {
        let split = split_for(
            "sglang",
            &["--cuda-graph-bs", "1", "2", "4", "--model-path", "m"],
        );
        assert_eq!(split.engine, ["--cuda-graph-bs", "1", "2", "4"]);
        assert_eq!(ours(&split), ["--model-path=m"]);
    }

    #[test]
    fn a_missing_value_is_left_for_clap_to_report() {
        let split = split_for("vllm", &["--model"]);
        assert_eq!(ours(&split), ["--model"]);
    }
}
