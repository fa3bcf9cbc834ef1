//! A real single-member etcd on free loopback ports; optionally also serving TLS with a
//! self-signed certificate (made with the `openssl` command), for tests of `https://` endpoints.

use super::{
    HarnessError, find_on_path, free_port, kill, log_tail, port_was_taken, spawn_logged, wait_ready,
};
use crate::discovery::etcd::client::{ClientOptions, EtcdClient, EtcdError};
use crate::discovery::etcd::endpoint::EtcdEndpoint;
use std::path::PathBuf;
use std::process::{Child, Command};
use std::time::Duration;
use tempfile::TempDir;

const INSTALL: &str = "`apt-get install -y etcd-server` (or `cargo xtask tools`)";
const ATTEMPTS: usize = 3;

/// A running `etcd`, killed and its data dir removed on drop.
#[derive(Debug)]
pub struct EtcdServer {
    binary: PathBuf,
    dir: TempDir,
    client_port: u16,
    peer_port: u16,
    /// The TLS client port, when started with [`EtcdServer::start_with_tls`].
    tls_port: Option<u16>,
    child: Option<Child>,
}

impl EtcdServer {
    /// Starts etcd on free 127.0.0.1 ports with a fresh data dir and waits until it answers.
    ///
    /// # Errors
    /// [`HarnessError::BinaryMissing`] if `etcd` is not installed; [`HarnessError::NotReady`] with
    /// the end of its log if it exits or does not answer within [`READY_TIMEOUT`].
    pub async fn start() -> Result<Self, HarnessError> {
        Self::start_inner(false).await
    }

    /// As [`EtcdServer::start`], and also serving TLS at [`EtcdServer::https_endpoint`] with a
    /// fresh self-signed certificate for `127.0.0.1` (so no system root trusts it).
    ///
    /// # Errors
    /// As [`EtcdServer::start`]; [`HarnessError::BinaryMissing`] if `openssl` is not installed.
    pub async fn start_with_tls() -> Result<Self, HarnessError> {
        Self::start_inner(true).await
    }

    async fn start_inner(tls: bool) -> Result<Self, HarnessError> {
        let binary = find_on_path("etcd")
            .or_else(|| Some(PathBuf::from("/usr/bin/etcd")).filter(|p| p.is_file()))
            .ok_or_else(|| HarnessError::BinaryMissing {
                binary: "etcd",
                looked_in: "PATH and /usr/bin".to_owned(),
                install: INSTALL,
            })?;
        let dir = tempfile::Builder::new()
            .prefix("infera-etcd-")
            .tempdir()
            .map_err(|e| HarnessError::io("creating etcd's temp dir", e))?;
        let mut server = Self {
            binary,
            dir,
            client_port: 0,
            peer_port: 0,
            tls_port: None,
            child: None,
        };
        if tls {
            server.make_certificate()?;
        }
        for attempt in 1..=ATTEMPTS {
            server.client_port = free_port()?;
            server.peer_port = free_port()?;
            server.tls_port = if tls { Some(free_port()?) } else { None };
            match server.launch().await {
                Ok(()) => return Ok(server),
                Err(e) if attempt < ATTEMPTS && port_was_taken(&server.log_path()) => {
                    tracing::warn!(error = %e, "etcd port taken; retrying on other ports");
                    // The failed member's data dir names the old peer URL; start afresh.
                    let _ = std::fs::remove_dir_all(server.data_dir());
                }
                Err(e) => return Err(e),
            }
        }
        Err(HarnessError::NotReady {
            binary: "etcd",
            reason: "no free ports after retries".to_owned(),
            log_tail: log_tail(&server.log_path(), 20),
        })
    }

    /// The client URL, e.g. `http://127.0.0.1:41234`.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.client_port)
    }

    /// The TLS client URL, e.g. `https://127.0.0.1:41236`, if started with TLS.
    pub fn https_endpoint(&self) -> Option<String> {
        self.tls_port
            .map(|port| format!("https://127.0.0.1:{port}"))
    }

    /// The client address.
    pub fn client_addr(&self) -> std::net::SocketAddr {
        std::net::SocketAddr::from(([127, 0, 0, 1], self.client_port))
    }

    /// The data directory (kept across [`EtcdServer::restart`]).
    pub fn data_dir(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    /// The server's combined stdout and stderr.
    pub fn log_path(&self) -> PathBuf {
        self.dir.path().join("etcd.log")
    }

    /// A raw client of this server, for what tests do behind the backend's back.
    ///
    /// # Errors
    /// [`EtcdError::Setup`] if the endpoint is unusable.
    pub fn client(&self) -> Result<EtcdClient, EtcdError> {
        client(&self.endpoint())
    }

    /// Kills the process (as a crash would) and starts it again on the same ports and data, then
    /// waits until it answers.
    ///
    /// # Errors
    /// As [`EtcdServer::start`].
    pub async fn restart(&mut self) -> Result<(), HarnessError> {
        self.stop();
        self.launch().await
    }

    /// Kills the process; the data dir stays until drop.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            kill(&mut child);
        }
    }

    fn make_certificate(&self) -> Result<(), HarnessError> {
        let openssl = find_on_path("openssl").ok_or_else(|| HarnessError::BinaryMissing {
            binary: "openssl",
            looked_in: "PATH".to_owned(),
            install: "`apt-get install -y openssl`",
        })?;
        let output = Command::new(&openssl)
            .args([
                "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
            ])
            .args([
                "-subj",
                "/CN=127.0.0.1",
                "-addext",
                "subjectAltName=IP:127.0.0.1",
            ])
            .arg("-keyout")
            .arg(self.dir.path().join("key.pem"))
            .arg("-out")
            .arg(self.dir.path().join("cert.pem"))
            .output()
            .map_err(|e| HarnessError::io("running openssl", e))?;
        if output.status.success() {
            return Ok(());
        }
        Err(HarnessError::NotReady {
            binary: "openssl",
            reason: format!("making a test certificate: {}", output.status),
            log_tail: String::from_utf8_lossy(&output.stderr).into_owned(),
        })
    }

    async fn launch(&mut self) -> Result<(), HarnessError> {
        let client = self.endpoint();
        let clients = match self.https_endpoint() {
            Some(https) => format!("{client},{https}"),
            None => client.clone(),
        };
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let mut command = Command::new(&self.binary);
        command
            .arg("--name=infera-test")
            .arg(format!("--data-dir={}", self.data_dir().display()))
            .arg(format!("--listen-client-urls={clients}"))
            .arg(format!("--advertise-client-urls={clients}"))
            .arg(format!("--listen-peer-urls={peer}"))
            .arg(format!("--initial-advertise-peer-urls={peer}"))
            .arg(format!("--initial-cluster=infera-test={peer}"))
            .arg("--initial-cluster-state=new");
        if self.tls_port.is_some() {
            command
                .arg(format!(
                    "--cert-file={}",
                    self.dir.path().join("cert.pem").display()
                ))
                .arg(format!(
                    "--key-file={}",
                    self.dir.path().join("key.pem").display()
                ));
        }
        let log = self.log_path();
        self.child = Some(spawn_logged(&mut command, &self.binary, &log)?);
        wait_ready(&mut self.child, "etcd", &log, || probe(client.clone())).await
    }
}

fn client(url: &str) -> Result<EtcdClient, EtcdError> {
    let endpoint = EtcdEndpoint::parse(url).map_err(|e| EtcdError::Setup {
        endpoint: url.to_owned(),
        message: e.to_string(),
    })?;
    let options = ClientOptions {
        request_timeout: Duration::from_secs(5),
        http2_keepalive: Duration::from_secs(10),
    };
    EtcdClient::new(&[endpoint], &options)
}

/// Whether etcd at `endpoint` answers a linearizable read (which needs a leader, as puts and
/// watches do).
async fn probe(endpoint: String) -> Result<(), String> {
    let client = client(&endpoint).map_err(|e| e.to_string())?;
    client
        .range(b"/infera-harness-probe", b"")
        .await
        .map_err(|e| e.to_string())?;
    Ok(())
}

impl Drop for EtcdServer {
    fn drop(&mut self) {
        self.stop();
    }
}
