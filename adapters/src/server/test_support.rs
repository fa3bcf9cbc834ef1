//! Fixtures shared by the server's unit tests: a state over the fixture tokenizer and a worker
//! record.

use super::{ServerOptions, ServerState};
use crate::tokenize::Tokenizer;
use infera_core::event::{Engine, RequestTransport, Role, WorkerRecord};
use infera_core::fleet::FleetConfig;
use infera_core::ids::WorkerId;
use infera_core::policy::RouterConfig;
use std::path::Path;
use std::sync::Arc;

/// A server with no workers, the default router and the fixture tokenizer.
pub(crate) fn state() -> ServerState {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/tokenizers/deepseek-v4");
    let tokenizer = Tokenizer::from_path(&dir).expect("fixture tokenizer");
    let options = ServerOptions {
        max_body_bytes: 1 << 16,
        request_max_retries: 0,
        router: RouterConfig::default(),
        fleet: FleetConfig::default(),
        chat_template: None,
        direct: false,
        client: super::ClientOptions::default(),
    };
    ServerState::new(options, Arc::new(tokenizer))
}

/// A vLLM worker `id` of model `m`, block size 16, one dp rank, HTTP transport.
pub(crate) fn record(id: &str) -> WorkerRecord {
    WorkerRecord {
        worker_id: WorkerId::new(id),
        url: format!("http://{id}"),
        model_name: "m".into(),
        engine: Engine::Vllm,
        disagg_mode: Role::Mixed,
        disagg_meta: None,
        kv_events_endpoint: None,
        kv_block_size: 16,
        dp_rank: 0,
        dp_size: 1,
        request_transport: RequestTransport::Http,
        kv: None,
        extra: serde_json::Map::new(),
    }
}
