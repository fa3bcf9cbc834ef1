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
            "--etcd-endpoint",
            "e:2379",
            "--enable-kv-events",
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
fn atom_publishes_no_kv_events_unless_asked() {
    // ATOM has no native event stream: the Python launcher enables it only on request.
    let plan = plan_for(&["atom", "--model", "m", "--etcd-endpoint", "e:2379"], &[]).unwrap();
    assert!(plan.env.is_empty(), "{:?}", plan.env);
    assert_eq!(plan.kv_events_endpoint, None);
    assert_eq!(
        &plan.args[plan.args.len() - 2..],
        &strings(&["--port", "29500"])[..]
    );
}

#[test]
fn sglang_arguments_are_read_through_argparse_abbreviations() {
    let plan = plan_for(
        &[
            "sglang",
            "--model-path",
            "m",
            "--advertise-host",
            "node1",
            "--served",
            "chat",
            "--dp",
            "4",
            "--disaggregation-m",
            "decode",
            "--disaggregation-b=9000",
            "--disaggregation-t",
            "mooncake",
            "--kv-cache-d",
            "auto",
            "--disaggregation-decode-enable-r",
            "--kv-events-c",
            r#"{"publisher":"zmq","endpoint":"tcp://*:7000","topic":"kv-events"}"#,
        ],
        &[],
    )
    .unwrap();
    assert_eq!(plan.served_model, "chat");
    assert_eq!((plan.dp_rank, plan.dp_size), (0, 4));
    assert_eq!(plan.role, Role::Decode);
    assert_eq!(
        plan.disagg_meta,
        Some(json!({"protocol": "sglang-bootstrap", "params": {
            "bootstrap_host": "node1", "bootstrap_port": 9000, "transfer_backend": "mooncake"}}))
    );
    // The user's settings stand: nothing SGLang would read as a second value is added.
    for added in [
        "--kv-cache-dtype",
        "--disaggregation-decode-enable-radix-cache",
        "--kv-events-config",
    ] {
        assert!(!plan.args.iter().any(|a| a == added), "{added} added");
    }
    assert_eq!(plan.kv_events_endpoint.as_deref(), Some("tcp://node1:7000"));
}

#[test]
fn an_ambiguous_sglang_prefix_is_not_read_and_vllm_takes_none() {
    // `--disaggregation` starts three SGLang flags: SGLang refuses it, so it sets no role.
    let plan = plan_for(
        &["sglang", "--model-path", "m", "--disaggregation", "decode"],
        &[],
    )
    .unwrap();
    assert_eq!(plan.role, Role::Mixed);
    // vLLM arguments count in their exact spellings only.
    let plan = plan_for(&["vllm", "--model", "m", "--served", "chat"], &[]).unwrap();
    assert_eq!(plan.served_model, "m");
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

/// The value of the last `--kv-transfer-config` of a plan, parsed.
fn transfer_config(plan: &LaunchPlan) -> Value {
    serde_json::from_str(flag_value(&plan.args, &["--kv-transfer-config"]).unwrap()).unwrap()
}

fn kvd_connector() -> Value {
    json!({"kv_connector": "InferaKvdConnector", "kv_role": "kv_both",
        "kv_connector_module_path": "infera.engine.vllm.kvd_connector",
        "kv_connector_extra_config": {"socket": "/run/kvd.sock"}})
}

#[test]
fn vllm_with_kvd_gets_the_connector_and_the_socket() {
    let plan = plan_for(
        &[
            "vllm",
            "--model",
            "m",
            "--infera-kvd-socket",
            "/run/kvd.sock",
        ],
        &[],
    )
    .unwrap();
    assert_eq!(transfer_config(&plan), kvd_connector());
    assert!(!plan.args.iter().any(|a| a.contains("infera-kvd-socket")));
    assert!(
        plan.env
            .contains(&("INFERA_KVD_SOCKET".to_owned(), "/run/kvd.sock".to_owned()))
    );
    assert_eq!(plan.role, Role::Mixed);
    assert_eq!(
        plan.kvd_socket.as_deref(),
        Some(std::path::Path::new("/run/kvd.sock"))
    );

    // Without the flag: no connector, no socket, not kvd-backed.
    let plain = plan_for(&["vllm", "--model", "m"], &[]).unwrap();
    assert!(flag_value(&plain.args, &["--kv-transfer-config"]).is_none());
    assert!(plain.env.iter().all(|(k, _)| k != "INFERA_KVD_SOCKET"));
    assert_eq!(plain.kvd_socket, None);
}

#[test]
fn vllm_kvd_is_merged_with_a_pd_connector_the_registration_still_reads() {
    let transfer = r#"{"kv_connector":"MooncakeConnector","kv_role":"kv_producer"}"#;
    let argv = [
        "vllm",
        "--model",
        "m",
        "--port",
        "8003",
        "--advertise-host",
        "h1",
        "--kv-transfer-config",
        transfer,
        "--infera-kvd-socket",
        "/run/kvd.sock",
    ];
    let plan = plan_for(&argv, &[]).unwrap();
    // One --kv-transfer-config: a MultiConnector, kvd first, the PD transport as given (with
    // the pinned engine id); the top level keeps the role and the engine id.
    assert_eq!(
        plan.args
            .iter()
            .filter(|a| *a == "--kv-transfer-config")
            .count(),
        1
    );
    assert_eq!(
        transfer_config(&plan),
        json!({"kv_connector": "MultiConnector", "kv_role": "kv_producer",
            "engine_id": "infera-h1-8003",
            "kv_connector_extra_config": {"connectors": [kvd_connector(),
                {"kv_connector": "MooncakeConnector", "kv_role": "kv_producer",
                 "engine_id": "infera-h1-8003"}]}})
    );
    assert_eq!(plan.role, Role::Prefill);
    let meta = plan.disagg_meta.unwrap();
    assert_eq!(meta["protocol"], "vllm-mooncake");
    assert_eq!(meta["params"]["engine_id"], "infera-h1-8003");
    assert!(plan.kvd_socket.is_some());

    // A MultiConnector gets kvd appended; one that names kvd already is kept as given.
    let multi = r#"{"kv_connector":"MultiConnector","kv_connector_extra_config":{"connectors":[{"kv_connector":"NixlConnector"}]}}"#;
    let plan = plan_for(
        &[
            "vllm",
            "--model",
            "m",
            "--kv-transfer-config",
            multi,
            "--infera-kvd-socket",
            "/run/kvd.sock",
        ],
        &[],
    )
    .unwrap();
    assert_eq!(
        transfer_config(&plan)["kv_connector_extra_config"]["connectors"],
        json!([{"kv_connector": "NixlConnector"}, kvd_connector()])
    );
    let own = r#"{"kv_connector":"InferaKvdConnector","kv_role":"kv_both","kv_connector_module_path":"infera.engine.vllm.kvd_connector"}"#;
    let plan = plan_for(
        &[
            "vllm",
            "--model",
            "m",
            "--kv-transfer-config",
            own,
            "--infera-kvd-socket",
            "/run/kvd.sock",
        ],
        &[],
    )
    .unwrap();
    assert_eq!(
        transfer_config(&plan),
        serde_json::from_str::<Value>(own).unwrap()
    );
}

#[test]
fn sglang_with_kvd_gets_the_hicache_backend_and_a_decode_leg_does_not() {
    let plan = plan_for(
        &[
            "sglang",
            "--model-path",
            "m",
            "--infera-kvd-socket",
            "/run/kvd.sock",
        ],
        &[],
    )
    .unwrap();
    let at = plan
        .args
        .iter()
        .position(|a| a == "--enable-hierarchical-cache")
        .unwrap();
    assert_eq!(
        &plan.args[at + 1..at + 4],
        &strings(&[
            "--hicache-storage-backend",
            "dynamic",
            "--hicache-storage-backend-extra-config"
        ])[..]
    );
    let extra: Value = serde_json::from_str(&plan.args[at + 4]).unwrap();
    assert_eq!(
        extra,
        json!({"backend_name": "infera-kvd", "module_path": "infera.engine.sglang.kvd_adapter",
            "class_name": "InferaKvdBackend", "prefetch_threshold": 64, "interface_v1": 1})
    );
    // SGLang exits on an unknown flag: ours is never forwarded.
    assert!(!plan.args.iter().any(|a| a.contains("infera-kvd-socket")));
    assert_eq!(
        plan.env,
        vec![("INFERA_KVD_SOCKET".to_owned(), "/run/kvd.sock".to_owned())]
    );
    assert!(plan.kvd_socket.is_some());

    // The user's own HiCache settings are kept.
    let own = plan_for(
        &[
            "sglang",
            "--model-path",
            "m",
            "--hicache-storage-backend",
            "file",
            "--infera-kvd-socket",
            "/run/kvd.sock",
        ],
        &[],
    )
    .unwrap();
    assert_eq!(
        flag_value(&own.args, &["--hicache-storage-backend"]),
        Some("file")
    );

    let decode = plan_for(
        &[
            "sglang",
            "--model-path",
            "m",
            "--advertise-host",
            "10.0.0.2",
            "--disaggregation-mode",
            "decode",
            "--disaggregation-transfer-backend",
            "mooncake",
            "--infera-kvd-socket",
            "/run/kvd.sock",
        ],
        &[],
    )
    .unwrap();
    assert!(!decode.args.iter().any(|a| a.contains("hicache")));
    assert_eq!(decode.kvd_socket, None);
}

#[test]
fn atom_refuses_kvd() {
    let Command::Worker(command) = parse_from([
        "infera",
        "worker",
        "atom",
        "--model",
        "m",
        "--etcd-endpoint",
        "e:2379",
        "--infera-kvd-socket",
        "/run/kvd.sock",
    ])
    .unwrap()
    .command
    else {
        panic!("not a worker command");
    };
    let error = WorkerConfig::try_from(command).unwrap_err();
    assert!(error.to_string().contains("--infera-kvd-socket"), "{error}");
}
