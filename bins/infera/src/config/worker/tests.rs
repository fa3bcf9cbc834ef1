use super::*;
use crate::cli::{Command, parse_from};

fn parse(argv: &[&str]) -> Result<WorkerConfig, ConfigError> {
    let mut full = vec!["infera", "worker"];
    full.extend_from_slice(argv);
    match parse_from(full).unwrap().command {
        Command::Worker(command) => WorkerConfig::try_from(command),
        other => panic!("parsed as {other:?}"),
    }
}

fn process(config: &WorkerConfig) -> &EngineProcessConfig {
    match &config.launch {
        LaunchConfig::Process(process) => process,
        LaunchConfig::Mock(_) => panic!("expected a process launch"),
    }
}

#[test]
fn vllm_re_emits_model_host_and_port_in_its_spelling() {
    let config = parse(&["vllm", "--model-path", "m", "--port", "8001", "--foo"]).unwrap();
    let launch = process(&config);
    assert_eq!(launch.command, ["vllm", "serve"]);
    assert_eq!(
        launch.args,
        [
            "--model", "m", "--host", "0.0.0.0", "--port", "8001", "--foo"
        ]
    );
    assert_eq!(launch.passthrough, ["--foo"]);
    assert_eq!(config.advertise_host, "0.0.0.0");
}

#[test]
fn sglang_and_atom_use_their_own_spellings_and_default_ports() {
    let config = parse(&["sglang", "--model", "m"]).unwrap();
    assert_eq!(config.port, 30000);
    assert_eq!(
        process(&config).args,
        ["--model-path", "m", "--host", "0.0.0.0", "--port", "30000"]
    );
    let config = parse(&[
        "atom",
        "--model-path",
        "m",
        "--server-port",
        "9000",
        "--etcd-endpoint",
        "e:2379",
    ])
    .unwrap();
    assert_eq!(
        process(&config).args,
        ["--model", "m", "--host", "0.0.0.0", "--server-port", "9000"]
    );
}

#[test]
fn atom_forwards_its_internal_port() {
    let config = parse(&[
        "atom",
        "--model",
        "m",
        "--port",
        "29500",
        "--etcd-endpoint",
        "e:2379",
    ])
    .unwrap();
    assert_eq!(config.port, 8000);
    assert_eq!(process(&config).passthrough, ["--port", "29500"]);
}

#[test]
fn engine_sizes_are_peeked_but_still_forwarded() {
    let config = parse(&[
        "vllm",
        "--model",
        "m",
        "-tp",
        "2",
        "--block-size=32",
        "--data-parallel-size",
        "4",
    ])
    .unwrap();
    let launch = process(&config);
    assert_eq!(launch.kv_block_size, Some(32));
    assert_eq!(launch.tensor_parallel_size, Some(2));
    assert_eq!(launch.data_parallel_size, Some(4));
    assert_eq!(
        launch.passthrough,
        ["-tp", "2", "--block-size=32", "--data-parallel-size", "4"]
    );
    let config = parse(&[
        "sglang",
        "--model-path",
        "m",
        "--page-size",
        "64",
        "--tp-size",
        "8",
    ])
    .unwrap();
    assert_eq!(process(&config).kv_block_size, Some(64));
    assert_eq!(process(&config).tensor_parallel_size, Some(8));
}

#[test]
fn sglang_sizes_are_read_through_argparse_abbreviations() {
    // SGLang's argparse reads a unique prefix as the flag: `--dp 8` is `--dp-size 8`.
    let config = parse(&[
        "sglang",
        "--model-path",
        "m",
        "--dp",
        "8",
        "--tp=4",
        "--page",
        "32",
    ])
    .unwrap();
    let launch = process(&config);
    assert_eq!(launch.data_parallel_size, Some(8));
    assert_eq!(launch.tensor_parallel_size, Some(4));
    assert_eq!(launch.kv_block_size, Some(32));
    // Forwarded as written: SGLang reads them the same way.
    assert_eq!(launch.passthrough, ["--dp", "8", "--tp=4", "--page", "32"]);
    // The last spelling wins, abbreviated or not.
    let config = parse(&[
        "sglang",
        "--model-path",
        "m",
        "--dp-size",
        "2",
        "--data-parallel",
        "4",
    ])
    .unwrap();
    assert_eq!(process(&config).data_parallel_size, Some(4));
    // An abbreviated value is checked like a spelled-out one, under the flag it stands for.
    let error = parse(&["sglang", "--model-path", "m", "--dp", "x"]).unwrap_err();
    assert_eq!(error.flag, "--dp-size");
}

#[test]
fn only_an_unambiguous_prefix_of_an_sglang_flag_is_read() {
    // `--d` and `--t` start several SGLang flags (argparse refuses them as ambiguous);
    // `--tp-size-x` starts none.
    for argv in [
        &["--d", "8"][..],
        &["--t", "8"][..],
        &["--tp-size-x", "8"][..],
    ] {
        let mut full = vec!["sglang", "--model-path", "m"];
        full.extend_from_slice(argv);
        let config = parse(&full).unwrap();
        assert_eq!(process(&config).data_parallel_size, None, "{argv:?}");
        assert_eq!(process(&config).tensor_parallel_size, None, "{argv:?}");
    }
}

#[test]
fn vllm_and_atom_sizes_count_in_exact_spellings_only() {
    // The Python launchers parse vLLM and ATOM arguments with allow_abbrev=False.
    let config = parse(&[
        "vllm",
        "--model",
        "m",
        "--data-parallel",
        "8",
        "--tensor",
        "2",
    ])
    .unwrap();
    assert_eq!(process(&config).data_parallel_size, None);
    assert_eq!(process(&config).tensor_parallel_size, None);
    let config = parse(&[
        "atom",
        "--model",
        "m",
        "--etcd-endpoint",
        "e:2379",
        "--tensor-parallel",
        "8",
        "--block",
        "32",
    ])
    .unwrap();
    assert_eq!(process(&config).tensor_parallel_size, None);
    assert_eq!(process(&config).kv_block_size, None);
}

#[test]
fn every_sglang_flag_read_is_one_sglang_has() {
    // Otherwise none of its abbreviations would be read.
    let known = EngineKind::Sglang.abbreviable_flags().unwrap();
    for flag in [
        EngineKind::Sglang.block_size_flags(),
        EngineKind::Sglang.tensor_parallel_flags(),
        EngineKind::Sglang.data_parallel_flags(),
    ]
    .concat()
    {
        assert!(known.contains(&flag), "{flag}");
    }
    assert!(EngineKind::Vllm.abbreviable_flags().is_none());
    assert!(EngineKind::Atom.abbreviable_flags().is_none());
}

#[test]
fn engine_flag_value_reads_abbreviations_only_for_sglang() {
    let args: Vec<String> = [
        "--disaggregation-m",
        "decode",
        "--served=chat",
        "--port",
        "1",
    ]
    .map(str::to_owned)
    .into();
    let read = |engine, flag| engine_flag_value(engine, &args, &[flag]);
    assert_eq!(
        read(EngineKind::Sglang, "--disaggregation-mode"),
        Some(("--disaggregation-mode", "decode"))
    );
    assert_eq!(
        read(EngineKind::Sglang, "--served-model-name"),
        Some(("--served-model-name", "chat"))
    );
    assert_eq!(read(EngineKind::Vllm, "--served-model-name"), None);
    // `--port` is SGLang's own flag, never an abbreviation of another.
    assert_eq!(read(EngineKind::Sglang, "--port-x"), None);
    assert!(engine_flag_given(
        EngineKind::Sglang,
        &args,
        &["--disaggregation-mode"]
    ));
    assert!(!engine_flag_given(
        EngineKind::Atom,
        &args,
        &["--disaggregation-mode"]
    ));
}

#[test]
fn an_unreadable_engine_size_names_the_engine_flag() {
    let error = parse(&["sglang", "--model-path", "m", "--page-size", "big"]).unwrap_err();
    assert_eq!(error.flag, "--page-size");
    let error = parse(&["vllm", "--model", "m", "--block-size", "0"]).unwrap_err();
    assert_eq!(error.flag, "--block-size");
}

#[test]
fn the_model_is_required_in_the_engine_spelling() {
    assert_eq!(parse(&["vllm"]).unwrap_err().flag, "--model");
    assert_eq!(parse(&["sglang"]).unwrap_err().flag, "--model-path");
    assert_eq!(parse(&["mock"]).unwrap_err().flag, "--model-path");
    assert_eq!(
        parse(&["vllm", "--model", "m", "--port", "0"])
            .unwrap_err()
            .flag,
        "--port"
    );
}

#[test]
fn atom_defaults_to_the_python_launchers_etcd_http_and_no_kv_events() {
    // python -m infera.engine.atom --model … --etcd-endpoint 127.0.0.1:2379
    let config = parse(&["atom", "--model", "m", "--etcd-endpoint", "127.0.0.1:2379"]).unwrap();
    assert_eq!(
        config.discovery,
        DiscoveryConfig::Etcd {
            endpoint: "127.0.0.1:2379".to_owned(),
            prefix: "/infera/workers/".to_owned(),
        }
    );
    assert_eq!(config.request_transport, RequestTransport::Http);
    assert!(!config.kv_events.enabled);
    let config = parse(&[
        "atom",
        "--model",
        "m",
        "--etcd-endpoint",
        "e:2379",
        "--enable-kv-events",
    ])
    .unwrap();
    assert!(config.kv_events.enabled);
}

#[test]
fn atom_needs_an_etcd_endpoint_unless_another_backend_is_chosen() {
    let error = parse(&["atom", "--model", "m"]).unwrap_err();
    assert_eq!(error.flag, "--etcd-endpoint");
    assert!(
        error.to_string().contains("atom workers register in etcd"),
        "{error}"
    );
    let error = parse(&["atom", "--model", "m", "--discovery-backend", "etcd"]).unwrap_err();
    assert_eq!(error.flag, "--etcd-endpoint");
    let config = parse(&["atom", "--model", "m", "--discovery-backend", "kubernetes"]).unwrap();
    assert!(matches!(
        config.discovery,
        DiscoveryConfig::Kubernetes { .. }
    ));
}

#[test]
fn atom_takes_the_extension_flags_when_given() {
    let config = parse(&[
        "atom",
        "--model",
        "m",
        "--discovery-backend",
        "kubernetes",
        "--request-transport",
        "nats",
        "--no-enable-kv-events",
        "--enable-kv-events",
    ])
    .unwrap();
    assert!(matches!(
        config.discovery,
        DiscoveryConfig::Kubernetes { .. }
    ));
    assert_eq!(config.request_transport, RequestTransport::Nats);
    assert!(config.kv_events.enabled);
}

#[test]
fn the_other_engines_keep_kubernetes_nats_and_kv_events() {
    for argv in [
        &["vllm", "--model", "m"][..],
        &["sglang", "--model-path", "m"][..],
        &["mock", "--model-path", "m"][..],
    ] {
        let config = parse(argv).unwrap();
        assert!(
            matches!(config.discovery, DiscoveryConfig::Kubernetes { .. }),
            "{argv:?}"
        );
        assert_eq!(config.request_transport, RequestTransport::Nats, "{argv:?}");
        assert!(config.kv_events.enabled, "{argv:?}");
    }
    let config = parse(&["vllm", "--model", "m", "--request-transport", "http"]).unwrap();
    assert_eq!(config.request_transport, RequestTransport::Http);
}

#[test]
fn kv_events_default_on_and_the_last_switch_wins() {
    let enabled = |argv: &[&str]| parse(argv).unwrap().kv_events.enabled;
    assert!(enabled(&["mock", "--model-path", "m"]));
    assert!(!enabled(&[
        "mock",
        "--model-path",
        "m",
        "--no-enable-kv-events"
    ]));
    assert!(enabled(&[
        "mock",
        "--model-path",
        "m",
        "--no-enable-kv-events",
        "--enable-kv-events"
    ]));
    assert!(!enabled(&[
        "vllm",
        "--model",
        "m",
        "--enable-kv-events",
        "--no-enable-kv-events"
    ]));
}

#[test]
fn mock_defaults_and_checks() {
    let config = parse(&["mock", "--model-path", "m"]).unwrap();
    let LaunchConfig::Mock(mock) = &config.launch else {
        panic!("expected the mock engine");
    };
    assert_eq!(mock.gpu_blocks, 16384);
    assert_eq!(mock.block_size, 16);
    assert_eq!(mock.max_batched_tokens, 8192);
    assert_eq!(mock.max_seqs, 256);
    assert_eq!(mock.speedup, 1.0);
    assert_eq!(mock.prefill_coeffs, TimingCoeffs([4.21e-7, 0.01518, 16.5]));
    assert_eq!(mock.decode_coeffs, TimingCoeffs([-25.74, 54.01, 5.74]));
    for flag in [
        "--gpu-blocks",
        "--block-size",
        "--max-batched-tokens",
        "--max-seqs",
        "--speedup",
    ] {
        let error = parse(&["mock", "--model-path", "m", flag, "0"]).unwrap_err();
        assert_eq!(error.flag, flag);
    }
}

#[test]
fn timing_coefficients_parse() {
    assert_eq!("1,2,3".parse(), Ok(TimingCoeffs([1.0, 2.0, 3.0])));
    assert_eq!(
        " -1 , 2e-3 ,0".parse(),
        Ok(TimingCoeffs([-1.0, 0.002, 0.0]))
    );
    assert!("1,2".parse::<TimingCoeffs>().is_err());
    assert!("1,2,x".parse::<TimingCoeffs>().is_err());
    assert!("1,2,inf".parse::<TimingCoeffs>().is_err());
}

#[test]
fn an_empty_engine_command_is_rejected() {
    let error = parse(&["vllm", "--model", "m", "--engine-cmd", " "]).unwrap_err();
    assert_eq!(error.flag, "--engine-cmd");
}

#[test]
fn the_config_round_trips_through_json() {
    for argv in [
        &["vllm", "--model", "m", "--tensor-parallel-size", "2"][..],
        &["mock", "--model-path", "m", "--speedup", "10"][..],
    ] {
        let config = parse(argv).unwrap();
        let json = serde_json::to_string(&config).unwrap();
        assert_eq!(serde_json::from_str::<WorkerConfig>(&json).unwrap(), config);
    }
}

#[test]
fn each_backend_flag_is_accepted_exactly_when_this_worker_uses_a_backend_this_build_has() {
    use crate::config::assert_accepted_iff_built;
    use crate::wiring::Backend::{Kubernetes, Nats, Zmq};
    let k8s = (Kubernetes, "--discovery-backend", "kubernetes");
    let kv = |transport| {
        [
            "--request-transport",
            "http",
            "--kv-event-transport",
            transport,
        ]
    };
    let cases: [(Vec<&str>, &[_]); 5] = [
        // the mock publishes its own events
        (
            [&["mock", "--model", "m"][..], &kv("zmq")].concat(),
            &[k8s, (Zmq, "--kv-event-transport", "zmq")],
        ),
        // a real engine publishes on ZeroMQ itself; the server reads it
        ([&["vllm", "--model", "m"][..], &kv("zmq")].concat(), &[k8s]),
        // the worker relays a real engine's ZeroMQ events onto NATS
        (
            [&["vllm", "--model", "m"][..], &kv("nats")].concat(),
            &[
                k8s,
                (Nats, "--kv-event-transport", "nats"),
                (Zmq, "--kv-event-transport", "nats"),
            ],
        ),
        (
            vec![
                "mock",
                "--model",
                "m",
                "--request-transport",
                "nats",
                "--no-enable-kv-events",
            ],
            &[k8s, (Nats, "--request-transport", "nats")],
        ),
        (
            [
                &[
                    "mock",
                    "--model",
                    "m",
                    "--discovery-backend",
                    "etcd",
                    "--etcd-endpoint",
                    "e:2379",
                ][..],
                &kv("zmq"),
            ]
            .concat(),
            &[
                (crate::wiring::Backend::Etcd, "--discovery-backend", "etcd"),
                (Zmq, "--kv-event-transport", "zmq"),
            ],
        ),
    ];
    for (argv, needs) in cases {
        assert_accepted_iff_built(&parse(&argv), needs);
    }
}
