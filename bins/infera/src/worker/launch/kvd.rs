//! `--infera-kvd-socket PATH`: what the launcher adds so that the engine saves and loads its KV
//! blocks through kvd, with the Python Infera's module and class names (its `kvd_wiring` for
//! SGLang, its documented `--kv-transfer-config` for vLLM). Both engines also get
//! `INFERA_KVD_SOCKET=PATH`, which the Python connector and backend read.
//!
//! - **vLLM**: the connector `{"kv_connector": "InferaKvdConnector", "kv_role": "kv_both",
//!   "kv_connector_module_path": "infera.engine.vllm.kvd_connector",
//!   "kv_connector_extra_config": {"socket": PATH}}` as `--kv-transfer-config`. A given
//!   `--kv-transfer-config` is merged: one that names the kvd connector already is kept; a
//!   `MultiConnector` gets the kvd connector appended to its `connectors`; any other connector
//!   (a PD transport) is wrapped in a `MultiConnector` with the kvd connector first, keeping the
//!   top-level fields (`kv_role`, `engine_id`, …) that the PD registration reads.
//! - **SGLang**: `--enable-hierarchical-cache`, `--hicache-storage-backend dynamic` and
//!   `--hicache-storage-backend-extra-config {"backend_name": "infera-kvd", "module_path":
//!   "infera.engine.sglang.kvd_adapter", "class_name": "InferaKvdBackend",
//!   "prefetch_threshold": 64, "interface_v1": 1}` (`interface_v1`: SGLang's zero-copy storage
//!   calls, pages copied in place between its host pool and kvd's arena), each unless the
//!   command line sets it; a `--hicache-ratio` under 1.5 without `--hicache-size` is warned
//!   about (storage prefetch barely runs then).
//! - **PD decode legs** are not wired: neither engine reads from kvd on the decode leg, so kvd
//!   would only be written to there (the Python launcher skips it too).

use super::{LaunchError, json_object, replace_flag_value};
use crate::config::worker::{EngineKind, engine_flag_given, engine_flag_value, last_flag_value};
use infera_core::event::Role;
use serde_json::{Map, Value, json};
use std::path::Path;

/// The environment variable the Python connector and backend read the socket from.
pub const SOCKET_ENV: &str = "INFERA_KVD_SOCKET";
/// vLLM's kvd connector class.
pub const VLLM_CONNECTOR: &str = "InferaKvdConnector";
/// The module vLLM loads the connector from.
pub const VLLM_CONNECTOR_MODULE: &str = "infera.engine.vllm.kvd_connector";
/// SGLang's dynamic storage backend: module and class.
pub const SGLANG_BACKEND_MODULE: &str = "infera.engine.sglang.kvd_adapter";
pub const SGLANG_BACKEND_CLASS: &str = "InferaKvdBackend";
const TRANSFER_FLAG: &str = "--kv-transfer-config";
const EXTRA_CONFIG_FLAG: &str = "--hicache-storage-backend-extra-config";
/// A `--hicache-ratio` under this (without `--hicache-size`) is warned about, as the Python
/// launcher's `hicache_validate` does.
const HICACHE_RATIO_FLOOR: f64 = 1.5;

/// Wires the engine to kvd at `socket`; returns whether it did (not for a decode leg).
///
/// # Errors
/// A given `--kv-transfer-config` that is not a JSON object, or a `MultiConnector` whose
/// `connectors` is not a list.
pub(super) fn wire(
    engine: EngineKind,
    role: Role,
    socket: &Path,
    args: &mut Vec<String>,
    env_out: &mut Vec<(String, String)>,
) -> Result<bool, LaunchError> {
    if role == Role::Decode {
        tracing::warn!(
            "--infera-kvd-socket on a decode leg: not wiring kvd (a decode leg never reads \
             from it); kvd belongs on the prefill leg"
        );
        return Ok(false);
    }
    let socket_text = socket.to_string_lossy().into_owned();
    match engine {
        EngineKind::Vllm => vllm(&socket_text, args)?,
        EngineKind::Sglang => sglang(args),
        EngineKind::Atom | EngineKind::Mock => return Ok(false),
    }
    env_out.push((SOCKET_ENV.to_owned(), socket_text));
    Ok(true)
}

/// The kvd connector's entry of a `--kv-transfer-config`.
fn vllm_connector(socket: &str) -> Value {
    json!({
        "kv_connector": VLLM_CONNECTOR,
        "kv_role": "kv_both",
        "kv_connector_module_path": VLLM_CONNECTOR_MODULE,
        "kv_connector_extra_config": {"socket": socket},
    })
}

fn names_kvd(connector: &Map<String, Value>) -> bool {
    connector.get("kv_connector").and_then(Value::as_str) == Some(VLLM_CONNECTOR)
}

fn vllm(socket: &str, args: &mut Vec<String>) -> Result<(), LaunchError> {
    let Some((_, given)) = last_flag_value(args, &[TRANSFER_FLAG]) else {
        args.push(TRANSFER_FLAG.to_owned());
        args.push(vllm_connector(socket).to_string());
        return Ok(());
    };
    let mut config = json_object(TRANSFER_FLAG, given)?;
    if names_kvd(&config) {
        return Ok(());
    }
    let multi = config.get("kv_connector").and_then(Value::as_str) == Some("MultiConnector");
    let merged = if multi {
        let extra = config
            .entry("kv_connector_extra_config")
            .or_insert_with(|| json!({}));
        let Some(connectors) = extra
            .as_object_mut()
            .map(|e| e.entry("connectors").or_insert_with(|| json!([])))
            .and_then(Value::as_array_mut)
        else {
            return Err(LaunchError(format!(
                "{TRANSFER_FLAG}: a MultiConnector's kv_connector_extra_config.connectors must \
                 be a list"
            )));
        };
        if connectors
            .iter()
            .any(|c| c.as_object().is_some_and(names_kvd))
        {
            return Ok(());
        }
        connectors.push(vllm_connector(socket));
        config
    } else {
        let mut top: Map<String, Value> = config
            .iter()
            .filter(|(k, _)| {
                !matches!(
                    k.as_str(),
                    "kv_connector" | "kv_connector_module_path" | "kv_connector_extra_config"
                )
            })
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        top.insert("kv_connector".into(), "MultiConnector".into());
        top.entry("kv_role").or_insert_with(|| "kv_both".into());
        top.insert(
            "kv_connector_extra_config".into(),
            json!({"connectors": [vllm_connector(socket), Value::Object(config)]}),
        );
        top
    };
    replace_flag_value(args, TRANSFER_FLAG, &Value::Object(merged).to_string());
    Ok(())
}

fn sglang(args: &mut Vec<String>) {
    // As SGLang reads its arguments (an unambiguous prefix is the flag).
    let has = |args: &[String], flag: &str| engine_flag_given(EngineKind::Sglang, args, &[flag]);

    if !has(args, "--enable-hierarchical-cache") {
        args.push("--enable-hierarchical-cache".to_owned());
    }
    if !has(args, "--hicache-storage-backend") {
        args.extend(["--hicache-storage-backend".to_owned(), "dynamic".to_owned()]);
    }
    let ratio = engine_flag_value(EngineKind::Sglang, args, &["--hicache-ratio"])
        .and_then(|(_, r)| r.parse().ok());
    if !has(args, "--hicache-size") && ratio.is_some_and(|r: f64| r < HICACHE_RATIO_FLOOR) {
        tracing::warn!(
            "--hicache-ratio below {HICACHE_RATIO_FLOOR} leaves SGLang's host pool too close to \
             its GPU pool for storage prefetch to pay (at 1.0 older SGLang never reads kvd at \
             all); use --hicache-ratio 2 (SGLang's default) or --hicache-size GB"
        );
    }
    if has(args, EXTRA_CONFIG_FLAG) {
        tracing::warn!(
            "{EXTRA_CONFIG_FLAG} is given, so the launcher adds none: it must name the kvd \
             backend (module_path {SGLANG_BACKEND_MODULE}, class_name {SGLANG_BACKEND_CLASS}), \
             and without prefetch_threshold 64 prompts under 256 tokens never prefetch from kvd"
        );
        return;
    }
    let config = json!({
        "backend_name": "infera-kvd",
        "module_path": SGLANG_BACKEND_MODULE,
        "class_name": SGLANG_BACKEND_CLASS,
        "prefetch_threshold": 64,
        "interface_v1": 1,
    });
    args.extend([EXTRA_CONFIG_FLAG.to_owned(), config.to_string()]);
}
