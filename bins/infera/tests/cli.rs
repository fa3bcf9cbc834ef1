//! The `infera` command-line contract, tested against the real binary: every flag of the seed
//! reference with its default in `--help`, validation failures (exit code 2, one line naming the
//! flag), environment fallbacks, and how worker arguments are forwarded to the engine.
#![allow(clippy::unwrap_used)]

use serde_json::{Value, json};
use std::path::Path;
use std::process::{Command, Output};

/// Variables that would change the defaults under test; every run starts without them.
/// Variables the commands read, removed so the machine's own cannot leak into the tests.
const ENV_FALLBACKS: &[&str] = &[
    "NATS_SERVER",
    "INFERA_K8S_LABEL_SELECTOR",
    "INFERA_ENGINE_CMD",
    "RUST_LOG",
    "INFERA_ROUTER_MODE",
    "INFERA_ROUTER_BACKEND",
    "INFERA_ROUTER_DEFAULT_RETENTION",
    "INFERA_REQUEST_MAX_RETRIES",
    "INFERA_ENABLE_PROFILING",
    "INFERA_ENABLE_SLA_METRICS",
    "INFERA_NATS_REQ_IDLE_TIMEOUT",
    "INFERA_NATS_REQ_MAX_DURATION",
    "INFERA_NATS_REQ_MAX_PENDING",
    "INFERA_BREAKER_FAILURE_THRESHOLD",
    "INFERA_BREAKER_COOLDOWN_S",
    "INFERA_BREAKER_MAX_COOLDOWN_S",
    "INFERA_MIGRATION_LIMIT",
    "INFERA_DRAIN_TIMEOUT",
    "INFERA_ADMIN_TOKEN",
    "INFERA_DEFAULT_KV_FP8",
    "INFERA_KVD_IO_MODE",
    "HF_HUB_CACHE",
    "HUGGINGFACE_HUB_CACHE",
    "HF_HOME",
    "HF_REVISION",
    "HF_ENDPOINT",
    "HF_HUB_OFFLINE",
    "HF_TOKEN",
    "HUGGING_FACE_HUB_TOKEN",
];

/// The worker selector every `infera server` of these tests gets through its variable.
const SERVER_SELECTOR: &str = "app=infera-worker";

fn infera_with_env(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut command = Command::new(env!("CARGO_BIN_EXE_infera"));
    command.args(args);
    for name in ENV_FALLBACKS.iter().copied() {
        command.env_remove(name);
    }
    // The worker selector that the server requires with kubernetes discovery (its default), so
    // that a server test passes only the flags it is about; `env` may blank it.
    if args.first() == Some(&"server") {
        command.env("INFERA_K8S_LABEL_SELECTOR", SERVER_SELECTOR);
    }
    command.envs(env.iter().copied());
    command.output().unwrap()
}

fn infera(args: &[&str]) -> Output {
    infera_with_env(args, &[])
}

fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

/// Runs with `--check-config` (placed before any `--`) and returns the printed configuration.
fn check_config_with_env(args: &[&str], env: &[(&str, &str)]) -> Value {
    let mut full = args.to_vec();
    let end_of_ours = full
        .iter()
        .position(|arg| *arg == "--")
        .unwrap_or(full.len());
    full.insert(end_of_ours, "--check-config");
    let output = infera_with_env(&full, env);
    assert_eq!(
        output.status.code(),
        Some(0),
        "{full:?} failed: {}",
        stderr(&output)
    );
    serde_json::from_slice(&output.stdout)
        .unwrap_or_else(|error| panic!("{full:?} printed no JSON ({error}): {}", stdout(&output)))
}

fn check_config(args: &[&str]) -> Value {
    check_config_with_env(args, &[])
}

/// Asserts a validation failure: exit code 2 and exactly one stderr line that names `flag`
/// and contains `expected`.
fn assert_invalid(args: &[&str], flag: &str, expected: &str) {
    assert_invalid_with_env(args, &[], flag, expected);
}

/// [`assert_invalid`] with `env` set for the child.
fn assert_invalid_with_env(args: &[&str], env: &[(&str, &str)], flag: &str, expected: &str) {
    let output = infera_with_env(args, env);
    let message = stderr(&output);
    assert_eq!(output.status.code(), Some(2), "{args:?}: {message}");
    let lines: Vec<&str> = message
        .lines()
        .filter(|line| !line.trim().is_empty())
        .collect();
    assert_eq!(
        lines.len(),
        1,
        "{args:?} should fail on one line: {message}"
    );
    assert!(
        lines[0].contains(flag),
        "{args:?}: {message} does not name {flag}"
    );
    assert!(
        lines[0].contains(expected),
        "{args:?}: {message} lacks {expected:?}"
    );
    assert!(output.stdout.is_empty(), "{args:?} printed to stdout");
}

/// A directory holding a (not necessarily valid) tokenizer.json: only readability is checked.
fn tokenizer_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("tokenizer.json"), b"{}").unwrap();
    dir
}

fn path_str(path: &Path) -> &str {
    path.to_str().unwrap()
}

// ---------------------------------------------------------------------------------------------
// --help lists every seed flag with its default.
// ---------------------------------------------------------------------------------------------

/// One flag and what its help entry must say (its default, possible values, notes).
type FlagSpec = (&'static str, &'static [&'static str]);

const SERVER_SEED_FLAGS: &[FlagSpec] = &[
    ("--host", &["[default: 0.0.0.0]"]),
    ("--port", &["[default: 8000]"]),
    ("--router-tokenizer-path", &["required"]),
    ("--router-mode", &["[default: auto]", "direct"]),
    ("--router-policy", &["[default: kv-aware]", "round-robin"]),
    (
        "--kv-overlap-weight",
        &["[default: 1.0]", "16 with --router-profile infera"],
    ),
    ("--kv-prefill-overlap-weight", &["[default: unset]", "20.0"]),
    ("--kv-decode-overlap-weight", &["[default: unset]", "2.0"]),
    ("--request-max-retries", &["[default: 1]", "0 disables"]),
    ("--discovery-backend", &["[default: kubernetes]", "etcd"]),
    (
        "--etcd-endpoint",
        &["required for --discovery-backend etcd"],
    ),
    ("--etcd-prefix", &["[default: /infera/workers/]"]),
    ("--k8s-label-selector", &["INFERA_K8S_LABEL_SELECTOR"]),
    ("--k8s-namespace", &["[default: the Pod's own namespace]"]),
    ("--request-transport", &["[default: nats]", "http"]),
    ("--kv-event-transport", &["[default: nats]", "zmq"]),
    (
        "--nats-server",
        &["[env: NATS_SERVER=]", "[default: nats://127.0.0.1:4222]"],
    ),
    (
        "--nats-req-idle-timeout",
        &["[default: 900s]", "0 = forever"],
    ),
    ("--nats-req-max-duration", &["[default: 0]", "0 = off"]),
    (
        "--nats-req-max-pending",
        &["[default: 0]", "0 = off", "429"],
    ),
    ("--kvd-socket-path", &["/v1/cache/prewarm", "503"]),
    ("--enable-profiling", &["[default: off]"]),
];

const SERVER_EXTENSION_FLAGS: &[FlagSpec] = &[
    (
        "--router-profile",
        &[
            "[default: python]",
            "[env: INFERA_ROUTER_PROFILE=]",
            "infera",
        ],
    ),
    (
        "--auto-tune",
        &["[default: advise]", "off", "apply", "/v1/admin/tuning"],
    ),
    (
        "--router-temperature",
        &["[default: 0]", "argmin", "softmax"],
    ),
    (
        "--event-log",
        &["[default: memory]", "sqlite:PATH", "postgres://"],
    ),
    ("--record-trace", &["DIR"]),
    ("--record-prompts", &["--record-trace"]),
    ("--chat-template", &["FILE"]),
    ("--max-body-bytes", &["[default: 32MiB]"]),
    ("--client-header-timeout", &["[default: 10s]", "0 = off"]),
    ("--client-idle-timeout", &["[default: 60s]", "0 = off"]),
    ("--client-body-timeout", &["[default: 60s]", "408"]),
    ("--max-connections", &["open-file limit", "503"]),
    ("--parse-budget", &["[default: 512MiB]", "503"]),
    (
        "--admin-token",
        &["INFERA_ADMIN_TOKEN", "/v1/admin/*", "/v1/workers", "401"],
    ),
];

const WORKER_SEED_FLAGS: &[FlagSpec] = &[
    ("--model-path", &["required"]),
    ("--model", &["required"]),
    ("--host", &["[default: 0.0.0.0]"]),
    (
        "--etcd-endpoint",
        &["required for --discovery-backend etcd"],
    ),
    ("--advertise-host", &["[default: = --host]"]),
    ("--discovery-backend", &["[default: kubernetes]", "etcd"]),
    ("--request-transport", &["[default: nats]", "http"]),
    ("--enable-kv-events", &["[default: on]"]),
    ("--no-enable-kv-events", &[]),
    ("--kv-event-transport", &["[default: nats]", "zmq"]),
];

/// ATOM's launcher registers in etcd, is reached over HTTP and publishes KV events only when
/// asked (infera/engine/atom/args.py): these replace the entries of [`WORKER_SEED_FLAGS`].
const ATOM_SEED_DEFAULTS: &[FlagSpec] = &[
    ("--discovery-backend", &["[default: etcd]", "kubernetes"]),
    ("--request-transport", &["[default: http]", "nats"]),
    ("--enable-kv-events", &["[default: off]"]),
];

const WORKER_EXTENSION_FLAGS: &[FlagSpec] = &[
    ("--drain-timeout", &["[default: 30s]", "0 = do not wait"]),
    (
        "--nats-req-max-duration",
        &["[default: 0]", "0 = off", "504"],
    ),
    ("--etcd-prefix", &["[default: /infera/workers/]"]),
    (
        "--nats-server",
        &["[env: NATS_SERVER=]", "[default: nats://127.0.0.1:4222]"],
    ),
    ("--k8s-namespace", &["[default: the Pod's own namespace]"]),
    (
        "--k8s-label-selector",
        &["[env: INFERA_K8S_LABEL_SELECTOR=]"],
    ),
];

const MOCK_FLAGS: &[FlagSpec] = &[
    ("--gpu-blocks", &["[default: 16384]"]),
    ("--block-size", &["[default: 16]"]),
    ("--max-batched-tokens", &["[default: 8192]"]),
    ("--max-seqs", &["[default: 256]"]),
    ("--speedup", &["[default: 1.0]"]),
    ("--prefill-coeffs", &["[default: 4.21e-7,0.01518,16.5]"]),
    ("--decode-coeffs", &["[default: -25.74,54.01,5.74]"]),
];

const KVD_SEED_FLAGS: &[FlagSpec] = &[
    ("--socket", &["Unix socket"]),
    ("--max-bytes", &["RAM"]),
    ("--shared-arena-bytes", &["[default: auto]", "0 = off"]),
    ("--long-path", &["mutually exclusive with --long-paths"]),
    ("--long-paths", &["mutually exclusive with --long-path"]),
    ("--long-bytes", &["L3 region size"]),
    ("--use-tablespace", &["deprecated", "no-op"]),
    (
        "--long-backend",
        &["[default: tablespace]", "mooncake", "lmcache"],
    ),
    ("--io-mode", &["[default: auto]", "direct", "buffered"]),
    ("--long-workers-per-shard", &["[default: 8]"]),
];

/// Splits long `--help` output into one whitespace-collapsed entry per option.
fn help_entries(help: &str) -> Vec<String> {
    let mut entries: Vec<String> = Vec::new();
    for line in help.lines() {
        let indent = line.len() - line.trim_start().len();
        let starts_entry = line.trim_start().starts_with('-') && indent < 10;
        let belongs_to_entry = indent >= 10 && !entries.is_empty();
        if starts_entry {
            entries.push(line.trim().to_owned());
        } else if belongs_to_entry && let Some(entry) = entries.last_mut() {
            entry.push(' ');
            entry.push_str(line.trim());
        }
    }
    entries
        .into_iter()
        .map(|entry| entry.split_whitespace().collect::<Vec<_>>().join(" "))
        .collect()
}

/// The help entry of `flag`: the entry that names it first, or lists it as an alias.
fn help_entry<'h>(entries: &'h [String], flag: &str) -> Option<&'h String> {
    entries.iter().find(|entry| {
        let header = entry
            .split_whitespace()
            .next()
            .map(|first| first.trim_end_matches(','));
        let short_then_long = entry.split_whitespace().nth(1);
        header == Some(flag)
            || (entry.starts_with("-h,") && short_then_long == Some(flag))
            || entry.contains(&format!("[alias: {flag}]"))
            || entry.contains(&format!("[aliases: {flag}"))
    })
}

fn assert_help_lists(command: &[&str], flags: &[FlagSpec], marker: Option<&str>) {
    let mut args = command.to_vec();
    args.push("--help");
    let output = infera(&args);
    assert_eq!(output.status.code(), Some(0), "{args:?}");
    let help = stdout(&output);
    let entries = help_entries(&help);
    for (flag, expected) in flags {
        let entry = help_entry(&entries, flag).unwrap_or_else(|| {
            panic!(
                "`infera {}` --help lacks {flag}:\n{help}",
                command.join(" ")
            )
        });
        for text in expected.iter().chain(marker.iter()) {
            assert!(
                entry.contains(text),
                "`infera {}` --help: {flag} should mention {text:?}: {entry}",
                command.join(" ")
            );
        }
    }
}

#[test]
fn server_help_lists_every_seed_flag_with_its_default() {
    assert_help_lists(&["server"], SERVER_SEED_FLAGS, None);
    assert_help_lists(
        &["server"],
        SERVER_EXTENSION_FLAGS,
        Some("Infera extension"),
    );
}

#[test]
fn worker_help_lists_every_seed_flag_with_its_default() {
    for engine in ["vllm", "sglang", "atom", "mock"] {
        let seed: Vec<FlagSpec> = if engine == "atom" {
            let atom_own = |(flag, _): &&FlagSpec| ATOM_SEED_DEFAULTS.iter().any(|a| a.0 == *flag);
            let shared = WORKER_SEED_FLAGS.iter().filter(|f| !atom_own(f));
            shared.chain(ATOM_SEED_DEFAULTS).copied().collect()
        } else {
            WORKER_SEED_FLAGS.to_vec()
        };
        assert_help_lists(&["worker", engine], &seed, None);
        assert_help_lists(
            &["worker", engine],
            WORKER_EXTENSION_FLAGS,
            Some("Infera extension"),
        );
    }
    for engine in ["vllm", "sglang", "atom"] {
        assert_help_lists(
            &["worker", engine],
            &[("--engine-cmd", &["[env: INFERA_ENGINE_CMD=]", "[default: "])],
            Some("Infera extension"),
        );
    }
    assert_help_lists(
        &["worker", "vllm"],
        &[("--port", &["8000"]), ("--server-port", &[])],
        None,
    );
    assert_help_lists(&["worker", "sglang"], &[("--port", &["30000"])], None);
    assert_help_lists(&["worker", "atom"], &[("--server-port", &["8000"])], None);
    assert_help_lists(&["worker", "mock"], MOCK_FLAGS, None);
}

#[test]
fn worker_help_explains_forwarding() {
    let help = stdout(&infera(&["worker", "vllm", "--help"]));
    assert!(help.contains("forwarded verbatim"), "{help}");
}

#[test]
fn kvd_help_lists_every_seed_flag_with_its_default() {
    assert_help_lists(&["kvd"], KVD_SEED_FLAGS, None);
}

// ---------------------------------------------------------------------------------------------
// Validation: exit code 2 and one line naming the flag.
// ---------------------------------------------------------------------------------------------

#[test]
fn server_validation_failures_name_the_flag() {
    let tokenizer = tokenizer_dir();
    let tok = path_str(tokenizer.path());
    let empty = tempfile::tempdir().unwrap();
    let missing = empty.path().join("missing");
    assert_invalid(&["server"], "--router-tokenizer-path", "is required");
    assert_invalid(
        &["server", "--router-tokenizer-path", path_str(empty.path())],
        "--router-tokenizer-path",
        "without tokenizer.json",
    );
    assert_invalid(
        &["server", "--router-tokenizer-path", path_str(&missing)],
        "--router-tokenizer-path",
        "does not exist",
    );
    assert_invalid(
        &[
            "server",
            "--router-tokenizer-path",
            tok,
            "--discovery-backend",
            "etcd",
        ],
        "--etcd-endpoint",
        "--discovery-backend etcd",
    );
    for flag in [
        "--kv-overlap-weight",
        "--kv-prefill-overlap-weight",
        "--kv-decode-overlap-weight",
        "--router-temperature",
    ] {
        assert_invalid(
            &["server", "--router-tokenizer-path", tok, flag, "-1"],
            flag,
            ">= 0",
        );
    }
    assert_invalid(
        &[
            "server",
            "--router-tokenizer-path",
            tok,
            "--max-body-bytes",
            "0",
        ],
        "--max-body-bytes",
        "greater than 0",
    );
    assert_invalid(
        &[
            "server",
            "--router-tokenizer-path",
            tok,
            "--chat-template",
            path_str(&missing),
        ],
        "--chat-template",
        "cannot be read",
    );
    assert_invalid(
        &["server", "--router-tokenizer-path", tok, "--record-prompts"],
        "--record-prompts",
        "--record-trace",
    );
    assert_invalid(
        &[
            "server",
            "--router-tokenizer-path",
            tok,
            "--api-keys",
            path_str(&missing),
        ],
        "--api-keys",
        "missing",
    );
    let keys = empty.path().join("keys.json");
    std::fs::write(&keys, r#"{"tenants": [{"name": "a", "keys": ["short"]}]}"#).unwrap();
    assert_invalid(
        &[
            "server",
            "--router-tokenizer-path",
            tok,
            "--api-keys",
            path_str(&keys),
        ],
        "--api-keys",
        "at least 16 printable",
    );
}

#[test]
fn a_tokenizer_file_is_accepted_as_well_as_a_directory() {
    let tokenizer = tokenizer_dir();
    let file = tokenizer.path().join("tokenizer.json");
    let config = check_config(&["server", "--router-tokenizer-path", path_str(&file)]);
    assert_eq!(config["router"]["tokenizer_file"], json!(path_str(&file)));
    let config = check_config(&[
        "server",
        "--router-tokenizer-path",
        path_str(tokenizer.path()),
    ]);
    assert_eq!(config["router"]["tokenizer_file"], json!(path_str(&file)));
}

#[test]
fn the_workers_template_defaults_are_a_json_object() {
    let tokenizer = tokenizer_dir();
    let dir = path_str(tokenizer.path());
    let flag = "--kv-default-chat-template-kwargs";
    let config = check_config(&[
        "server",
        "--router-tokenizer-path",
        dir,
        flag,
        r#"{"enable_thinking": false, "reasoning_effort": "high"}"#,
    ]);
    assert_eq!(
        config["router"]["default_chat_template_kwargs"],
        json!({"enable_thinking": false, "reasoning_effort": "high"})
    );
    let server = ["server", "--router-tokenizer-path", dir, flag];
    let with = |value: &'static str| [&server[..], &[value]].concat();
    assert_invalid(&with("[1, 2]"), flag, "must be a JSON object");
    assert_invalid(&with("{enable_thinking: false}"), flag, "is not JSON");
}

#[test]
fn a_hugging_face_model_id_is_read_from_the_local_cache() {
    // The hub layout huggingface_hub writes: a ref naming a snapshot.
    let cache = tempfile::tempdir().unwrap();
    let model = cache.path().join("models--Qwen--Qwen3-0.6B");
    std::fs::create_dir_all(model.join("refs")).unwrap();
    std::fs::create_dir_all(model.join("snapshots/0123abcd")).unwrap();
    std::fs::write(model.join("refs/main"), "0123abcd").unwrap();
    let file = model.join("snapshots/0123abcd/tokenizer.json");
    std::fs::write(&file, b"{}").unwrap();
    let env = [("HF_HUB_CACHE", path_str(cache.path()))];
    let server = ["server", "--router-tokenizer-path", "Qwen/Qwen3-0.6B"];
    let config = check_config_with_env(&server, &env);
    assert_eq!(config["router"]["tokenizer_path"], json!("Qwen/Qwen3-0.6B"));
    assert_eq!(config["router"]["tokenizer_file"], json!(path_str(&file)));
    // A model the cache lacks, offline: one line naming the cache and how to fill it.
    let output = infera_with_env(
        &[
            "server",
            "--router-tokenizer-path",
            "Qwen/Qwen3-8B",
            "--check-config",
        ],
        &[env[0], ("HF_HUB_OFFLINE", "1")],
    );
    assert_eq!(output.status.code(), Some(2));
    let message = stderr(&output);
    assert!(message.contains("--router-tokenizer-path"), "{message}");
    assert!(message.contains(path_str(cache.path())), "{message}");
    assert!(
        message.contains("huggingface-cli download Qwen/Qwen3-8B"),
        "{message}"
    );
}

#[test]
fn kvd_validation_failures_name_the_flag() {
    assert_invalid(
        &["kvd", "--max-bytes", "0"],
        "--max-bytes",
        "greater than 0",
    );
    assert_invalid(
        &["kvd", "--long-bytes", "0"],
        "--long-bytes",
        "greater than 0",
    );
    assert_invalid(
        &["kvd", "--long-workers-per-shard", "0"],
        "--long-workers-per-shard",
        "greater than 0",
    );
    assert_invalid(
        &["kvd", "--long-path", "/a", "--long-paths", "/b,/c"],
        "--long-paths",
        "--long-path",
    );
    assert_invalid(
        &["kvd", "--long-backend", "mooncake"],
        "--mooncake-config",
        "master_address and cluster_id required",
    );
}

#[test]
fn worker_validation_failures_name_the_flag() {
    assert_invalid(&["worker", "vllm"], "--model", "is required");
    assert_invalid(&["worker", "sglang"], "--model-path", "is required");
    assert_invalid(
        &[
            "worker",
            "vllm",
            "--model",
            "m",
            "--discovery-backend",
            "etcd",
        ],
        "--etcd-endpoint",
        "--discovery-backend etcd",
    );
    for flag in [
        "--gpu-blocks",
        "--block-size",
        "--max-seqs",
        "--max-batched-tokens",
        "--speedup",
    ] {
        assert_invalid(
            &["worker", "mock", "--model-path", "m", flag, "0"],
            flag,
            "greater than 0",
        );
    }
    assert_invalid(
        &["worker", "sglang", "--model-path", "m", "--page-size", "x"],
        "--page-size",
        "positive integer",
    );
    assert_invalid(
        &[
            "worker",
            "mock",
            "--model-path",
            "m",
            "--etcd-lease-ttl",
            "500ms",
        ],
        "--etcd-lease-ttl",
        "at least 1s",
    );
}

#[test]
fn use_tablespace_is_a_deprecated_no_op() {
    let output = infera(&["kvd", "--use-tablespace", "--check-config"]);
    assert_eq!(output.status.code(), Some(0), "{}", stderr(&output));
    assert!(
        stderr(&output).contains("deprecated"),
        "{}",
        stderr(&output)
    );
    let with: Value = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(with, check_config(&["kvd"]));
}

#[test]
fn unknown_enum_values_are_usage_errors_listing_the_valid_ones() {
    let output = infera(&["kvd", "--io-mode", "fast"]);
    assert_eq!(output.status.code(), Some(2));
    let message = stderr(&output);
    assert!(message.contains("--io-mode"), "{message}");
    assert!(message.contains("auto, direct, buffered"), "{message}");

    let output = infera(&[
        "worker",
        "vllm",
        "--model",
        "m",
        "--discovery-backend",
        "consul",
    ]);
    assert_eq!(output.status.code(), Some(2));
    assert!(
        stderr(&output).contains("kubernetes, etcd"),
        "{}",
        stderr(&output)
    );

    let output = infera(&["server", "--router-policy", "random"]);
    assert_eq!(output.status.code(), Some(2));
    assert!(
        stderr(&output).contains("kv-aware, round-robin"),
        "{}",
        stderr(&output)
    );
}

#[test]
fn malformed_durations_sizes_and_unknown_flags_are_usage_errors() {
    for args in [
        &["kvd", "--max-bytes", "lots"][..],
        &["kvd", "--max-bytes", "1PB"][..],
        &["server", "--nats-req-idle-timeout", "3 days"][..],
        &[
            "worker",
            "mock",
            "--model-path",
            "m",
            "--drain-timeout",
            "soon",
        ][..],
        &[
            "worker",
            "mock",
            "--model-path",
            "m",
            "--tensor-parallel-size",
            "2",
        ][..],
        &["kvd", "--no-such-flag"][..],
    ] {
        let output = infera(args);
        assert_eq!(
            output.status.code(),
            Some(2),
            "{args:?}: {}",
            stderr(&output)
        );
    }
}

#[test]
fn default_nats_transports_without_a_broker_stop_the_server_with_one_line() {
    let tokenizer =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/tokenizers/deepseek-v4");
    let tok = path_str(&tokenizer);
    // The seed's default transports (nats) need a broker: one that does not answer stops
    // startup with one line naming the flag, not a silent fallback to http.
    let free = || {
        std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
            .to_string()
    };
    let nats = format!("nats://127.0.0.1:{}", free());
    let output = infera(&[
        "server",
        "--router-tokenizer-path",
        tok,
        "--host",
        "127.0.0.1",
        "--port",
        &free(),
        "--nats-server",
        &nats,
    ]);
    assert_eq!(output.status.code(), Some(1));
    let err = stderr(&output);
    let err = err.trim().lines().last().unwrap_or_default();
    assert!(
        err.starts_with(&format!(
            "infera server: error: cannot connect to NATS at {nats}"
        )),
        "{err}"
    );
    assert!(err.contains("--nats-server"), "{err}");
}

/// Starts `infera kvd ARGS`, waits for it to listen on `socket`, stops it with SIGTERM and checks
/// the clean exit and the socket's removal.
fn kvd_serves_until_sigterm(args: &[&str], socket: &Path) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_infera"))
        .arg("kvd")
        .args(args)
        .env_remove("RUST_LOG")
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // The daemon says when it listens (its signal handlers are installed before that).
    let mut log = std::io::BufReader::new(child.stderr.take().unwrap());
    let mut line = String::new();
    loop {
        line.clear();
        let n = std::io::BufRead::read_line(&mut log, &mut line).unwrap();
        assert!(n > 0, "kvd exited before listening");
        if line.contains("kvd listening") {
            break;
        }
    }
    assert!(std::os::unix::net::UnixStream::connect(socket).is_ok());
    let kill = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(kill.success());
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(0));
    assert!(!socket.exists(), "the socket is removed on shutdown");
}

#[test]
fn kvd_serves_until_sigterm_and_removes_its_socket() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("kvd.sock");
    kvd_serves_until_sigterm(
        &["--socket", path_str(&socket), "--max-bytes", "64MiB"],
        &socket,
    );
    // With an L3 tablespace too.
    let long = dir.path().join("l3");
    std::fs::create_dir(&long).unwrap();
    let socket = dir.path().join("b.sock");
    kvd_serves_until_sigterm(
        &[
            "--socket",
            path_str(&socket),
            "--max-bytes",
            "64MiB",
            "--long-path",
            path_str(&long),
            "--long-bytes",
            "64MiB",
        ],
        &socket,
    );
}

// ---------------------------------------------------------------------------------------------
// Defaults, units and environment fallbacks, observed through --check-config.
// ---------------------------------------------------------------------------------------------

#[test]
fn server_defaults_and_units_resolve() {
    let tokenizer = tokenizer_dir();
    let tok = path_str(tokenizer.path());
    let config = check_config(&["server", "--router-tokenizer-path", tok]);
    assert_eq!(
        config["http"],
        json!({
            "host": "0.0.0.0",
            "port": 8000,
            "max_body_bytes": "32MiB",
            "client_header_timeout": "10s",
            "client_idle_timeout": "1m",
            "client_body_timeout": "1m",
            "client_write_timeout": "1m",
            "max_connections": null,
            "parse_budget": "512MiB",
            "admin_token": null,
            "api_keys": null
        })
    );
    // The router's queue is on at Dynamo's default threshold.
    assert_eq!(config["router"]["queue_threshold"], json!(4.0));
    assert_eq!(config["router"]["queue_timeout"], json!("1m"));
    assert_eq!(config["router"]["queue_max"], json!(10_000));
    let off = check_config(&[
        "server",
        "--router-tokenizer-path",
        tok,
        "--router-queue-threshold",
        "off",
    ]);
    assert_eq!(off["router"]["queue_threshold"], Value::Null);
    assert_eq!(
        config["nats"],
        json!({
            "server": "nats://127.0.0.1:4222",
            "req_idle_timeout": "15m",
            "req_max_duration": null,
            "req_max_pending": null
        })
    );
    assert_eq!(
        config["discovery"],
        json!({"kind": "kubernetes", "namespace": null, "label_selector": SERVER_SELECTOR})
    );
    assert_eq!(config["event_log"], json!({"kind": "memory"}));

    let config = check_config(&[
        "server",
        "--router-tokenizer-path",
        tok,
        "--nats-req-idle-timeout",
        "0",
        "--nats-req-max-duration",
        "250ms",
        "--nats-req-max-pending",
        "64",
        "--max-body-bytes",
        "1G",
        "--discovery-backend",
        "etcd",
        "--etcd-endpoint",
        "127.0.0.1:2379",
        "--event-log",
        "postgres://infera@localhost/events",
    ]);
    assert_eq!(config["nats"]["req_idle_timeout"], Value::Null);
    assert_eq!(config["nats"]["req_max_duration"], json!("250ms"));
    assert_eq!(config["nats"]["req_max_pending"], json!(64));
    assert_eq!(config["http"]["max_body_bytes"], json!("1GiB"));
    assert_eq!(
        config["discovery"],
        json!({"kind": "etcd", "endpoint": "127.0.0.1:2379", "prefix": "/infera/workers/"})
    );
    assert_eq!(
        config["event_log"],
        json!({"kind": "postgres", "url": "postgres://infera@localhost/events"})
    );
}

#[test]
fn kvd_sizes_resolve() {
    let config = check_config(&["kvd", "--max-bytes", "64GiB", "--long-paths", "/n0,/n1"]);
    assert_eq!(config["max_bytes"], json!("64GiB"));
    assert_eq!(config["shared_arena_bytes"], json!("64GiB"));
    assert_eq!(
        config["long_tier"]["layout"],
        json!({"kind": "striped", "paths": ["/n0", "/n1"], "workers_per_shard": 8})
    );
    let config = check_config(&["kvd", "--max-bytes", "512MiB", "--shared-arena-bytes", "0"]);
    assert_eq!(config["shared_arena_bytes"], json!("0B"));
}

#[test]
fn env_fallbacks_apply_and_flags_override_them() {
    let tokenizer = tokenizer_dir();
    let tok = path_str(tokenizer.path());
    let env = [
        ("NATS_SERVER", "nats://env:4222"),
        ("INFERA_K8S_LABEL_SELECTOR", "app=from-env"),
    ];
    let commands: [&[&str]; 2] = [
        &["server", "--router-tokenizer-path", tok],
        &["worker", "vllm", "--model", "m"],
    ];
    for command in commands {
        let nats = |config: &Value| {
            config
                .pointer("/nats/server")
                .or_else(|| config.get("nats_server"))
                .cloned()
                .unwrap()
        };
        let selector = |config: &Value| config["discovery"]["label_selector"].clone();

        let defaults = check_config(command);
        assert_eq!(
            nats(&defaults),
            json!("nats://127.0.0.1:4222"),
            "{command:?}"
        );
        // Without a selector a worker patches its own Pod; the server refuses to start.
        let no_selector = [("INFERA_K8S_LABEL_SELECTOR", "")];
        if command[0] == "server" {
            let expected = "is required with --discovery-backend kubernetes";
            assert_invalid_with_env(command, &no_selector, "--k8s-label-selector", expected);
        } else {
            let config = check_config_with_env(command, &no_selector);
            assert_eq!(selector(&config), Value::Null, "{command:?}");
        }

        let from_env = check_config_with_env(command, &env);
        assert_eq!(nats(&from_env), json!("nats://env:4222"), "{command:?}");
        assert_eq!(selector(&from_env), json!("app=from-env"), "{command:?}");

        let mut with_flags = command.to_vec();
        with_flags.extend(["--nats-server", "nats://flag:4222"]);
        with_flags.extend(["--k8s-label-selector", "app=from-flag"]);
        let from_flags = check_config_with_env(&with_flags, &env);
        assert_eq!(nats(&from_flags), json!("nats://flag:4222"), "{command:?}");
        assert_eq!(selector(&from_flags), json!("app=from-flag"), "{command:?}");
    }
}

#[test]
fn the_python_infera_variables_are_read_and_flags_override_them() {
    let tokenizer = tokenizer_dir();
    let tok = path_str(tokenizer.path());
    let server_env = [
        ("INFERA_ROUTER_MODE", "direct"),
        ("INFERA_REQUEST_MAX_RETRIES", "4"),
        ("INFERA_ENABLE_PROFILING", "1"),
        ("INFERA_ENABLE_SLA_METRICS", "yes"),
        ("INFERA_NATS_REQ_IDLE_TIMEOUT", "30"),
        ("INFERA_NATS_REQ_MAX_DURATION", "2m"),
        ("INFERA_NATS_REQ_MAX_PENDING", "8"),
        ("INFERA_BREAKER_FAILURE_THRESHOLD", "5"),
        ("INFERA_BREAKER_COOLDOWN_S", "2.5"),
        ("INFERA_BREAKER_MAX_COOLDOWN_S", "30"),
        ("INFERA_MIGRATION_LIMIT", "2"),
        ("INFERA_ROUTER_BACKEND", "rust"),
        ("INFERA_ROUTER_DEFAULT_RETENTION", "short"),
    ];
    let server = ["server", "--router-tokenizer-path", tok];
    let c = check_config_with_env(&server, &server_env);
    for (pointer, expected) in [
        ("/router/mode", json!("direct")),
        ("/router/request_max_retries", json!(4)),
        ("/router/default_retention", json!("short")),
        ("/enable_profiling", json!(true)),
        ("/enable_sla_metrics", json!(true)),
        ("/nats/req_idle_timeout", json!("30s")),
        ("/nats/req_max_duration", json!("2m")),
        ("/nats/req_max_pending", json!(8)),
        ("/worker_edge/breaker_failure_threshold", json!(5)),
        ("/worker_edge/breaker_cooldown_s", json!(2.5)),
        ("/worker_edge/breaker_max_cooldown_s", json!(30.0)),
        ("/worker_edge/migration_limit", json!(2)),
    ] {
        assert_eq!(c.pointer(pointer), Some(&expected), "{pointer} in {c}");
    }
    let mut flags = server.to_vec();
    flags.extend(["--router-mode", "auto", "--request-max-retries", "0"]);
    let c = check_config_with_env(&flags, &server_env);
    assert_eq!(c.pointer("/router/mode"), Some(&json!("auto")));
    assert_eq!(c.pointer("/router/request_max_retries"), Some(&json!(0)));

    let worker_env = [
        ("INFERA_DRAIN_TIMEOUT", "45"),
        ("INFERA_NATS_REQ_IDLE_TIMEOUT", "60"),
        ("INFERA_NATS_REQ_MAX_PENDING", "3"),
    ];
    let c = check_config_with_env(&["worker", "vllm", "--model", "m"], &worker_env);
    assert_eq!(c["drain_timeout"], json!("45s"), "{c}");
    assert_eq!(c["nats_req_idle_timeout"], json!("1m"), "{c}");
    assert_eq!(c["nats_req_max_pending"], json!(3), "{c}");
}

#[test]
fn the_engine_command_comes_from_the_flag_the_environment_or_the_engine() {
    let launch = |config: Value| config["launch"]["command"].clone();
    assert_eq!(
        launch(check_config(&["worker", "vllm", "--model", "m"])),
        json!(["vllm", "serve"])
    );
    assert_eq!(
        launch(check_config(&["worker", "sglang", "--model-path", "m"])),
        json!(["python3", "-m", "sglang.launch_server"])
    );
    let env = [("INFERA_ENGINE_CMD", "/bin/stand-in --fast")];
    assert_eq!(
        launch(check_config_with_env(
            &[
                "worker",
                "atom",
                "--model",
                "m",
                "--etcd-endpoint",
                "e:2379"
            ],
            &env
        )),
        json!(["/bin/stand-in", "--fast"])
    );
    assert_eq!(
        launch(check_config_with_env(
            &[
                "worker",
                "atom",
                "--model",
                "m",
                "--etcd-endpoint",
                "e:2379",
                "--engine-cmd",
                "/bin/other"
            ],
            &env
        )),
        json!(["/bin/other"])
    );
}

// ---------------------------------------------------------------------------------------------
// Worker arguments: Infera's are read, everything else reaches the engine in order.
// ---------------------------------------------------------------------------------------------

#[test]
fn vllm_forwards_engine_arguments_in_order() {
    let kv_transfer = r#"{"kv_connector":"NixlConnector","kv_role":"kv_producer"}"#;
    let config = check_config(&[
        "worker",
        "vllm",
        "--model-path",
        "m",
        "--port",
        "8001",
        "--tensor-parallel-size",
        "2",
        "--enable-prefix-caching",
        "--kv-transfer-config",
        kv_transfer,
        "--advertise-host=10.0.0.5",
        "--block-size=32",
        "--served-model-name",
        "--port",
        "--seed",
        "-1",
        "--no-enable-kv-events",
        "--",
        "--host",
        "engine-only",
    ]);
    assert_eq!(config["model"], json!("m"));
    assert_eq!(config["port"], json!(8001));
    assert_eq!(config["advertise_host"], json!("10.0.0.5"));
    assert_eq!(config["kv_events"]["enabled"], json!(false));
    let passthrough = json!([
        "--tensor-parallel-size",
        "2",
        "--enable-prefix-caching",
        "--kv-transfer-config",
        kv_transfer,
        "--block-size=32",
        "--served-model-name",
        "--port",
        "--seed",
        "-1",
        "--host",
        "engine-only"
    ]);
    assert_eq!(config["launch"]["passthrough"], passthrough);
    let mut args = json!(["--model", "m", "--host", "0.0.0.0", "--port", "8001"]);
    args.as_array_mut()
        .unwrap()
        .extend(passthrough.as_array().unwrap().iter().cloned());
    assert_eq!(config["launch"]["args"], args);
    assert_eq!(config["launch"]["kv_block_size"], json!(32));
    assert_eq!(config["launch"]["tensor_parallel_size"], json!(2));
    assert_eq!(config["launch"]["data_parallel_size"], Value::Null);
}

#[test]
fn sglang_forwards_engine_arguments_in_order() {
    let config = check_config(&[
        "worker",
        "sglang",
        "--model=org/model",
        "--tp-size",
        "4",
        "--page-size=64",
        "--disaggregation-mode",
        "prefill",
        "--host=127.0.0.1",
        "--dp-size",
        "2",
        "--cuda-graph-bs",
        "1",
        "2",
        "4",
        "--server-port",
        "30001",
    ]);
    assert_eq!(config["model"], json!("org/model"));
    assert_eq!(config["host"], json!("127.0.0.1"));
    assert_eq!(config["port"], json!(30001));
    assert_eq!(
        config["launch"]["passthrough"],
        json!([
            "--tp-size",
            "4",
            "--page-size=64",
            "--disaggregation-mode",
            "prefill",
            "--dp-size",
            "2",
            "--cuda-graph-bs",
            "1",
            "2",
            "4"
        ])
    );
    assert_eq!(
        config["launch"]["args"].as_array().unwrap()[..6],
        json!([
            "--model-path",
            "org/model",
            "--host",
            "127.0.0.1",
            "--port",
            "30001"
        ])
        .as_array()
        .unwrap()[..]
    );
    assert_eq!(config["launch"]["kv_block_size"], json!(64));
    assert_eq!(config["launch"]["tensor_parallel_size"], json!(4));
    assert_eq!(config["launch"]["data_parallel_size"], json!(2));
}

#[test]
fn atom_forwards_engine_arguments_in_order() {
    let config = check_config(&[
        "worker",
        "atom",
        "--model",
        "m",
        "--etcd-endpoint",
        "e:2379",
        "-tp",
        "8",
        "--server-port=8100",
        "--port",
        "29500",
        "--kv-transfer-config={\"kv_role\":\"kv_consumer\"}",
        "--block-size",
        "16",
    ]);
    assert_eq!(config["port"], json!(8100));
    assert_eq!(
        config["launch"]["passthrough"],
        json!([
            "-tp",
            "8",
            "--port",
            "29500",
            "--kv-transfer-config={\"kv_role\":\"kv_consumer\"}",
            "--block-size",
            "16"
        ])
    );
    assert_eq!(
        config["launch"]["args"].as_array().unwrap()[..6],
        json!(["--model", "m", "--host", "0.0.0.0", "--server-port", "8100"])
            .as_array()
            .unwrap()[..]
    );
    assert_eq!(config["launch"]["tensor_parallel_size"], json!(8));
    assert_eq!(config["launch"]["kv_block_size"], json!(16));
}

#[test]
fn mock_worker_registers_its_simulation() {
    let config = check_config(&["worker", "mock", "--model", "m", "--speedup", "4"]);
    assert_eq!(config["engine"], json!("mock"));
    assert_eq!(config["port"], json!(8000));
    assert_eq!(config["launch"]["kind"], json!("mock"));
    assert_eq!(config["launch"]["speedup"], json!(4.0));
    assert_eq!(
        config["launch"]["decode_coeffs"],
        json!([-25.74, 54.01, 5.74])
    );
    assert_eq!(config["drain_timeout"], json!("30s"));
    assert_eq!(config["nats_req_max_duration"], Value::Null);

    let config = check_config(&[
        "worker",
        "mock",
        "--model",
        "m",
        "--nats-req-max-duration",
        "90s",
    ]);
    assert_eq!(config["nats_req_max_duration"], json!("90s"));
}
