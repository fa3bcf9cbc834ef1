//! Per-worker chat renderings (`--kv-per-worker-template-kwargs`, on by default): an SGLang
//! engine started with `--default-chat-template-kwargs` merges those into every chat request
//! before its template runs, and nothing tells the router, so a worker launched with other
//! defaults than `--kv-default-chat-template-kwargs` renders other tokens and every lookup for
//! it misses. At registration the server asks each SGLang worker (`GET /get_server_info`, its
//! `default_chat_template_kwargs`, as the Python Infera's render probe does); a worker whose
//! defaults differ from the fleet's gets its chat prompts hashed its own way (the
//! [`WorkerHashes`] of the route request), so its cache is seen and charged as its engine
//! stores it. A worker that cannot be asked keeps the fleet's defaults; a uniform fleet renders
//! each chat once, as before.
//!
//! [`WorkerHashes`]: infera_core::policy::WorkerHashes

use super::ServerState;
use super::transport::nodelay_connector;
use crate::tokenize::TemplateKwargs;
use axum::body::Bytes;
use http_body_util::{BodyExt as _, Empty, Limited};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use infera_core::event::{Engine, WorkerRecord};
use infera_core::ids::WorkerId;
use infera_core::ports::tokenize::Rendering;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

/// How long a worker may take to answer the probe.
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(5);
/// The largest `/get_server_info` answer read.
const MAX_INFO_BYTES: usize = 4 << 20;

/// What each probed worker's engine merges into chat requests, kept only where it differs from
/// the fleet's defaults: a uniform fleet leaves the map empty, and its chats pay one lock.
#[derive(Debug, Default)]
pub(crate) struct Variants {
    /// `--kv-per-worker-template-kwargs`.
    enabled: bool,
    per_worker: Mutex<HashMap<WorkerId, Arc<TemplateKwargs>>>,
}

impl Variants {
    pub(crate) fn new(enabled: bool) -> Self {
        Self {
            enabled,
            per_worker: Mutex::default(),
        }
    }

    fn map(&self) -> std::sync::MutexGuard<'_, HashMap<WorkerId, Arc<TemplateKwargs>>> {
        self.per_worker
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// The renderings of `workers` other than the fleet's, each with its workers.
    pub(crate) fn differing<'a>(
        &self,
        workers: impl Iterator<Item = &'a WorkerId>,
    ) -> Vec<(Arc<TemplateKwargs>, Vec<WorkerId>)> {
        let map = self.map();
        let mut out: Vec<(Arc<TemplateKwargs>, Vec<WorkerId>)> = Vec::new();
        for worker in workers {
            let Some(kwargs) = map.get(worker) else {
                continue;
            };
            match out.iter_mut().find(|(k, _)| k == kwargs) {
                Some((_, members)) => members.push(worker.clone()),
                None => out.push((Arc::clone(kwargs), vec![worker.clone()])),
            }
        }
        out
    }

    pub(crate) fn forget(&self, worker: &WorkerId) {
        self.map().remove(worker);
    }
}

impl ServerState {
    /// The renderings of `model`'s workers that differ from the fleet's, each with its workers
    /// and their block sizes; empty for a uniform fleet.
    pub(crate) fn differing_renderings(&self, model: &str) -> Vec<Rendering<Arc<TemplateKwargs>>> {
        let variants = &self.inner.variants;
        if !variants.enabled || variants.map().is_empty() {
            return Vec::new();
        }
        let workers: Vec<(WorkerId, u32)> = self.service().with_fleet(|f| {
            f.workers()
                .filter(|w| w.model_name == model)
                .map(|w| (w.worker_id.clone(), w.kv_block_size))
                .collect()
        });
        let groups = variants.differing(workers.iter().map(|(w, _)| w));
        groups
            .into_iter()
            .map(|(kwargs, members)| {
                let sized = workers
                    .iter()
                    .filter(|(w, _)| members.contains(w))
                    .cloned()
                    .collect();
                (kwargs, sized)
            })
            .collect()
    }

    /// Asks `record`'s engine which template defaults it renders with, if it is an SGLang
    /// worker and per-worker renderings are on, and hashes its chat requests that way from then
    /// on (see the module docs). [`ServerState::register_worker`] starts this itself; a caller
    /// may await it to know the answer is in.
    pub async fn probe_render_variant(&self, record: &WorkerRecord) {
        let variants = &self.inner.variants;
        if !variants.enabled || record.engine != Engine::Sglang {
            return;
        }
        let url = format!("{}/get_server_info", record.url.trim_end_matches('/'));
        let kwargs = match tokio::time::timeout(PROBE_TIMEOUT, server_defaults(&url)).await {
            Ok(Ok(kwargs)) => kwargs,
            Ok(Err(e)) => {
                tracing::info!(worker = %record.worker_id.as_str(), %url,
                    "render probe failed, hashing this worker's chats with the fleet's template defaults: {e}");
                return;
            }
            Err(_) => {
                tracing::info!(worker = %record.worker_id.as_str(), %url,
                    "render probe got no answer within {PROBE_TIMEOUT:?}; the fleet's template defaults apply");
                return;
            }
        };
        let fleet = &self.inner.options.template_defaults;
        if kwargs == **fleet {
            // Renders as the fleet does (again, after a restart with other defaults).
            variants.forget(&record.worker_id);
            return;
        }
        tracing::warn!(
            worker = %record.worker_id.as_str(),
            engine_defaults = %label(&kwargs),
            router_defaults = %label(fleet),
            "kv-aware: this worker renders with server-side template defaults that differ \
             from the router's; requests for it are now hashed its way"
        );
        variants
            .map()
            .insert(record.worker_id.clone(), Arc::new(kwargs));
    }
}

/// `default_chat_template_kwargs` from an SGLang `/get_server_info` at `url` (absent or `null`:
/// none).
async fn server_defaults(url: &str) -> Result<TemplateKwargs, String> {
    let client: Client<_, Empty<Bytes>> =
        Client::builder(TokioExecutor::new()).build(nodelay_connector());
    let uri = url.parse().map_err(|e| format!("bad URL: {e}"))?;
    let response = client.get(uri).await.map_err(|e| e.to_string())?;
    if !response.status().is_success() {
        return Err(format!("answered {}", response.status()));
    }
    let body = Limited::new(response.into_body(), MAX_INFO_BYTES)
        .collect()
        .await
        .map_err(|e| e.to_string())?
        .to_bytes();
    let info: serde_json::Value =
        serde_json::from_slice(&body).map_err(|e| format!("not JSON: {e}"))?;
    match info.get("default_chat_template_kwargs") {
        None | Some(serde_json::Value::Null) => Ok(TemplateKwargs::new()),
        Some(value) => serde_json::from_value(value.clone())
            .map_err(|e| format!("default_chat_template_kwargs is not an object: {e}")),
    }
}

/// The defaults on one line, for logs.
fn label(kwargs: &TemplateKwargs) -> String {
    if kwargs.is_empty() {
        return "none".to_owned();
    }
    kwargs
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",")
}
