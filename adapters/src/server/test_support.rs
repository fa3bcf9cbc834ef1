//! Fixtures shared by the server's unit tests: a state over the fixture tokenizer and a worker
//! record.

use super::{ServerOptions, ServerState};
use crate::tokenize::Tokenizer;
use infera_core::event::{Engine, WorkerRecord};
use infera_core::fleet::FleetConfig;
use infera_core::ids::WorkerId;
use infera_core::policy::RouterConfig;
use infera_core::service::ServiceOptions;
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

/// A server with no workers, the default router and the fixture tokenizer.
pub(crate) fn state() -> ServerState {
    state_with_models(BTreeMap::new())
}

/// [`state`] with `models` tokenized by their own tokenizers.
pub(crate) fn state_with_models(models: BTreeMap<String, Arc<Tokenizer>>) -> ServerState {
    built(models, super::ClientOptions::default())
}

/// [`state`] whose tenants are `keys`' (`--api-keys`).
pub(crate) fn state_with_keys(keys: super::KeyStore) -> ServerState {
    built(
        BTreeMap::new(),
        super::ClientOptions {
            api_keys: Some(keys),
            ..super::ClientOptions::default()
        },
    )
}

fn built(models: BTreeMap<String, Arc<Tokenizer>>, client: super::ClientOptions) -> ServerState {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/tokenizers/deepseek-v4");
    let tokenizer = Tokenizer::from_path(&dir).expect("fixture tokenizer");
    let options = ServerOptions {
        service: ServiceOptions {
            router: RouterConfig::default(),
            fleet: FleetConfig::default(),
            request_max_retries: 0,
            max_body_bytes: 1 << 16,
        },
        chat_template: None,
        template_defaults: Default::default(),
        per_worker_template_kwargs: true,
        model_tokenizers: models,
        lora_loading: None,
        direct: false,
        client,
    };
    ServerState::new(options, Arc::new(tokenizer))
}

/// A vLLM worker `id` of model `m`, block size 16, one dp rank, HTTP transport.
pub(crate) fn record(id: &str) -> WorkerRecord {
    WorkerRecord::mixed(
        WorkerId::new(id),
        format!("http://{id}"),
        "m",
        Engine::Vllm,
        16,
    )
}
