//! The worker's model inventory: the LoRA adapters its engine serves, read from the engine's own
//! `GET /v1/models` before registering and every [`REFRESH`] after, re-registered when it
//! changes (an adapter loaded or unloaded at run time).
//!
//! vLLM lists each adapter (`--lora-modules`, `/v1/load_lora_adapter`) as a model whose
//! `parent` is the base model (`vllm/entrypoints/openai/serving_models.py`, `show_available_models`);
//! SGLang lists its LoRA adapters the same way. Any entry with a non-null `parent` is taken as an
//! adapter; the base model is what the launcher registers as `model_name`.

use super::probe::Probe;
use infera_core::event::WorkerRecord;
use infera_core::ports::discovery::Registration;
use std::convert::Infallible;
use std::time::Duration;

/// How often the engine's model list is read again.
pub const REFRESH: Duration = Duration::from_secs(10);
/// How long one read may take.
const TIMEOUT: Duration = Duration::from_secs(5);
/// Adapters kept per worker (a registration stays small).
const MAX_ADAPTERS: usize = 1024;

/// The adapters on a `/v1/models` page, sorted; `None` when the page is not a model list.
pub fn adapters_of(page: &str) -> Option<Vec<String>> {
    let json: serde_json::Value = serde_json::from_str(page).ok()?;
    let data = json.get("data")?.as_array()?;
    let mut adapters: Vec<String> = data
        .iter()
        .filter(|m| m.get("parent").is_some_and(|p| !p.is_null()))
        .filter_map(|m| m.get("id")?.as_str().map(str::to_owned))
        .take(MAX_ADAPTERS)
        .collect();
    adapters.sort_unstable();
    adapters.dedup();
    Some(adapters)
}

/// The engine's adapters now; `None` when the engine does not answer with a model list (the
/// registration then keeps what it has).
pub async fn read(probe: &Probe) -> Option<Vec<String>> {
    match probe.get("/v1/models", TIMEOUT).await {
        Ok((200, page)) => adapters_of(&page),
        Ok((status, _)) => {
            tracing::debug!(status, "the engine's /v1/models did not answer 200");
            None
        }
        Err(e) => {
            tracing::debug!(error = %e, "cannot read the engine's /v1/models");
            None
        }
    }
}

/// Sets `record`'s adapters from the engine, before the first registration.
pub async fn fill(probe: &Probe, record: &mut WorkerRecord) {
    if let Some(adapters) = read(probe).await {
        record.set_lora_adapters(&adapters);
    }
}

/// Re-reads the engine's adapters every [`REFRESH`] and updates the registration when they
/// change. Never returns; a failed update is logged and tried again at the next change check.
pub async fn follow(
    probe: Probe,
    registration: &Registration,
    mut record: WorkerRecord,
) -> Infallible {
    let mut tick = tokio::time::interval(REFRESH);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    loop {
        tick.tick().await;
        let Some(adapters) = read(&probe).await else {
            continue;
        };
        if record
            .lora_adapters()
            .eq(adapters.iter().map(String::as_str))
        {
            continue;
        }
        let mut next = record.clone();
        next.set_lora_adapters(&adapters);
        match registration.update(&next).await {
            Ok(()) => {
                tracing::info!(
                    ?adapters,
                    "the engine's LoRA adapters changed; re-registered"
                );
                record = next;
            }
            Err(e) => tracing::warn!(error = %e, "cannot update the registration's adapters"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn adapters_are_the_entries_with_a_parent() {
        let page = r#"{"object":"list","data":[
            {"id":"base","object":"model","root":"base","parent":null},
            {"id":"sql","object":"model","root":"/a/sql","parent":"base"},
            {"id":"chat","object":"model","root":"/a/chat","parent":"base"}]}"#;
        assert_eq!(adapters_of(page), Some(vec!["chat".into(), "sql".into()]));
        let plain = r#"{"object":"list","data":[{"id":"base","object":"model"}]}"#;
        assert_eq!(adapters_of(plain), Some(vec![]));
        assert_eq!(adapters_of("not json"), None);
        assert_eq!(adapters_of(r#"{"detail":"x"}"#), None);
    }
}
