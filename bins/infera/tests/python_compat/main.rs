//! The Python Infera's documented command lines, run by this binary with `--check-config`.
//!
//! `fixtures/python-infera/command-lines.txt` holds command lines of the Python Infera's README,
//! manual, shell examples, Kubernetes manifests and operator (format and sources in the README
//! beside it). Each runs as `infera server|worker X|kvd|gaie … --check-config`, with only the
//! environment the documentation gives it, and its test asserts, field by field, that the printed
//! configuration means what the Python does with the same line: ports, discovery, transports,
//! policy and weights, PD roles and the engine arguments forwarded, environment fallbacks.
//!
//! This file reads the fixture and checks it; the cases are in `server.rs`, `engines.rs` and
//! `kvd.rs` (kvd and the endpoint picker).
//!
//! Substitutions (documented in the fixture's README): `@TOKENIZER` is the fixture tokenizer
//! directory, and a Hugging Face id given as a tokenizer resolves from a temporary Hugging Face
//! cache (`HF_HUB_CACHE`) that holds the fixture tokenizer under that id.
#![allow(clippy::unwrap_used)]

#[path = "../common/mod.rs"]
mod common;

use serde_json::{Value, json};
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

const FIXTURE: &str = "../../fixtures/python-infera/command-lines.txt";

/// A case of the fixture, resolved: the words of the Python command line and its environment.
struct Case {
    argv: Vec<String>,
    env: Vec<(String, String)>,
}

/// The `[id]` blocks of the fixture, in order, as (id, key → raw value).
fn blocks() -> Vec<(String, Vec<(String, String)>)> {
    let text = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join(FIXTURE))
        .expect("fixture");
    let mut blocks: Vec<(String, Vec<(String, String)>)> = Vec::new();
    for line in text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
    {
        if let Some(id) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            blocks.push((id.to_owned(), Vec::new()));
        } else {
            let (key, value) = line.split_once(" = ").expect("`key = value`");
            let block = blocks.last_mut().expect("a key before the first [id]");
            block.1.push((key.to_owned(), value.to_owned()));
        }
    }
    blocks
}

/// Words of a shell line: blanks separate them, '…' is literal, "…" takes \" \\ \$ escapes.
fn shell_words(line: &str) -> Vec<String> {
    let (mut words, mut word, mut in_word) = (Vec::new(), String::new(), false);
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        match c {
            ' ' | '\t' => {
                if in_word {
                    words.push(std::mem::take(&mut word));
                }
                in_word = false;
                continue;
            }
            '\'' => word.extend(chars.by_ref().take_while(|&c| c != '\'')),
            '"' => {
                while let Some(c) = chars.next() {
                    match c {
                        '"' => break,
                        '\\' => word.push(chars.next().unwrap()),
                        c => word.push(c),
                    }
                }
            }
            '\\' => word.push(chars.next().unwrap()),
            c => word.push(c),
        }
        in_word = true;
    }
    if in_word {
        words.push(word);
    }
    words
}

/// `NAME=value` words as pairs.
fn assignments(line: &str) -> Vec<(String, String)> {
    shell_words(line)
        .into_iter()
        .map(|w| {
            let (k, v) = w.split_once('=').expect("NAME=value");
            (k.to_owned(), v.to_owned())
        })
        .collect()
}

/// Expands `$NAME`, `${NAME}`, `${NAME:-default}` and the kubelet's `$(NAME)` from `known`; an
/// unknown variable (without a default) is a fixture error.
fn expand(text: &str, known: &[(String, String)]) -> String {
    let lookup = |name: &str| {
        known
            .iter()
            .rev()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.clone())
    };
    let (mut out, mut rest) = (String::new(), text);
    while let Some(at) = rest.find('$') {
        out.push_str(&rest[..at]);
        let after = &rest[at + 1..];
        let (name, default, len) = if let Some(inner) = after.strip_prefix('(') {
            let end = inner.find(')').unwrap();
            (&inner[..end], None, end + 2)
        } else if let Some(inner) = after.strip_prefix('{') {
            let end = inner.find('}').unwrap();
            match inner[..end].split_once(":-") {
                Some((name, default)) => (name, Some(default), end + 2),
                None => (&inner[..end], None, end + 2),
            }
        } else {
            let end = after
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .unwrap_or(after.len());
            (&after[..end], None, end)
        };
        let value = lookup(name).or(default.map(str::to_owned));
        out.push_str(&value.unwrap_or_else(|| panic!("no value for ${name} in {text:?}")));
        rest = &after[len..];
    }
    out + rest
}

/// The case `id`, with `replace`, `vars` and `@TOKENIZER` applied.
fn case(id: &str) -> Case {
    let (_, keys) = blocks()
        .into_iter()
        .find(|(name, _)| name == id)
        .unwrap_or_else(|| panic!("no case [{id}] in {FIXTURE}"));
    let get = |key: &str| keys.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str());
    let replace = assignments(get("replace").unwrap_or(""));
    let replaced = |text: &str| {
        replace
            .iter()
            .fold(text.to_owned(), |t, (k, v)| t.replace(k, v))
    };
    let tokenizer = common::tokenizer_dir();
    let resolved = |text: String| text.replace("@TOKENIZER", &tokenizer);
    let mut known = assignments(get("vars").unwrap_or(""));
    let mut env = Vec::new();
    for (name, value) in assignments(get("env").unwrap_or("")) {
        let value = expand(&replaced(&value), &known);
        known.push((name.clone(), value.clone()));
        env.push((name, value));
    }
    let argv = match (get("argv"), get("argv-json")) {
        (Some(line), None) => shell_words(&expand(&replaced(line), &known)),
        (None, Some(array)) => serde_json::from_str::<Vec<String>>(array)
            .expect("argv-json")
            .iter()
            .map(|word| expand(&replaced(word), &known))
            .collect(),
        _ => panic!("[{id}] needs one of argv, argv-json"),
    };
    Case {
        argv: argv.into_iter().map(resolved).collect(),
        env,
    }
}

/// A Hugging Face cache holding the fixture tokenizer as `Qwen/Qwen3-0.6B` (kept for the run).
fn hf_cache() -> &'static Path {
    static CACHE: OnceLock<tempfile::TempDir> = OnceLock::new();
    CACHE
        .get_or_init(|| {
            let dir = tempfile::tempdir().unwrap();
            let model = dir.path().join("models--Qwen--Qwen3-0.6B");
            std::fs::create_dir_all(model.join("refs")).unwrap();
            std::fs::create_dir_all(model.join("snapshots/fixture")).unwrap();
            std::fs::write(model.join("refs/main"), "fixture").unwrap();
            let file = PathBuf::from(common::tokenizer_dir()).join("tokenizer.json");
            std::os::unix::fs::symlink(file, model.join("snapshots/fixture/tokenizer.json"))
                .unwrap();
            dir
        })
        .path()
}

/// Runs case `id` as `infera … --check-config` and returns the printed configuration; a line
/// the binary refuses fails the test with its error.
fn check(id: &str) -> Value {
    let Case { argv, env } = case(id);
    let words: Vec<&str> = argv.iter().map(String::as_str).collect();
    let words = words
        .strip_prefix(&["/overlay/bin/infera-exec"])
        .unwrap_or(&words);
    let (module, rest) = match words {
        [python, "-m", module, rest @ ..] if python.starts_with("python") => (*module, rest),
        other => panic!("[{id}] is not `python -m MODULE …`: {other:?}"),
    };
    let ours: &[&str] = match module {
        "infera.server" => &["server"],
        "infera.engine.vllm" => &["worker", "vllm"],
        "infera.engine.sglang" => &["worker", "sglang"],
        "infera.engine.atom" => &["worker", "atom"],
        "infera.kvd" => &["kvd"],
        "infera.gaie" => &["gaie"],
        other => panic!("[{id}]: no mapping for python -m {other}"),
    };
    let args: Vec<&str> = [ours, rest, &["--check-config"]].concat();
    let output = Command::new(env!("CARGO_BIN_EXE_infera"))
        .args(&args)
        .env_clear()
        .envs(env.iter().map(|(k, v)| (k, v)))
        .env("HF_HUB_CACHE", hf_cache())
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "[{id}] the Python's `{}` is refused as `infera {}` (exit {:?}):\n{}",
        argv.join(" "),
        args.join(" "),
        output.status.code(),
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).unwrap()
}

type Fields = Vec<(&'static str, Value)>;

/// `"/json/pointer" => value` pairs, values written as in `json!`.
macro_rules! fields {
    ($($pointer:literal => $value:tt),* $(,)?) => { vec![$(($pointer, json!($value))),*] };
}

// The cases, one module per entry point (after the macro they use).
mod engines;
mod kvd;
mod server;

/// `base` with the entries of `over` replacing those of the same JSON pointer.
fn with(mut base: Fields, over: Fields) -> Fields {
    for (pointer, value) in over {
        base.retain(|(p, _)| *p != pointer);
        base.push((pointer, value));
    }
    base
}

/// Fields the configuration leaves out when unset (`null` matches their absence).
const OMITTED_WHEN_UNSET: &[&str] = &["/kvd_socket"];

/// Asserts each field (JSON pointer → value) and reports every one that differs from the
/// Python's meaning at once.
fn expect(id: &str, fields: Fields) {
    let config = check(id);
    let wrong: Vec<String> = fields
        .iter()
        .filter(|(pointer, want)| {
            config.pointer(pointer).map_or(
                !(want.is_null() && OMITTED_WHEN_UNSET.contains(pointer)),
                |got| got != want,
            )
        })
        .map(|(pointer, want)| {
            format!(
                "{pointer}: Python {want}, ours {:?}",
                config.pointer(pointer)
            )
        })
        .collect();
    assert!(
        wrong.is_empty(),
        "[{id}] means something else than in the Python Infera:\n  {}\nconfiguration: {config:#}",
        wrong.join("\n  ")
    );
}

/// Space-separated words (forwarded engine arguments without blanks in them).
fn words(text: &str) -> Vec<&str> {
    text.split_whitespace().collect()
}

fn etcd(endpoint: &str) -> Fields {
    fields! {
        "/discovery/kind" => "etcd", "/discovery/endpoint" => endpoint,
        "/discovery/prefix" => "/infera/workers/",
    }
}

/// Kubernetes discovery; no namespace is the Pod's own, resolved at runtime.
fn kubernetes(selector: Option<&str>) -> Fields {
    fields! {
        "/discovery/kind" => "kubernetes", "/discovery/namespace" => null,
        "/discovery/label_selector" => selector,
    }
}

/// What `python -m infera.server` uses for the flags a line leaves out (infera/server/args.py).
fn server(over: Fields) -> Fields {
    let defaults = fields! {
        "/http/host" => "0.0.0.0", "/http/port" => 8000,
        "/router/mode" => "auto", "/router/policy" => "kv-aware",
        "/router/kv_overlap_weight" => 1.0,
        "/router/kv_prefill_overlap_weight" => null, "/router/kv_decode_overlap_weight" => null,
        "/router/request_max_retries" => 1, "/worker_edge/migration_limit" => 0,
        "/worker_edge/breaker_failure_threshold" => 3,
        "/worker_edge/breaker_cooldown_s" => 5.0, "/worker_edge/breaker_max_cooldown_s" => 60.0,
        "/request_transport" => "nats", "/kv_event_transport" => "nats",
        "/nats/server" => "nats://127.0.0.1:4222", "/nats/req_idle_timeout" => "15m",
        "/nats/req_max_duration" => null, "/nats/req_max_pending" => null,
        "/kvd_socket_path" => null, "/enable_profiling" => false,
    };
    with(defaults, over)
}

/// The quickstart's no-broker plane: etcd discovery, HTTP requests, ZeroMQ KV events.
fn server_dev(endpoint: &str, over: Fields) -> Fields {
    let plane = fields! { "/request_transport" => "http", "/kv_event_transport" => "zmq" };
    server(with(with(etcd(endpoint), plane), over))
}

/// A worker launched as `python -m infera.engine.X`: the engine, model, bind address and port
/// given to the engine, and the launcher's defaults (infera/engine/*/args.py, worker.py).
fn worker(engine: &str, model: &str, port: u16, command: &[&str]) -> Fields {
    let model_flag = if engine == "sglang" {
        "--model-path"
    } else {
        "--model"
    };
    fields! {
        "/engine" => engine, "/model" => model, "/host" => "0.0.0.0", "/port" => port,
        "/request_transport" => "nats", "/kv_events/enabled" => true,
        "/kv_events/transport" => "nats", "/kvd_socket" => null,
        "/launch/kind" => "process", "/launch/command" => command,
        "/launch/args/0" => model_flag, "/launch/args/1" => model,
        "/launch/args/5" => (port.to_string()), "/launch/ready_timeout" => "30m",
    }
}

/// Defaults of the SGLang and vLLM launchers that ATOM's lacks: NATS, drain, index block size.
fn launcher_defaults() -> Fields {
    fields! {
        "/nats_server" => "nats://127.0.0.1:4222", "/nats_req_idle_timeout" => "15m",
        "/nats_req_max_duration" => null, "/nats_req_max_pending" => null,
        "/drain_timeout" => "30s", "/launch/index_block_size" => 64,
    }
}

fn sglang(model: &str, port: u16, over: Fields) -> Fields {
    let base = worker(
        "sglang",
        model,
        port,
        &["python3", "-m", "sglang.launch_server"],
    );
    with(with(base, launcher_defaults()), over)
}

fn vllm(model: &str, port: u16, over: Fields) -> Fields {
    with(
        with(
            worker("vllm", model, port, &["vllm", "serve"]),
            launcher_defaults(),
        ),
        over,
    )
}

/// A worker on the quickstart's no-broker plane.
fn worker_dev(endpoint: &str, over: Fields) -> Fields {
    let plane = fields! { "/request_transport" => "http", "/kv_events/transport" => "zmq" };
    with(with(etcd(endpoint), plane), over)
}

/// An ATOM worker as `python -m infera.engine.atom` runs one: it registers in etcd only
/// (`--etcd-endpoint` is required, there is no `--discovery-backend`), is reached over HTTP (no
/// NATS), and publishes no KV events without `--enable-kv-events` (infera/engine/atom/args.py,
/// __main__.py).
fn atom(model: &str, port: u16, endpoint: &str, over: Fields) -> Fields {
    let command = ["python3", "-m", "atom.entrypoints.openai_server"];
    let atom = fields! { "/request_transport" => "http", "/kv_events/enabled" => false };
    let base = with(
        worker("atom", model, port, &command),
        with(etcd(endpoint), atom),
    );
    with(base, over)
}

// ---- the fixture itself ---------------------------------------------------------------------

/// Every case of the fixture has its test above (a case added without one fails here), and the
/// fixture covers every entry point of the Python Infera.
#[test]
fn every_case_is_asserted_and_every_entry_point_covered() {
    let source = [
        include_str!("server.rs"),
        include_str!("engines.rs"),
        include_str!("kvd.rs"),
    ]
    .concat();
    let ids: BTreeSet<String> = blocks().into_iter().map(|(id, _)| id).collect();
    let unasserted: Vec<&String> = ids
        .iter()
        .filter(|id| !source.contains(&format!("expect(\"{id}\"")))
        .collect();
    assert!(
        unasserted.is_empty(),
        "fixture cases without a test: {unasserted:?}"
    );
    let modules: BTreeSet<String> = ids
        .iter()
        .filter_map(|id| {
            let argv = case(id).argv;
            argv.iter()
                .position(|w| w == "-m")
                .map(|i| argv[i + 1].clone())
        })
        .collect();
    let all = ["atom", "sglang", "vllm"].map(|e| format!("infera.engine.{e}"));
    let all = all
        .into_iter()
        .chain(["infera.gaie", "infera.kvd", "infera.server"].map(String::from));
    assert_eq!(modules, all.collect(), "entry points covered");
}

#[test]
fn the_fixture_reader_expands_and_splits_as_the_shell_does() {
    let known = vec![
        ("P".to_owned(), "-tp 8".to_owned()),
        ("S".to_owned(), "[1, 2]".to_owned()),
    ];
    assert_eq!(
        expand("a $P '$S' ${X:-64G} $(P)", &known),
        "a -tp 8 '[1, 2]' 64G -tp 8"
    );
    let line = r#"a -tp 8 '[1, 2]' "x \"y\"" '{"k":1}'"#;
    assert_eq!(
        shell_words(line),
        ["a", "-tp", "8", "[1, 2]", r#"x "y""#, r#"{"k":1}"#]
    );
}
