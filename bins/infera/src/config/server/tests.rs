use super::*;
use crate::cli::Cli;
use clap::Parser;

fn tokenizer_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("tokenizer.json"), b"{}").unwrap();
    dir
}

/// Parses `infera server` with a tokenizer and the worker selector that kubernetes discovery (the
/// default) requires, then `extra`.
fn parse(extra: &[&str]) -> Result<ServerConfig, ConfigError> {
    parse_exactly(&[&["--k8s-label-selector", "app=worker"], extra].concat())
}

/// Parses `infera server` with a tokenizer, then `extra`.
fn parse_exactly(extra: &[&str]) -> Result<ServerConfig, ConfigError> {
    let dir = tokenizer_dir();
    let path = dir.path().to_str().unwrap().to_owned();
    let mut argv = vec!["infera", "server", "--router-tokenizer-path", &path];
    argv.extend_from_slice(extra);
    let cli = Cli::try_parse_from(argv).unwrap();
    match cli.command {
        crate::cli::Command::Server(args) => ServerConfig::try_from(*args),
        other => panic!("parsed as {other:?}"),
    }
}

#[test]
fn defaults_match_the_seed() {
    let config = parse(&[]).unwrap();
    assert_eq!(config.http.host, "0.0.0.0");
    assert_eq!(config.http.port, 8000);
    assert_eq!(config.http.max_body_bytes, ByteSize(32 << 20));
    assert_eq!(config.router.mode, RouterMode::Auto);
    assert_eq!(config.router.policy, PolicyKind::KV_AWARE);
    // The seed's (the python profile's); the infera profile's is the routing suite's.
    assert_eq!(config.router.kv_overlap_weight, 1.0);
    assert_eq!(config.router.balance_tokens, 0);
    let infera = parse(&["--router-profile", "infera"]).unwrap();
    assert_eq!(infera.router.kv_overlap_weight, 16.0);
    assert_eq!(infera.router.balance_tokens, 512);
    let given = parse(&["--kv-overlap-weight", "2", "--router-balance-tokens", "0"]).unwrap();
    assert_eq!(given.router.kv_overlap_weight, 2.0);
    assert_eq!(given.router.balance_tokens, 0);
    assert_eq!(config.router.kv_prefill_overlap_weight, None);
    assert_eq!(config.router.temperature, 0.0);
    assert_eq!(config.router.request_max_retries, 1);
    assert!(matches!(
        config.discovery,
        DiscoveryConfig::Kubernetes {
            namespace: None,
            ..
        }
    ));
    assert_eq!(config.request_transport, RequestTransport::Nats);
    assert_eq!(config.kv_event_transport, KvEventTransport::Nats);
    assert_eq!(config.nats.req_idle_timeout, Some("900s".parse().unwrap()));
    assert_eq!(config.nats.req_max_duration, None);
    assert_eq!(config.nats.req_max_pending, None);
    assert_eq!(config.event_log, EventLogConfig::Memory);
    assert_eq!(config.record_trace, None);
    assert!(config.router.tokenizer_file.ends_with("tokenizer.json"));
}

#[test]
fn the_config_round_trips_through_json() {
    let config = parse(&["--kv-prefill-overlap-weight", "20", "--event-log", "nats"]).unwrap();
    let json = serde_json::to_string(&config).unwrap();
    let back: ServerConfig = serde_json::from_str(&json).unwrap();
    assert_eq!(back, config);
}

#[test]
fn negative_weights_and_temperature_are_rejected() {
    for (flag, value) in [
        ("--kv-overlap-weight", "-1"),
        ("--kv-prefill-overlap-weight", "-0.5"),
        ("--kv-decode-overlap-weight", "-2"),
        ("--router-temperature", "-0.1"),
        ("--router-resident-weight", "-1"),
    ] {
        let error = parse(&[flag, value]).unwrap_err();
        assert_eq!(error.flag, flag);
    }
    assert!(parse(&["--kv-overlap-weight", "0", "--router-temperature", "0.5"]).is_ok());
    let resident = parse(&["--router-resident-weight", "0.5"]).unwrap();
    assert_eq!(resident.router.resident_weight, 0.5);
    assert_eq!(parse(&[]).unwrap().router.resident_weight, 0.0);
    let balance = parse(&["--router-balance-tokens", "1"]).unwrap();
    assert_eq!(balance.router.balance_tokens, 1);
    let negative = ["infera", "server", "--router-balance-tokens", "-1"];
    assert!(Cli::try_parse_from(negative).is_err());
}

#[test]
fn event_log_specs_parse() {
    let log = |spec: &str| parse(&["--event-log", spec]).map(|c| c.event_log);
    assert_eq!(log("memory"), Ok(EventLogConfig::Memory));
    let nats = parse(&[
        "--event-log",
        "nats",
        "--nats-server",
        "nats://10.0.0.1:4222",
    ]);
    assert_eq!(
        nats.map(|c| c.event_log),
        Ok(EventLogConfig::Jetstream(JetStreamLogConfig::new(
            "nats://10.0.0.1:4222"
        )))
    );
    assert!(matches!(
        log("nats://h:4222?stream=S"),
        Ok(EventLogConfig::Jetstream(c)) if c.stream == "S"
    ));
    assert_eq!(
        log("sqlite:///tmp/events.db"),
        Ok(EventLogConfig::Sqlite(SqliteLogConfig {
            path: "/tmp/events.db".into()
        }))
    );
    assert!(matches!(
        log("postgresql://u@h/db"),
        Ok(EventLogConfig::Postgres(_))
    ));
    for bad in ["sqlite:", "redis://x"] {
        let error = parse(&["--event-log", bad]).unwrap_err();
        assert_eq!(error.flag, "--event-log");
        assert!(error.to_string().contains("sqlite:PATH"), "{error}");
    }
}

#[test]
fn sqlite_event_log_needs_an_existing_directory() {
    let error = parse(&["--event-log", "sqlite:/no/such/dir/events.db"]).unwrap_err();
    assert_eq!(error.flag, "--event-log");
    assert!(parse(&["--event-log", "sqlite:events.db"]).is_ok());
}

#[test]
fn record_prompts_needs_record_trace() {
    assert_eq!(
        parse(&["--record-prompts"]).unwrap_err().flag,
        "--record-prompts"
    );
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("trace");
    let config = parse(&[
        "--record-trace",
        trace.to_str().unwrap(),
        "--record-prompts",
    ])
    .unwrap();
    assert_eq!(
        config.record_trace,
        Some(TraceRecordingConfig {
            dir: trace.clone(),
            prompts: true,
            segment_bytes: "64MiB".parse().unwrap(),
            segment_age: "60s".parse().unwrap(),
        })
    );
}

#[test]
fn tokenizer_paths_are_checked_for_readability() {
    assert_eq!(tokenizer(None).unwrap_err().flag, "--router-tokenizer-path");
    let empty = tempfile::tempdir().unwrap();
    let error = tokenizer(Some(empty.path().into())).unwrap_err();
    assert!(error.reason.contains("without tokenizer.json"), "{error}");
    let error = tokenizer(Some(empty.path().join("missing.json"))).unwrap_err();
    assert!(error.reason.contains("does not exist"), "{error}");
    let file = empty.path().join("tok.json");
    std::fs::write(&file, b"{}").unwrap();
    assert_eq!(tokenizer(Some(file.clone())).unwrap(), (file.clone(), file));
}

#[test]
fn each_model_tokenizer_names_its_model_once_and_a_readable_tokenizer() {
    let other = tokenizer_dir();
    let path = other.path().to_str().unwrap().to_owned();
    let one = format!("llama={path}");
    let config = parse(&["--model-tokenizer", &one]).unwrap();
    let [(model, given, file)] = config.router.model_tokenizers.as_slice() else {
        panic!("{:?}", config.router.model_tokenizers)
    };
    assert_eq!(
        (model.as_str(), given, file),
        (
            "llama",
            &other.path().to_path_buf(),
            &other.path().join("tokenizer.json")
        )
    );
    assert!(parse(&[]).unwrap().router.model_tokenizers.is_empty());
    for bad in ["llama", "=x", "llama="] {
        let error = parse(&["--model-tokenizer", bad]).unwrap_err();
        assert_eq!(error.flag, "--model-tokenizer");
        assert!(error.reason.contains("MODEL=PATH"), "{error}");
    }
    let twice = parse(&["--model-tokenizer", &one, "--model-tokenizer", &one]).unwrap_err();
    assert!(twice.reason.contains("given twice"), "{twice}");
    let missing = parse(&["--model-tokenizer", "llama=/no/such/dir/x.json"]).unwrap_err();
    assert_eq!(missing.flag, "--model-tokenizer");
    assert!(missing.reason.contains("does not exist"), "{missing}");
}

#[test]
fn on_demand_adapter_loading_is_off_by_default_and_needs_a_name_in_its_path() {
    assert_eq!(parse(&[]).unwrap().router.lora_loading, None);
    let on = parse(&["--lora-load-path", "/a/{name}", "--lora-load-base", "q"]).unwrap();
    let loading = on.router.lora_loading.unwrap();
    assert_eq!(
        (loading.path_template.as_str(), loading.base.as_deref()),
        ("/a/{name}", Some("q"))
    );
    assert_eq!(loading.timeout, std::time::Duration::from_secs(60));
    let nameless = parse(&["--lora-load-path", "/a/b"]).unwrap_err();
    assert_eq!(nameless.flag, "--lora-load-path");
    let forever = ["--lora-load-path", "/a/{name}", "--lora-load-timeout", "0"];
    assert_eq!(parse(&forever).unwrap_err().flag, "--lora-load-timeout");
}

#[test]
fn kubernetes_discovery_needs_a_label_selector_as_in_the_python_server() {
    let error = parse_exactly(&[]).unwrap_err();
    assert_eq!(error.flag, "--k8s-label-selector");
    assert!(
        error.reason.contains("--discovery-backend kubernetes"),
        "{error}"
    );
    let blank = parse_exactly(&["--k8s-label-selector", " "]).unwrap_err();
    assert_eq!(blank.flag, "--k8s-label-selector");
    let etcd = [
        "--discovery-backend",
        "etcd",
        "--etcd-endpoint",
        "127.0.0.1",
    ];
    assert!(matches!(
        parse_exactly(&etcd).unwrap().discovery,
        DiscoveryConfig::Etcd { .. }
    ));
}

#[test]
fn client_bounds_default_on_turn_off_with_zero_and_the_token_stays_secret() {
    let config = parse(&[]).unwrap();
    assert_eq!(
        config.http.client_header_timeout,
        Some("10s".parse().unwrap())
    );
    assert_eq!(
        config.http.client_idle_timeout,
        Some("60s".parse().unwrap())
    );
    assert_eq!(
        config.http.client_body_timeout,
        Some("60s".parse().unwrap())
    );
    assert_eq!(
        config.http.client_write_timeout,
        Some("60s".parse().unwrap())
    );
    assert_eq!(config.http.max_connections, None);
    assert_eq!(config.http.parse_budget, ByteSize(512 << 20));
    assert_eq!(config.http.admin_token, None);
    let config = parse(&[
        "--client-header-timeout",
        "0",
        "--client-idle-timeout",
        "0",
        "--client-body-timeout",
        "2m",
        "--client-write-timeout",
        "0",
        "--max-connections",
        "100",
        "--parse-budget",
        "0",
        "--admin-token",
        "s3cret-token",
    ])
    .unwrap();
    assert_eq!(config.http.client_header_timeout, None);
    assert_eq!(config.http.client_idle_timeout, None);
    assert_eq!(
        config.http.client_body_timeout,
        Some("120s".parse().unwrap())
    );
    assert_eq!(config.http.client_write_timeout, None);
    assert_eq!(config.http.max_connections, Some(100));
    assert_eq!(config.http.parse_budget, ByteSize(0));
    let token = config.http.admin_token.as_ref().unwrap();
    assert_eq!(token.expose(), "s3cret-token");
    let printed = format!("{} {config:?}", serde_json::to_string(&config).unwrap());
    assert!(!printed.contains("s3cret"), "{printed}");
    for (flag, value) in [
        ("--max-connections", "0"),
        ("--admin-token", ""),
        ("--admin-token", "two words"),
    ] {
        assert_eq!(
            parse(&[flag, value]).unwrap_err().flag,
            flag,
            "{flag} {value:?}"
        );
    }
}

#[test]
fn zero_max_body_bytes_is_rejected() {
    assert_eq!(
        parse(&["--max-body-bytes", "0"]).unwrap_err().flag,
        "--max-body-bytes"
    );
}

#[test]
fn each_backend_flag_is_accepted_exactly_when_this_build_has_its_backend() {
    use crate::config::assert_accepted_iff_built;
    use crate::wiring::Backend::{Etcd, Kubernetes, Nats, Sql, Zmq};
    let dir = tempfile::tempdir().unwrap();
    let sqlite = format!("sqlite:{}", dir.path().join("events.db").display());
    let k8s = ["--discovery-backend", "kubernetes"];
    let plain = ["--request-transport", "http", "--kv-event-transport", "zmq"];
    let cases: [(Vec<&str>, &[_]); 5] = [
        (
            [&k8s[..], &plain].concat(),
            &[
                (Kubernetes, "--discovery-backend", "kubernetes"),
                (Zmq, "--kv-event-transport", "zmq"),
            ],
        ),
        (
            [
                &[
                    "--discovery-backend",
                    "etcd",
                    "--etcd-endpoint",
                    "127.0.0.1:2379",
                ][..],
                &plain,
            ]
            .concat(),
            &[
                (Etcd, "--discovery-backend", "etcd"),
                (Zmq, "--kv-event-transport", "zmq"),
            ],
        ),
        (
            [
                &k8s[..],
                &[
                    "--request-transport",
                    "nats",
                    "--kv-event-transport",
                    "nats",
                ],
            ]
            .concat(),
            &[
                (Kubernetes, "--discovery-backend", "kubernetes"),
                (Nats, "--request-transport", "nats"),
                (Nats, "--kv-event-transport", "nats"),
            ],
        ),
        (
            [&k8s[..], &plain, &["--event-log", &sqlite]].concat(),
            &[
                (Kubernetes, "--discovery-backend", "kubernetes"),
                (Zmq, "--kv-event-transport", "zmq"),
                (Sql, "--event-log", "sqlite"),
            ],
        ),
        (
            [&k8s[..], &plain, &["--event-log", "nats"]].concat(),
            &[
                (Kubernetes, "--discovery-backend", "kubernetes"),
                (Zmq, "--kv-event-transport", "zmq"),
                (Nats, "--event-log", "nats"),
            ],
        ),
    ];
    for (argv, needs) in cases {
        assert_accepted_iff_built(&parse(&argv), needs);
    }
}
