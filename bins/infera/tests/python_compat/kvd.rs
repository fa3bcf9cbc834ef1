//! `python -m infera.kvd` and `python -m infera.gaie` command lines.

use super::*;

// ---- python -m infera.kvd -------------------------------------------------------------------

/// A kvd with one L3 directory, sizes as the Python's `_parse_size` reads them (K/M/G/T are
/// powers of 1024), and the shared arena at its default `auto`: the size of the RAM tier.
fn kvd(socket: &str, ram: &str, l3: &str, l3_bytes: &str, io_mode: &str) -> Fields {
    fields! {
        "/socket" => socket, "/max_bytes" => ram, "/shared_arena_bytes" => ram,
        "/long_tier/layout" => {"kind": "single", "path": l3}, "/long_tier/bytes" => l3_bytes,
        "/long_tier/io_mode" => io_mode, "/l4_tier" => null,
    }
}

#[test]
fn kv_offload_kvd() {
    let fields = kvd(
        "/var/run/infera-kvd.sock",
        "16GiB",
        "/nvme/kvd-long",
        "256GiB",
        "auto",
    );
    expect("kv-offload-kvd", fields);
}

#[test]
fn k8s_kvd_sidecar_plain_byte_counts() {
    let want = kvd("/kvd/kvd.sock", "32GiB", "/l3/long", "100GiB", "auto");
    expect("k8s-mixed-kvd-vllm-kvd", want);
}

#[test]
fn glm52_recipe_kvd_with_tablespace_pools() {
    // --tablespace-pools 1M,4M: one tablespace pool per slot size, so that both the KV pages and
    // the indexer pages fit a slot (infera/kvd/server.py). Nothing in the config shows the pools
    // yet; the line must at least be accepted with the rest of its meaning.
    let fields = kvd(
        "/tmp/infera-kvd/kvd.sock",
        "64GiB",
        "/kvd-l3",
        "512GiB",
        "direct",
    );
    expect("glm52-fp8-recipe-kvd", fields);
}

#[test]
fn glm52_1p1d_kvd_with_log_level() {
    let want = kvd(
        "/tmp/kvd/kvd.sock",
        "64GiB",
        "/tmp/kvd-long",
        "64GiB",
        "auto",
    );
    expect("glm52-1p1d-kvd", want);
}

// ---- python -m infera.gaie ------------------------------------------------------------------

#[test]
fn operator_gaie_epp() {
    let over = fields! {
        "/grpc/host" => "0.0.0.0", "/grpc/grpc_port" => 9002, "/grpc/grpc_health_port" => 9003,
        "/grpc/destination_port" => 8000, "/grpc/secure_serving" => true,
        "/router/tokenizer_path" => "Qwen/Qwen3-0.6B", "/router/policy" => "kv-aware",
        "/router/kv_overlap_weight" => 1.0, "/router/kv_prefill_overlap_weight" => null,
        "/router/kv_decode_overlap_weight" => null, "/kv_event_transport" => "nats",
        "/nats_server" => "nats://demo-gaie-nats:4222",
    };
    let selector = Some("infera.amd.com/deployment=demo-gaie");
    let want = with(kubernetes(selector), over);
    expect("operator-gaie-epp", want);
}
