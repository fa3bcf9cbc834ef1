//! `--router-tokenizer-path ORG/NAME` on a machine whose Hugging Face cache lacks the model: the
//! real binary downloads the tokenizer from `HF_ENDPOINT` into the cache in the hub's layout, as
//! the Python server's tokenizer load does, and later runs (offline too) read it from there.
//!
//! The hub is a loopback HTTP server speaking the `resolve` protocol: a redirect to the file's
//! blob with the commit in `X-Repo-Commit`, 404 for a file the model lacks, 401 for a gated one.
#![allow(clippy::unwrap_used)]

mod common;

use common::tokenizer_dir;
use serde_json::Value;
use std::io::{BufRead as _, BufReader, Write as _};
use std::net::TcpListener;
use std::path::Path;
use std::process::{Command, Output};
use std::sync::{Arc, Mutex};

const COMMIT: &str = "4f1e2d3c4b5a69788796a5b4c3d2e1f0a1b2c3d4";

/// What the hub was asked: (path, the Authorization header).
type Seen = Arc<Mutex<Vec<(String, Option<String>)>>>;

/// Serves the hub on a loopback port; returns its URL and what it was asked.
fn hub(tokenizer: Vec<u8>) -> (String, Seen) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let seen: Seen = Arc::default();
    let log = Arc::clone(&seen);
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            let mut reader = BufReader::new(stream.try_clone().unwrap());
            let mut head = String::new();
            reader.read_line(&mut head).unwrap();
            let path = head.split(' ').nth(1).unwrap_or_default().to_owned();
            let mut auth = None;
            loop {
                let mut line = String::new();
                if reader.read_line(&mut line).unwrap() == 0 || line == "\r\n" {
                    break;
                }
                if let Some((name, value)) = line.split_once(':')
                    && name.eq_ignore_ascii_case("authorization")
                {
                    auth = Some(value.trim().to_owned());
                }
            }
            log.lock().unwrap().push((path.clone(), auth));
            let (status, extra, body): (&str, String, &[u8]) = match path.as_str() {
                "/org/tiny/resolve/main/tokenizer.json" => (
                    "302 Found",
                    format!("Location: /blobs/tok\r\nX-Repo-Commit: {COMMIT}\r\n"),
                    b"",
                ),
                "/blobs/tok" => ("200 OK", String::new(), &tokenizer),
                "/org/gated/resolve/main/tokenizer.json" => {
                    ("401 Unauthorized", String::new(), b"")
                }
                _ => ("404 Not Found", String::new(), b""),
            };
            let head = format!(
                "HTTP/1.1 {status}\r\n{extra}Content-Length: {}\r\nConnection: close\r\n\r\n",
                body.len()
            );
            let _ = stream.write_all(head.as_bytes());
            let _ = stream.write_all(body);
        }
    });
    (url, seen)
}

fn check_config(model: &str, env: &[(&str, &str)]) -> Output {
    let mut command = Command::new(env!("CARGO_BIN_EXE_infera"));
    command
        .args(["server", "--router-tokenizer-path", model, "--check-config"])
        .args([
            "--discovery-backend",
            "etcd",
            "--etcd-endpoint",
            "127.0.0.1",
        ]);
    for name in [
        "HF_HOME",
        "HF_HUB_CACHE",
        "HUGGINGFACE_HUB_CACHE",
        "HF_HUB_OFFLINE",
        "HF_ENDPOINT",
        "HF_TOKEN",
        "HUGGING_FACE_HUB_TOKEN",
        "HF_REVISION",
    ] {
        command.env_remove(name);
    }
    command.envs(env.iter().copied()).output().unwrap()
}

#[test]
fn a_model_id_missing_from_the_cache_is_downloaded_into_it_once() {
    let fixture = Path::new(&tokenizer_dir()).join("tokenizer.json");
    let bytes = std::fs::read(&fixture).unwrap();
    let (endpoint, seen) = hub(bytes.clone());
    let cache = tempfile::tempdir().unwrap();
    let cache_dir = cache.path().to_str().unwrap();
    let env = [
        ("HF_HUB_CACHE", cache_dir),
        ("HF_ENDPOINT", endpoint.as_str()),
        ("HF_TOKEN", "hf_secret"),
    ];

    let output = check_config("org/tiny", &env);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(0), "{stderr}");
    let config: Value = serde_json::from_slice(&output.stdout).unwrap();
    let model = cache.path().join("models--org--tiny");
    let file = model.join("snapshots").join(COMMIT).join("tokenizer.json");
    assert_eq!(
        config["router"]["tokenizer_file"].as_str(),
        file.to_str(),
        "{config}"
    );
    assert_eq!(std::fs::read(&file).unwrap(), bytes);
    assert!(
        std::fs::read_link(&file)
            .unwrap()
            .starts_with("../../blobs")
    );
    assert_eq!(
        std::fs::read_to_string(model.join("refs/main")).unwrap(),
        COMMIT
    );
    let asked = seen.lock().unwrap().clone();
    let paths: Vec<&str> = asked.iter().map(|(p, _)| p.as_str()).collect();
    assert_eq!(
        paths,
        [
            "/org/tiny/resolve/main/tokenizer.json",
            "/blobs/tok",
            "/org/tiny/resolve/main/tokenizer_config.json",
        ]
    );
    assert!(
        asked
            .iter()
            .all(|(_, auth)| auth.as_deref() == Some("Bearer hf_secret"))
    );

    // Cached now: offline, and without asking the hub again.
    let offline = [env[0], env[1], ("HF_HUB_OFFLINE", "1")];
    let output = check_config("org/tiny", &offline);
    assert_eq!(output.status.code(), Some(0));
    let output = check_config("org/tiny", &env);
    assert_eq!(output.status.code(), Some(0));
    assert_eq!(seen.lock().unwrap().len(), asked.len());
}

#[test]
fn a_model_the_hub_refuses_or_lacks_is_one_line_naming_why() {
    let (endpoint, seen) = hub(Vec::new());
    let cache = tempfile::tempdir().unwrap();
    let env = [
        ("HF_HUB_CACHE", cache.path().to_str().unwrap()),
        ("HF_ENDPOINT", endpoint.as_str()),
    ];
    for (model, why) in [
        ("org/gated", "gated or private"),
        ("org/absent", "not found"),
    ] {
        let output = check_config(model, &env);
        assert_eq!(output.status.code(), Some(2), "{model}");
        let stderr = String::from_utf8_lossy(&output.stderr);
        let line = stderr.trim();
        assert_eq!(line.lines().count(), 1, "{stderr}");
        assert!(line.contains("--router-tokenizer-path"), "{line}");
        assert!(line.contains(why), "{line}");
        assert!(
            line.contains(&format!("huggingface-cli download {model}")),
            "{line}"
        );
    }
    // Offline, the hub is not asked at all.
    let before = seen.lock().unwrap().len();
    let output = check_config("org/other", &[env[0], env[1], ("HF_HUB_OFFLINE", "yes")]);
    assert_eq!(output.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&output.stderr).contains("HF_HUB_OFFLINE is set"));
    assert_eq!(seen.lock().unwrap().len(), before);
}
