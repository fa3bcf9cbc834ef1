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
    let config = parse(&["atom", "--model-path", "m", "--server-port", "9000"]).unwrap();
    assert_eq!(
        process(&config).args,
        ["--model", "m", "--host", "0.0.0.0", "--server-port", "9000"]
    );
}

#[test]
fn atom_forwards_its_internal_port() {
    let config = parse(&["atom", "--model", "m", "--port", "29500"]).unwrap();
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
