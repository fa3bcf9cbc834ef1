//! Plain-HTTP probes of a local engine: `/health`, `/metrics` and SGLang's `/get_server_info`.
//!
//! Each probe is one GET with a timeout; the launcher decides what a failure means (not ready
//! yet, drain state unknown, fall back to the command-line value).

use bytes::Bytes;
use http_body_util::{BodyExt as _, Empty};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use std::time::Duration;

/// Largest probe response read (a `/metrics` page of a big engine is well below this).
const MAX_BODY: usize = 8 << 20;

/// A probe client for one engine.
#[derive(Debug, Clone)]
pub struct Probe {
    client: Client<HttpConnector, Empty<Bytes>>,
    base: String,
}

impl Probe {
    /// Probes `http://{host}:{port}`; a wildcard bind host is probed on loopback.
    pub fn new(bind_host: &str, port: u16) -> Self {
        let host = match bind_host {
            "" | "0.0.0.0" => "127.0.0.1".to_owned(),
            "::" | "[::]" => "[::1]".to_owned(),
            other => crate::net::url_host(other),
        };
        Self {
            client: Client::builder(TokioExecutor::new()).build_http(),
            base: format!("http://{host}:{port}"),
        }
    }

    /// The base URL probed.
    pub fn base(&self) -> &str {
        &self.base
    }

    /// `GET path`: the status and body, or why there is none.
    pub async fn get(&self, path: &str, timeout: Duration) -> Result<(u16, String), String> {
        let uri: hyper::Uri = format!("{}{path}", self.base)
            .parse()
            .map_err(|e| format!("bad probe url: {e}"))?;
        let fetch = async {
            let response = self.client.get(uri).await.map_err(|e| e.to_string())?;
            let status = response.status().as_u16();
            let body = http_body_util::Limited::new(response.into_body(), MAX_BODY)
                .collect()
                .await
                .map_err(|e| e.to_string())?
                .to_bytes();
            Ok((status, String::from_utf8_lossy(&body).into_owned()))
        };
        tokio::time::timeout(timeout, fetch)
            .await
            .map_err(|_| format!("no answer within {timeout:?}"))?
    }

    /// Whether `GET /health` answers 200.
    pub async fn healthy(&self) -> bool {
        matches!(
            self.get("/health", Duration::from_secs(5)).await,
            Ok((200, _))
        )
    }
}

/// The sum of the samples of each gauge in `names` on a Prometheus text page (labels ignored);
/// `None` when none of them is present.
pub fn gauge_sum(page: &str, names: &[&str]) -> Option<f64> {
    let mut total = None;
    for line in page.lines() {
        if line.starts_with('#') {
            continue;
        }
        let Some((series, value)) = line.rsplit_once(' ') else {
            continue;
        };
        let name = series.split('{').next().unwrap_or(series).trim();
        if names.contains(&name)
            && let Ok(v) = value.trim().parse::<f64>()
        {
            *total.get_or_insert(0.0) += v;
        }
    }
    total
}

/// The value of `label` on the first sample of `metric` (`vllm:cache_config_info{block_size="16"}`).
pub fn label_value(page: &str, metric: &str, label: &str) -> Option<String> {
    let needle = format!("{label}=\"");
    page.lines()
        .filter(|line| !line.starts_with('#'))
        .filter(|line| line.split('{').next() == Some(metric))
        .find_map(|line| {
            let labels = line.split_once('{')?.1.split_once('}')?.0;
            let start = labels.find(&needle)? + needle.len();
            let rest = &labels[start..];
            Some(rest[..rest.find('"')?].to_owned())
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    const PAGE: &str = "# HELP vllm:num_requests_running Running.\n\
        vllm:num_requests_running{model_name=\"m\",engine=\"0\"} 2.0\n\
        vllm:num_requests_running{model_name=\"m\",engine=\"1\"} 1.0\n\
        vllm:num_requests_waiting{model_name=\"m\"} 0.0\n\
        vllm:cache_config_info{block_size=\"32\",cache_dtype=\"auto\"} 1.0\n";

    #[test]
    fn gauges_sum_over_labels_and_names() {
        assert_eq!(
            gauge_sum(
                PAGE,
                &["vllm:num_requests_running", "vllm:num_requests_waiting"]
            ),
            Some(3.0)
        );
        assert_eq!(gauge_sum(PAGE, &["sglang:num_running_reqs"]), None);
    }

    #[test]
    fn labels_are_read_from_the_named_metric() {
        assert_eq!(
            label_value(PAGE, "vllm:cache_config_info", "block_size").as_deref(),
            Some("32")
        );
        assert_eq!(label_value(PAGE, "vllm:cache_config_info", "missing"), None);
        assert_eq!(label_value(PAGE, "other", "block_size"), None);
    }
}
