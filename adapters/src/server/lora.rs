//! Loading a LoRA adapter on demand (`--lora-load-path`, off by default).
//!
//! A request naming a model the fleet does not serve is taken, when this is on, as an adapter
//! of the base model (`--lora-load-base`, or the fleet's only base model) to load: the router
//! asks the least loaded of that model's mixed workers to load it (vLLM's
//! `POST /v1/load_lora_adapter` with `lora_name` and `lora_path`, the path template with `{name}`
//! replaced; the engine must allow run-time loading, `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`),
//! records the adapter on that worker and routes the request there. The worker's launcher
//! re-registers with the adapter at its next refresh, which agrees.
//!
//! Invariants: one load per adapter name at a time (later requests wait for it, then find it
//! served); every load has a deadline (`--lora-load-timeout`); a name that could escape the
//! path template (anything but letters, digits, `-`, `_` and `.`, or `..`) is never loaded; at
//! most [`MAX_TRIES`] workers are tried, and a failure is the request's 404 with each worker's
//! answer.

use super::ServerState;
use super::http::ApiError;
use super::transport::nodelay_connector;
use axum::body::Bytes;
use axum::http::StatusCode;
use http_body_util::{BodyExt as _, Full, Limited};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use infera_core::event::{Role, WorkerRecord};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

/// Workers asked to load one adapter before the request fails.
pub const MAX_TRIES: usize = 2;
/// The longest engine answer read.
const MAX_ANSWER: usize = 64 << 10;

/// `--lora-load-path` and its companions.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct LoraLoading {
    /// Where an adapter named `{name}` is, as the engine reads `lora_path`.
    pub path_template: String,
    /// The base model adapters are loaded onto; `None`: the fleet's only one.
    pub base: Option<String>,
    /// How long one engine may take to load.
    pub timeout: Duration,
}

/// One lock per adapter name being loaded.
#[derive(Debug, Default)]
pub(crate) struct Loads(Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>);

impl Loads {
    fn lock_for(&self, name: &str) -> Arc<tokio::sync::Mutex<()>> {
        let mut map = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        Arc::clone(map.entry(name.to_owned()).or_default())
    }

    fn done(&self, name: &str) {
        let mut map = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        if map.get(name).is_some_and(|l| Arc::strong_count(l) == 1) {
            map.remove(name);
        }
    }
}

/// Whether `name` may stand in the path template.
fn loadable(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 256
        && !name.contains("..")
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
}

impl ServerState {
    /// Makes `model` served when it is not and on-demand loading is on (see the module docs).
    /// Without loading, or for a name that cannot be loaded, nothing happens: the request gets
    /// the usual 404.
    ///
    /// # Errors
    /// A 404 naming what each worker answered when no worker could load it.
    pub(crate) async fn ensure_served(&self, model: &str) -> Result<(), ApiError> {
        let Some(loading) = self.inner.options.lora_loading.as_ref() else {
            return Ok(());
        };
        if self.service().with_fleet(|f| f.served(model).is_some()) || !loadable(model) {
            return Ok(());
        }
        let lock = self.inner.lora_loads.lock_for(model);
        let result = {
            let _guard = lock.lock().await;
            self.load(loading, model).await
        };
        drop(lock);
        self.inner.lora_loads.done(model);
        result
    }

    async fn load(&self, loading: &LoraLoading, model: &str) -> Result<(), ApiError> {
        // Loaded by the request before this one.
        let workers = self.service().with_fleet(|f| {
            if f.served(model).is_some() {
                return Ok(Vec::new());
            }
            let bases: Vec<&str> = f
                .models()
                .into_iter()
                .filter(|(_, s)| s.parent.is_none())
                .map(|(m, _)| m)
                .collect();
            let base = match (&loading.base, bases.as_slice()) {
                (Some(base), _) => base.as_str(),
                (None, [only]) => only,
                (None, _) => {
                    return Err(format!(
                        "the fleet serves {} base models ({}): set --lora-load-base",
                        bases.len(),
                        bases.join(", ")
                    ));
                }
            };
            let mut ranked: Vec<(usize, WorkerRecord)> = Vec::new();
            for c in f.candidates(base, Role::Mixed) {
                let Some(record) = f.worker(&c.rank.worker) else {
                    continue;
                };
                let load = f.inflight_on(&c.rank);
                match ranked
                    .iter_mut()
                    .find(|(_, r)| r.worker_id == record.worker_id)
                {
                    Some(entry) => entry.0 += load,
                    None => ranked.push((load, record.clone())),
                }
            }
            ranked.sort_by_key(|(load, _)| *load);
            Ok(ranked.into_iter().map(|(_, r)| r).collect())
        });
        let workers = workers.map_err(|reason| not_loaded(model, &reason))?;
        if workers.is_empty() && self.service().with_fleet(|f| f.served(model).is_some()) {
            return Ok(());
        }
        let path = loading.path_template.replace("{name}", model);
        let mut answers = Vec::new();
        for mut record in workers.into_iter().take(MAX_TRIES) {
            match load_on(&record.url, model, &path, loading.timeout).await {
                Ok(()) => {
                    tracing::info!(adapter = model, worker = %record.worker_id.as_str(),
                        %path, "LoRA adapter loaded on demand");
                    let mut adapters: Vec<String> =
                        record.lora_adapters().map(str::to_owned).collect();
                    adapters.push(model.to_owned());
                    record.set_lora_adapters(&adapters);
                    self.register_worker(record);
                    return Ok(());
                }
                Err(e) => {
                    tracing::warn!(adapter = model, worker = %record.worker_id.as_str(),
                        error = %e, "the worker did not load the LoRA adapter");
                    answers.push(format!("{}: {e}", record.worker_id.as_str()));
                }
            }
        }
        if answers.is_empty() {
            answers.push("no worker of the base model is available".to_owned());
        }
        Err(not_loaded(model, &answers.join("; ")))
    }
}

fn not_loaded(model: &str, why: &str) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        format!("model {model:?} is not served, and loading it as a LoRA adapter failed: {why}"),
    )
}

/// Asks the engine at `url` to load adapter `name` from `path` within `timeout`. An engine
/// that already has it (vLLM answers 400 "has already been loaded") counts as loaded.
async fn load_on(url: &str, name: &str, path: &str, timeout: Duration) -> Result<(), String> {
    let client: Client<_, Full<Bytes>> =
        Client::builder(TokioExecutor::new()).build(nodelay_connector());
    let body = serde_json::json!({"lora_name": name, "lora_path": path}).to_string();
    let request = hyper::Request::post(format!(
        "{}/v1/load_lora_adapter",
        url.trim_end_matches('/')
    ))
    .header("content-type", "application/json")
    .body(Full::new(Bytes::from(body)))
    .map_err(|e| format!("bad request: {e}"))?;
    let exchange = async {
        let response = client.request(request).await.map_err(|e| e.to_string())?;
        let status = response.status();
        let answer = Limited::new(response.into_body(), MAX_ANSWER)
            .collect()
            .await
            .map_err(|e| e.to_string())?
            .to_bytes();
        let answer = String::from_utf8_lossy(&answer).into_owned();
        if status.is_success() || answer.contains("already been loaded") {
            Ok(())
        } else {
            Err(format!("{status}: {}", answer.trim()))
        }
    };
    tokio::time::timeout(timeout, exchange)
        .await
        .map_err(|_| format!("no answer within {timeout:?}"))?
}

#[cfg(test)]
mod tests {
    use super::loadable;

    #[test]
    fn only_plain_names_reach_the_path_template() {
        for ok in ["sql", "tenant-7_v2", "a.b"] {
            assert!(loadable(ok), "{ok}");
        }
        for bad in ["", "../etc", "a/b", "a..b", "x y", "é", &"x".repeat(257)] {
            assert!(!loadable(bad), "{bad:?}");
        }
    }
}
