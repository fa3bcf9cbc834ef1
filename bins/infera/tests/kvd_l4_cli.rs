//! `infera kvd`'s L4 flags: `--long-backend lmcache` (L4 instead of L3), `--l4-backend lmcache`
//! (L4 behind L3), `--lmcache-config` with `${VAR}` expansion and `INFERA_L4_*` overrides,
//! `--l4-required`; what `--check-config` prints, what is refused (one line naming the flag),
//! and an L4 that does not answer at start: a warning, or with `--l4-required` an error.

#![allow(clippy::unwrap_used)]

use serde_json::{Value, json};
use std::io::BufRead;
use std::process::{Command, Output, Stdio};

const L4_VARS: &[&str] = &[
    "INFERA_L4_REMOTE_URL",
    "INFERA_L4_PREFIX",
    "INFERA_L4_MAX_VALUE_BYTES",
    "INFERA_L4_RPC_TIMEOUT_S",
    "RUST_LOG",
];

fn infera(args: &[&str], env: &[(&str, &str)]) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_infera"));
    command.args(args);
    for name in L4_VARS {
        command.env_remove(name);
    }
    command.envs(env.iter().copied());
    command
}

fn run(args: &[&str], env: &[(&str, &str)]) -> Output {
    infera(args, env).output().unwrap()
}

fn check_config(args: &[&str], env: &[(&str, &str)]) -> Value {
    let mut full = args.to_vec();
    full.push("--check-config");
    let out = run(&full, env);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{full:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

fn assert_refused(args: &[&str], env: &[(&str, &str)], flag: &str, says: &str) {
    let out = run(args, env);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
    let lines: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "{args:?} should fail on one line: {err}");
    assert!(
        lines[0].contains(flag) && lines[0].contains(says),
        "{args:?}: {err}"
    );
}

#[test]
fn lmcache_settings_resolve_with_the_environment_winning() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("lmcache.yaml");
    std::fs::write(
        &file,
        "remote_url: redis://:secret@127.0.0.1:${L4_PORT}/1\nprefix: from-file\n\
         rpc_timeout_s: 2.5\nchunk_size: 256\nconnector_extra:\n  pool_size: 8\n",
    )
    .unwrap();
    let path = file.to_str().unwrap();
    let env = [("L4_PORT", "7001"), ("INFERA_L4_PREFIX", "from-env")];
    let config = check_config(
        &["kvd", "--long-backend", "lmcache", "--lmcache-config", path],
        &env,
    );
    let l4 = &config["l4_tier"];
    assert_eq!(l4["store"], json!("lmcache"));
    assert_eq!(l4["placement"], json!("instead_of_l3"));
    assert_eq!(l4["remote_url"], json!("redis://***@127.0.0.1:7001/1"));
    assert_eq!(l4["prefix"], json!("from-env"));
    assert_eq!(l4["max_value_bytes"], json!(64 << 20));
    assert_eq!(l4["connector_extra"], json!(["pool_size"]));
    assert_eq!(l4["required"], json!(false));
    assert_eq!(config["long_tier"], Value::Null);
    assert!(!config.to_string().contains("secret"), "{config}");

    // Behind L3, configured from the environment alone.
    let config = check_config(
        &[
            "kvd",
            "--long-path",
            "/l3",
            "--l4-backend",
            "lmcache",
            "--l4-required",
        ],
        &[("INFERA_L4_REMOTE_URL", "lm://127.0.0.1:65432")],
    );
    assert_eq!(config["l4_tier"]["placement"], json!("behind_l3"));
    assert_eq!(config["l4_tier"]["required"], json!(true));
    assert_eq!(config["long_tier"]["layout"]["kind"], json!("single"));
    assert_eq!(check_config(&["kvd"], &[])["l4_tier"], Value::Null);
}

#[test]
fn mooncake_settings_resolve_from_the_python_kvds_file_and_variables() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("mooncake.yaml");
    std::fs::write(
        &file,
        "master_address: ${MASTER}:50051\ncluster_id: prod\nprotocol: tcp\n\
         metadata_server: P2PHANDSHAKE\nglobal_segment_size: 0\n",
    )
    .unwrap();
    let path = file.to_str().unwrap();
    let config = check_config(
        &[
            "kvd",
            "--long-backend",
            "mooncake",
            "--mooncake-config",
            path,
        ],
        &[("MASTER", "10.0.0.9"), ("INFERA_L4_CLUSTER_ID", "from-env")],
    );
    let l4 = &config["l4_tier"];
    assert_eq!(l4["store"], json!("mooncake"));
    assert_eq!(l4["placement"], json!("instead_of_l3"));
    assert_eq!(l4["remote_url"], json!("mooncake://10.0.0.9:50051"));
    assert_eq!(l4["prefix"], json!("from-env"));
    assert_eq!(
        config["inert_flags"],
        Value::Null,
        "--mooncake-config is read"
    );
    let stacked = check_config(
        &[
            "kvd",
            "--long-path",
            "/l3",
            "--l4-backend",
            "mooncake",
            "--mooncake-config",
            path,
        ],
        &[("MASTER", "10.0.0.9")],
    );
    assert_eq!(stacked["l4_tier"]["placement"], json!("behind_l3"));
    assert_eq!(stacked["l4_tier"]["prefix"], json!("prod"));
}

#[test]
fn l4_flag_mistakes_are_refused_on_one_line() {
    let url = [("INFERA_L4_REMOTE_URL", "redis://127.0.0.1:6379")];
    assert_refused(
        &["kvd", "--long-backend", "mooncake"],
        &[],
        "--mooncake-config",
        "master_address and cluster_id required",
    );
    assert_refused(
        &["kvd", "--long-backend", "mooncake", "--long-path", "/l3"],
        &[
            ("INFERA_L4_MASTER_ADDRESS", "127.0.0.1:50051"),
            ("INFERA_L4_CLUSTER_ID", "c"),
        ],
        "--long-backend",
        "--l4-backend mooncake",
    );
    assert_refused(
        &["kvd", "--long-backend", "mooncake"],
        &[
            ("INFERA_L4_MASTER_ADDRESS", "127.0.0.1:50051"),
            ("INFERA_L4_CLUSTER_ID", "c"),
            ("INFERA_L4_PROTOCOL", "rdma"),
            ("INFERA_L4_DEVICE_NAME", "no_such_rdma_device"),
        ],
        "--mooncake-config",
        "refusing to start",
    );
    assert_refused(
        &["kvd", "--long-backend", "lmcache", "--long-path", "/l3"],
        &url,
        "--long-backend",
        "--l4-backend lmcache",
    );
    assert_refused(
        &["kvd", "--l4-backend", "lmcache"],
        &url,
        "--l4-backend",
        "needs --long-path",
    );
    assert_refused(
        &["kvd", "--l4-required"],
        &url,
        "--l4-required",
        "needs an L4",
    );
    assert_refused(
        &["kvd", "--long-backend", "lmcache"],
        &[],
        "--lmcache-config",
        "remote_url is required",
    );
    assert_refused(
        &["kvd", "--long-backend", "lmcache"],
        &[("INFERA_L4_REMOTE_URL", "s3://host/bucket/kv")],
        "--lmcache-config",
        "expected s3://HOST[:PORT] or s3://HOST[:PORT]/BUCKET",
    );
    assert_refused(
        &[
            "kvd",
            "--long-backend",
            "lmcache",
            "--lmcache-config",
            "/no/such.yaml",
        ],
        &[],
        "--lmcache-config",
        "cannot read",
    );
}

/// A loopback port nothing listens on.
fn closed_port() -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap().port().to_string()
}

#[test]
fn an_l4_down_at_start_is_a_warning_unless_required() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("kvd.sock");
    let url = format!("redis://127.0.0.1:{}", closed_port());
    let env = [("INFERA_L4_REMOTE_URL", url.as_str())];
    let sock = socket.to_str().unwrap();
    let args = [
        "kvd",
        "--socket",
        sock,
        "--max-bytes",
        "64MiB",
        "--long-backend",
        "lmcache",
        "--kv-events-endpoint",
        "off",
    ];

    let mut required = args.to_vec();
    required.push("--l4-required");
    let out = run(&required, &env);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(err.contains("not reachable"), "{err}");

    let mut child = infera(&args, &env).stderr(Stdio::piped()).spawn().unwrap();
    let mut log = std::io::BufReader::new(child.stderr.take().unwrap());
    let mut seen = String::new();
    loop {
        let mut line = String::new();
        let n = log.read_line(&mut line).unwrap();
        assert!(n > 0, "kvd exited before listening:\n{seen}");
        seen.push_str(&line);
        if line.contains("kvd listening") {
            break;
        }
    }
    assert!(seen.contains("not reachable at start"), "{seen}");
    let kill = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(kill.success());
    assert_eq!(child.wait().unwrap().code(), Some(0));
}
