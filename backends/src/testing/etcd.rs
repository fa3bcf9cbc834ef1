//! A real single-member etcd on free loopback ports.

use super::{
    HarnessError, PROBE_INTERVAL, READY_TIMEOUT, find_on_path, free_port, kill, log_tail,
    port_was_taken,
};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use tempfile::TempDir;
use tokio::time::Instant;

const INSTALL: &str = "`apt-get install -y etcd-server` (or `cargo xtask tools`)";
const ATTEMPTS: usize = 3;

/// A running `etcd`, killed and its data dir removed on drop.
#[derive(Debug)]
pub struct EtcdServer {
    binary: PathBuf,
    dir: TempDir,
    client_port: u16,
    peer_port: u16,
    child: Option<Child>,
}

impl EtcdServer {
    /// Starts etcd on free 127.0.0.1 ports with a fresh data dir and waits until it answers.
    ///
    /// # Errors
    /// [`HarnessError::BinaryMissing`] if `etcd` is not installed; [`HarnessError::NotReady`] with
    /// the end of its log if it exits or does not answer within [`READY_TIMEOUT`].
    pub async fn start() -> Result<Self, HarnessError> {
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
            child: None,
        };
        for attempt in 1..=ATTEMPTS {
            server.client_port = free_port()?;
            server.peer_port = free_port()?;
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

    /// A client connected to this server.
    ///
    /// # Errors
    /// The client's error if the endpoint is unusable.
    pub async fn client(&self) -> Result<etcd_client::Client, etcd_client::Error> {
        etcd_client::Client::connect([self.endpoint()], None).await
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

    async fn launch(&mut self) -> Result<(), HarnessError> {
        let log_path = self.log_path();
        let log = File::options()
            .create(true)
            .append(true)
            .open(&log_path)
            .map_err(|e| HarnessError::io(format!("opening {}", log_path.display()), e))?;
        let log_err = log
            .try_clone()
            .map_err(|e| HarnessError::io("duplicating the etcd log handle", e))?;
        let client = self.endpoint();
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let child = Command::new(&self.binary)
            .arg("--name=infera-test")
            .arg(format!("--data-dir={}", self.data_dir().display()))
            .arg(format!("--listen-client-urls={client}"))
            .arg(format!("--advertise-client-urls={client}"))
            .arg(format!("--listen-peer-urls={peer}"))
            .arg(format!("--initial-advertise-peer-urls={peer}"))
            .arg(format!("--initial-cluster=infera-test={peer}"))
            .arg("--initial-cluster-state=new")
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log_err)
            .spawn()
            .map_err(|e| HarnessError::io(format!("spawning {}", self.binary.display()), e))?;
        self.child = Some(child);
        self.wait_ready().await
    }

    /// Polls etcd's status call until it answers, the process exits, or the deadline passes.
    async fn wait_ready(&mut self) -> Result<(), HarnessError> {
        let deadline = Instant::now() + READY_TIMEOUT;
        let not_ready = |reason: String, log: &Path| HarnessError::NotReady {
            binary: "etcd",
            reason,
            log_tail: log_tail(log, 20),
        };
        loop {
            if let Some(child) = self.child.as_mut()
                && let Ok(Some(status)) = child.try_wait()
            {
                self.child = None;
                return Err(not_ready(format!("exited with {status}"), &self.log_path()));
            }
            let last_error = match tokio::time::timeout(PROBE_INTERVAL * 20, self.probe()).await {
                Ok(Ok(())) => return Ok(()),
                Ok(Err(e)) => e.to_string(),
                Err(_) => "status call timed out".to_owned(),
            };
            if Instant::now() >= deadline {
                self.stop();
                return Err(not_ready(
                    format!("no answer within {READY_TIMEOUT:?}: {last_error}"),
                    &self.log_path(),
                ));
            }
            tokio::time::sleep(PROBE_INTERVAL).await;
        }
    }

    async fn probe(&self) -> Result<(), etcd_client::Error> {
        let mut client = self.client().await?;
        client.status().await?;
        // A leader is needed before puts and watches work.
        let mut kv = client.kv_client();
        kv.get("/infera-harness-probe", None).await?;
        Ok(())
    }
}

impl Drop for EtcdServer {
    fn drop(&mut self) {
        self.stop();
    }
}
