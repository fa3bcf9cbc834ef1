//! Downloading a model's tokenizer files into the local Hugging Face cache, as `huggingface_hub`
//! does when the Python server loads a tokenizer by id: each file from
//! `{HF_ENDPOINT}/{id}/resolve/{revision}/{file}` (redirects followed, `HF_TOKEN` sent as a bearer
//! token to the endpoint only), its bytes in `blobs/{sha256}`, the snapshot's file a relative
//! symlink `snapshots/{commit}/{file}` → `../../blobs/{sha256}`, and `refs/{revision}` naming the
//! commit the hub answered in `X-Repo-Commit`. Every file is written under a temporary name and
//! renamed, so an interrupted download leaves no half file where a reader looks.
//!
//! Bounded: a connection must open within [`CONNECT_TIMEOUT`], each file must arrive within
//! [`FILE_TIMEOUT`] and hold at most [`MAX_FILE_BYTES`], and at most [`MAX_REDIRECTS`] redirects
//! are followed.

use http_body_util::{BodyExt as _, Empty, Limited};
use hyper::body::Bytes;
use hyper::{Request, StatusCode, Uri, header};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use sha2::{Digest as _, Sha256};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The tokenizer files fetched; the first is required, the others are used when the model has
/// them.
pub const FILES: [&str; 2] = ["tokenizer.json", "tokenizer_config.json"];
/// How long a connection may take to open.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// How long one file (its redirects included) may take.
pub const FILE_TIMEOUT: Duration = Duration::from_secs(300);
/// The largest file accepted.
pub const MAX_FILE_BYTES: usize = 512 << 20;
/// The most redirects followed for one file.
pub const MAX_REDIRECTS: usize = 5;

type HttpsClient = Client<hyper_rustls::HttpsConnector<HttpConnector>, Empty<Bytes>>;

/// Where and how to download.
#[derive(Debug, Clone)]
pub struct Hub {
    /// `HF_ENDPOINT`, without a trailing slash.
    pub endpoint: String,
    /// `HF_TOKEN`, sent to the endpoint's host only.
    pub token: Option<String>,
}

/// Downloads the tokenizer files of `id` at `revision` into the model's folder `model` of the
/// cache; returns the snapshot's `tokenizer.json`.
///
/// # Errors
/// A message naming the URL and what failed (unreachable, refused, missing, too large).
pub fn tokenizer(hub: &Hub, id: &str, revision: &str, model: &Path) -> Result<PathBuf, String> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the download: {e}"))?;
    runtime.block_on(fetch_all(hub, id, revision, model))
}

async fn fetch_all(hub: &Hub, id: &str, revision: &str, model: &Path) -> Result<PathBuf, String> {
    let client = client()?;
    let mut commit: Option<String> = None;
    let mut files = Vec::new();
    for (i, name) in FILES.iter().enumerate() {
        let url = format!("{}/{id}/resolve/{revision}/{name}", hub.endpoint);
        match tokio::time::timeout(FILE_TIMEOUT, get(&client, hub, &url)).await {
            Err(_) => return Err(format!("{url}: no complete answer within {FILE_TIMEOUT:?}")),
            Ok(Err(e)) => return Err(format!("{url}: {e}")),
            // Only the tokenizer itself is required.
            Ok(Ok(None)) if i > 0 => continue,
            Ok(Ok(None)) => {
                return Err(format!(
                    "{url}: not found (is {id} a model id, and {revision} its revision?)"
                ));
            }
            Ok(Ok(Some((bytes, repo_commit)))) => {
                commit = commit.or(repo_commit);
                files.push((*name, bytes));
            }
        }
    }
    let commit = commit
        .or_else(|| is_commit(revision).then(|| revision.to_owned()))
        .ok_or_else(|| {
            format!(
                "{}/{id}: the hub did not say which commit revision {revision} is \
                 (no X-Repo-Commit header)",
                hub.endpoint
            )
        })?;
    store(model, revision, &commit, &files).map_err(|e| {
        format!(
            "cannot write {id} into the cache at {}: {e}",
            model.display()
        )
    })?;
    Ok(model.join("snapshots").join(&commit).join(FILES[0]))
}

fn client() -> Result<HttpsClient, String> {
    let mut http = HttpConnector::new();
    http.set_connect_timeout(Some(CONNECT_TIMEOUT));
    http.enforce_http(false);
    let https = hyper_rustls::HttpsConnectorBuilder::new()
        .with_native_roots()
        .map_err(|e| format!("no system TLS root certificates to verify the hub with: {e}"))?
        .https_or_http()
        .enable_http1()
        .wrap_connector(http);
    Ok(Client::builder(TokioExecutor::new()).build(https))
}

/// The body of `url` and the `X-Repo-Commit` of the first answer, following redirects; `None`
/// for a 404.
async fn get(
    client: &HttpsClient,
    hub: &Hub,
    url: &str,
) -> Result<Option<(Bytes, Option<String>)>, String> {
    let mut uri: Uri = url.parse().map_err(|e| format!("not a URL: {e}"))?;
    let endpoint_authority = uri.authority().cloned();
    let mut commit = None;
    for _ in 0..=MAX_REDIRECTS {
        let mut request = Request::get(uri.clone()).header(header::USER_AGENT, "infera");
        if let Some(token) = &hub.token
            && uri.authority() == endpoint_authority.as_ref()
        {
            request = request.header(header::AUTHORIZATION, format!("Bearer {token}"));
        }
        let request = request
            .body(Empty::new())
            .map_err(|e| format!("bad request: {e}"))?;
        let response = client
            .request(request)
            .await
            .map_err(|e| format!("cannot reach the hub: {e:#}"))?;
        if commit.is_none() {
            commit = response
                .headers()
                .get("x-repo-commit")
                .and_then(|v| v.to_str().ok())
                .filter(|v| is_commit(v))
                .map(str::to_owned);
        }
        let status = response.status();
        if status.is_redirection() {
            let location = response
                .headers()
                .get(header::LOCATION)
                .and_then(|v| v.to_str().ok())
                .ok_or_else(|| format!("{status} without a Location"))?;
            uri = resolve(&uri, location)?;
            continue;
        }
        match status {
            StatusCode::OK => {}
            StatusCode::NOT_FOUND => return Ok(None),
            StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN => {
                return Err(format!(
                    "{status}: the model is gated or private; accept its terms on the hub and \
                     set HF_TOKEN"
                ));
            }
            other => return Err(format!("the hub answered {other}")),
        }
        let body = Limited::new(response.into_body(), MAX_FILE_BYTES)
            .collect()
            .await
            .map_err(|e| format!("reading the file: {e} (the limit is {MAX_FILE_BYTES} bytes)"))?
            .to_bytes();
        return Ok(Some((body, commit)));
    }
    Err(format!("more than {MAX_REDIRECTS} redirects"))
}

/// `location` (absolute, or a path on the same origin) against `base`.
fn resolve(base: &Uri, location: &str) -> Result<Uri, String> {
    if location.contains("://") {
        return location
            .parse()
            .map_err(|e| format!("bad redirect {location:?}: {e}"));
    }
    let path = if location.starts_with('/') {
        location.to_owned()
    } else {
        let dir = base.path().rsplit_once('/').map_or("", |(dir, _)| dir);
        format!("{dir}/{location}")
    };
    let scheme = base.scheme_str().unwrap_or("https");
    let authority = base.authority().map_or("", |a| a.as_str());
    format!("{scheme}://{authority}{path}")
        .parse()
        .map_err(|e| format!("bad redirect {location:?}: {e}"))
}

/// A full commit hash: 40 lowercase hex digits.
fn is_commit(text: &str) -> bool {
    text.len() == 40
        && text
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// Writes the files in the hub cache layout (see the module docs).
fn store(
    model: &Path,
    revision: &str,
    commit: &str,
    files: &[(&str, Bytes)],
) -> std::io::Result<()> {
    let blobs = model.join("blobs");
    let snapshot = model.join("snapshots").join(commit);
    std::fs::create_dir_all(&blobs)?;
    std::fs::create_dir_all(&snapshot)?;
    for (name, bytes) in files {
        let digest = hex(&Sha256::digest(bytes));
        let blob = blobs.join(&digest);
        if !blob.is_file() {
            write_atomically(&blob, bytes)?;
        }
        let link = snapshot.join(name);
        let staged = snapshot.join(format!(".{name}.{}.tmp", std::process::id()));
        let _ = std::fs::remove_file(&staged);
        std::os::unix::fs::symlink(Path::new("../../blobs").join(&digest), &staged)?;
        std::fs::rename(&staged, &link)?;
    }
    if revision != commit {
        let refs = model.join("refs");
        std::fs::create_dir_all(&refs)?;
        write_atomically(&refs.join(revision), commit.as_bytes())?;
    }
    Ok(())
}

fn write_atomically(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned());
    let staged = path.with_file_name(format!(
        ".{}.{}.tmp",
        name.unwrap_or_default(),
        std::process::id()
    ));
    std::fs::write(&staged, bytes)?;
    std::fs::rename(&staged, path)
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn redirects_resolve_against_their_origin() {
        let base: Uri = "https://huggingface.co/org/m/resolve/main/tokenizer.json"
            .parse()
            .unwrap();
        assert_eq!(
            resolve(&base, "/api/resolve-cache/models/org/m/abc/tokenizer.json").unwrap(),
            "https://huggingface.co/api/resolve-cache/models/org/m/abc/tokenizer.json"
        );
        assert_eq!(
            resolve(&base, "https://cdn.example/blob?sig=1").unwrap(),
            "https://cdn.example/blob?sig=1"
        );
        assert_eq!(
            resolve(&base, "other.json").unwrap(),
            "https://huggingface.co/org/m/resolve/main/other.json"
        );
    }

    #[test]
    fn the_cache_layout_is_the_hubs() {
        let dir = tempfile::tempdir().unwrap();
        let model = dir.path().join("models--org--m");
        let commit = "0123456789abcdef0123456789abcdef01234567";
        let files = [("tokenizer.json", Bytes::from_static(b"{\"tok\":1}"))];
        store(&model, "main", commit, &files).unwrap();
        store(&model, "main", commit, &files).unwrap();
        let link = model.join("snapshots").join(commit).join("tokenizer.json");
        let target = std::fs::read_link(&link).unwrap();
        assert!(target.starts_with("../../blobs"), "{}", target.display());
        assert_eq!(std::fs::read(&link).unwrap(), b"{\"tok\":1}");
        assert_eq!(
            std::fs::read_to_string(model.join("refs/main")).unwrap(),
            commit
        );
        assert!(is_commit(commit) && !is_commit("main"));
    }
}
