//! `infera replay` and `infera trace` end to end, through the real binary on the bundled traces:
//! the table is printed, results are readable Parquet (checked with an independent reader,
//! pyarrow), `--plot` charts open in independent SVG and PNG readers (Python's XML parser and
//! zlib), runs are deterministic, and bad input fails clearly without writing anything.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn fixture(name: &str) -> PathBuf {
    root().join("fixtures/traces").join(name)
}

fn infera(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_infera"))
        .args(args)
        .env_remove("RUST_LOG")
        .output()
        .expect("run infera")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn mooncake() -> String {
    fixture("mooncake_trace_1000.parquet").display().to_string()
}

#[test]
fn replay_prints_a_ranked_table_for_a_sweep() {
    let out = infera(&[
        "replay",
        &mooncake(),
        "--sweep",
        "router-policy=round-robin,kv-aware",
        "--gpu-blocks",
        "256",
    ]);
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{}\n{}", stdout, text(&out.stderr));
    assert!(stdout.contains("1000 requests"), "{stdout}");
    assert!(stdout.contains("ideal"), "{stdout}");
    assert!(
        stdout.contains("38.0%"),
        "the unlimited-cache bound of the fixture: {stdout}"
    );
    assert!(
        stdout.contains("router-policy=round-robin") && stdout.contains("router-policy=kv-aware")
    );
    assert!(
        stdout.contains("note: bucketed timestamps spread"),
        "{stdout}"
    );
    assert!(stdout.contains("best: "), "{stdout}");
}

#[test]
fn replay_is_deterministic_for_a_seed() {
    let run = || {
        let out = infera(&[
            "replay",
            &mooncake(),
            "--router-temperature",
            "0.5",
            "--seed",
            "7",
            "--limit",
            "300",
        ]);
        assert!(out.status.success(), "{}", text(&out.stderr));
        // The last line reports wall time; everything before it must be identical.
        let s = text(&out.stdout);
        s.lines()
            .filter(|l| !l.starts_with("simulated "))
            .collect::<Vec<_>>()
            .join("\n")
    };
    assert_eq!(run(), run());
}

#[test]
fn out_writes_parquet_that_pyarrow_reads() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = dir.path().join("results.parquet");
    let res = infera(&[
        "replay",
        &mooncake(),
        "--limit",
        "200",
        "--sweep",
        "kv-overlap-weight=0,2",
        "--out",
        out.to_str().expect("utf8"),
    ]);
    assert!(res.status.success(), "{}", text(&res.stderr));
    let summary = dir.path().join("results.summary.parquet");
    let script = format!(
        "import pyarrow.parquet as pq\n\
         t = pq.read_table({:?})\n\
         s = pq.read_table({:?})\n\
         print(t.num_rows, s.num_rows, sorted(set(t.column('config').to_pylist())))\n\
         assert 'ttft_us' in t.column_names and 'hit_rate' in s.column_names\n",
        out.display().to_string(),
        summary.display().to_string()
    );
    let py = Command::new("python3")
        .args(["-c", &script])
        .output()
        .expect(
            "python3 is required for this test (an independent Parquet reader); install python3",
        );
    assert!(
        py.status.success(),
        "pyarrow failed to read the results (install it with `pip install pyarrow`): {}",
        text(&py.stderr)
    );
    let line = text(&py.stdout);
    assert!(line.starts_with("400 2 "), "{line}");
    assert!(
        line.contains("kv-overlap-weight=0") && line.contains("kv-overlap-weight=2"),
        "{line}"
    );
}

#[test]
fn malformed_trace_fails_naming_the_line_and_writes_nothing() {
    let dir = tempfile::tempdir().expect("tempdir");
    let trace = dir.path().join("bad.jsonl");
    std::fs::write(
        &trace,
        "{\"timestamp\": 0, \"input_length\": 600, \"output_length\": 5, \"hash_ids\": [1, 2]}\n\
         {\"timestamp\": 1, \"input_length\": \"many\", \"output_length\": 5, \"hash_ids\": [1]}\n",
    )
    .expect("write");
    let out = dir.path().join("r.parquet");
    let res = infera(&[
        "replay",
        trace.to_str().expect("utf8"),
        "--out",
        out.to_str().expect("utf8"),
    ]);
    assert_eq!(res.status.code(), Some(1));
    let err = text(&res.stderr);
    assert!(err.contains("bad.jsonl:2"), "{err}");
    assert_eq!(
        std::fs::read_dir(dir.path()).expect("dir").count(),
        1,
        "nothing but the trace"
    );
}

#[test]
fn non_monotonic_and_empty_traces_are_rejected() {
    let dir = tempfile::tempdir().expect("tempdir");
    let back = dir.path().join("back.jsonl");
    std::fs::write(
        &back,
        "{\"timestamp\": 5, \"input_length\": 10, \"output_length\": 5, \"hash_ids\": [1]}\n\
         {\"timestamp\": 1, \"input_length\": 10, \"output_length\": 5, \"hash_ids\": [2]}\n",
    )
    .expect("write");
    let res = infera(&["replay", back.to_str().expect("utf8")]);
    assert_eq!(res.status.code(), Some(1));
    assert!(
        text(&res.stderr).contains("back.jsonl"),
        "{}",
        text(&res.stderr)
    );
    let empty = dir.path().join("empty.jsonl");
    std::fs::write(&empty, "").expect("write");
    let res = infera(&["replay", empty.to_str().expect("utf8")]);
    assert_eq!(res.status.code(), Some(1));
    assert!(text(&res.stderr).contains("empty"), "{}", text(&res.stderr));
}

#[test]
fn bad_flags_exit_2_before_reading_anything() {
    for (args, needle) in [
        (vec!["--sweep", "warp-factor=1,2"], "cannot vary"),
        (vec!["--sweep", "workers=0"], "workers"),
        (vec!["--kv-overlap-weight=-1"], "--kv-overlap-weight"),
        (vec!["--out", "results.csv"], "--out"),
        (vec!["--plot", "chart.jpg"], "--plot"),
        (
            vec!["--retention-rule", "input_length<2048"],
            "retention rule",
        ),
        (vec!["--workers", "0"], "--workers"),
    ] {
        // A trace path that does not exist proves validation happens before reading it.
        let mut all = vec!["replay", "/nonexistent/trace.parquet"];
        all.extend(args.iter().copied());
        let res = infera(&all);
        let err = text(&res.stderr);
        assert_eq!(res.status.code(), Some(2), "{all:?}: {err}");
        assert!(err.contains(needle), "{all:?}: {err}");
        assert_eq!(err.trim().lines().count(), 1, "one line: {err}");
    }
}

#[test]
fn trace_inspect_reports_the_ideal_hit_rate_and_import_round_trips() {
    let res = infera(&[
        "trace",
        "inspect",
        fixture("conversation_trace.jsonl").to_str().expect("utf8"),
    ]);
    let s = text(&res.stdout);
    assert!(res.status.success(), "{}", text(&res.stderr));
    assert!(s.contains("12,031") && s.contains("36.6 %"), "{s}");
    let dir = tempfile::tempdir().expect("tempdir");
    let out = dir.path().join("m.parquet");
    let res = infera(&[
        "trace",
        "import",
        fixture("mooncake_trace_1000.jsonl").to_str().expect("utf8"),
        out.to_str().expect("utf8"),
    ]);
    assert!(res.status.success(), "{}", text(&res.stderr));
    let res = infera(&["trace", "inspect", out.to_str().expect("utf8")]);
    assert!(
        text(&res.stdout).contains("38.0 %"),
        "{}",
        text(&res.stdout)
    );
}

#[test]
fn plot_writes_a_chart_per_format_that_independent_readers_open() {
    let dir = tempfile::tempdir().expect("tempdir");
    for name in ["chart.svg", "chart.png"] {
        let path = dir.path().join(name);
        let res = infera(&[
            "replay",
            &mooncake(),
            "--limit",
            "100",
            "--sweep",
            "router-policy=round-robin,kv-aware",
            "--sweep",
            "kv-overlap-weight=0,1,4",
            "--plot",
            path.to_str().expect("utf8"),
        ]);
        assert!(res.status.success(), "{}", text(&res.stderr));
        assert!(text(&res.stdout).contains(&format!("wrote {}", path.display())));
    }
    // Python's own XML parser and zlib: the SVG's panels and lines, the PNG's chunks and pixels.
    let script = format!(
        "import xml.etree.ElementTree as ET, struct, zlib\n\
         ns = '{{http://www.w3.org/2000/svg}}'\n\
         svg = ET.parse({:?}).getroot()\n\
         texts = [t.text.strip() for t in svg.iter(ns + 'text') if t.text]\n\
         lines = [p.get('stroke').lower() for p in svg.iter(ns + 'polyline')]\n\
         data = open({:?}, 'rb').read()\n\
         assert data[:8] == bytes([137, 80, 78, 71, 13, 10, 26, 10])\n\
         pos, idat, size = 8, b'', None\n\
         while pos < len(data):\n\
         \x20   n, kind = struct.unpack('>I4s', data[pos:pos + 8])\n\
         \x20   body = data[pos + 8:pos + 8 + n]\n\
         \x20   assert zlib.crc32(kind + body) == struct.unpack('>I', data[pos + 8 + n:pos + 12 + n])[0]\n\
         \x20   size = struct.unpack('>II', body[:8]) if kind == b'IHDR' else size\n\
         \x20   idat += body if kind == b'IDAT' else b''\n\
         \x20   pos += 12 + n\n\
         w, h = size\n\
         assert len(zlib.decompress(idat)) == h * (1 + 3 * w)\n\
         print(w, h, svg.get('width'), svg.get('height'), texts.count('TTFT p50 (ms)'), \n\
         \x20     texts.count('router-policy:'), lines.count('#1f77b4'), lines.count('#ff7f0e'))\n",
        dir.path().join("chart.svg").display().to_string(),
        dir.path().join("chart.png").display().to_string(),
    );
    let py = Command::new("python3")
        .args(["-c", &script])
        .output()
        .expect("python3 is required for this test (independent SVG and PNG readers)");
    assert!(py.status.success(), "{}", text(&py.stderr));
    let fields: Vec<String> = text(&py.stdout)
        .split_whitespace()
        .map(str::to_owned)
        .collect();
    // Same size in both formats; one TTFT p50 panel; one legend; per policy six panels' lines
    // and a legend swatch.
    assert_eq!(fields[0], fields[2], "{fields:?}");
    assert_eq!(fields[1], fields[3], "{fields:?}");
    assert_eq!(fields[4..], ["1", "1", "7", "7"], "{fields:?}");
}

#[test]
fn every_trace_command_takes_the_trace_block_size() {
    // A Mooncake-format trace hashed in 64-token blocks: 1,000 tokens are 16 ids.
    let dir = tempfile::tempdir().expect("tempdir");
    let ids: Vec<String> = (0..16).map(|i| i.to_string()).collect();
    let mut lines = String::new();
    for t in 0..4 {
        lines.push_str(&format!(
            "{{\"timestamp\": {t}, \"input_length\": 1000, \"output_length\": 4, \"hash_ids\": [{}]}}\n",
            ids.join(", ")
        ));
    }
    let path = dir.path().join("small.jsonl");
    std::fs::write(&path, lines).expect("write");
    let trace = path.display().to_string();
    let out = infera(&["trace", "inspect", &trace]);
    let stderr = text(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("needs ceil(1000/512) = 2")
            && stderr.contains("fit a trace block size of 64"),
        "{stderr}"
    );
    let out = infera(&["trace", "inspect", &trace, "--trace-block-size", "64"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let parquet = dir.path().join("small.parquet").display().to_string();
    let out = infera(&[
        "trace",
        "import",
        &trace,
        &parquet,
        "--trace-block-size",
        "64",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let out = infera(&["replay", &trace, "--trace-block-size", "64"]);
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", text(&out.stderr));
    assert!(stdout.contains("block size 64"), "{stdout}");
    let out = infera(&["replay", &parquet, "--trace-block-size", "512"]);
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("has block size 64"),
        "{}",
        text(&out.stderr)
    );
}

/// A trace whose tenant `a` floods two workers while `b` sends a short prompt now and then.
fn tenants_trace(path: &Path) {
    use infera_replay::trace::{Trace, TraceRequest};
    let req = |i: u64, at: u64, tenant: &str, blocks: u64| TraceRequest {
        arrival_us: at,
        request_id: format!("{tenant}-{i}"),
        model: "m".into(),
        input_length: blocks as u32 * 16,
        output_length: 8,
        block_size: 16,
        block_hashes: (0..blocks).map(|b| (i + 1) * 1_000_000 + b).collect(),
        tenant: Some(tenant.to_owned()),
        ..TraceRequest::default()
    };
    let mut requests: Vec<TraceRequest> = (0..300).map(|i| req(i, i * 2_000, "a", 128)).collect();
    requests.extend((0..30).map(|i| req(10_000 + i, 5_000 + i * 20_000, "b", 4)));
    requests.sort_by_key(|r| r.arrival_us);
    let trace = Trace {
        requests,
        source: "tenants".into(),
        notes: Vec::new(),
    };
    infera_replay::trace::parquet::write_parquet(&trace, path).expect("write the trace");
}

/// The quiet tenant's TTFT p99 in milliseconds, from the per-tenant table.
fn quiet_p99(stdout: &str) -> f64 {
    let row = stdout
        .lines()
        .find(|l| l.split_whitespace().next() == Some("b"))
        .unwrap_or_else(|| panic!("no row for tenant b: {stdout}"));
    let cells: Vec<&str> = row.split_whitespace().collect();
    cells[5].trim_end_matches("ms").parse().expect("a p99")
}

#[test]
fn replay_answers_what_a_tenant_doubling_does_to_another() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tenants.parquet");
    tenants_trace(&path);
    let path = path.to_str().unwrap();
    let run = |extra: &[&str]| {
        let mut args = vec!["replay", path, "--workers", "2"];
        args.extend_from_slice(extra);
        let out = infera(&args);
        let stdout = text(&out.stdout);
        assert!(out.status.success(), "{stdout}\n{}", text(&out.stderr));
        assert!(stdout.contains("per tenant:"), "{stdout}");
        stdout
    };
    let base = run(&[]);
    let doubled = run(&["--tenant-scale", "a=2"]);
    assert!(
        doubled.contains("--tenant-scale a=2: 300 of its requests became 600"),
        "{doubled}"
    );
    let unqueued = run(&["--router-queue-threshold", "off"]);
    let (base, doubled, unqueued) = (quiet_p99(&base), quiet_p99(&doubled), quiet_p99(&unqueued));
    eprintln!("tenant b's ttft p99: {base} ms; a doubled: {doubled} ms; no queue: {unqueued} ms");
    assert!(doubled > base, "a's doubling costs b: {base} -> {doubled}");
    assert!(
        unqueued > base,
        "the queue protects b: {base} vs {unqueued}"
    );
    let bad = infera(&["replay", path, "--tenant-scale", "a"]);
    assert_eq!(bad.status.code(), Some(2));
    assert!(text(&bad.stderr).contains("NAME=FACTOR"));

    // The server's key file: a held to 60 requests a minute, b made more urgent.
    let keys = dir.path().join("keys.json");
    std::fs::write(
        &keys,
        r#"{"tenants": [
            {"name": "a", "keys": ["sk-a-0123456789abcdef"], "limits": {"requests_per_minute": 60}},
            {"name": "b", "keys": ["sk-b-0123456789abcdef"], "default_priority": -1,
             "priority_floor": -1}]}"#,
    )
    .unwrap();
    let limited = run(&["--api-keys", keys.to_str().unwrap()]);
    let row = limited
        .lines()
        .find(|l| l.split_whitespace().next() == Some("a"))
        .unwrap_or_else(|| panic!("no row for tenant a: {limited}"));
    let cells: Vec<u64> = row
        .split_whitespace()
        .skip(1)
        .take(2)
        .map(|c| c.parse().unwrap())
        .collect();
    eprintln!(
        "with a limited to 60 a minute: served {}, refused {}",
        cells[0], cells[1]
    );
    assert!(
        (60..=61).contains(&cells[0]) && cells[0] + cells[1] == 300,
        "a served about a minute's 60 and was refused the rest: {row}"
    );
    let bad_keys = dir.path().join("bad.json");
    std::fs::write(&bad_keys, r#"{"tenants": [{"name": "a"}]}"#).unwrap();
    let bad = infera(&["replay", path, "--api-keys", bad_keys.to_str().unwrap()]);
    assert!(!bad.status.success());
    assert!(
        text(&bad.stderr).contains("--api-keys"),
        "{}",
        text(&bad.stderr)
    );
}
