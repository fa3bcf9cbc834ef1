//! The scaling port: what `GET` / `POST /v1/admin/scale` (`--enable-scaling-api`) read and
//! resize, the worker pools of the deployment the server belongs to. The Kubernetes backend edits
//! the InferaDeployment the operator reconciles (the Python Infera's `DeploymentScaler`).
//!
//! A resize is all or nothing: [`validate`] checks every named pool before anything is written,
//! and a backend writes them in one request, so a caller rebalancing prefill against decode never
//! gets one applied and the other refused.

use crate::error::{ErrorCode, ServiceError};
use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::collections::BTreeMap;

/// Every pool's requested and observed size (`GET /v1/admin/scale`, and the answer of a resize).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolSnapshot {
    /// The deployment the server belongs to.
    pub deployment: String,
    /// Its namespace.
    pub namespace: String,
    /// The operator's verdict (ready replicas against the spec), `unknown` without one.
    pub state: String,
    /// Each pool by service name.
    pub services: BTreeMap<String, PoolSize>,
}

/// One pool: what was asked for and what the cluster has so far.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolSize {
    /// `prefill`, `decode` or `mixed`.
    pub role: String,
    /// Replicas asked for.
    pub replicas: u64,
    /// Replicas that exist.
    pub current_replicas: u64,
    /// Replicas ready to serve.
    pub ready_replicas: u64,
    /// Nodes each replica spans.
    pub nodes_per_replica: u64,
    /// Why the pool is short of its replicas, as the scheduler or the kubelet says, when it is
    /// short and the cluster says why (a replica that will never start reads, in the counts
    /// alone, like one still starting).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub blocked: Option<String>,
}

/// A scaling request that cannot be honoured, with the answer's code.
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct ScalingError {
    /// 400 for a bad request, 403 for a refused permission, 404 for a missing deployment, 409
    /// for a server not created by the operator, 503 when the cluster cannot be asked, 502 when
    /// it answered something unusable.
    pub code: ErrorCode,
    /// The sentence the caller reads.
    pub message: String,
    #[source]
    source: Option<Box<dyn std::error::Error + Send + Sync>>,
}

impl ScalingError {
    /// An error without a cause.
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
            source: None,
        }
    }

    /// A refused request (400).
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::BadRequest, message)
    }

    /// An error caused by `source`.
    pub fn caused_by(
        code: ErrorCode,
        message: impl Into<String>,
        source: impl std::error::Error + Send + Sync + 'static,
    ) -> Self {
        Self {
            code,
            message: message.into(),
            source: Some(Box::new(source)),
        }
    }
}

impl ServiceError for ScalingError {
    fn code(&self) -> ErrorCode {
        self.code
    }
}

/// Reads and resizes the pools.
#[async_trait]
pub trait PoolScaler: Send + Sync + std::fmt::Debug {
    /// Every pool's requested and observed size.
    ///
    /// # Errors
    /// [`ScalingError`] when the deployment cannot be found or read.
    async fn snapshot(&self) -> Result<PoolSnapshot, ScalingError>;

    /// Resizes the named pools, all of them or none (each value as the caller sent it, checked
    /// by [`validate`] against the deployment's pools), and returns the snapshot after the write.
    ///
    /// # Errors
    /// [`ScalingError`] for a refused request (nothing written) or a failed write.
    async fn scale(
        &self,
        requested: &BTreeMap<String, Value>,
    ) -> Result<PoolSnapshot, ScalingError>;
}

/// Reads a resize body, `{"services": {"<name>": {"replicas": N}}}` or `{"services": {"<name>":
/// N}}` (the form the deployment uses, so a caller can paste from one to the other, and the bare
/// number), into the requested value per pool. The values are checked by [`validate`].
///
/// # Errors
/// A 400 [`ScalingError`] for any other shape, or no pool named.
pub fn parse_request(body: &[u8]) -> Result<BTreeMap<String, Value>, ScalingError> {
    let body: Value = serde_json::from_slice(body)
        .map_err(|e| ScalingError::caused_by(ErrorCode::BadRequest, "body must be JSON", e))?;
    let Some(services) = body.get("services").and_then(Value::as_object) else {
        return Err(ScalingError::bad_request(
            r#"body must be {"services": {"<name>": {"replicas": N}}}"#,
        ));
    };
    if services.is_empty() {
        return Err(ScalingError::bad_request("no services named"));
    }
    Ok(services
        .iter()
        .map(|(name, value)| {
            let count = match value {
                Value::Object(pool) => pool.get("replicas").cloned().unwrap_or(Value::Null),
                other => other.clone(),
            };
            (name.clone(), count)
        })
        .collect())
}

/// Checks a resize against the deployment's pools (`known`), refusing what the cluster would
/// accept but nobody wants: an unknown pool (naming the ones that exist), a count that is not a
/// whole number, and a count below one (an empty pool stops serving; in a prefill/decode
/// deployment an empty side fails every request). Returns the counts to write.
///
/// # Errors
/// A 400 [`ScalingError`] naming the first offending pool.
pub fn validate<'a>(
    requested: &BTreeMap<String, Value>,
    known: impl IntoIterator<Item = &'a str>,
) -> Result<BTreeMap<String, u64>, ScalingError> {
    let known: Vec<&str> = known.into_iter().collect();
    let unknown: Vec<&str> = requested
        .keys()
        .map(String::as_str)
        .filter(|name| !known.contains(name))
        .collect();
    if !unknown.is_empty() {
        let mut existing = known.clone();
        existing.sort_unstable();
        return Err(ScalingError::bad_request(format!(
            "no such service(s): {}. This deployment has: {}",
            unknown.join(", "),
            existing.join(", ")
        )));
    }
    requested
        .iter()
        .map(|(name, value)| {
            let count = match value {
                Value::Number(n) if n.is_i64() || n.is_u64() => n.as_i64().unwrap_or(i64::MAX),
                other => {
                    return Err(ScalingError::bad_request(format!(
                        "{name}: replicas must be an integer, got {other}"
                    )));
                }
            };
            match u64::try_from(count) {
                Ok(count) if count >= 1 => Ok((name.clone(), count)),
                _ => Err(ScalingError::bad_request(format!(
                    "{name}: refusing to scale to {count}. A pool at zero stops serving, and in a \
                     PD deployment an empty prefill or decode pool fails every request. Edit the \
                     InferaDeployment directly if that is the intent."
                ))),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn request(body: Value) -> Result<BTreeMap<String, Value>, ScalingError> {
        parse_request(body.to_string().as_bytes())
    }

    #[test]
    fn the_nested_and_the_bare_form_name_the_same_counts() {
        let nested = request(json!({"services": {"prefill": {"replicas": 4}, "decode": 8}}));
        let counts = validate(&nested.unwrap(), ["decode", "prefill"]).unwrap();
        assert_eq!(
            counts,
            BTreeMap::from([("decode".to_owned(), 8), ("prefill".to_owned(), 4)])
        );
    }

    #[test]
    fn bodies_of_another_shape_are_refused() {
        for bad in [json!([]), json!({"services": [1]}), json!({"services": {}})] {
            let error = request(bad.clone()).unwrap_err();
            assert_eq!(error.code, ErrorCode::BadRequest, "{bad}");
        }
        let error = parse_request(b"{not json").unwrap_err();
        assert_eq!(error.message, "body must be JSON");
        assert!(std::error::Error::source(&error).is_some());
    }

    #[test]
    fn an_unknown_pool_is_named_with_the_ones_that_exist() {
        let requested = request(json!({"services": {"decode": 5, "prefil": 2}})).unwrap();
        let error = validate(&requested, ["prefill", "decode"]).unwrap_err();
        assert_eq!(
            error.message,
            "no such service(s): prefil. This deployment has: decode, prefill"
        );
    }

    #[test]
    fn counts_must_be_whole_and_at_least_one() {
        for bad in [
            json!("4"),
            json!(4.5),
            json!(4.0),
            json!(null),
            json!(true),
            json!(0),
            json!(-1),
        ] {
            let requested = BTreeMap::from([("decode".to_owned(), bad.clone())]);
            let error = validate(&requested, ["decode"]).unwrap_err();
            assert_eq!(error.code, ErrorCode::BadRequest, "{bad}");
            assert!(error.message.starts_with("decode: "), "{bad}: {error}");
        }
        let zero = BTreeMap::from([("decode".to_owned(), json!(0))]);
        assert!(
            validate(&zero, ["decode"])
                .unwrap_err()
                .message
                .contains("stops serving")
        );
        let missing = request(json!({"services": {"decode": {}}})).unwrap();
        assert_eq!(
            validate(&missing, ["decode"]).unwrap_err().message,
            "decode: replicas must be an integer, got null"
        );
    }
}
