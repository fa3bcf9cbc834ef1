//! `cargo xtask image [-- --binary PATH] [--tag TAG]`: the container image, built by the local
//! Docker engine from nothing (`bins/deploy/image/Containerfile`: `FROM scratch`; no registry is
//! needed or asked).
//!
//! The root file system is assembled under `target/image/rootfs`: the `infera` binary
//! (`--binary`, else a release build), each shared library it links (read off `ldd`: glibc's
//! and libgcc's, from Debian's `libc6` and `libgcc-s1` packages, whose names and versions the
//! image carries in a label), the CA certificates rustls reads, and a non-root user
//! (65532, `infera`) with a home and `/tmp`. Nothing else: no shell, no package manager, no
//! build tools.
//!
//! Each build is followed by [`smoke`]; `cargo xtask test` builds the image from the stripped
//! debug binary.

use anyhow::{Context, bail};
use std::ffi::OsString;
use std::io::{Read as _, Write as _};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

const CONTAINERFILE: &str = "bins/deploy/image/Containerfile";
const CONTEXT: &str = "target/image";
const UID: u32 = 65532;
/// How long the smoke check waits for the fleet in the container to answer.
const READY_WITHIN: Duration = Duration::from_secs(60);

/// `cargo xtask image`'s arguments.
#[derive(Debug, Default, PartialEq)]
pub struct Args {
    pub binary: Option<PathBuf>,
    pub tag: Option<String>,
}

impl Args {
    /// # Errors
    /// An unknown argument or one without its value.
    pub fn parse(extra: &[OsString]) -> anyhow::Result<Self> {
        let mut args = Self::default();
        let mut it = extra.iter();
        while let Some(arg) = it.next() {
            let mut value = || {
                it.next()
                    .cloned()
                    .with_context(|| format!("{arg:?} needs a value"))
            };
            match arg.to_str() {
                Some("--binary") => args.binary = Some(PathBuf::from(value()?)),
                Some("--tag") => args.tag = Some(value()?.to_string_lossy().into_owned()),
                _ => bail!("unknown argument {arg:?}; expected --binary PATH or --tag TAG"),
            }
        }
        Ok(args)
    }
}

/// Builds the image; returns its (first) tag.
///
/// # Errors
/// The first step that fails, by name.
pub fn build(root: &Path, args: &Args, cargo: impl Fn() -> Command) -> anyhow::Result<String> {
    let binary = match &args.binary {
        Some(binary) => binary.clone(),
        None => {
            let mut release = cargo();
            release.args(["build", "--locked", "--release", "-p", "infera"]);
            crate::run_step("image: the release binary", &mut release)?;
            root.join("target/release/infera")
        }
    };
    let context = root.join(CONTEXT);
    if context.exists() {
        std::fs::remove_dir_all(&context).with_context(|| format!("cannot remove {CONTEXT}"))?;
    }
    let rootfs = context.join("rootfs");
    install(&binary, &rootfs.join("usr/local/bin/infera"))?;
    let mut packages = Vec::new();
    for library in linked_libraries(&binary)? {
        let inside = rootfs.join(library.strip_prefix("/").unwrap_or(&library));
        install(&std::fs::canonicalize(&library)?, &inside)?;
        packages.extend(package_of(&library));
    }
    packages.sort();
    packages.dedup();
    install(
        Path::new("/etc/ssl/certs/ca-certificates.crt"),
        &rootfs.join("etc/ssl/certs/ca-certificates.crt"),
    )
    .context("the CA certificates (Debian's ca-certificates package)")?;
    write(
        &rootfs.join("etc/passwd"),
        &format!(
            "root:x:0:0:root:/root:/sbin/nologin\ninfera:x:{UID}:{UID}:infera:/home/infera:/sbin/nologin\n"
        ),
    )?;
    write(
        &rootfs.join("etc/group"),
        &format!("root:x:0:\ninfera:x:{UID}:\n"),
    )?;
    write(&rootfs.join("etc/nsswitch.conf"), "hosts: files dns\n")?;
    for dir in ["tmp", "home/infera"] {
        std::fs::create_dir_all(rootfs.join(dir))?;
    }
    std::fs::copy(root.join(CONTAINERFILE), context.join("Containerfile"))?;

    let version = env!("CARGO_PKG_VERSION");
    let tag = args
        .tag
        .clone()
        .unwrap_or_else(|| format!("infera:{version}"));
    let mut docker = Command::new("docker");
    docker
        .args(["build", "--quiet", "--file"])
        .arg(context.join("Containerfile"))
        .args(["--tag", &tag, "--label"])
        .arg(format!("org.opencontainers.image.version={version}"))
        .arg("--label")
        .arg(format!("io.infera.debian-packages={}", packages.join(" ")))
        .arg(&context);
    crate::run_step("image: docker build", &mut docker)?;
    let size =
        output(Command::new("docker").args(["image", "inspect", "--format", "{{.Size}}", &tag]))?;
    println!(
        "xtask: image {tag}: {} MB",
        size.trim().parse::<u64>().unwrap_or(0) / 1_000_000
    );
    Ok(tag)
}

/// Starts `infera up` from the image on a private network, sends it a chat completion through
/// a port published on loopback, and checks that it answers and runs as the non-root user;
/// removes the container and the network whatever happens.
///
/// # Errors
/// What did not hold, with the container's log.
pub fn smoke(root: &Path, tag: &str) -> anyhow::Result<()> {
    let name = format!("infera-smoke-{}", std::process::id());
    let _cleanup = Cleanup(name.clone());
    run(
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
    run("image smoke: infera up in a container", &mut start)?;
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

/// The libraries `binary` links, as `ldd` resolves them (the loader included).
fn linked_libraries(binary: &Path) -> anyhow::Result<Vec<PathBuf>> {
    let listing = output(Command::new("ldd").arg(binary))?;
    let mut libraries = Vec::new();
    for line in listing.lines() {
        let path = match line.split_once("=>") {
            Some((_, after)) => after.split_whitespace().next(),
            None => line
                .split_whitespace()
                .next()
                .filter(|p| p.starts_with('/')),
        };
        match path {
            Some(path) if path.starts_with('/') => libraries.push(PathBuf::from(path)),
            Some("not") => bail!("ldd: {binary:?} links a library that is not found: {line}"),
            _ => {}
        }
    }
    if libraries.is_empty() {
        bail!("ldd found no library for {binary:?}");
    }
    Ok(libraries)
}

/// The Debian package (`name=version`) that installed `file`, if dpkg knows it.
fn package_of(file: &Path) -> Option<String> {
    let owner = output(Command::new("dpkg-query").arg("--search").arg(file)).ok()?;
    let name = owner.split(':').next()?.trim().to_owned();
    let version =
        output(Command::new("dpkg-query").args(["--show", "--showformat", "${Version}", &name]))
            .ok()?;
    Some(format!("{name}={}", version.trim()))
}

fn install(from: &Path, to: &Path) -> anyhow::Result<()> {
    if let Some(dir) = to.parent() {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::copy(from, to)
        .with_context(|| format!("cannot copy {} to {}", from.display(), to.display()))?;
    Ok(())
}

fn write(path: &Path, text: &str) -> anyhow::Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(path, text).with_context(|| format!("cannot write {}", path.display()))
}

fn run(name: &str, command: &mut Command) -> anyhow::Result<()> {
    command.stdout(std::process::Stdio::null());
    crate::run_step(name, command)
}

/// A command's standard output, failing with its standard error.
fn output(command: &mut Command) -> anyhow::Result<String> {
    let out = command
        .output()
        .with_context(|| format!("could not start {:?}", command.get_program()))?;
    if !out.status.success() {
        bail!(
            "{:?} failed: {}",
            command.get_program(),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arguments_take_a_binary_and_a_tag() {
        let args = |list: &[&str]| list.iter().map(OsString::from).collect::<Vec<_>>();
        assert_eq!(Args::parse(&[]).unwrap(), Args::default());
        assert_eq!(
            Args::parse(&args(&["--binary", "/b", "--tag", "x:1"])).unwrap(),
            Args {
                binary: Some("/b".into()),
                tag: Some("x:1".into())
            }
        );
        assert!(Args::parse(&args(&["--binary"])).is_err());
        assert!(Args::parse(&args(&["--push"])).is_err());
    }
}
