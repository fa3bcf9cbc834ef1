use super::*;
use crate::cli::{Command, parse_from};
use crate::config::worker::LaunchConfig;

const PORTS: FreePorts = FreePorts {
    events: 5557,
    replay: 5558,
    atom_internal: 29500,
};

fn plan_for(argv: &[&str], env: &[(&str, &str)]) -> Result<LaunchPlan, LaunchError> {
    let mut full = vec!["infera", "worker"];
    full.extend_from_slice(argv);
    let Command::Worker(command) = parse_from(full).unwrap().command else {
        panic!("not a worker command");
    };
    let config = WorkerConfig::try_from(command).unwrap();
    let LaunchConfig::Process(process) = &config.launch else {
        panic!("not a process engine");
    };
    let lookup = |key: &str| {
        env.iter()
            .find(|(k, _)| *k == key)
            .map(|(_, v)| (*v).to_owned())
    };
    plan(&config, process, &lookup, PORTS)
}

fn strings(args: &[&str]) -> Vec<String> {
    args.iter().map(|s| (*s).to_owned()).collect()
}

#[test]
fn vllm_gets_kv_events_and_a_fixed_hash_seed() {
    let plan = plan_for(
        &[
            "vllm",
            "--model",
            "m",
            "--port",
            "8001",
            "--advertise-host",
            "10.0.0.5",
            "--tensor-parallel-size",
            "2",
            "--served-model-name",
            "chat",
        ],
        &[],
    )
    .unwrap();
    assert_eq!(plan.program, "vllm");
    assert_eq!(
        &strings(&[
            "serve",
            "--model",
            "m",
            "--host",
            "0.0.0.0",
            "--port",
            "8001",
            "--tensor-parallel-size",
            "2",
            "--served-model-name",
            "chat",
            "--kv-cache-dtype",
            "fp8_e4m3",
            "--kv-events-config",
        ])[..],
        &plan.args[..plan.args.len() - 1]
    );
    let kv: Value = serde_json::from_str(plan.args.last().unwrap()).unwrap();
    assert_eq!(
        kv,
        json!({"enable_kv_cache_events": true, "publisher": "zmq",
            "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558",
            "topic": "kv-events"})
    );
    assert_eq!(
        plan.env,
        vec![
            ("PYTHONHASHSEED".to_owned(), "0".to_owned()),
            (
                "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES".to_owned(),
                "1".to_owned()
            ),
        ]
    );
    assert_eq!(
        plan.kv_events_endpoint.as_deref(),
        Some("tcp://10.0.0.5:5557")
    );
    assert_eq!(plan.served_model, "chat");
    assert_eq!((plan.role, plan.kv_block_size), (Role::Mixed, Some(16)));
}

#[test]
fn vllm_refuses_another_hash_seed_and_keeps_zero() {
    let error = plan_for(&["vllm", "--model", "m"], &[("PYTHONHASHSEED", "42")]).unwrap_err();
    assert!(error.to_string().contains("PYTHONHASHSEED=42"), "{error}");
    let plan = plan_for(&["vllm", "--model", "m"], &[("PYTHONHASHSEED", "0")]).unwrap();
    assert!(plan.env.iter().all(|(k, _)| k != "PYTHONHASHSEED"));
}

#[test]
fn a_users_kv_events_config_is_kept_and_advertised() {
    let given = r#"{"publisher":"zmq","endpoint":"tcp://*:7000","topic":"kv-events"}"#;
    let plan = plan_for(
        &[
            "sglang",
            "--model-path",
            "m",
            "--host",
            "127.0.0.1",
            "--kv-events-config",
            given,
        ],
        &[],
    )
    .unwrap();
    assert_eq!(
        plan.args
            .iter()
            .filter(|a| *a == "--kv-events-config")
            .count(),
        1
    );
    assert_eq!(
        plan.kv_events_endpoint.as_deref(),
        Some("tcp://127.0.0.1:7000")
    );
    let error = plan_for(
        &["sglang", "--model-path", "m", "--kv-events-config", "{"],
        &[],
    )
    .unwrap_err();
    assert!(
        error
            .to_string()
            .contains("--kv-events-config is not valid JSON")
    );
}

#[test]
fn sglang_pd_registers_its_bootstrap() {
    let plan = plan_for(
        &[
            "sglang",
            "--model-path",
            "m",
            "--advertise-host",
            "node1",
            "--page-size",
            "32",
            "--dp-size",
            "4",
            "--disaggregation-mode",
            "prefill",
            "--disaggregation-bootstrap-port",
            "9000",
            "--disaggregation-transfer-backend",
            "mooncake",
        ],
        &[],
    )
    .unwrap();
    assert_eq!(plan.program, "python3");
    assert_eq!(
        &plan.args[..2],
        &strings(&["-m", "sglang.launch_server"])[..]
    );
    let kv: Value = serde_json::from_str(plan.args.last().unwrap()).unwrap();
    assert_eq!(
        kv,
        json!({"publisher": "zmq", "endpoint": "tcp://*:5557", "topic": "kv-events"})
    );
    assert!(plan.env.is_empty());
    assert_eq!(plan.role, Role::Prefill);
    assert_eq!(
        (plan.dp_rank, plan.dp_size, plan.kv_block_size),
        (0, 4, Some(32))
    );
    assert_eq!(
        plan.disagg_meta,
        Some(json!({"protocol": "sglang-bootstrap", "params": {
            "bootstrap_host": "node1", "bootstrap_port": 9000, "transfer_backend": "mooncake"}}))
    );
    assert_eq!(
        plan_for(&["sglang", "--model-path", "m"], &[])
            .unwrap()
            .kv_block_size,
        None
    );
}

#[test]
fn atom_gets_events_by_environment_and_an_internal_port() {
    let plan = plan_for(
        &[
            "atom",
            "--model",
            "m",
            "--server-port",
            "8002",
            "-tp",
            "8",
            "--kv-transfer-config",
            r#"{"kv_role":"kv_consumer","kv_connector":"mooncake"}"#,
        ],
        &[],
    )
    .unwrap();
    assert_eq!(
        plan.args,
        strings(&[
            "-m",
            "atom.entrypoints.openai_server",
            "--model",
            "m",
            "--host",
            "0.0.0.0",
            "--server-port",
            "8002",
            "-tp",
            "8",
            "--kv-transfer-config",
            r#"{"kv_role":"kv_consumer","kv_connector":"mooncake"}"#,
            "--port",
            "29500",
        ])
    );
    assert_eq!(
        plan.env,
        vec![
            ("ATOM_KV_EVENTS_ENABLE".to_owned(), "1".to_owned()),
            (
                "ATOM_KV_EVENTS_ENDPOINT".to_owned(),
                "tcp://*:5557".to_owned()
            ),
            ("ATOM_KV_EVENTS_TOPIC".to_owned(), "kv-events".to_owned()),
        ]
    );
    assert_eq!(plan.role, Role::Decode);
    assert_eq!(plan.disagg_meta.unwrap()["params"]["tp_size"], 8);
}

#[test]
fn vllm_pd_pins_the_engine_id_it_registers() {
    let transfer = r#"{"kv_connector":"MooncakeConnector","kv_role":"kv_producer"}"#;
    let plan = plan_for(
        &[
            "vllm",
            "--model",
            "m",
            "--port",
            "8003",
            "--advertise-host",
            "h1",
            "--kv-transfer-config",
            transfer,
        ],
        &[],
    )
    .unwrap();
    assert_eq!(plan.role, Role::Prefill);
    let meta = plan.disagg_meta.unwrap();
    assert_eq!(meta["protocol"], "vllm-mooncake");
    assert_eq!(meta["params"]["engine_id"], "infera-h1-8003");
    assert_eq!(meta["params"]["bootstrap_addr"], "http://h1:8998");
    let forwarded = flag_value(&plan.args, &["--kv-transfer-config"]).unwrap();
    let forwarded: Value = serde_json::from_str(forwarded).unwrap();
    assert_eq!(forwarded["engine_id"], "infera-h1-8003");
}

fn mock_config(extra: &[&str]) -> Result<WorkerConfig, crate::config::ConfigError> {
    let mut argv = vec![
        "infera",
        "worker",
        "mock",
        "--model-path",
        "m",
        "--port",
        "8003",
    ];
    argv.extend_from_slice(&["--advertise-host", "h1"]);
    argv.extend_from_slice(extra);
    let Command::Worker(command) = parse_from(argv).unwrap().command else {
        panic!("not a worker command");
    };
    WorkerConfig::try_from(command)
}

#[test]
fn a_pd_mock_registers_what_the_launcher_registers_for_its_protocol() {
    let config = mock_config(&[]).unwrap();
    let LaunchConfig::Mock(mock) = &config.launch else {
        panic!("not a mock");
    };
    assert_eq!(mock.pd, None, "a mock is mixed unless told otherwise");
    // vLLM Mooncake: the same engine id and bootstrap address a launched vLLM registers.
    let transfer = r#"{"kv_connector":"MooncakeConnector","kv_role":"kv_producer"}"#;
    let launched = plan_for(
        &[
            "vllm",
            "--model",
            "m",
            "--port",
            "8003",
            "--advertise-host",
            "h1",
        ]
        .into_iter()
        .chain(["--kv-transfer-config", transfer])
        .collect::<Vec<_>>(),
        &[],
    )
    .unwrap()
    .disagg_meta
    .unwrap();
    let meta = mock_disagg_meta(&config, PdProtocol::VllmMooncake, 8998);
    assert_eq!(meta["protocol"], launched["protocol"]);
    assert_eq!(meta["params"]["engine_id"], launched["params"]["engine_id"]);
    assert_eq!(
        meta["params"]["bootstrap_addr"],
        launched["params"]["bootstrap_addr"]
    );
    // SGLang: the prefill's bootstrap host and port.
    let meta = mock_disagg_meta(&config, PdProtocol::SglangBootstrap, 9000);
    assert_eq!(meta["params"]["bootstrap_host"], "h1");
    assert_eq!(meta["params"]["bootstrap_port"], 9000);
    // MoRI: the side-channel ports its forged request ids name.
    let meta = mock_disagg_meta(&config, PdProtocol::VllmMoriRead, 9000);
    assert_eq!(
        meta["params"]["kv_connector_extra_config"],
        json!({"handshake_port": 9000, "notify_port": 9001, "tp_size": 1})
    );
    let config = mock_config(&[
        "--disaggregation-mode",
        "decode",
        "--disaggregation-protocol",
        "atom-mooncake",
    ])
    .unwrap();
    let LaunchConfig::Mock(mock) = &config.launch else {
        panic!("not a mock");
    };
    let pd = mock.pd.as_ref().unwrap();
    assert_eq!(
        (pd.role, pd.protocol.name()),
        (Role::Decode, "atom-mooncake")
    );
    let meta = mock_disagg_meta(&config, pd.protocol, pd.bootstrap_port);
    assert_eq!(meta["params"]["http_port"], 8003);
    assert_eq!(meta["params"]["handshake_port"], 8998);
}

#[test]
fn a_pd_mock_refuses_an_unknown_mode_or_protocol() {
    let e = mock_config(&["--disaggregation-mode", "both"]).unwrap_err();
    assert_eq!(e.flag, "--disaggregation-mode");
    let e = mock_config(&[
        "--disaggregation-mode",
        "prefill",
        "--disaggregation-protocol",
        "carrier-pigeon",
    ])
    .unwrap_err();
    assert_eq!(e.flag, "--disaggregation-protocol");
    assert!(e.reason.contains("vllm-nixl"), "{}", e.reason);
}

#[test]
fn disabled_kv_events_add_nothing() {
    let plan = plan_for(&["vllm", "--model", "m", "--no-enable-kv-events"], &[]).unwrap();
    assert!(!plan.args.iter().any(|a| a == "--kv-events-config"));
    assert_eq!(plan.kv_events_endpoint, None);
}

#[test]
fn the_python_launchers_flags_set_the_publisher_and_the_preflight() {
    // --kv-events-bind: the endpoint written and the port advertised.
    let plan = plan_for(
        &[
            "sglang",
            "--model-path",
            "m",
            "--advertise-host",
            "10.0.0.7",
            "--kv-events-bind",
            "tcp://0.0.0.0:6100",
        ],
        &[],
    )
    .unwrap();
    let kv: Value = serde_json::from_str(plan.args.last().unwrap()).unwrap();
    assert_eq!(kv["endpoint"], "tcp://0.0.0.0:6100");
    assert_eq!(
        plan.kv_events_endpoint.as_deref(),
        Some("tcp://10.0.0.7:6100")
    );
    assert_eq!(
        flag_value(&plan.args, &["--kv-cache-dtype"]),
        Some("fp8_e4m3")
    );
    // --kv-events off: no publisher, nothing advertised.
    let plan = plan_for(&["vllm", "--model", "m", "--kv-events", "off"], &[]).unwrap();
    assert!(flag_value(&plan.args, &["--kv-events-config"]).is_none());
    assert_eq!(plan.kv_events_endpoint, None);
    // A decode worker without an RDMA backend is refused unless allowed.
    let decode = [
        "sglang",
        "--model-path",
        "m",
        "--advertise-host",
        "10.0.0.7",
        "--disaggregation-mode",
        "decode",
    ];
    let error = plan_for(&decode, &[]).unwrap_err();
    assert!(
        error
            .to_string()
            .contains("--disaggregation-transfer-backend"),
        "{error}"
    );
    let mut allowed = decode.to_vec();
    allowed.push("--disaggregation-allow-tcp");
    let plan = plan_for(&allowed, &[("INFERA_DEFAULT_KV_FP8", "0")]).unwrap();
    assert_eq!(plan.role, Role::Decode);
    assert!(flag_value(&plan.args, &["--kv-cache-dtype"]).is_none());
    // A Mooncake decode worker with events gets SGLang's decode radix cache.
    let mut mooncake = decode.to_vec();
    mooncake.extend(["--disaggregation-transfer-backend", "mooncake"]);
    let plan = plan_for(&mooncake, &[]).unwrap();
    assert!(
        plan.args
            .iter()
            .any(|a| a == "--disaggregation-decode-enable-radix-cache")
    );
}
