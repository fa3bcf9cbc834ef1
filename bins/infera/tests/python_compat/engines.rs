//! `python -m infera.engine.{sglang,vllm,atom}` command lines.

use super::*;

// ---- python -m infera.engine.{sglang,vllm,atom} ----------------------------------------------

#[test]
fn readme_sglang() {
    let over = fields! { "/advertise_host" => "0.0.0.0", "/launch/passthrough" => [] };
    let over = worker_dev("127.0.0.1:2379", over);
    let want = sglang("Qwen/Qwen3-0.6B", 30000, over);
    expect("readme-sglang", want);
}

#[test]
fn kv_aware_routing_sglang_page_size() {
    let over = fields! {
        "/launch/kv_block_size" => 16, "/launch/passthrough" => ["--page-size", "16"],
    };
    let over = worker_dev("etcd-0:2379", over);
    let want = sglang("/models/qwen", 30000, over);
    expect("kv-aware-routing-sglang", want);
}

#[test]
fn pd_sglang_mooncake_prefill_defaults_to_kubernetes_and_nats() {
    let passthrough = words(
        "--disaggregation-mode prefill --disaggregation-bootstrap-port 8998 \
         --disaggregation-transfer-backend mooncake",
    );
    let over = with(
        kubernetes(None),
        fields! { "/launch/passthrough" => passthrough },
    );
    let want = sglang("/models/qwen", 30001, over);
    expect("pd-sglang-mooncake-prefill", want);
}

#[test]
fn dsv4_pd_decode_sglang() {
    let passthrough = words(
        "--tp-size 8 --trust-remote-code --attention-backend dsv4 --disable-radix-cache \
         --page-size 256 --cuda-graph-max-bs 512 --swa-full-tokens-ratio 0.15 \
         --disable-shared-experts-fusion --context-length 9472 --dp 8 --enable-dp-attention \
         --ep-size 8 --enable-prefill-delayer --prefill-delayer-max-delay-ms 5000 \
         --chunked-prefill-size 163840 --max-prefill-tokens 163840 --mem-fraction-static 0.90 \
         --disaggregation-mode decode --disaggregation-transfer-backend mooncake",
    );
    // SGLang's argparse reads `--dp 8` as `--dp-size 8` (a unique prefix), and the Python
    // launcher registers the worker with that dp_size.
    let over = fields! {
        "/advertise_host" => "10.0.0.3", "/kv_events/enabled" => false,
        "/launch/kv_block_size" => 256, "/launch/tensor_parallel_size" => 8,
        "/launch/data_parallel_size" => 8, "/launch/passthrough" => passthrough,
    };
    let over = worker_dev("10.0.0.1:2379", over);
    let want = sglang("/models/DeepSeek-V4-Pro", 30000, over);
    expect("dsv4-pd-decode", want);
}

#[test]
fn kimi26_prefill_without_kv_events() {
    let passthrough = words(
        "--tp-size 4 --dp-size 4 --enable-dp-attention --attention-backend aiter \
         --trust-remote-code --kv-cache-dtype fp8_e4m3 --mem-fraction-static 0.85 \
         --max-running-requests 4096 --chunked-prefill-size 131072 --disaggregation-mode prefill \
         --disaggregation-bootstrap-port 8998 --disaggregation-transfer-backend mooncake",
    );
    let over = fields! {
        "/request_transport" => "http", "/advertise_host" => "10.0.0.11",
        "/kv_events/enabled" => false, "/launch/tensor_parallel_size" => 4,
        "/launch/data_parallel_size" => 4, "/launch/passthrough" => passthrough,
    };
    let over = with(etcd("10.0.0.11:2379"), over);
    let want = sglang("/models/Kimi-K2.6-MXFP4", 30001, over);
    expect("kimi26-sglang-prefill", want);
}

#[test]
fn k8s_pd_mori_prefill() {
    let passthrough = words(
        "--disaggregation-mode prefill --tp-size 1 --attention-backend aiter --trust-remote-code \
         --mem-fraction-static 0.8 --disaggregation-transfer-backend mori \
         --disaggregation-ib-device rdma0",
    );
    let over = fields! {
        "/request_transport" => "http", "/kv_events/transport" => "zmq",
        "/launch/tensor_parallel_size" => 1, "/launch/passthrough" => passthrough,
    };
    let over = with(kubernetes(None), over);
    let want = sglang("/models/qwen", 30000, over);
    expect("k8s-pd-mori-prefill", want);
}

#[test]
fn glm52_recipe_prefill_with_kvd_and_ready_timeout_from_the_environment() {
    let mut passthrough = words(
        "--tp-size 8 --dp-size 8 --enable-dp-attention --trust-remote-code \
         --kv-cache-dtype fp8_e4m3 --reasoning-parser glm45 --tool-call-parser glm47 \
         --dsa-prefill-backend tilelang --dsa-decode-backend tilelang --mem-fraction-static 0.85 \
         --max-running-requests 128 --chunked-prefill-size 8192 --watchdog-timeout 1200 \
         --disable-custom-all-reduce --enable-cache-report --speculative-algorithm EAGLE \
         --speculative-num-steps 5 --speculative-eagle-topk 1 --speculative-num-draft-tokens 6",
    );
    passthrough.extend([
        "--json-model-override-args",
        r#"{"index_share_for_mtp_iteration":false}"#,
        "--hicache-size",
        "32",
        "--weight-loader-prefetch-checkpoints",
        "--model-loader-extra-config",
        r#"{"enable_multithread_load": true, "num_threads": 32}"#,
    ]);
    passthrough.extend(words(
        "--disaggregation-mode prefill --disaggregation-bootstrap-port 8998 \
         --disaggregation-transfer-backend mooncake --disaggregation-ib-device rdma0,rdma1",
    ));
    // INFERA_ENGINE_READY_TIMEOUT=5400 (seconds) from the manifest's env.
    let over = fields! {
        "/advertise_host" => "10.1.0.7", "/request_transport" => "http",
        "/kv_events/transport" => "zmq", "/kvd_socket" => "/tmp/infera-kvd/kvd.sock",
        "/launch/ready_timeout" => "90m", "/launch/tensor_parallel_size" => 8,
        "/launch/data_parallel_size" => 8, "/launch/passthrough" => passthrough,
    };
    let over = with(kubernetes(None), over);
    let want = sglang("/models/GLM-5.2-FP8", 30001, over);
    expect("glm52-fp8-recipe-prefill", want);
}

#[test]
fn operator_gaie_prefill_over_nats() {
    let passthrough = words(
        "--disaggregation-mode prefill --tp-size 1 --trust-remote-code \
         --disaggregation-transfer-backend mori --disaggregation-ib-device rdma0",
    );
    let over = fields! {
        "/nats_server" => "nats://demo-gaie-nats:4222", "/launch/passthrough" => passthrough,
    };
    let over = with(kubernetes(None), over);
    let want = sglang("Qwen/Qwen3-0.6B", 30000, over);
    expect("operator-gaie-prefill", want);
}

#[test]
fn quickstart_vllm() {
    let over = worker_dev("127.0.0.1:2379", fields! { "/launch/passthrough" => [] });
    let want = vllm("Qwen/Qwen3-0.6B", 30000, over);
    expect("quickstart-vllm", want);
}

#[test]
fn kv_aware_routing_vllm_block_size() {
    let over = fields! {
        "/launch/kv_block_size" => 16, "/launch/passthrough" => ["--block-size", "16"],
    };
    let over = worker_dev("etcd-0:2379", over);
    let want = vllm("/models/qwen", 30000, over);
    expect("kv-aware-routing-vllm", want);
}

#[test]
fn pd_vllm_mooncake_producer() {
    let config = r#"{"kv_connector":"MooncakeConnector","kv_role":"kv_producer"}"#;
    let over = fields! {
        "/advertise_host" => "10.0.0.2", "/launch/passthrough" => ["--kv-transfer-config", config],
    };
    let over = with(kubernetes(None), over);
    let want = vllm("/models/qwen", 30001, over);
    expect("pd-vllm-mooncake-producer", want);
}

const KVD_CONNECTOR: &str = r#"{"kv_connector":"InferaKvdConnector","kv_role":"kv_both","kv_connector_module_path":"infera.engine.vllm.kvd_connector"}"#;

#[test]
fn kv_offload_vllm_keeps_its_connector_config() {
    let passthrough = [
        "--enable-prefix-caching",
        "--kv-transfer-config",
        KVD_CONNECTOR,
    ];
    let over = with(
        kubernetes(None),
        fields! { "/launch/passthrough" => passthrough },
    );
    let want = vllm("/models/qwen", 8000, over);
    expect("kv-offload-vllm", want);
}

#[test]
fn k8s_mixed_kvd_vllm() {
    let mut passthrough = words(
        "--served-model-name qwen --kv-cache-dtype auto --tensor-parallel-size 1 \
         --gpu-memory-utilization 0.85 --trust-remote-code --kv-transfer-config",
    );
    passthrough.push(KVD_CONNECTOR);
    let over = fields! {
        "/request_transport" => "http", "/kv_events/transport" => "zmq",
        "/launch/tensor_parallel_size" => 1, "/launch/passthrough" => passthrough,
    };
    let over = with(kubernetes(None), over);
    let want = vllm("/models/Qwen3-0.6B", 30000, over);
    expect("k8s-mixed-kvd-vllm", want);
}

#[test]
fn quickstart_atom_registers_in_etcd() {
    let over =
        fields! { "/launch/tensor_parallel_size" => 1, "/launch/passthrough" => ["-tp", "1"] };
    let want = atom("Qwen/Qwen3-0.6B", 30000, "127.0.0.1:2379", over);
    expect("quickstart-atom", want);
}

#[test]
fn pd_atom_producer_registers_in_etcd() {
    let config = r#"{"kv_role":"kv_producer","kv_connector":"mooncake","handshake_port":6301,"http_port":30001,"proxy_ip":"10.0.0.2","ib_device":"rdma0"}"#;
    let over = fields! {
        "/advertise_host" => "10.0.0.2", "/launch/tensor_parallel_size" => 1,
        "/launch/passthrough" => ["-tp", "1", "--kv-transfer-config", config],
    };
    let want = atom("/models/qwen", 30001, "etcd-0:2379", over);
    expect("pd-atom-producer", want);
}

#[test]
fn dsv4_atom_mix_registers_in_etcd() {
    let mut passthrough = words(
        "-tp 8 --kv_cache_dtype fp8 --trust-remote-code --gpu-memory-utilization 0.9 \
         --no-enable_prefix_caching --cudagraph-capture-sizes",
    );
    passthrough.extend([
        "[1, 2, 4, 8, 16, 32, 48, 64, 128, 256, 512]",
        "--max-model-len",
        "16384",
    ]);
    let over = fields! {
        "/advertise_host" => "127.0.0.1", "/launch/tensor_parallel_size" => 8,
        "/launch/passthrough" => passthrough,
    };
    let want = atom("/models/DeepSeek-V4-Pro", 30000, "127.0.0.1:2379", over);
    expect("dsv4-atom-mix", want);
}
