//! One fleet per fault: etcd (and nats-server), mock workers and the server as separate
//! processes of this build's binary, on free loopback ports, stopped when dropped.

use crate::common::{
    Proc, eventually, free_mock_port, free_port, get_json, mock_worker_command, tokenizer_dir,
};
use infera_backends::testing::{EtcdServer, NatsServer};
use std::process::{Command, Stdio};

/// How requests and KV events travel between the server and its workers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transport {
    HttpZmq,
    Nats,
}

/// What a fault's fleet looks like.
#[derive(Debug, Clone)]
pub struct Shape {
    pub transport: Transport,
    /// Extra flags of each worker (one entry per worker).
    pub workers: Vec<Vec<String>>,
    /// Extra flags of the server.
    pub server: Vec<String>,
    /// The server's open-file limit (`ulimit -n`), when it is to be lowered.
    pub fd_limit: Option<u32>,
}

pub struct Fleet {
    pub server_port: u16,
    pub model: String,
    pub workers: Vec<Proc>,
    /// Each worker's HTTP port, in `workers` order.
    pub worker_ports: Vec<u16>,
    /// The worker a fault struck (see [`Fleet::busiest`]), for its repair.
    pub struck: usize,
    pub etcd: EtcdServer,
    pub nats: Option<NatsServer>,
    _server: Proc,
}

/// What every fault's server runs with besides its defaults: stream migration. No deadline
/// flag: the defaults (900 s deadlines, the active health checks) must carry every fault.
pub const SERVER_EDGE: [&str; 2] = ["--migration-limit", "2"];

/// What a NATS fleet's server adds: a broker restart loses the replies in flight while their
/// worker stays healthy, and only the reply idle deadline ends those requests (at its default,
/// 900 s, 9 of 120 hung past 30 s).
pub const NATS_EDGE: [&str; 2] = ["--nats-req-idle-timeout", "4s"];

impl Fleet {
    pub async fn start(shape: &Shape) -> Fleet {
        let etcd = EtcdServer::start().await.expect("etcd starts");
        let nats = match shape.transport {
            Transport::HttpZmq => None,
            Transport::Nats => Some(NatsServer::start().await.expect("nats-server starts")),
        };
        let wires: Vec<String> = match &nats {
            None => ["--request-transport", "http", "--kv-event-transport", "zmq"]
                .map(str::to_owned)
                .to_vec(),
            Some(n) => vec!["--nats-server".to_owned(), n.url()],
        };
        let tok = tokenizer_dir();
        let ports: Vec<u16> = shape.workers.iter().map(|_| free_mock_port()).collect();
        let workers = ports
            .iter()
            .zip(&shape.workers)
            .map(|(port, extra)| {
                let mut cmd = mock_worker_command(&tok, &etcd.endpoint(), *port);
                cmd.args(["--etcd-lease-ttl", "3s"])
                    .args(&wires)
                    .args(extra);
                spawn(cmd)
            })
            .collect();
        let server_port = free_port();
        let mut server_args: Vec<String> = ["server", "--router-tokenizer-path", &tok]
            .into_iter()
            .map(str::to_owned)
            .collect();
        server_args
            .extend(["--host", "127.0.0.1", "--port", &server_port.to_string()].map(str::to_owned));
        server_args.extend(
            [
                "--discovery-backend",
                "etcd",
                "--etcd-endpoint",
                &etcd.endpoint(),
            ]
            .map(str::to_owned),
        );
        server_args.extend(wires);
        server_args.extend(SERVER_EDGE.map(str::to_owned));
        if shape.transport == Transport::Nats {
            server_args.extend(NATS_EDGE.map(str::to_owned));
        }
        server_args.extend(shape.server.iter().cloned());
        let bin = env!("CARGO_BIN_EXE_infera");
        let cmd = match shape.fd_limit {
            None => {
                let mut cmd = Command::new(bin);
                cmd.args(&server_args);
                cmd
            }
            Some(limit) => {
                // The shell lowers its own limit, then becomes the server.
                let mut cmd = Command::new("sh");
                cmd.args([
                    "-c",
                    &format!("ulimit -n {limit} && exec \"$0\" \"$@\""),
                    bin,
                ])
                .args(&server_args);
                cmd
            }
        };
        let server = spawn(cmd);
        let expected = shape.workers.len();
        eventually("every worker to be discovered", || {
            get_json(server_port, "/health").is_some_and(|h| h["active_workers"] == expected)
        });
        Fleet {
            server_port,
            model: tok,
            workers,
            worker_ports: ports,
            struck: 0,
            etcd,
            nats,
            _server: server,
        }
    }

    /// The worker with the most requests in flight, as the server counts them (`/v1/workers`):
    /// the one a fault should strike to show what happens to its streams.
    pub fn busiest(&self) -> usize {
        let Some(view) = get_json(self.server_port, "/v1/workers") else {
            return 0;
        };
        let inflight_at = |port: u16| {
            view["data"].as_array().into_iter().flatten().find_map(|w| {
                let url = w["record"]["url"].as_str()?;
                url.ends_with(&format!(":{port}"))
                    .then(|| w["load"][0]["inflight"].as_u64().unwrap_or(0))
            })
        };
        (0..self.worker_ports.len())
            .max_by_key(|&i| inflight_at(self.worker_ports[i]).unwrap_or(0))
            .unwrap_or(0)
    }

    /// The server's migration counters: streams migrated, and of those continued from their
    /// exact token ids.
    pub fn migrations(&self) -> (u64, u64) {
        let Some((_, text)) = crate::common::http(self.server_port, "GET", "/metrics", "") else {
            return (0, 0);
        };
        let counter = |name: &str| {
            text.lines()
                .find(|l| l.split(' ').next() == Some(name))
                .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                .map_or(0, |v| v as u64)
        };
        (
            counter("infera_stream_migrations_total"),
            counter("infera_stream_migrations_exact_total"),
        )
    }
}

/// Sends `signal` (`KILL`, `STOP`, `CONT`) to a worker.
pub fn signal(worker: &Proc, signal: &str) {
    crate::common::signal(&worker.0, signal);
}

fn spawn(mut cmd: Command) -> Proc {
    Proc(
        cmd.env_remove("RUST_LOG")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("the binary starts"),
    )
}
