//! `python -m infera.server` command lines.

use super::*;

// ---- python -m infera.server -----------------------------------------------------------------

#[test]
fn readme_server() {
    let file = hf_cache().join("models--Qwen--Qwen3-0.6B/snapshots/fixture/tokenizer.json");
    let over = fields! {
        "/router/tokenizer_path" => "Qwen/Qwen3-0.6B", "/router/tokenizer_file" => file,
    };
    let want = server_dev("127.0.0.1:2379", over);
    expect("readme-server", want);
}

#[test]
fn quickstart_server_takes_the_migration_limit_from_the_environment() {
    let over = fields! { "/worker_edge/migration_limit" => 1 };
    let want = server_dev("127.0.0.1:2379", over);
    expect("quickstart-server-migration-env", want);
}

#[test]
fn kv_aware_routing_server() {
    let over = fields! { "/router/policy" => "kv-aware", "/router/kv_overlap_weight" => 1.0 };
    let want = server_dev("etcd-0:2379", over);
    expect("kv-aware-routing-server", want);
}

#[test]
fn dsv4_pd_router_round_robin() {
    let tokenizer = common::tokenizer_dir();
    let over = fields! {
        "/router/policy" => "round-robin", "/router/tokenizer_path" => tokenizer,
    };
    let want = server_dev("10.0.0.1:2379", over);
    expect("dsv4-pd-router", want);
}

#[test]
fn glm52_router_pd_overlap_weights() {
    let over = fields! {
        "/router/kv_prefill_overlap_weight" => 20.0, "/router/kv_decode_overlap_weight" => 2.0,
    };
    let want = server_dev("10.0.0.1:2379", over);
    expect("glm52-gfx942-router", want);
}

#[test]
fn k8s_server_takes_the_operators_label_selector_from_the_environment() {
    let plane = fields! { "/request_transport" => "http", "/kv_event_transport" => "zmq" };
    let over = with(
        kubernetes(Some("infera.amd.com/deployment=qwen-agg")),
        plane,
    );
    let want = server(over);
    expect("k8s-single-node-server", want);
}

#[test]
fn glm52_recipe_server() {
    let over = fields! {
        "/request_transport" => "http", "/kv_event_transport" => "zmq",
        "/router/kv_prefill_overlap_weight" => 20.0, "/router/kv_decode_overlap_weight" => 2.0,
    };
    let selector = Some("infera.amd.com/deployment=glm52-fp8-pd-kvd");
    let want = server(with(kubernetes(selector), over));
    expect("glm52-fp8-recipe-server", want);
}

#[test]
fn operator_gaie_frontend_is_direct_mode_over_nats() {
    let over = fields! {
        "/router/mode" => "direct", "/nats/server" => "nats://demo-gaie-nats:4222",
        "/router/tokenizer_path" => "Qwen/Qwen3-0.6B",
    };
    let selector = Some("infera.amd.com/deployment=demo-gaie");
    let want = server(with(kubernetes(selector), over));
    expect("operator-gaie-frontend", want);
}
