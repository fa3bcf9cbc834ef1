//! A real engine as a child process: spawned in its own process group, probed until healthy,
//! drained by watching its own queue gauges, and stopped with SIGTERM then SIGKILL to the whole
//! group (engines fork workers per GPU; none may outlive the launcher's shutdown). A launcher
//! killed outright still takes its engine with it: the engine gets SIGTERM on the launcher's death.

use super::launch::LaunchPlan;
use super::probe::{Probe, gauge_sum, label_value};
use crate::config::worker::EngineKind;
use anyhow::{Context as _, bail};
use rustix::process::{Pid, Signal, kill_process_group};
use std::process::{ExitStatus, Stdio};
use std::time::Duration;
use tokio::process::{Child, Command};
use tokio::time::Instant;

/// How long the engine may take to exit after SIGTERM before its group is killed.
pub const STOP_GRACE: Duration = Duration::from_secs(30);
/// Gauges whose sum is the engine's in-flight work, across the engines' spellings.
const IN_FLIGHT_GAUGES: &[&str] = &[
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "sglang:num_running_reqs",
    "sglang:num_queue_reqs",
];

/// The running engine.
#[derive(Debug)]
pub struct EngineProcess {
    child: Child,
    pgid: Pid,
    probe: Probe,
    engine: EngineKind,
    status: Option<ExitStatus>,
}

/// Makes the engine receive SIGTERM when the launcher dies without stopping it (SIGKILL, OOM
/// kill, a panic that aborts): an engine outliving its launcher holds GPUs and a port with no
/// registration in front of it. SIGTERM rather than SIGKILL so the engine still stops its own
/// per-GPU workers. The signal follows the thread that spawned the child; engines are spawned
/// from the runtime's worker threads, which live as long as the launcher. A launcher that died
/// between `fork` and the `prctl` is caught by the parent check, and the engine never execs.
fn die_with_launcher(command: &mut Command) {
    let launcher = rustix::process::getpid();
    let hook = move || -> std::io::Result<()> {
        rustix::process::set_parent_process_death_signal(Some(Signal::TERM))?;
        if rustix::process::getppid() != Some(launcher) {
            return Err(rustix::io::Errno::SRCH.into());
        }
        Ok(())
    };
    // SAFETY: the hook runs in the forked child before `exec`; it makes two system calls
    // (prctl, getppid) and builds an error without allocating, all async-signal-safe.
    #[allow(unsafe_code)]
    unsafe {
        command.pre_exec(hook);
    }
}

impl EngineProcess {
    /// Starts the engine of `plan` in a new process group, its output going to ours.
    ///
    /// # Errors
    /// The executable cannot be started.
    pub fn spawn(
        engine: EngineKind,
        plan: &LaunchPlan,
        bind_host: &str,
        port: u16,
    ) -> anyhow::Result<Self> {
        let mut command = Command::new(&plan.program);
        command
            .args(&plan.args)
            .envs(plan.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .process_group(0);
        die_with_launcher(&mut command);
        let child = command
            .spawn()
            .with_context(|| format!("cannot start the {engine} engine `{}`", plan.program))?;
        let pid = child
            .id()
            .and_then(|id| i32::try_from(id).ok())
            .and_then(Pid::from_raw)
            .context("the engine process has no pid")?;
        tracing::info!(%engine, pid = pid.as_raw_nonzero().get(), program = %plan.program,
            args = ?plan.args, env = ?plan.env, "engine started");
        Ok(Self {
            child,
            pgid: pid,
            probe: Probe::new(bind_host, port),
            engine,
            status: None,
        })
    }

    /// Waits until `GET /health` answers 200.
    ///
    /// # Errors
    /// The engine exited first, or `timeout` passed.
    pub async fn wait_ready(&mut self, timeout: Duration) -> anyhow::Result<()> {
        let started = Instant::now();
        let deadline = started + timeout;
        let mut pause = Duration::from_millis(100);
        let mut last_log = started;
        loop {
            if self.probe.healthy().await {
                tracing::info!(engine = %self.engine, url = self.probe.base(),
                    waited_ms = started.elapsed().as_millis(), "engine ready");
                return Ok(());
            }
            let now = Instant::now();
            if now >= deadline {
                bail!(
                    "the {} engine did not answer GET {}/health within {timeout:?} \
                     (--engine-ready-timeout)",
                    self.engine,
                    self.probe.base()
                );
            }
            if now.duration_since(last_log) >= Duration::from_secs(30) {
                tracing::info!(engine = %self.engine, elapsed_s = started.elapsed().as_secs(),
                    "waiting for the engine to become healthy");
                last_log = now;
            }
            tokio::select! {
                status = self.child.wait() => {
                    let status = status.context("cannot wait for the engine")?;
                    self.status = Some(status);
                    bail!("the {} engine exited before it was ready ({status})", self.engine);
                }
                () = tokio::time::sleep(pause.min(deadline - now)) => {}
            }
            pause = (pause * 2).min(Duration::from_secs(2));
        }
    }

    /// The KV block size the running engine uses, where it says: vLLM's
    /// `vllm:cache_config_info{block_size}` metric (vLLM resolves its block size only after
    /// loading the model), SGLang's `page_size` in `/get_server_info`. `fallback` otherwise.
    pub async fn resolve_block_size(&self, fallback: Option<u32>) -> Option<u32> {
        let timeout = Duration::from_secs(10);
        let resolved = match self.engine {
            EngineKind::Vllm => match self.probe.get("/metrics", timeout).await {
                Ok((200, page)) => label_value(&page, "vllm:cache_config_info", "block_size")
                    .and_then(|v| v.parse::<u32>().ok()),
                _ => None,
            },
            EngineKind::Sglang => match self.probe.get("/get_server_info", timeout).await {
                Ok((200, body)) => serde_json::from_str::<serde_json::Value>(&body)
                    .ok()
                    .and_then(|info| info.get("page_size")?.as_u64())
                    .and_then(|size| u32::try_from(size).ok()),
                _ => None,
            },
            EngineKind::Atom | EngineKind::Mock => None,
        };
        match (resolved, fallback) {
            (Some(size), Some(asked)) if size != asked => {
                tracing::info!(
                    resolved = size,
                    asked,
                    "the engine resolved another block size than its command line; registering it"
                );
            }
            (None, _) => tracing::info!(block_size = ?fallback,
                "block size not reported by the engine; registering the command-line value"),
            _ => {}
        }
        resolved.filter(|size| *size > 0).or(fallback)
    }

    /// Waits until the engine reports no running or queued request, it exits, or `timeout`
    /// passes. Without readable queue gauges it waits the whole timeout.
    pub async fn drain(&mut self, timeout: Duration) {
        if timeout.is_zero() || self.status.is_some() {
            return;
        }
        let deadline = Instant::now() + timeout;
        let mut warned = false;
        loop {
            let in_flight = match self.probe.get("/metrics", Duration::from_secs(2)).await {
                Ok((200, page)) => gauge_sum(&page, IN_FLIGHT_GAUGES),
                _ => None,
            };
            match in_flight {
                Some(n) if n <= 0.0 => {
                    tracing::info!(engine = %self.engine, "engine drained");
                    return;
                }
                Some(n) => tracing::debug!(in_flight = n, "draining"),
                None if !warned => {
                    warned = true;
                    tracing::warn!(engine = %self.engine,
                        "the engine's queue gauges are unreadable; waiting the whole drain timeout");
                }
                None => {}
            }
            let now = Instant::now();
            if now >= deadline {
                tracing::warn!(engine = %self.engine, in_flight = ?in_flight,
                    "drain timeout reached; stopping the engine with work in flight");
                return;
            }
            tokio::select! {
                status = self.child.wait() => {
                    self.status = status.ok();
                    return;
                }
                () = tokio::time::sleep(Duration::from_millis(200).min(deadline - now)) => {}
            }
        }
    }

    /// Completes when the engine exits on its own.
    pub async fn exited(&mut self) -> std::io::Result<ExitStatus> {
        if let Some(status) = self.status {
            return Ok(status);
        }
        let status = self.child.wait().await?;
        self.status = Some(status);
        Ok(status)
    }

    /// SIGTERM to the engine's group, then SIGKILL after `grace`; returns the exit status.
    pub async fn stop(mut self, grace: Duration) -> Option<ExitStatus> {
        if let Some(status) = self.status {
            self.kill_group(Signal::KILL);
            return Some(status);
        }
        self.kill_group(Signal::TERM);
        let status = match tokio::time::timeout(grace, self.child.wait()).await {
            Ok(status) => status.ok(),
            Err(_) => {
                tracing::warn!(engine = %self.engine, ?grace,
                    "engine did not exit after SIGTERM; killing its process group");
                self.kill_group(Signal::KILL);
                self.child.wait().await.ok()
            }
        };
        // Whatever the engine forked and left behind goes with it.
        self.kill_group(Signal::KILL);
        tracing::info!(engine = %self.engine, ?status, "engine stopped");
        status
    }

    fn kill_group(&self, signal: Signal) {
        if let Err(e) = kill_process_group(self.pgid, signal)
            && e != rustix::io::Errno::SRCH
        {
            tracing::warn!(error = %e, ?signal, "cannot signal the engine's process group");
        }
    }
}
