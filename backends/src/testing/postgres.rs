//! PostgreSQL for tests: fresh, uniquely named databases, dropped afterwards.
//!
//! The server is the machine's own on `127.0.0.1:5432` (trust auth, user `postgres`) when it
//! answers; otherwise a private cluster is created from Debian's `postgresql` binaries (`initdb`,
//! `postgres`, found on `PATH` or under `/usr/lib/postgresql/*/bin`) in a temp dir and started on
//! a free loopback port, run as the `postgres` user when the tests run as root (Postgres refuses
//! root). Neither available is an error naming the package: tests fail, they never skip.

use super::{HarnessError, find_on_path, free_port, kill, log_tail, spawn_logged, wait_ready};
use sqlx::Connection;
use sqlx::postgres::PgConnection;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use tempfile::TempDir;

const INSTALL: &str = "`apt-get install -y postgresql` (or `cargo xtask tools`)";
/// The machine's server, if it runs one.
const MACHINE_HOST: &str = "127.0.0.1";
const MACHINE_PORT: u16 = 5432;
const USER: &str = "postgres";
/// How long the probe of the machine's server may take.
const PROBE_TIMEOUT: Duration = Duration::from_secs(3);

static DATABASES: AtomicU64 = AtomicU64::new(0);

/// A reachable PostgreSQL server and the test databases created on it.
#[derive(Debug)]
pub struct PostgresServer {
    port: u16,
    cluster: Option<Cluster>,
    databases: Mutex<Vec<String>>,
}

/// A private cluster: its data dir and the postmaster.
#[derive(Debug)]
struct Cluster {
    dir: TempDir,
    bin: PathBuf,
    as_postgres: bool,
    child: Option<Child>,
}

impl PostgresServer {
    /// The machine's server if it answers on 127.0.0.1:5432, else a private cluster.
    ///
    /// # Errors
    /// As [`PostgresServer::start_private`] when the machine runs none.
    pub async fn start() -> Result<Self, HarnessError> {
        let url = admin_url(MACHINE_PORT);
        let probe = tokio::time::timeout(PROBE_TIMEOUT, PgConnection::connect(&url)).await;
        match probe {
            Ok(Ok(conn)) => {
                let _ = conn.close().await;
                Ok(Self {
                    port: MACHINE_PORT,
                    cluster: None,
                    databases: Mutex::new(Vec::new()),
                })
            }
            Ok(Err(e)) => {
                tracing::info!(error = %e, "no PostgreSQL on 127.0.0.1:5432; starting a private one");
                Self::start_private().await
            }
            Err(_) => Self::start_private().await,
        }
    }

    /// Creates a cluster in a temp dir with `initdb` and starts it on a free loopback port.
    ///
    /// # Errors
    /// [`HarnessError::BinaryMissing`] naming the package if the server binaries are not
    /// installed; [`HarnessError::NotReady`] with the end of its log if it does not start.
    pub async fn start_private() -> Result<Self, HarnessError> {
        let bin = locate_bin_dir()?;
        let dir = tempfile::Builder::new()
            .prefix("infera-pg-")
            .tempdir()
            .map_err(|e| HarnessError::io("creating PostgreSQL's temp dir", e))?;
        let as_postgres = running_as_root();
        let mut cluster = Cluster {
            dir,
            bin,
            as_postgres,
            child: None,
        };
        if as_postgres {
            run(
                Command::new("chown")
                    .args(["-R", USER])
                    .arg(cluster.dir.path()),
                "chown",
            )?;
        }
        let data = cluster.data_dir();
        let initdb_log = cluster.dir.path().join("initdb.log");
        let mut initdb = cluster.command("initdb");
        initdb
            .arg("-D")
            .arg(&data)
            .args(["-U", USER, "-A", "trust", "-E", "UTF8", "--no-sync"]);
        let status = spawn_logged(&mut initdb, &cluster.bin.join("initdb"), &initdb_log)?
            .wait()
            .map_err(|e| HarnessError::io("waiting for initdb", e))?;
        if !status.success() {
            return Err(HarnessError::NotReady {
                binary: "initdb",
                reason: format!("exited with {status}"),
                log_tail: log_tail(&initdb_log, 20),
            });
        }
        let port = free_port()?;
        let log = cluster.dir.path().join("postgres.log");
        let mut postgres = cluster.command("postgres");
        postgres
            .arg("-D")
            .arg(&data)
            .args(["-p", &port.to_string(), "-k"])
            .arg(cluster.dir.path())
            .args([
                "-c",
                "listen_addresses=127.0.0.1",
                "-c",
                "fsync=off",
                "-c",
                "full_page_writes=off",
            ]);
        cluster.child = Some(spawn_logged(
            &mut postgres,
            &cluster.bin.join("postgres"),
            &log,
        )?);
        let url = admin_url(port);
        wait_ready(&mut cluster.child, "postgres", &log, || {
            let url = url.clone();
            async move {
                PgConnection::connect(&url)
                    .await
                    .map(drop)
                    .map_err(|e| e.to_string())
            }
        })
        .await?;
        Ok(Self {
            port,
            cluster: Some(cluster),
            databases: Mutex::new(Vec::new()),
        })
    }

    /// Whether this is a private cluster (not the machine's server).
    pub fn is_private(&self) -> bool {
        self.cluster.is_some()
    }

    /// Creates an empty database named after `label` and returns its URL. It is dropped with
    /// the harness.
    ///
    /// # Errors
    /// [`HarnessError::Io`] if the server refuses.
    pub async fn create_database(&self, label: &str) -> Result<String, HarnessError> {
        let label: String = label
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() {
                    c.to_ascii_lowercase()
                } else {
                    '_'
                }
            })
            .take(20)
            .collect();
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        let name = format!(
            "infera_test_{label}_{}_{}_{nanos}",
            std::process::id(),
            DATABASES.fetch_add(1, Ordering::Relaxed)
        );
        let mut conn = self.admin().await?;
        sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE \"{name}\"")))
            .execute(&mut conn)
            .await
            .map_err(|e| sql_failed(&format!("creating database {name}"), e))?;
        let _ = conn.close().await;
        self.databases
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(name.clone());
        Ok(format!(
            "postgres://{USER}@{MACHINE_HOST}:{}/{name}",
            self.port
        ))
    }

    /// Drops every database [`PostgresServer::create_database`] made (also done on drop).
    ///
    /// # Errors
    /// [`HarnessError::Io`] if one cannot be dropped.
    pub async fn drop_databases(&self) -> Result<(), HarnessError> {
        let names = std::mem::take(&mut *self.databases.lock().unwrap_or_else(|p| p.into_inner()));
        if names.is_empty() {
            return Ok(());
        }
        let mut conn = self.admin().await?;
        for name in names {
            sqlx::query(sqlx::AssertSqlSafe(format!(
                "DROP DATABASE IF EXISTS \"{name}\" WITH (FORCE)"
            )))
            .execute(&mut conn)
            .await
            .map_err(|e| sql_failed(&format!("dropping database {name}"), e))?;
        }
        let _ = conn.close().await;
        Ok(())
    }

    async fn admin(&self) -> Result<PgConnection, HarnessError> {
        PgConnection::connect(&admin_url(self.port))
            .await
            .map_err(|e| sql_failed("connecting to PostgreSQL as postgres", e))
    }
}

impl Drop for PostgresServer {
    fn drop(&mut self) {
        let pending = !self
            .databases
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_empty();
        if pending && self.cluster.is_none() {
            // Drop may run inside a runtime: clean up from a thread with a runtime of its own.
            let port = self.port;
            let names =
                std::mem::take(&mut *self.databases.lock().unwrap_or_else(|p| p.into_inner()));
            let cleanup = std::thread::spawn(move || {
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build();
                if let Ok(runtime) = runtime {
                    let server = PostgresServer {
                        port,
                        cluster: None,
                        databases: Mutex::new(names),
                    };
                    if let Err(e) = runtime.block_on(server.drop_databases()) {
                        tracing::warn!(error = %e, "test databases left behind");
                    }
                }
            });
            let _ = cleanup.join();
        }
        if let Some(cluster) = self.cluster.as_mut() {
            cluster.stop();
        }
    }
}

impl Cluster {
    fn data_dir(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    /// `program` from the server's bin dir, as the `postgres` user when running as root.
    fn command(&self, program: &str) -> Command {
        let path = self.bin.join(program);
        if self.as_postgres {
            // setpriv execs the program itself, so killing the child kills the server.
            let mut command = Command::new("setpriv");
            command
                .args(["--reuid", USER, "--regid", USER, "--init-groups", "--"])
                .arg(path);
            command
        } else {
            Command::new(path)
        }
    }

    fn stop(&mut self) {
        let mut pg_ctl = self.command("pg_ctl");
        pg_ctl
            .arg("-D")
            .arg(self.data_dir())
            .args(["stop", "-m", "immediate", "-w"]);
        let _ = pg_ctl.output();
        if let Some(mut child) = self.child.take() {
            kill(&mut child);
        }
    }
}

fn admin_url(port: u16) -> String {
    format!("postgres://{USER}@{MACHINE_HOST}:{port}/postgres")
}

fn sql_failed(what: &str, e: sqlx::Error) -> HarnessError {
    HarnessError::io(what, std::io::Error::other(e))
}

fn run(command: &mut Command, what: &str) -> Result<(), HarnessError> {
    let output = command
        .output()
        .map_err(|e| HarnessError::io(format!("running {what}"), e))?;
    if output.status.success() {
        Ok(())
    } else {
        Err(HarnessError::io(
            format!("running {what}"),
            std::io::Error::other(String::from_utf8_lossy(&output.stderr).into_owned()),
        ))
    }
}

/// Whether this process runs as root (Postgres must then be started as another user).
fn running_as_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
}

/// The directory holding `initdb` and `postgres`.
fn locate_bin_dir() -> Result<PathBuf, HarnessError> {
    let has_both = |dir: &Path| dir.join("initdb").is_file() && dir.join("postgres").is_file();
    if let Some(initdb) = find_on_path("initdb") {
        let real = std::fs::canonicalize(&initdb).unwrap_or(initdb);
        if let Some(dir) = real.parent().filter(|d| has_both(d)) {
            return Ok(dir.to_owned());
        }
    }
    let mut versions: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .map(|entries| {
            entries
                .filter_map(Result::ok)
                .map(|e| e.path().join("bin"))
                .filter(|d| has_both(d))
                .collect()
        })
        .unwrap_or_default();
    versions.sort_by_key(|d| {
        d.parent()
            .and_then(|v| v.file_name())
            .and_then(|v| v.to_str())
            .and_then(|v| v.parse::<u32>().ok())
            .unwrap_or(0)
    });
    versions.pop().ok_or_else(|| HarnessError::BinaryMissing {
        binary: "postgres",
        looked_in: "127.0.0.1:5432 (no answer), PATH and /usr/lib/postgresql/*/bin".to_owned(),
        install: INSTALL,
    })
}

#[cfg(test)]
mod tests {
    use super::PostgresServer;
    use sqlx::Connection;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_private_cluster_starts_and_serves_fresh_databases() {
        let server = PostgresServer::start_private()
            .await
            .unwrap_or_else(|e| panic!("this test needs PostgreSQL's server binaries: {e}"));
        assert!(server.is_private());
        let url = server.create_database("private").await.expect("create");
        let mut conn = sqlx::PgConnection::connect(&url).await.expect("connect");
        let one: i32 = sqlx::query_scalar("SELECT 1")
            .fetch_one(&mut conn)
            .await
            .expect("query");
        assert_eq!(one, 1);
        conn.close().await.expect("close");
        server.drop_databases().await.expect("drop");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn databases_are_dropped_with_the_harness() {
        let server = PostgresServer::start().await.expect("postgres");
        let url = server.create_database("dropped").await.expect("create");
        let name = url.rsplit('/').next().expect("name").to_owned();
        let port = server.port;
        drop(server);
        let admin = super::admin_url(port);
        if let Ok(mut conn) = sqlx::PgConnection::connect(&admin).await {
            let left: i64 =
                sqlx::query_scalar("SELECT COUNT(*) FROM pg_database WHERE datname = $1")
                    .bind(&name)
                    .fetch_one(&mut conn)
                    .await
                    .expect("count");
            assert_eq!(left, 0, "database {name} was not dropped");
        }
    }
}
