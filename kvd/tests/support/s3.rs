//! An S3-compatible server of the test's own (moto's standalone server, `python3 -m
//! moto.server`) on a free loopback port with one bucket, stopped when dropped. Starting it
//! fails the test loudly (it never skips): `pip install 'moto[server]'` (`cargo xtask test`
//! does). Its objects live in its memory: a restart starts empty (the bucket is made again).

#![allow(dead_code, clippy::unwrap_used)]

use infera_kvd::l4::L4Config;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// How long the server may take to say it is ready.
const READY_WITHIN: Duration = Duration::from_secs(60);
/// The bucket every test writes in.
pub const BUCKET: &str = "kv-blocks";

pub struct S3Server {
    child: Option<Child>,
    pub port: u16,
}

/// An L4 on `bucket` of the server at `port` (path-style, plain HTTP), 5 s per operation.
pub fn l4_config(port: u16, bucket: &str) -> L4Config {
    config(port, bucket, false)
}

/// The same over HTTPS.
pub fn l4_config_tls(port: u16, bucket: &str) -> L4Config {
    config(port, bucket, true)
}

fn config(port: u16, bucket: &str, tls: bool) -> L4Config {
    let url = format!("s3://127.0.0.1:{port}/{bucket}");
    let env = move |k: &str| match k {
        "INFERA_L4_REMOTE_URL" => Some(url.clone()),
        "INFERA_L4_RPC_TIMEOUT_S" => Some("5".to_owned()),
        "INFERA_L4_S3_REGION" => Some("us-east-1".to_owned()),
        "INFERA_L4_DISABLE_TLS" => Some((!tls).to_string()),
        "AWS_ACCESS_KEY_ID" => Some("testing".to_owned()),
        "AWS_SECRET_ACCESS_KEY" => Some("testing".to_owned()),
        _ => None,
    };
    L4Config::from_lmcache(None, &env).unwrap()
}

/// A port nothing listens on right now.
pub fn free_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap().port()
}

impl S3Server {
    /// A server on a free port, with [`BUCKET`].
    pub fn start() -> Self {
        Self::start_on(free_port())
    }

    /// A server on `port` with [`BUCKET`], once it answers.
    pub fn start_on(port: u16) -> Self {
        let server = Self::spawn(port, false);
        assert_eq!(server.request("PUT", &format!("/{BUCKET}"), b""), 200);
        server
    }

    /// A server speaking HTTPS with a certificate of its own making (no system trusts it).
    pub fn start_self_signed() -> Self {
        Self::spawn(free_port(), true)
    }

    fn spawn(port: u16, tls: bool) -> Self {
        let python = std::env::var("INFERA_PYTHON").unwrap_or_else(|_| "python3".into());
        let port_arg = port.to_string();
        let mut child = Command::new(&python)
            .args(["-m", "moto.server", "-H", "127.0.0.1", "-p", &port_arg])
            .args(tls.then_some("--ssl"))
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot run {python} ({e})"));
        let stderr = child.stderr.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut seen = String::new();
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                if line.contains("Running on http") {
                    let _ = tx.send(Ok(()));
                }
                // Keep draining (each request logs a line) so the server never blocks.
                if seen.len() < 16 << 10 {
                    seen.push_str(&line);
                    seen.push('\n');
                }
            }
            let _ = tx.send(Err(seen));
        });
        match rx.recv_timeout(READY_WITHIN) {
            Ok(Ok(())) => {}
            Ok(Err(output)) => {
                let _ = child.kill();
                panic!(
                    "moto's S3 server on port {port} exited before it was ready (pip install \
                     'moto[server]'):\n{output}"
                )
            }
            Err(_) => {
                let _ = child.kill();
                panic!("moto's S3 server on port {port} not ready within {READY_WITHIN:?}")
            }
        }
        Self {
            child: Some(child),
            port,
        }
    }

    /// One unsigned request (moto's server needs no signature); its status.
    pub fn request(&self, method: &str, path: &str, body: &[u8]) -> u16 {
        let mut stream = TcpStream::connect(("127.0.0.1", self.port)).unwrap();
        write!(
            stream,
            "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{}\r\nContent-Length: {}\r\n\
             Connection: close\r\n\r\n",
            self.port,
            body.len()
        )
        .unwrap();
        stream.write_all(body).unwrap();
        let mut answer = String::new();
        stream.read_to_string(&mut answer).unwrap();
        answer
            .split(' ')
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("not an HTTP answer: {answer:?}"))
    }

    /// Kills the server (SIGKILL) and reaps it.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for S3Server {
    fn drop(&mut self) {
        self.kill();
    }
}
