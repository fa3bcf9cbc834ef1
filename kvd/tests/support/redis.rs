//! A `redis-server` of the test's own on a free loopback port, stopped when dropped. Starting
//! it fails the test loudly (it never skips): install Debian's `redis-server` package
//! (`cargo xtask test` does).

#![allow(dead_code, clippy::unwrap_used)]

use infera_kvd::l4::L4Config;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// How long a server may take to say it is ready.
const READY_WITHIN: Duration = Duration::from_secs(20);

pub struct RedisServer {
    child: Option<Child>,
    pub port: u16,
}

/// An L4 of LMCache's Redis layout on the server at `port`, 5 s per remote operation.
pub fn l4_config(port: u16) -> L4Config {
    let url = format!("redis://127.0.0.1:{port}");
    let env = move |k: &str| match k {
        "INFERA_L4_REMOTE_URL" => Some(url.clone()),
        "INFERA_L4_RPC_TIMEOUT_S" => Some("5".to_owned()),
        _ => None,
    };
    L4Config::from_lmcache(None, &env).unwrap()
}

/// A port nothing listens on right now.
pub fn free_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap().port()
}

impl RedisServer {
    /// A server on a free port.
    pub fn start() -> Self {
        Self::start_on(free_port())
    }

    /// A server on `port` (no persistence), once it accepts connections.
    pub fn start_on(port: u16) -> Self {
        let bin = std::env::var("REDIS_SERVER").unwrap_or_else(|_| "redis-server".into());
        let mut child = Command::new(&bin)
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no", "--loglevel", "notice"])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| {
                panic!("cannot start {bin} ({e}); install the redis-server package")
            });
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut seen = String::new();
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                seen.push_str(&line);
                seen.push('\n');
                if line.contains("Ready to accept connections") {
                    let _ = tx.send(Ok(()));
                    // Keep draining so the server never blocks on a full pipe.
                    continue;
                }
            }
            let _ = tx.send(Err(seen));
        });
        match rx.recv_timeout(READY_WITHIN) {
            Ok(Ok(())) => Self {
                child: Some(child),
                port,
            },
            Ok(Err(output)) => {
                let _ = child.kill();
                panic!("redis-server on port {port} exited before it was ready:\n{output}")
            }
            Err(_) => {
                let _ = child.kill();
                panic!("redis-server on port {port} not ready within {READY_WITHIN:?}")
            }
        }
    }

    /// Kills the server (SIGKILL) and reaps it.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
    }
}
