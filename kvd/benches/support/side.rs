//! A store's own Python client beside kvd in the L4 throughput benches (`l4_mooncake`,
//! `l4_s3`): its script runs in one process for the whole bench and plays one round per
//! request, so its rounds and kvd's alternate and whatever the machine does at a moment (the
//! store's own work, another process) touches both alike.
//!
//! The script defines `play(size)`, one round of blocks of `size` bytes, returning the seconds
//! each of its ways took; its configuration is `sys.argv[1]` (JSON).

use crate::timed::Times;
use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};

/// Reads sizes from stdin, one per line, and answers each with `play`'s times as JSON.
const SERVE: &str = "
import json as _json, sys as _sys
for _line in _sys.stdin:
    print(_json.dumps(play(int(_line))), flush=True)
";

/// The running script.
pub struct Side {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl Side {
    /// Starts `script` with `config` (`$INFERA_PYTHON`, else `python3`).
    pub fn start(script: &str, config: &serde_json::Value) -> Self {
        let mut child =
            Command::new(std::env::var("INFERA_PYTHON").unwrap_or_else(|_| "python3".into()))
                .arg("-c")
                .arg(format!("{script}\n{SERVE}"))
                .arg(config.to_string())
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .spawn()
                .expect("python3 starts");
        let stdin = child.stdin.take().unwrap();
        let stdout = BufReader::new(child.stdout.take().unwrap());
        Self {
            child,
            stdin,
            stdout,
        }
    }

    /// One round of `size`-byte blocks, each way's seconds added to `times`.
    pub fn round(&mut self, size: usize, times: &mut Times) {
        writeln!(self.stdin, "{size}").unwrap();
        let mut line = String::new();
        self.stdout.read_line(&mut line).unwrap();
        assert!(
            !line.is_empty(),
            "the store's client stopped (its error is above)"
        );
        let round: HashMap<String, f64> = serde_json::from_str(&line).unwrap();
        for (way, secs) in round {
            times.push(&way, secs);
        }
    }
}

impl Drop for Side {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
