//! `infera replay --shard I/N` and `infera replay merge` through the real binary: a `--tune`
//! sweep cut in slices that run as separate processes merges into the unsharded run's table,
//! Pareto front and files, row for row (read back with an independent reader, pyarrow); a
//! missing or foreign slice fails the merge, naming it; bad slices fail before any work.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};

fn mooncake() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/traces/mooncake_trace_1000.parquet")
}

fn infera() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_infera"));
    c.env_remove("RUST_LOG");
    c
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn finished(out: Output) -> String {
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", text(&out.stderr));
    stdout
}

/// The sweep of the tests: `--tune` over two axes (12 configurations) of 300 requests.
fn sweep_args(out: &Path) -> Vec<String> {
    let mut args: Vec<String> = [
        "replay",
        "--limit",
        "300",
        "--gpu-blocks",
        "512",
        "--workers",
        "4",
        "--tune",
        "--sweep",
        "kv-overlap-weight=0,1,4",
        "--sweep",
        "router-balance-tokens=0,256,512,1024",
        "--threads",
        "1",
        "--out",
    ]
    .map(str::to_owned)
    .to_vec();
    args.push(out.display().to_string());
    args.push(mooncake().display().to_string());
    args
}

/// What a run printed about its results, without the lines that name files or times.
fn results(stdout: &str) -> String {
    stdout
        .lines()
        .filter(|l| {
            ![
                "trace:",
                "note:",
                "fleet:",
                "simulated ",
                "merged ",
                "wrote ",
                "slice ",
            ]
            .iter()
            .any(|p| l.starts_with(p))
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// Both files of `a` and `b` hold the same rows, columns and footers (pyarrow).
fn assert_same_files(a: &Path, b: &Path) {
    let script = format!(
        "import pyarrow.parquet as pq\n\
         for a, b in [({a:?}, {b:?}), ({sa:?}, {sb:?})]:\n\
         \x20   ta, tb = pq.read_table(a), pq.read_table(b)\n\
         \x20   assert ta.num_rows > 0\n\
         \x20   assert ta.equals(tb), (a, ta.num_rows, tb.num_rows)\n\
         \x20   ma, mb = pq.read_metadata(a).metadata, pq.read_metadata(b).metadata\n\
         \x20   assert ma[b'infera.replay.sweep'] == mb[b'infera.replay.sweep'], (ma, mb)\n\
         \x20   print(a, ta.num_rows)\n",
        a = a.display().to_string(),
        b = b.display().to_string(),
        sa = a.with_extension("summary.parquet").display().to_string(),
        sb = b.with_extension("summary.parquet").display().to_string(),
    );
    let py = Command::new("python3")
        .args(["-c", &script])
        .output()
        .expect("python3 (with pyarrow) reads the results independently");
    assert!(
        py.status.success(),
        "the merged files differ from the unsharded run's:\n{}{}",
        text(&py.stdout),
        text(&py.stderr)
    );
}

#[test]
fn slices_run_as_processes_merge_into_the_unsharded_run() {
    let dir = tempfile::tempdir().unwrap();
    let whole = dir.path().join("whole.parquet");
    let slices = dir.path().join("slices");
    std::fs::create_dir(&slices).unwrap();
    let unsharded = finished(infera().args(sweep_args(&whole)).output().unwrap());
    assert!(unsharded.contains("Pareto front ("), "{unsharded}");

    let count = 3;
    let children: Vec<Child> = (0..count)
        .map(|i| {
            let mut args = sweep_args(&slices.join(format!("slice-{i}.parquet")));
            args.extend(["--shard".into(), format!("{i}/{count}")]);
            infera()
                .args(args)
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    for child in children {
        let out = finished(child.wait_with_output().unwrap());
        assert!(out.contains("4 of the sweep's 12 configurations"), "{out}");
        assert!(
            !out.contains("Pareto front ("),
            "a slice has no front: {out}"
        );
    }

    let merged = dir.path().join("merged.parquet");
    let out = finished(
        infera()
            .args(["replay", "merge", "--out"])
            .arg(&merged)
            .arg(&slices)
            .output()
            .unwrap(),
    );
    assert!(
        out.starts_with("merged 3 slice file(s) of a sweep of 12 configuration(s)"),
        "{out}"
    );
    assert_eq!(results(&out), results(&unsharded));
    assert_same_files(&whole, &merged);

    // A missing slice is named, and nothing is written.
    std::fs::remove_file(slices.join("slice-1.parquet")).unwrap();
    let partial = dir.path().join("partial.parquet");
    let out = infera()
        .args(["replay", "merge", "--out"])
        .arg(&partial)
        .arg(slices.join("slice-0.parquet"))
        .arg(slices.join("slice-2.summary.parquet"))
        .output()
        .unwrap();
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("missing slices: 1/3"), "{stderr}");
    assert!(!partial.exists());

    // A slice of another sweep (other flags) is refused.
    let mut args = sweep_args(&slices.join("slice-1.parquet"));
    args.extend(["--shard".into(), "1/3".into(), "--seed".into(), "5".into()]);
    finished(infera().args(args).output().unwrap());
    let out = infera()
        .args(["replay", "merge"])
        .arg(&slices)
        .output()
        .unwrap();
    let stderr = text(&out.stderr);
    assert!(stderr.contains("comes from another sweep"), "{stderr}");
}

#[test]
fn bad_slices_fail_before_any_work() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("s.parquet");
    for (extra, says) in [
        (vec!["--shard", "3/3"], "is not I/N"),
        (vec!["--shard", "0/0"], "is not I/N"),
        (
            vec!["--shard", "0/2", "--plot", "x.svg"],
            "cannot be used with",
        ),
    ] {
        let mut args = sweep_args(&out);
        args.extend(extra.iter().map(|s| s.to_string()));
        let res = infera().args(&args).output().unwrap();
        let stderr = text(&res.stderr);
        assert_eq!(res.status.code(), Some(2), "{extra:?}: {stderr}");
        assert!(stderr.contains(says), "{extra:?}: {stderr}");
    }
    let res = infera()
        .args(["replay", "--shard", "0/2"])
        .arg(mooncake())
        .output()
        .unwrap();
    assert_eq!(res.status.code(), Some(2));
    assert!(text(&res.stderr).contains("--out"), "{}", text(&res.stderr));
    assert!(!out.exists());
    let res = infera().args(["replay", "merge"]).output().unwrap();
    assert_eq!(res.status.code(), Some(2), "merge without slices");
}
