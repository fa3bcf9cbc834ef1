//! Tenants at the edge: the key file (`--api-keys`), reloaded when it changes, the key a
//! request presents, its limits and the `x-ratelimit-*` headers (tenants themselves, their
//! limits and the queue's order are `infera_core::tenancy`'s).
//!
//! # Keys
//! A request presents its key as `Authorization: Bearer <key>` (the OpenAI clients) or
//! `x-api-key: <key>` (the Anthropic clients). With a key file, a data-plane request without a
//! known key is answered 401 before its body is read; keys are never logged. Without one every
//! request is the anonymous tenant's, as before.
//!
//! # Reload
//! [`KeyStore::watch`] reads the file again every [`RELOAD_EVERY`] when its size, modification
//! time or content changed (a Kubernetes Secret volume swaps a symlink, which changes all
//! three). A file that no longer parses is logged and counted, and the last good one stays.
//!
//! # Limits
//! After the prompt is tokenized, the tenant's [`Usage`](infera_core::tenancy::Usage) admits
//! the request or refuses it: 429 with `Retry-After`, in the OpenAI (`rate_limit_exceeded`) or
//! Anthropic (`rate_limit_error`) error shape. Responses to a tenant with limits carry the
//! OpenAI API's `x-ratelimit-{limit,remaining,reset}-{requests,tokens}` headers (tokens: the
//! prompt-token allowance).
//!
//! # Replicas
//! With a durable event log (`--event-log`) the replicas' `RequestRouted` carry their tenant,
//! and each replica charges its peers' requests, and the tokens they generated, to its own
//! buckets ([`KeyStore::charge_peer`], from the durable log's tail): the limits hold for the
//! fleet. While the tail fails or stalls (see the durable module's `tail`), the replica is cut
//! off from its peers and admits as one of the replicas it last saw, each of its requests
//! costing that many ([`KeyStore::set_share`]; `infera_tenant_limit_share` says which).

use super::http::ApiError;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use infera_core::clock::Micros;
use infera_core::event::Event;
use infera_core::ids::RequestId;
use infera_core::tenancy::{Refusal, Standing, Tenant, Tenants};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, SystemTime};

/// How often the key file is checked for changes.
pub const RELOAD_EVERY: Duration = Duration::from_secs(2);

/// The tenants of the key file, swapped whole on reload. Clones share it.
#[derive(Debug, Clone)]
pub struct KeyStore {
    path: Arc<Path>,
    current: Arc<RwLock<Arc<Tenants>>>,
    /// The file as last read, which [`KeyStore::watch`] compares with.
    read: Arc<std::sync::Mutex<Option<Stamp>>>,
    /// 1 while this replica sees its peers' requests; else how many replicas share the limits.
    share: Arc<AtomicU32>,
}

/// Peers' requests already charged, by request key, so a retried request is charged once and
/// its answer's tokens find their tenant.
#[derive(Debug, Default)]
pub(crate) struct PeerCharges {
    open: HashMap<String, (Arc<Tenant>, Micros)>,
}

/// Peers' requests remembered at most; past it those older than [`PEER_MEMORY_US`] go.
const PEER_REQUESTS: usize = 1 << 16;
const PEER_MEMORY_US: Micros = 600_000_000;

/// The request a peer's attempt id (`<key>.<attempt>`) belongs to.
fn request_key(id: &RequestId) -> &str {
    id.0.rsplit_once('.').map_or(id.0.as_str(), |(key, _)| key)
}

/// What tells a changed file: size, modification time, content.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Stamp {
    len: u64,
    modified: Option<SystemTime>,
    text: String,
}

fn read(path: &Path) -> std::io::Result<Stamp> {
    let meta = std::fs::metadata(path)?;
    Ok(Stamp {
        len: meta.len(),
        modified: meta.modified().ok(),
        text: std::fs::read_to_string(path)?,
    })
}

fn now_us() -> Micros {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
}

impl KeyStore {
    /// Reads and parses the key file at `path`.
    ///
    /// # Errors
    /// The file cannot be read, or is not a valid key file (the message says where).
    pub fn load(path: &Path) -> Result<Self, String> {
        let stamp = read(path).map_err(|e| format!("--api-keys {}: {e}", path.display()))?;
        let tenants = Tenants::parse(&stamp.text, None, now_us())
            .map_err(|e| format!("--api-keys {}: {e}", path.display()))?;
        Ok(KeyStore {
            path: Arc::from(PathBuf::from(path)),
            current: Arc::new(RwLock::new(Arc::new(tenants))),
            read: Arc::new(std::sync::Mutex::new(Some(stamp))),
            share: Arc::new(AtomicU32::new(1)),
        })
    }

    /// How many replicas' worth each admission costs: 1 while the peers are seen.
    pub fn share(&self) -> u32 {
        self.share.load(Ordering::Relaxed)
    }

    /// Sets [`KeyStore::share`]: 1 when this replica sees its peers, else the replicas there are.
    pub fn set_share(&self, replicas: u32) {
        let replicas = replicas.max(1);
        if self.share.swap(replicas, Ordering::Relaxed) != replicas {
            if replicas == 1 {
                tracing::info!("tenant limits are shared with the peer replicas again");
            } else {
                tracing::warn!(
                    replicas,
                    "cut off from the peer replicas: each tenant gets its share of the limits here"
                );
            }
        }
    }

    /// Charges a peer replica's request event to its tenant here (see the module docs).
    pub(crate) fn charge_peer(&self, charges: &mut PeerCharges, event: &Event, now: Micros) {
        match event {
            Event::RequestRouted(r) => {
                let Some(name) = &r.tenant else { return };
                let key = request_key(&r.request_id);
                if charges.open.contains_key(key) {
                    return;
                }
                let Some(tenant) = self.tenants().named(name).cloned() else {
                    return;
                };
                tenant
                    .usage
                    .charge_peer(now, 1, u64::from(r.prompt_tokens), 0);
                if charges.open.len() >= PEER_REQUESTS {
                    charges
                        .open
                        .retain(|_, (_, at)| now.saturating_sub(*at) < PEER_MEMORY_US);
                    if charges.open.len() >= PEER_REQUESTS {
                        charges.open.clear();
                    }
                }
                charges.open.insert(key.to_owned(), (tenant, now));
            }
            Event::RequestFinished(f) if f.tokens_out > 0 => {
                if let Some((tenant, _)) = charges.open.get(request_key(&f.request_id)) {
                    tenant.usage.charge_peer(now, 0, 0, u64::from(f.tokens_out));
                }
            }
            _ => {}
        }
    }

    /// The tenants now.
    pub fn tenants(&self) -> Arc<Tenants> {
        Arc::clone(&self.current.read().unwrap_or_else(|e| e.into_inner()))
    }

    /// Parses `text` as the new key file, keeping every tenant's usage.
    ///
    /// # Errors
    /// Not a valid key file; the current one stays.
    pub fn replace(&self, text: &str) -> Result<usize, String> {
        let old = self.tenants();
        let next = Tenants::parse(text, Some(&old), now_us()).map_err(|e| e.to_string())?;
        let n = next.all().len();
        *self.current.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(next);
        Ok(n)
    }

    /// Reloads the file whenever it changes, until the returned task is aborted.
    pub fn watch(&self) -> tokio::task::JoinHandle<()> {
        let store = self.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(RELOAD_EVERY);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                let path = Arc::clone(&store.path);
                let Ok(Ok(stamp)) = tokio::task::spawn_blocking(move || read(&path)).await else {
                    continue;
                };
                let mut last = store.read.lock().unwrap_or_else(|e| e.into_inner());
                if last.as_ref() == Some(&stamp) {
                    continue;
                }
                match store.replace(&stamp.text) {
                    Ok(n) => tracing::info!(path = %store.path.display(), tenants = n,
                        "API key file reloaded"),
                    Err(e) => tracing::error!(path = %store.path.display(), error = %e,
                        "the changed API key file is not valid; keeping the last good one"),
                }
                *last = Some(stamp);
            }
        })
    }

    /// The tenant whose key `headers` present.
    ///
    /// # Errors
    /// 401 (with `WWW-Authenticate: Bearer`) without a key, or with one no tenant has.
    pub(super) fn authenticate(&self, headers: &HeaderMap) -> Result<Arc<Tenant>, ApiError> {
        let presented = presented_key(headers).ok_or_else(|| {
            unauthorized(
                "this server needs an API key: send Authorization: Bearer <key> or x-api-key",
            )
        })?;
        self.tenants()
            .find(presented)
            .cloned()
            .ok_or_else(|| unauthorized("the API key is not valid"))
    }
}

/// The key `Authorization: Bearer` or `x-api-key` carries.
fn presented_key(headers: &HeaderMap) -> Option<&[u8]> {
    let bearer = headers
        .get(header::AUTHORIZATION)
        .map(HeaderValue::as_bytes)
        .and_then(|v| v.strip_prefix(b"Bearer "))
        .map(<[u8]>::trim_ascii);
    bearer
        .or_else(|| headers.get("x-api-key").map(HeaderValue::as_bytes))
        .filter(|k| !k.is_empty())
}

fn unauthorized(message: &str) -> ApiError {
    ApiError::new(StatusCode::UNAUTHORIZED, message)
}

/// The 429 for a request `refusal` turned away.
pub(super) fn limited(tenant: &Tenant, refusal: Refusal) -> ApiError {
    let what = refusal.limit.as_str().replace('_', " ");
    let message = match refusal.retry_after_us {
        None => format!(
            "the prompt is larger than tenant {}'s {what} allowance per minute",
            tenant.name
        ),
        Some(_) => format!(
            "tenant {} is over its {what} limit; retry later",
            tenant.name
        ),
    };
    let mut e = ApiError::new(StatusCode::TOO_MANY_REQUESTS, message);
    e.retry_after_s = refusal
        .retry_after_us
        .map(|us| u32::try_from(us.div_ceil(1_000_000).max(1)).unwrap_or(u32::MAX));
    e
}

/// Sets the `x-ratelimit-*` headers for `standing`.
pub(super) fn rate_headers(headers: &mut HeaderMap, standing: Standing) {
    let mut put = |name: &'static str, value: String| {
        if let Ok(v) = HeaderValue::from_str(&value) {
            headers.insert(name, v);
        }
    };
    if let Some((limit, remaining, reset)) = standing.requests {
        put("x-ratelimit-limit-requests", limit.to_string());
        put("x-ratelimit-remaining-requests", remaining.to_string());
        put("x-ratelimit-reset-requests", duration_text(reset));
    }
    if let Some((limit, remaining, reset)) = standing.tokens {
        put("x-ratelimit-limit-tokens", limit.to_string());
        put("x-ratelimit-remaining-tokens", remaining.to_string());
        put("x-ratelimit-reset-tokens", duration_text(reset));
    }
}

/// A reset time as the OpenAI API writes it: `1s`, `6m0s`, `120ms`.
fn duration_text(us: Micros) -> String {
    let ms = us.div_ceil(1_000);
    if ms < 1_000 {
        return format!("{ms}ms");
    }
    let s = ms.div_ceil(1_000);
    if s < 60 {
        format!("{s}s")
    } else {
        format!("{}m{}s", s / 60, s % 60)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_read_from_either_header() {
        let mut h = HeaderMap::new();
        assert_eq!(presented_key(&h), None);
        h.insert("x-api-key", HeaderValue::from_static("sk-ant-abc"));
        assert_eq!(presented_key(&h), Some(&b"sk-ant-abc"[..]));
        h.insert(
            header::AUTHORIZATION,
            HeaderValue::from_static("Bearer  sk-oa "),
        );
        assert_eq!(presented_key(&h), Some(&b"sk-oa"[..]));
    }

    #[test]
    fn resets_read_as_openai_writes_them() {
        assert_eq!(duration_text(120_000), "120ms");
        assert_eq!(duration_text(1_000_000), "1s");
        assert_eq!(duration_text(360_000_000), "6m0s");
        assert_eq!(duration_text(61_500_000), "1m2s");
    }
}
