use super::*;
use crate::cli::{Cli, Command};
use clap::Parser;

fn args(extra: &[&str]) -> BenchArgs {
    let argv = [
        "infera",
        "bench",
        "t.jsonl",
        "--target",
        "http://127.0.0.1:9",
    ]
    .iter()
    .chain(extra)
    .copied();
    match Cli::try_parse_from(argv).unwrap().command {
        Command::Bench(a) => a,
        _ => panic!("not bench"),
    }
}

#[test]
fn the_target_is_normalised_and_checked() {
    let s = validate(&args(&[])).unwrap();
    assert_eq!(s.uri.to_string(), "http://127.0.0.1:9/v1/completions");
    let mut a = args(&["--api", "chat"]);
    a.target = "http://h:1/v1/".into();
    assert_eq!(
        validate(&a).unwrap().uri.to_string(),
        "http://h:1/v1/chat/completions"
    );
    a.target = "https://h".into();
    assert!(validate(&a).unwrap_err().to_string().contains("http://"));
    for bad in [
        &["--speedup", "0"][..],
        &["--max-concurrency", "0"],
        &["--duration=-1"],
        &["--limit", "0"],
        &["--max-tokens", "0"],
        &["--timeout", "0"],
        &["--out", "x.csv"],
    ] {
        assert!(validate(&args(bad)).is_err(), "{bad:?}");
    }
}

#[test]
fn session_turns_leave_the_timeline_and_follow_their_predecessor() {
    let req = |arrival_us, session: &str, think_time_us| TraceRequest {
        arrival_us,
        request_id: "r".into(),
        model: "m".into(),
        input_length: 4,
        output_length: 2,
        block_size: 4,
        block_hashes: vec![1],
        token_ids: None,
        session_id: Some(session.to_owned()),
        retention: None,
        ttl_seconds: None,
        think_time_us,
        lora: None,
        cache_salt: None,
        images: Vec::new(),
        tenant: None,
        priority: None,
    };
    let trace = vec![
        req(0, "a", None),
        req(1_000_000, "b", None),
        req(2_000_000, "a", Some(400_000)),
        req(3_000_000, "a", Some(800_000)),
    ];
    let play = Play::new(&trace, &args(&["--speedup", "2"]));
    let timeline: Vec<usize> = plan(&trace, &play).iter().map(|p| p.index).collect();
    assert_eq!(timeline, [0, 1]);
    assert_eq!(play.next(&trace, 0), Some((2, Duration::from_millis(200))));
    assert_eq!(play.next(&trace, 2), Some((3, Duration::from_millis(400))));
    assert_eq!(play.next(&trace, 1), None);
    let limited = Play::new(&trace, &args(&["--limit", "3"]));
    assert_eq!(limited.next(&trace, 2), None, "--limit stops the session");
    let open = Play::new(&trace, &args(&["--playback", "timeline"]));
    assert_eq!(plan(&trace, &open).len(), 4);
    assert_eq!(open.next(&trace, 0), None);
}

#[test]
fn the_plan_follows_the_trace_timeline() {
    let req = |arrival_us| TraceRequest {
        arrival_us,
        request_id: "r".into(),
        model: "m".into(),
        input_length: 4,
        output_length: 2,
        block_size: 4,
        block_hashes: vec![1],
        token_ids: None,
        session_id: None,
        retention: None,
        ttl_seconds: None,
        think_time_us: None,
        lora: None,
        cache_salt: None,
        images: Vec::new(),
        tenant: None,
        priority: None,
    };
    let trace: Vec<TraceRequest> = [5_000_000, 6_000_000, 9_000_000, 25_000_000]
        .into_iter()
        .map(req)
        .collect();
    let due = |a: &BenchArgs| -> Vec<u64> {
        plan(&trace, &Play::new(&trace, a))
            .iter()
            .map(|p| p.scheduled_us)
            .collect()
    };
    assert_eq!(
        due(&args(&["--speedup", "2"])),
        vec![0, 500_000, 2_000_000, 10_000_000]
    );
    assert_eq!(
        due(&args(&["--speedup", "2", "--duration", "5"])),
        vec![0, 500_000, 2_000_000]
    );
    assert_eq!(due(&args(&["--limit", "2"])), vec![0, 1_000_000]);
    let shape = Shape {
        api: Api::Chat,
        model: Some("mock".into()),
        max_tokens: None,
        ignore_eos: true,
        uri: "http://h/v1/chat/completions".parse().unwrap(),
        timeout: Duration::from_secs(1),
    };
    let v: serde_json::Value = serde_json::from_slice(&body(&shape, &trace[0], 0)).unwrap();
    assert_eq!(v["model"], "mock");
    assert_eq!(v["max_tokens"], 2);
    assert_eq!(v["stream_options"]["include_usage"], true);
    assert_eq!(
        v["messages"][0]["content"]
            .as_str()
            .unwrap()
            .split(' ')
            .count(),
        5
    );
    // An adapter's salted row names its adapter, unless --model overrides it, and its salt.
    let mut row = trace[0].clone();
    row.lora = Some("sql".into());
    row.cache_salt = Some("tenant-a".into());
    let v: serde_json::Value = serde_json::from_slice(&body(&shape, &row, 0)).unwrap();
    assert_eq!(
        (&v["model"], &v["cache_salt"]),
        (&"mock".into(), &"tenant-a".into())
    );
    let own = Shape {
        model: None,
        ..shape
    };
    let v: serde_json::Value = serde_json::from_slice(&body(&own, &row, 0)).unwrap();
    assert_eq!(v["model"], "sql");
    assert!(
        body(&own, &trace[0], 0)
            .windows(10)
            .all(|w| w != b"cache_salt")
    );
}
