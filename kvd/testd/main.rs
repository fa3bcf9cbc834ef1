//! `infera-kvd-testd`: the daemon with its L3 tier, for tests that must kill a real process
//! (`kvd/tests/crash.rs`). Not a user-facing binary: `infera kvd` is.
//!
//! Usage: `infera-kvd-testd SOCKET L3_DIR L3_BYTES MAX_BYTES IO_MODE URING CHECKPOINT_MS
//! DURABLE`, with `IO_MODE` one of `auto|direct|buffered`, `URING` `0|1` and `DURABLE` `0|1`
//! (`--durable-long-writes`). Prints `ready` on stdout once it
//! listens; stops on SIGTERM (gracefully) or SIGKILL (not).

use infera_kvd::{IoMode, KvdOptions, LongBackendConfig, TablespaceConfig};
use std::process::ExitCode;
use std::time::Duration;

fn parse(args: &[String]) -> Result<KvdOptions, String> {
    let [
        _,
        socket,
        dir,
        l3_bytes,
        max_bytes,
        mode,
        uring,
        checkpoint_ms,
        durable,
    ] = args
    else {
        return Err(
            "usage: infera-kvd-testd SOCKET L3_DIR L3_BYTES MAX_BYTES IO_MODE URING CHECKPOINT_MS \
             DURABLE"
                .into(),
        );
    };
    let number = |s: &str| s.parse::<u64>().map_err(|e| format!("{s}: {e}"));
    let mut ts = TablespaceConfig::new(vec![dir.into()], number(l3_bytes)?);
    ts.io_mode = match mode.as_str() {
        "auto" => IoMode::Auto,
        "direct" => IoMode::Direct,
        "buffered" => IoMode::Buffered,
        other => return Err(format!("unknown io mode {other}")),
    };
    ts.io_uring = uring == "1";
    ts.durable_writes = durable == "1";
    ts.container_bytes = 16 << 20;
    ts.workers_per_shard = 4;
    let mut options = KvdOptions::new(socket, number(max_bytes)?);
    options.long = Some(LongBackendConfig::Tablespace(ts));
    options.checkpoint_interval = Duration::from_millis(number(checkpoint_ms)?.max(1));
    options.server_id = Some("kvd-testd".into());
    Ok(options)
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let options = match parse(&args) {
        Ok(o) => o,
        Err(e) => {
            eprintln!("infera-kvd-testd: {e}");
            return ExitCode::from(2);
        }
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("infera-kvd-testd: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async {
        let mut terminate =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
                .map_err(|e| e.to_string())?;
        let server = infera_kvd::KvdServer::bind(options)
            .await
            .map_err(|e| e.to_string())?;
        let stop = server.shutdown_handle();
        println!("ready");
        let serving = server.serve();
        tokio::pin!(serving);
        tokio::select! {
            r = &mut serving => return r.map_err(|e| e.to_string()),
            _ = terminate.recv() => stop.shutdown(),
        }
        serving.await.map_err(|e| e.to_string())
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("infera-kvd-testd: {e}");
            ExitCode::FAILURE
        }
    }
}
