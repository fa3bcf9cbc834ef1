//! A Mooncake Store cluster of the test's own on free loopback ports: `mooncake_master` (with
//! its HTTP metadata server) and one `mooncake_client` holding the store's memory, both from
//! the PyPI package `mooncake-transfer-engine-non-cuda` (which needs Debian's `libibverbs1`;
//! `cargo xtask test` installs both). Stopped when dropped. A cluster that cannot start fails
//! the test loudly (it never skips).

#![allow(dead_code, clippy::unwrap_used)]

use infera_kvd::l4::L4Config;
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// How long a process may take to listen.
const READY_WITHIN: Duration = Duration::from_secs(30);

pub struct Cluster {
    master: Option<Child>,
    holder: Option<Child>,
    pub rpc_port: u16,
    pub metadata_port: u16,
    metrics_port: u16,
    holder_port: u16,
    /// `mooncake_master`'s flags beyond the ports.
    master_flags: Vec<String>,
}

/// A port nothing listens on right now.
pub fn free_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap().port()
}

/// The directory of the installed `mooncake` package (its binaries sit there).
fn package_dir() -> PathBuf {
    let python = std::env::var("INFERA_PYTHON").unwrap_or_else(|_| "python3".into());
    let out = Command::new(&python)
        .args([
            "-c",
            "import mooncake, os; print(os.path.dirname(mooncake.__file__))",
        ])
        .output()
        .unwrap_or_else(|e| panic!("cannot run {python}: {e}"));
    assert!(
        out.status.success(),
        "the mooncake package is not installed for {python}: pip install \
         mooncake-transfer-engine-non-cuda (cargo xtask test does)\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())
}

fn wait_listening(what: &str, port: u16, child: &mut Child) {
    let start = Instant::now();
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        if let Ok(Some(status)) = child.try_wait() {
            panic!("{what} exited before it listened on {port}: {status}");
        }
        assert!(
            start.elapsed() < READY_WITHIN,
            "{what} did not listen on {port}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

impl Cluster {
    /// A master and a memory holder (256 MiB) on free ports.
    pub fn start() -> Self {
        Self::start_with(&[])
    }

    /// A cluster whose master also takes `master_flags`.
    pub fn start_with(master_flags: &[&str]) -> Self {
        let mut cluster = Self {
            master: None,
            holder: None,
            rpc_port: free_port(),
            metadata_port: free_port(),
            metrics_port: free_port(),
            holder_port: free_port(),
            master_flags: master_flags.iter().map(|f| f.to_string()).collect(),
        };
        cluster.restart();
        cluster
    }

    /// Starts the master and the holder again, on the same ports, after [`Cluster::kill`].
    pub fn restart(&mut self) {
        let dir = package_dir();
        let mut master = Command::new(dir.join("mooncake_master"))
            .args([
                format!("--rpc_port={}", self.rpc_port),
                "--rpc_address=127.0.0.1".into(),
                "--enable_http_metadata_server=true".into(),
                "--http_metadata_server_host=127.0.0.1".into(),
                format!("--http_metadata_server_port={}", self.metadata_port),
                "--metrics_host=127.0.0.1".into(),
                format!("--metrics_port={}", self.metrics_port),
            ])
            .args(&self.master_flags)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start mooncake_master from {}: {e}", dir.display()));
        wait_listening("mooncake_master", self.rpc_port, &mut master);
        wait_listening("the metadata server", self.metadata_port, &mut master);
        self.master = Some(master);
        let mut holder = Command::new(dir.join("mooncake_client"))
            .args([
                format!("--master_server_address=127.0.0.1:{}", self.rpc_port),
                format!("--metadata_server={}", self.metadata_url()),
                "--host=127.0.0.1".into(),
                format!("--port={}", self.holder_port),
                "--global_segment_size=256 MB".into(),
                "--local_buffer_size=16 MB".into(),
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start mooncake_client from {}: {e}", dir.display()));
        wait_listening("mooncake_client", self.holder_port, &mut holder);
        self.holder = Some(holder);
    }

    pub fn metadata_url(&self) -> String {
        format!("http://127.0.0.1:{}/metadata", self.metadata_port)
    }

    /// kvd's settings for this cluster: a client giving no memory of its own (so what it
    /// writes outlives it), named `127.0.0.1:<local_port>`, with `cluster_id`.
    pub fn config(&self, cluster_id: &str, local_port: u16) -> L4Config {
        self.config_through(cluster_id, local_port, self.rpc_port)
    }

    /// [`Cluster::config`] with the master reached at `master_port` on loopback (a proxy to
    /// it).
    pub fn config_through(&self, cluster_id: &str, local_port: u16, master_port: u16) -> L4Config {
        let vars = [
            (
                "INFERA_L4_MASTER_ADDRESS",
                format!("127.0.0.1:{master_port}"),
            ),
            ("INFERA_L4_CLUSTER_ID", cluster_id.to_owned()),
            ("INFERA_L4_METADATA_SERVER", self.metadata_url()),
            (
                "INFERA_L4_LOCAL_HOSTNAME",
                format!("127.0.0.1:{local_port}"),
            ),
            ("INFERA_L4_GLOBAL_SEGMENT_SIZE", "0".to_owned()),
            ("INFERA_L4_LOCAL_BUFFER_SIZE", (64u64 << 20).to_string()),
            ("INFERA_L4_MAX_VALUE_BYTES", (8u64 << 20).to_string()),
            ("INFERA_L4_RPC_TIMEOUT_S", "10".to_owned()),
        ];
        let python = std::env::var("INFERA_PYTHON").ok();
        let env = move |k: &str| {
            if k == "INFERA_L4_PYTHON" {
                return python.clone();
            }
            vars.iter().find(|(n, _)| *n == k).map(|(_, v)| v.clone())
        };
        L4Config::from_mooncake(None, &env).unwrap()
    }

    /// Kills the master and the holder (SIGKILL): the store and everything in it are gone.
    pub fn kill(&mut self) {
        for child in [self.holder.take(), self.master.take()]
            .into_iter()
            .flatten()
        {
            let mut child = child;
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.kill();
    }
}
