//! The launch plan of a real engine: its command line and environment, the KV-event endpoint it
//! publishes on, and what the worker record says about it (served model, PD role and metadata,
//! block size, data parallelism). PROTOCOLS.md §3 and §7 are the contract.
//!
//! Pure: built from the validated [`WorkerConfig`], the launcher's environment and the free ports
//! the caller picked, so tests assert it exactly.
//!
//! Per engine (only what the user did not set already is added):
//!
//! | engine | KV events | other settings |
//! |--------|-----------|----------------|
//! | vLLM   | `--kv-events-config {"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:P","replay_endpoint":"tcp://*:R","topic":"kv-events"}` | `PYTHONHASHSEED=0` (set if absent, refused if set to anything else), `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1` |
//! | SGLang | `--kv-events-config {"publisher":"zmq","endpoint":"tcp://*:P","topic":"kv-events"}` | |
//! | ATOM   | `ATOM_KV_EVENTS_ENABLE=1`, `ATOM_KV_EVENTS_ENDPOINT=tcp://*:P`, `ATOM_KV_EVENTS_TOPIC=kv-events` | `--port <free>` (ATOM's internal torch-distributed port) when absent |
//!
//! Every engine argument is read as the engine's own parser reads it ([`engine_value`]): for
//! SGLang an unambiguous prefix of one of its flags is that flag, as in argparse (`--dp 8`,
//! `--disaggregation-m decode`); vLLM and ATOM arguments count in their exact spellings only.
//!
//! A `--kv-events-config` (or `ATOM_KV_EVENTS_ENDPOINT`) given by the user is kept, and its
//! endpoint is the one advertised; `--kv-events-bind` sets the endpoint the launcher writes
//! (else a free port). The Python launchers' engine defaults (fp8 KV cache, SGLang's decode
//! radix cache) and PD preflight are in [`defaults`]. PD: SGLang's `--disaggregation-mode` and vLLM/ATOM's
//! `--kv-transfer-config` `kv_role` give the role; the connector gives the protocol the server's
//! two-leg dispatch speaks (`sglang-bootstrap`, `vllm-mooncake`, `vllm-mori-read|write`,
//! `vllm-nixl`, `atom-mooncake`). A vLLM PD worker's `engine_id` is pinned into the forwarded
//! `--kv-transfer-config`, so the id registered is the one the engine uses. A PD-role mock
//! (`infera worker mock --disaggregation-mode`) registers the same shapes
//! ([`mock_disagg_meta`]), so the server's dispatch is tested against what real workers say.
//! `--infera-kvd-socket` adds the kvd connector (vLLM) or HiCache backend (SGLang): see [`kvd`].

use crate::config::worker::{EngineKind, EngineProcessConfig, WorkerConfig};
use crate::net::url_host;
use infera_core::event::Role;
use infera_core::pd::{DisaggMeta, PdFamily, PdProtocol};
use serde_json::{Map, Value, json};

mod defaults;
mod kvd;

pub use kvd::SOCKET_ENV as KVD_SOCKET_ENV;

/// The topic the launcher asks engines to publish KV events on.
pub const KV_EVENTS_TOPIC: &str = "kv-events";
/// SGLang's default PD bootstrap port.
const SGLANG_BOOTSTRAP_PORT: u16 = 8998;
/// vLLM Mooncake connector's default bootstrap port (`VLLM_MOONCAKE_BOOTSTRAP_PORT`).
const VLLM_MOONCAKE_BOOTSTRAP_PORT: u16 = 8998;
/// ATOM Mooncake connector's default handshake port.
const ATOM_HANDSHAKE_PORT: u16 = 6301;

/// Ports the caller reserved for the engine (free when picked).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FreePorts {
    /// KV-event PUB socket (rank r publishes on `events + r`).
    pub events: u16,
    /// vLLM's KV-event replay ROUTER socket.
    pub replay: u16,
    /// ATOM's internal torch-distributed port.
    pub atom_internal: u16,
}

/// How to start the engine and what to register for it.
#[derive(Debug, Clone, PartialEq)]
pub struct LaunchPlan {
    /// The executable.
    pub program: String,
    /// Its arguments, in order.
    pub args: Vec<String>,
    /// Variables set on top of the inherited environment.
    pub env: Vec<(String, String)>,
    /// The KV-event endpoint to advertise (`tcp://ADVERTISE_HOST:P`), if events are on.
    pub kv_events_endpoint: Option<String>,
    /// The engine's KV-event replay socket to advertise, where it has one.
    pub kv_events_replay_endpoint: Option<String>,
    /// The model name requests use (`--served-model-name`, else the model).
    pub served_model: String,
    /// The PD role.
    pub role: Role,
    /// PD metadata (`{protocol, params}`) for prefill/decode workers.
    pub disagg_meta: Option<Value>,
    /// The engine's KV block size from its command line, or the engine's default.
    pub kv_block_size: Option<u32>,
    /// The prompt tokens the engine prefills per step, when its command line sets them
    /// (vLLM's and ATOM's `--max-num-batched-tokens`, SGLang's `--chunked-prefill-size`);
    /// registered for the router's queue, which assumes 8192 otherwise.
    pub prefill_budget: Option<u32>,
    /// First data-parallel rank served by this worker.
    pub dp_rank: u32,
    /// Data-parallel ranks behind this worker's one HTTP port.
    pub dp_size: u32,
    /// The kvd socket the engine was wired to (`--infera-kvd-socket`, not on a decode leg):
    /// checked with `hello` before the engine starts; the worker registers as kvd-backed.
    pub kvd_socket: Option<std::path::PathBuf>,
}

/// A configuration the launcher refuses, naming what to change.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct LaunchError(String);

/// Builds the plan. `env` reads the launcher's environment.
///
/// # Errors
/// `PYTHONHASHSEED` set to something other than 0 for vLLM; a `--kv-events-config` or
/// `--kv-transfer-config` that is not a JSON object.
pub fn plan(
    config: &WorkerConfig,
    process: &EngineProcessConfig,
    env: &dyn Fn(&str) -> Option<String>,
    ports: FreePorts,
) -> Result<LaunchPlan, LaunchError> {
    let engine = config.engine;
    let (program, command_args) = process
        .command
        .split_first()
        .ok_or_else(|| LaunchError("--engine-cmd is empty".to_owned()))?;
    let mut args: Vec<String> = command_args.to_vec();
    args.extend(process.args.iter().cloned());
    let users_end = args.len();
    let mut env_out = Vec::new();
    let passthrough = &process.passthrough;

    if engine == EngineKind::Vllm {
        match env("PYTHONHASHSEED").as_deref() {
            None | Some("") => env_out.push(("PYTHONHASHSEED".to_owned(), "0".to_owned())),
            Some("0") => {}
            Some(other) => {
                return Err(LaunchError(format!(
                    "PYTHONHASHSEED={other}: vLLM workers need PYTHONHASHSEED=0 so that block \
                     hashes agree across processes and restarts; unset it or set it to 0"
                )));
            }
        }
        if env("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES").is_none() {
            env_out.push((
                "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES".to_owned(),
                "1".to_owned(),
            ));
        }
    }
    if engine == EngineKind::Atom && engine_value(engine, passthrough, &["--port"]).is_none() {
        args.push("--port".to_owned());
        args.push(ports.atom_internal.to_string());
    }

    let data_parallel_rank = match engine {
        EngineKind::Vllm => engine_value(engine, passthrough, &["--data-parallel-rank", "-dpr"])
            .map(|v| parse_u32("--data-parallel-rank", v))
            .transpose()?,
        _ => None,
    };
    let (dp_rank, dp_size) = match data_parallel_rank {
        // External load balancing: this process is one rank of the group.
        Some(rank) => (rank, 1),
        None => (0, process.data_parallel_size.unwrap_or(1).max(1)),
    };
    let (kv_events_endpoint, kv_events_replay_endpoint) = if config.kv_events.enabled {
        let at = |p: u32| format!("tcp://{}:{p}", url_host(&config.advertise_host));
        let publisher = Publisher {
            ports,
            bind: process.kv_events_bind.as_deref(),
            dp_rank,
        };
        match kv_events(engine, passthrough, env, publisher, &mut args, &mut env_out)? {
            Some((events, replay)) => (Some(at(events)), replay.map(at)),
            None => (None, None),
        }
    } else {
        (None, None)
    };

    let served_model = engine_value(engine, passthrough, &["--served-model-name"])
        .map_or_else(|| config.model.clone(), str::to_owned);
    let mori_read = env("VLLM_MORIIO_CONNECTOR_READ_MODE").is_some();
    let (role, disagg_meta) = disaggregation(config, process, mori_read, &mut args)?;
    defaults::preflight(
        engine,
        role,
        &config.advertise_host,
        disagg_meta.is_some(),
        passthrough,
        process.allow_tcp,
    )?;
    let added = defaults::added_args(engine, role, config.kv_events.enabled, passthrough, env);
    args.splice(users_end..users_end, added);
    let kvd_socket = match &config.kvd_socket {
        Some(socket) if kvd::wire(engine, role, socket, &mut args, &mut env_out)? => {
            Some(socket.clone())
        }
        _ => None,
    };
    let kv_block_size = process.kv_block_size.or(match engine {
        // vLLM and ATOM page 16 tokens unless told otherwise; SGLang's page size is resolved
        // from the running server (see `worker::process`).
        EngineKind::Vllm | EngineKind::Atom => Some(16),
        EngineKind::Sglang | EngineKind::Mock => None,
    });
    let budget_flag = match engine {
        EngineKind::Sglang => "--chunked-prefill-size",
        EngineKind::Vllm | EngineKind::Atom | EngineKind::Mock => "--max-num-batched-tokens",
    };
    let prefill_budget = engine_value(engine, &args, &[budget_flag])
        .and_then(|v| v.parse::<u32>().ok())
        .filter(|n| *n > 0);
    Ok(LaunchPlan {
        program: program.clone(),
        args,
        env: env_out,
        kv_events_endpoint,
        kv_events_replay_endpoint,
        served_model,
        role,
        disagg_meta,
        kv_block_size,
        prefill_budget,
        dp_rank,
        dp_size,
        kvd_socket,
    })
}

/// Where the engine's KV-event publisher goes: the free ports picked, the user's
/// `--kv-events-bind`, and the first DP rank (rank `r` publishes on the port + `r`).
#[derive(Debug, Clone, Copy)]
struct Publisher<'a> {
    ports: FreePorts,
    bind: Option<&'a str>,
    dp_rank: u32,
}

/// Adds the KV-event settings the engine needs and returns the ports rank `dp_rank` publishes
/// and replays on (vLLM's replay socket, or one a user-given config names).
fn kv_events(
    engine: EngineKind,
    passthrough: &[String],
    env: &dyn Fn(&str) -> Option<String>,
    publisher: Publisher<'_>,
    args: &mut Vec<String>,
    env_out: &mut Vec<(String, String)>,
) -> Result<Option<(u32, Option<u32>)>, LaunchError> {
    let Publisher {
        ports,
        bind,
        dp_rank,
    } = publisher;
    let offset = |port: u32| port + dp_rank;
    // The endpoint the publisher binds and the port it advertises.
    let (endpoint, events_port) = match bind.and_then(|b| Some((b, endpoint_port(b)?))) {
        Some((bind, port)) => (bind.to_owned(), port),
        None => (format!("tcp://*:{}", ports.events), u32::from(ports.events)),
    };
    match engine {
        EngineKind::Vllm | EngineKind::Sglang => {
            if let Some(given) = engine_value(engine, passthrough, &["--kv-events-config"]) {
                let object = json_object("--kv-events-config", given)?;
                let port = |key: &str| {
                    object
                        .get(key)
                        .and_then(Value::as_str)
                        .and_then(endpoint_port)
                        .map(offset)
                };
                return Ok(port("endpoint").map(|events| (events, port("replay_endpoint"))));
            }
            let mut config = Map::new();
            if engine == EngineKind::Vllm {
                config.insert("enable_kv_cache_events".into(), true.into());
            }
            config.insert("publisher".into(), "zmq".into());
            config.insert("endpoint".into(), endpoint.into());
            if engine == EngineKind::Vllm {
                config.insert(
                    "replay_endpoint".into(),
                    format!("tcp://*:{}", ports.replay).into(),
                );
            }
            config.insert("topic".into(), KV_EVENTS_TOPIC.into());
            args.push("--kv-events-config".to_owned());
            args.push(Value::Object(config).to_string());
            let replay = (engine == EngineKind::Vllm).then(|| offset(u32::from(ports.replay)));
            Ok(Some((offset(events_port), replay)))
        }
        EngineKind::Atom => {
            if let Some(given) = env("ATOM_KV_EVENTS_ENDPOINT") {
                return Ok(endpoint_port(&given).map(|p| (offset(p), None)));
            }
            env_out.push(("ATOM_KV_EVENTS_ENABLE".to_owned(), "1".to_owned()));
            env_out.push(("ATOM_KV_EVENTS_ENDPOINT".to_owned(), endpoint));
            env_out.push((
                "ATOM_KV_EVENTS_TOPIC".to_owned(),
                KV_EVENTS_TOPIC.to_owned(),
            ));
            Ok(Some((offset(events_port), None)))
        }
        EngineKind::Mock => Ok(None),
    }
}

/// The PD role and metadata; pins a vLLM PD worker's `engine_id` into `args`.
fn disaggregation(
    config: &WorkerConfig,
    process: &EngineProcessConfig,
    mori_read: bool,
    args: &mut [String],
) -> Result<(Role, Option<Value>), LaunchError> {
    let passthrough = &process.passthrough;
    let host = config.advertise_host.as_str();
    let value = |flag: &str| engine_value(config.engine, passthrough, &[flag]);
    match config.engine {
        EngineKind::Sglang => {
            let role = match value("--disaggregation-mode") {
                Some("prefill") => Role::Prefill,
                Some("decode") => Role::Decode,
                None | Some("null") => Role::Mixed,
                Some(other) => {
                    return Err(LaunchError(format!(
                        "--disaggregation-mode {other}: expected prefill, decode or null"
                    )));
                }
            };
            if role == Role::Mixed {
                return Ok((role, None));
            }
            let port = value("--disaggregation-bootstrap-port")
                .map(|v| parse_u32("--disaggregation-bootstrap-port", v))
                .transpose()?
                .unwrap_or(u32::from(SGLANG_BOOTSTRAP_PORT));
            let backend = value("--disaggregation-transfer-backend").unwrap_or("mooncake");
            let meta = disagg_meta(
                PdProtocol::SglangBootstrap,
                json!({
                    "bootstrap_host": host,
                    "bootstrap_port": port,
                    "transfer_backend": backend,
                }),
            );
            Ok((role, Some(meta)))
        }
        EngineKind::Vllm | EngineKind::Atom => {
            let Some(given) = value("--kv-transfer-config") else {
                return Ok((Role::Mixed, None));
            };
            let mut transfer = json_object("--kv-transfer-config", given)?;
            let role = match transfer.get("kv_role").and_then(Value::as_str) {
                Some("kv_producer") => Role::Prefill,
                Some("kv_consumer") => Role::Decode,
                None | Some("kv_both") => Role::Mixed,
                Some(other) => {
                    tracing::warn!(kv_role = other, "unknown kv_role; registering as mixed");
                    Role::Mixed
                }
            };
            if role == Role::Mixed {
                return Ok((role, None));
            }
            let meta = if config.engine == EngineKind::Atom {
                atom_meta(config, process, &transfer)
            } else {
                let engine_id = transfer
                    .get("engine_id")
                    .and_then(Value::as_str)
                    .map_or_else(|| default_engine_id(config), str::to_owned);
                if transfer.get("engine_id").is_none() {
                    transfer.insert("engine_id".into(), engine_id.clone().into());
                    replace_flag_value(
                        args,
                        "--kv-transfer-config",
                        &Value::Object(transfer.clone()).to_string(),
                    );
                }
                vllm_meta(host, &transfer, mori_read)
            };
            Ok((role, meta))
        }
        EngineKind::Mock => Ok((Role::Mixed, None)),
    }
}

fn vllm_meta(host: &str, transfer: &Map<String, Value>, mori_read: bool) -> Option<Value> {
    let extra_of = |object: &Map<String, Value>| {
        object
            .get("kv_connector_extra_config")
            .cloned()
            .unwrap_or_else(|| json!({}))
    };
    let connector = transfer.get("kv_connector").and_then(Value::as_str);
    // MultiConnector nests the PD transport among its children.
    let found = if connector == Some("MultiConnector") {
        transfer
            .get("kv_connector_extra_config")
            .and_then(|extra| extra.get("connectors"))
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .filter_map(Value::as_object)
            .find_map(|child| {
                let protocol = child.get("kv_connector").and_then(Value::as_str);
                let protocol = PdProtocol::of_vllm_connector(protocol?, mori_read)?;
                Some((protocol, extra_of(child)))
            })
    } else {
        connector
            .and_then(|name| PdProtocol::of_vllm_connector(name, mori_read))
            .map(|protocol| (protocol, extra_of(transfer)))
    };
    let Some((protocol, extra)) = found else {
        tracing::warn!(
            connector = ?transfer.get("kv_connector"),
            "PD worker's kv_connector has no known protocol; registering without disagg_meta"
        );
        return None;
    };
    let mut params = json!({
        "engine_id": transfer.get("engine_id"),
        "kv_ip": transfer.get("kv_ip"),
        "kv_port": transfer.get("kv_port"),
        "kv_connector_extra_config": extra,
    });
    if protocol == PdProtocol::VllmMooncake {
        params["bootstrap_addr"] =
            format!("http://{}:{VLLM_MOONCAKE_BOOTSTRAP_PORT}", url_host(host)).into();
    }
    Some(disagg_meta(protocol, params))
}

/// The engine id a vLLM PD worker registers when its `--kv-transfer-config` names none.
pub fn default_engine_id(config: &WorkerConfig) -> String {
    format!("infera-{}-{}", config.advertise_host, config.port)
}

/// The `disagg_meta` of a PD-role mock: the shape the launcher registers for the protocol's
/// engine, with `bootstrap_port` as its bootstrap (SGLang, vLLM Mooncake) or handshake (MoRI,
/// ATOM) port and `bootstrap_port + 1` as MoRI's notify port.
pub fn mock_disagg_meta(config: &WorkerConfig, protocol: PdProtocol, bootstrap_port: u16) -> Value {
    let host = config.advertise_host.as_str();
    let params = match protocol.family() {
        PdFamily::Sglang => json!({
            "bootstrap_host": host,
            "bootstrap_port": bootstrap_port,
            "transfer_backend": "mock",
        }),
        PdFamily::Atom => json!({
            "host": host,
            "http_port": config.port,
            "handshake_port": bootstrap_port,
            "tp_size": 1,
            "dp_size": 1,
        }),
        PdFamily::Vllm => {
            let mut params = json!({
                "engine_id": default_engine_id(config),
                "kv_ip": null,
                "kv_port": null,
                "kv_connector_extra_config": {},
            });
            if matches!(
                protocol,
                PdProtocol::VllmMoriRead | PdProtocol::VllmMoriWrite
            ) {
                params["kv_connector_extra_config"] = json!({
                    "handshake_port": bootstrap_port,
                    "notify_port": u32::from(bootstrap_port) + 1,
                    "tp_size": 1,
                });
            }
            if protocol == PdProtocol::VllmMooncake {
                params["bootstrap_addr"] =
                    format!("http://{}:{bootstrap_port}", url_host(host)).into();
            }
            params
        }
    };
    disagg_meta(protocol, params)
}

/// The registration's `disagg_meta` for `protocol` with the engine's `params` (a JSON object).
fn disagg_meta(protocol: PdProtocol, params: Value) -> Value {
    let params = match params {
        Value::Object(map) => map,
        _ => Map::new(),
    };
    DisaggMeta { protocol, params }.to_value()
}

fn atom_meta(
    config: &WorkerConfig,
    process: &EngineProcessConfig,
    transfer: &Map<String, Value>,
) -> Option<Value> {
    let connector = transfer
        .get("kv_connector")
        .and_then(Value::as_str)
        .unwrap_or("mooncake");
    if connector != "mooncake" {
        tracing::warn!(
            connector,
            "ATOM PD is driven over the mooncake connector; registering without disagg_meta"
        );
        return None;
    }
    let handshake = transfer
        .get("handshake_port")
        .and_then(Value::as_u64)
        .unwrap_or(u64::from(ATOM_HANDSHAKE_PORT));
    let dp_size = transfer.get("dp_size").and_then(Value::as_u64).unwrap_or(1);
    Some(disagg_meta(
        PdProtocol::AtomMooncake,
        json!({
            "host": config.advertise_host,
            "http_port": config.port,
            "handshake_port": handshake,
            "tp_size": process.tensor_parallel_size.unwrap_or(1),
            "dp_size": dp_size,
        }),
    ))
}

/// The last value of any spelling in `flags` (`--flag V` or `--flag=V`), exact spellings only.
pub fn flag_value<'a>(args: &'a [String], flags: &[&str]) -> Option<&'a str> {
    crate::config::worker::last_flag_value(args, flags).map(|(_, value)| value)
}

/// [`flag_value`] as `engine`'s parser reads its arguments (SGLang: argparse's unambiguous
/// prefixes too, `--disaggregation-m decode` is `--disaggregation-mode decode`).
pub fn engine_value<'a>(engine: EngineKind, args: &'a [String], flags: &[&str]) -> Option<&'a str> {
    crate::config::worker::engine_flag_value(engine, args, flags).map(|(_, value)| value)
}

/// Rewrites every value of `flag` in `args` to `value`.
fn replace_flag_value(args: &mut [String], flag: &str, value: &str) {
    let mut index = 0;
    while index < args.len() {
        if args[index] == flag && index + 1 < args.len() {
            args[index + 1] = value.to_owned();
            index += 2;
            continue;
        }
        if args[index].starts_with(flag) && args[index][flag.len()..].starts_with('=') {
            args[index] = format!("{flag}={value}");
        }
        index += 1;
    }
}

fn json_object(flag: &str, text: &str) -> Result<Map<String, Value>, LaunchError> {
    match serde_json::from_str::<Value>(text) {
        Ok(Value::Object(object)) => Ok(object),
        Ok(_) => Err(LaunchError(format!(
            "{flag} must be a JSON object (got {text})"
        ))),
        Err(e) => Err(LaunchError(format!("{flag} is not valid JSON: {e}"))),
    }
}

fn parse_u32(flag: &str, value: &str) -> Result<u32, LaunchError> {
    value.parse().map_err(|_| {
        LaunchError(format!(
            "{flag} must be a non-negative integer (got '{value}')"
        ))
    })
}

/// The port of `tcp://HOST:PORT`.
fn endpoint_port(endpoint: &str) -> Option<u32> {
    endpoint.rsplit_once(':')?.1.parse().ok()
}

#[cfg(test)]
mod tests;
