//! What the Python Infera's launchers add to an engine's command line and check before they
//! start it, kept with the same conditions so its deployments behave the same here:
//!
//! - **fp8 KV cache** (vLLM, SGLang): `--kv-cache-dtype fp8_e4m3` unless the command line sets a
//!   `--kv-cache-dtype` or `INFERA_DEFAULT_KV_FP8=0`. It halves the KV footprint and the PD
//!   transfer volume, at a small accuracy cost.
//! - **SGLang decode radix cache**: a decode worker with KV events on and the `mooncake`
//!   transfer backend gets `--disaggregation-decode-enable-radix-cache`, so its KV events say
//!   what it holds (SGLang's flag defaults off). Not with `--speculative-algorithm`, which SGLang
//!   refuses it with.
//! - **PD preflight** (vLLM, SGLang; [`preflight`]): a prefill or decode worker must advertise
//!   a host its peers can reach, and must name an RDMA transport (SGLang:
//!   `--disaggregation-transfer-backend` one of ascend, mooncake, mori, nixl; vLLM: a connector
//!   with a PD protocol), else it would fall back to TCP silently. `--disaggregation-allow-tcp`
//!   skips the transport check (benchmarks only).

use super::{LaunchError, engine_value};
use crate::config::worker::{EngineKind, engine_flag_given};
use infera_core::event::Role;

/// The variable that turns the fp8 KV-cache default off (`0`).
pub const DEFAULT_KV_FP8_ENV: &str = "INFERA_DEFAULT_KV_FP8";
/// SGLang transfer backends that move KV over RDMA.
const SGLANG_RDMA_BACKENDS: [&str; 4] = ["ascend", "mooncake", "mori", "nixl"];
/// Hosts a worker may bind but peers on other nodes cannot reach.
const NON_ROUTABLE_HOSTS: [&str; 6] = ["", "0.0.0.0", "127.0.0.1", "localhost", "::", "::1"];

/// The engine arguments the defaults add, in order (appended after the user's).
pub(super) fn added_args(
    engine: EngineKind,
    role: Role,
    kv_events: bool,
    passthrough: &[String],
    env: &dyn Fn(&str) -> Option<String>,
) -> Vec<String> {
    let mut added = Vec::new();
    // As the engine reads its arguments: SGLang's `--kv-cache-d auto` sets its KV cache dtype.
    let given = |flag: &str| engine_flag_given(engine, passthrough, &[flag]);
    let fp8 = env(DEFAULT_KV_FP8_ENV).is_none_or(|v| v.trim() != "0");
    if matches!(engine, EngineKind::Vllm | EngineKind::Sglang) && fp8 && !given("--kv-cache-dtype")
    {
        added.extend(["--kv-cache-dtype".to_owned(), "fp8_e4m3".to_owned()]);
    }
    let radix = "--disaggregation-decode-enable-radix-cache";
    if engine == EngineKind::Sglang
        && kv_events
        && role == Role::Decode
        && engine_value(engine, passthrough, &["--disaggregation-transfer-backend"])
            == Some("mooncake")
        && !given(radix)
        && !given("--speculative-algorithm")
    {
        added.push(radix.to_owned());
    }
    added
}

/// Refuses a PD worker that would fail across nodes (see the module docs).
///
/// # Errors
/// A non-routable advertised host; no RDMA transport without `allow_tcp`.
pub(super) fn preflight(
    engine: EngineKind,
    role: Role,
    advertise_host: &str,
    has_protocol: bool,
    passthrough: &[String],
    allow_tcp: bool,
) -> Result<(), LaunchError> {
    if role == Role::Mixed || !matches!(engine, EngineKind::Vllm | EngineKind::Sglang) {
        return Ok(());
    }
    let host = advertise_host.trim().to_ascii_lowercase();
    if NON_ROUTABLE_HOSTS.contains(&host.as_str()) {
        return Err(LaunchError(format!(
            "a {role} worker must advertise a host its peers and the router reach across nodes, \
             got {advertise_host:?}: pass --advertise-host <routable-ip>",
            role = role.as_str()
        )));
    }
    if allow_tcp {
        return Ok(());
    }
    let hint = "pass --disaggregation-allow-tcp to start anyway (benchmarks only)";
    match engine {
        EngineKind::Sglang => {
            match engine_value(engine, passthrough, &["--disaggregation-transfer-backend"]) {
                None => Err(LaunchError(format!(
                    "a disaggregated SGLang worker needs an explicit \
                     --disaggregation-transfer-backend ({}): the default risks a silent TCP \
                     fallback; {hint}",
                    SGLANG_RDMA_BACKENDS.join(", ")
                ))),
                Some(b)
                    if !SGLANG_RDMA_BACKENDS.contains(&b.trim().to_ascii_lowercase().as_str()) =>
                {
                    Err(LaunchError(format!(
                        "--disaggregation-transfer-backend {b} does not move KV over RDMA \
                         (expected one of {}); {hint}",
                        SGLANG_RDMA_BACKENDS.join(", ")
                    )))
                }
                Some(_) => Ok(()),
            }
        }
        _ if has_protocol => Ok(()),
        _ => Err(LaunchError(format!(
            "a disaggregated vLLM worker needs a Mooncake, MoRIIO or NIXL connector in \
             --kv-transfer-config: without one no KV crosses nodes; {hint}"
        ))),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn args(a: &[&str]) -> Vec<String> {
        a.iter().map(|s| (*s).to_owned()).collect()
    }

    fn no_env(_: &str) -> Option<String> {
        None
    }

    #[test]
    fn fp8_is_the_default_unless_set_or_turned_off() {
        let added = added_args(EngineKind::Vllm, Role::Mixed, true, &[], &no_env);
        assert_eq!(added, args(&["--kv-cache-dtype", "fp8_e4m3"]));
        let own = args(&["--kv-cache-dtype=auto"]);
        assert!(added_args(EngineKind::Sglang, Role::Mixed, true, &own, &no_env).is_empty());
        let off = |k: &str| (k == DEFAULT_KV_FP8_ENV).then(|| "0".to_owned());
        assert!(added_args(EngineKind::Vllm, Role::Mixed, true, &[], &off).is_empty());
        assert!(added_args(EngineKind::Atom, Role::Mixed, true, &[], &no_env).is_empty());
    }

    #[test]
    fn sglang_mooncake_decode_with_events_gets_the_radix_cache() {
        let off = |k: &str| (k == DEFAULT_KV_FP8_ENV).then(|| "0".to_owned());
        let mooncake = args(&["--disaggregation-transfer-backend", "mooncake"]);
        let radix = args(&["--disaggregation-decode-enable-radix-cache"]);
        let added = |role, events, pass: &[String]| {
            added_args(EngineKind::Sglang, role, events, pass, &off)
        };
        assert_eq!(added(Role::Decode, true, &mooncake), radix);
        assert!(added(Role::Prefill, true, &mooncake).is_empty());
        assert!(added(Role::Decode, false, &mooncake).is_empty());
        let mori = args(&["--disaggregation-transfer-backend", "mori"]);
        assert!(added(Role::Decode, true, &mori).is_empty());
        let mut speculative = mooncake.clone();
        speculative.extend(args(&["--speculative-algorithm", "EAGLE"]));
        assert!(added(Role::Decode, true, &speculative).is_empty());
        let mut already = mooncake;
        already.extend(radix);
        assert!(added(Role::Decode, true, &already).is_empty());
    }

    #[test]
    fn pd_workers_need_a_routable_host_and_an_rdma_transport() {
        let mooncake = args(&["--disaggregation-transfer-backend", "mooncake"]);
        let check = |engine, role, host, proto, pass: &[String], tcp| {
            preflight(engine, role, host, proto, pass, tcp)
        };
        assert!(
            check(
                EngineKind::Sglang,
                Role::Mixed,
                "0.0.0.0",
                false,
                &[],
                false
            )
            .is_ok()
        );
        let e = check(
            EngineKind::Sglang,
            Role::Decode,
            "127.0.0.1",
            false,
            &mooncake,
            true,
        );
        assert!(e.unwrap_err().to_string().contains("--advertise-host"));
        assert!(
            check(
                EngineKind::Sglang,
                Role::Prefill,
                "10.0.0.2",
                false,
                &mooncake,
                false
            )
            .is_ok()
        );
        let e = check(
            EngineKind::Sglang,
            Role::Prefill,
            "10.0.0.2",
            false,
            &[],
            false,
        );
        assert!(
            e.unwrap_err()
                .to_string()
                .contains("--disaggregation-allow-tcp")
        );
        let tcp = args(&["--disaggregation-transfer-backend", "tcp"]);
        let e = check(
            EngineKind::Sglang,
            Role::Prefill,
            "10.0.0.2",
            false,
            &tcp,
            false,
        );
        assert!(
            e.unwrap_err()
                .to_string()
                .contains("tcp does not move KV over RDMA")
        );
        assert!(
            check(
                EngineKind::Sglang,
                Role::Prefill,
                "10.0.0.2",
                false,
                &tcp,
                true
            )
            .is_ok()
        );
        assert!(check(EngineKind::Vllm, Role::Decode, "10.0.0.2", true, &[], false).is_ok());
        let e = check(
            EngineKind::Vllm,
            Role::Decode,
            "10.0.0.2",
            false,
            &[],
            false,
        );
        assert!(e.unwrap_err().to_string().contains("connector"));
        assert!(check(EngineKind::Vllm, Role::Decode, "10.0.0.2", false, &[], true).is_ok());
    }
}
