//! The images started: the `infera` image serving a chat completion, the Python image running
//! the Python Infera's entry points; both as the non-root user.

use super::{UID, output};
use anyhow::{Context, bail};
use std::io::{Read as _, Write as _};
use std::net::TcpStream;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

/// How long the check waits for the fleet in the container to answer.
const READY_WITHIN: Duration = Duration::from_secs(60);

/// Starts `infera up` from the image on a private network, sends it a chat completion through
/// a port published on loopback, and checks that it answers and runs as the non-root user;
/// removes the container and the network whatever happens.
///
/// # Errors
/// What did not hold, with the container's log.
pub fn serves(root: &Path, tag: &str) -> anyhow::Result<()> {
    let name = format!("infera-smoke-{}", std::process::id());
    let _cleanup = Cleanup(name.clone());
    crate::tools::run_quiet(
        "image smoke: a private network",
        Command::new("docker").args(["network", "create", &name]),
    )?;
    let tokenizer = root.join("fixtures/tokenizers/deepseek-v4");
    let mut start = Command::new("docker");
    start
        .args(["run", "--detach", "--name", &name, "--network", &name])
        // The binary by name, as the Kubernetes manifests start it (`command: ["infera"]`).
        .args([
            "--entrypoint",
            "infera",
            "--publish",
            "127.0.0.1::8000",
            "--volume",
        ])
        .arg(format!("{}:/tokenizer:ro", tokenizer.display()))
        .arg(tag)
        .args([
            "up",
            "--workers",
            "2",
            "--host",
            "0.0.0.0",
            "--port",
            "8000",
        ])
        .args(["--router-tokenizer-path", "/tokenizer"]);
    crate::tools::run_quiet("image smoke: infera up in a container", &mut start)?;
    let port = output(Command::new("docker").args(["port", &name, "8000/tcp"]))?;
    let address = port
        .lines()
        .next()
        .context("docker port: no address")?
        .trim()
        .to_owned();
    let body = r#"{"model":"mock","messages":[{"role":"user","content":"Hello!"}],"max_tokens":8}"#;
    let deadline = Instant::now() + READY_WITHIN;
    let answer = loop {
        match post(&address, "/v1/chat/completions", body) {
            Ok(answer) if answer.starts_with("HTTP/1.1 200") => break answer,
            result if Instant::now() >= deadline => {
                let log = output(Command::new("docker").args(["logs", &name])).unwrap_or_default();
                bail!("image smoke: no 200 within {READY_WITHIN:?} ({result:?}); log:\n{log}");
            }
            // The fleet is still starting: try again shortly.
            _ => std::thread::sleep(Duration::from_millis(250)),
        }
    };
    if !answer.contains("\"choices\"") {
        bail!("image smoke: the answer has no choices:\n{answer}");
    }
    let pid =
        output(Command::new("docker").args(["inspect", "--format", "{{.State.Pid}}", &name]))?;
    let status = std::fs::read_to_string(format!("/proc/{}/status", pid.trim()))
        .context("image smoke: the container's process status")?;
    let uid = status
        .lines()
        .find_map(|line| line.strip_prefix("Uid:"))
        .and_then(|ids| ids.split_whitespace().next())
        .context("image smoke: no Uid line")?;
    if uid != UID.to_string() {
        bail!("image smoke: the server runs as uid {uid}, not {UID}");
    }
    println!("xtask: image smoke: {tag} answered a chat completion as uid {uid}");
    Ok(())
}

/// Removes the smoke check's container and network.
struct Cleanup(String);

impl Drop for Cleanup {
    fn drop(&mut self) {
        let quiet = |args: &[&str]| {
            let _ = Command::new("docker")
                .args(args)
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .status();
        };
        quiet(&["rm", "--force", &self.0]);
        quiet(&["network", "rm", &self.0]);
    }
}

/// One HTTP/1.1 POST with a JSON body; returns the whole response.
fn post(address: &str, path: &str, body: &str) -> std::io::Result<String> {
    let mut stream = TcpStream::connect(address)?;
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    write!(
        stream,
        "POST {path} HTTP/1.1\r\nHost: {address}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )?;
    let mut answer = String::new();
    stream.read_to_string(&mut answer)?;
    Ok(answer)
}

/// `python -m infera.server --version` in the Python image (the entry point execs the packaged
/// binary), as the non-root user.
pub fn runs_python_entry_points(tag: &str) -> anyhow::Result<()> {
    let run = |args: &[&str]| {
        output(
            Command::new("docker")
                .args(["run", "--rm", "--entrypoint", "python", tag])
                .args(args),
        )
    };
    let version = run(&["-m", "infera.server", "--version"])?;
    if !(version.starts_with("infera") && version.contains(env!("CARGO_PKG_VERSION"))) {
        bail!("image check: `python -m infera.server --version` printed {version:?}");
    }
    let direct = output(Command::new("docker").args([
        "run",
        "--rm",
        "--entrypoint",
        "infera",
        tag,
        "--version",
    ]))?;
    if direct.trim() != format!("infera {}", env!("CARGO_PKG_VERSION")) {
        bail!("image check: `infera --version` printed {direct:?}");
    }
    let uid = run(&["-c", "import os; print(os.getuid())"])?;
    if uid.trim() != UID.to_string() {
        bail!(
            "image check: the Python image runs as uid {}, not {UID}",
            uid.trim()
        );
    }
    println!(
        "xtask: image check: {tag} runs `python -m infera.server` ({}) as uid {UID}",
        version.trim()
    );
    Ok(())
}
