use super::*;
use crate::trace::{check_request, summarize};
use std::collections::HashMap;

fn small() -> SynthConfig {
    SynthConfig {
        sessions: 24,
        min_turns: 3,
        max_turns: 12,
        ..SynthConfig::default()
    }
}

fn by_session(trace: &Trace) -> HashMap<&str, Vec<&TraceRequest>> {
    let mut m: HashMap<&str, Vec<&TraceRequest>> = HashMap::new();
    for r in &trace.requests {
        m.entry(r.session_id.as_deref().expect("session id"))
            .or_default()
            .push(r);
    }
    m
}

#[test]
fn the_same_seed_gives_the_same_trace_and_another_seed_another() {
    let a = synthesize(&small()).expect("trace");
    assert_eq!(a, synthesize(&small()).expect("trace"));
    let b = synthesize(&SynthConfig { seed: 1, ..small() }).expect("trace");
    assert_ne!(a.requests, b.requests);
}

#[test]
fn adding_sessions_keeps_the_earlier_sessions_turns() {
    let a = synthesize(&small()).expect("trace");
    let b = synthesize(&SynthConfig {
        sessions: 30,
        ..small()
    })
    .expect("trace");
    let (a, b) = (by_session(&a), by_session(&b));
    for (s, turns) in &a {
        let other = &b[s];
        assert_eq!(turns.len(), other.len(), "{s}");
        for (x, y) in turns.iter().zip(other) {
            assert_eq!(
                (x.input_length, &x.block_hashes, x.think_time_us),
                (y.input_length, &y.block_hashes, y.think_time_us)
            );
        }
    }
}

#[test]
fn every_row_is_valid_and_in_arrival_order() {
    let trace = synthesize(&small()).expect("trace");
    let mut prev = None;
    for r in &trace.requests {
        check_request(r, prev).expect("valid row");
        assert_eq!(r.block_hashes.len() as u32, r.input_length / r.block_size);
        prev = Some(r.arrival_us);
    }
}

#[test]
fn each_turn_extends_its_predecessor_after_its_think_time() {
    let cfg = small();
    let trace = synthesize(&cfg).expect("trace");
    let sessions = by_session(&trace);
    assert_eq!(sessions.len(), cfg.sessions);
    for (s, turns) in sessions {
        assert!(turns.len() <= cfg.max_turns as usize, "{s}");
        assert_eq!(turns[0].think_time_us, None, "{s}: first turn");
        for (t, pair) in turns.windows(2).enumerate() {
            let (prev, next) = (pair[0], pair[1]);
            assert_eq!(next.request_id, format!("{s}-t{:03}", t + 1));
            let think = next.think_time_us.expect("later turns think");
            // The prompt is the previous prompt, the answer and at least one new token.
            assert!(next.input_length > prev.input_length + prev.output_length);
            assert!(next.block_hashes.starts_with(&prev.block_hashes), "{s}");
            assert!(next.arrival_us >= prev.arrival_us + think + NOMINAL_FIRST_TOKEN_US);
            assert!(next.input_length <= cfg.max_context_tokens);
        }
    }
}

#[test]
fn sessions_share_the_tool_definitions_and_their_system_prompt_only() {
    let cfg = SynthConfig {
        system_prompts: 2,
        ..small()
    };
    let trace = synthesize(&cfg).expect("trace");
    let bs = cfg.block_size as usize;
    let tools = cfg.tool_tokens as usize / bs;
    let shared = (cfg.tool_tokens + cfg.system_tokens) as usize / bs;
    let firsts: Vec<&TraceRequest> = trace
        .requests
        .iter()
        .filter(|r| r.think_time_us.is_none())
        .collect();
    let common = |a: &TraceRequest, b: &TraceRequest| {
        a.block_hashes
            .iter()
            .zip(&b.block_hashes)
            .take_while(|(x, y)| x == y)
            .count()
    };
    let mut same_system = 0;
    for (i, a) in firsts.iter().enumerate() {
        for b in &firsts[i + 1..] {
            let c = common(a, b);
            assert!(c == tools || c == shared, "sessions share {c} blocks");
            same_system += usize::from(c == shared);
        }
    }
    assert!(
        same_system > 0,
        "two of 24 sessions use the same of 2 prompts"
    );
}

#[test]
fn the_defaults_reuse_most_of_the_prompt() {
    let trace = synthesize(&SynthConfig::default()).expect("trace");
    let summary = summarize(&trace);
    assert!(
        summary.ideal_hit_rate > 0.9,
        "ideal hit rate {}",
        summary.ideal_hit_rate
    );
}

#[test]
fn bad_settings_are_named() {
    let cases = [
        (
            SynthConfig {
                sessions: 0,
                ..small()
            },
            "sessions",
        ),
        (
            SynthConfig {
                concurrency: 0.0,
                ..small()
            },
            "concurrency",
        ),
        (
            SynthConfig {
                min_turns: 5,
                max_turns: 2,
                ..small()
            },
            "turns",
        ),
        (
            SynthConfig {
                block_size: 0,
                ..small()
            },
            "block size",
        ),
        (
            SynthConfig {
                tool_call_fraction: 1.5,
                ..small()
            },
            "tool-call",
        ),
        (
            SynthConfig {
                user_think_s: -1.0,
                ..small()
            },
            "user think",
        ),
        (
            SynthConfig {
                max_context_tokens: 100,
                ..small()
            },
            "max context",
        ),
    ];
    for (cfg, needle) in cases {
        let err = synthesize(&cfg).expect_err(needle).to_string();
        assert!(err.contains(needle), "{err}");
    }
}

#[test]
fn adapters_share_tool_tokens_but_not_their_blocks() {
    let trace = synthesize(&SynthConfig {
        adapters: 8,
        ..small()
    })
    .expect("trace");
    let sessions = by_session(&trace);
    let mut adapters = std::collections::BTreeSet::new();
    for turns in sessions.values() {
        let lora = turns[0]
            .lora
            .as_deref()
            .expect("every turn names its adapter");
        assert!(turns.iter().all(|t| t.lora.as_deref() == Some(lora)));
        assert_eq!(turns[0].model, "default", "the base model stays the model");
        adapters.insert(lora);
    }
    assert!(adapters.len() > 1 && adapters.iter().all(|a| a.starts_with("adapter-")));
    // Two sessions of different adapters: the same tool-definition tokens, other blocks.
    let first = |a: &str| {
        sessions
            .values()
            .find(|t| t[0].lora.as_deref() == Some(a))
            .expect("a session")[0]
    };
    let mut names = adapters.iter();
    let (a, b) = (first(names.next().unwrap()), first(names.next().unwrap()));
    assert_eq!(a.block_hashes[0], b.block_hashes[0]);
    assert_ne!(a.engine_blocks()[0], b.engine_blocks()[0]);
    let plain = synthesize(&small()).expect("trace");
    assert!(summarize(&trace).ideal_hit_rate < summarize(&plain).ideal_hit_rate);
}

#[test]
fn images_are_the_same_tokens_but_blocks_of_their_own() {
    let cfg = SynthConfig {
        images: 4,
        system_prompts: 1,
        ..small()
    };
    let trace = synthesize(&cfg).expect("trace");
    let sessions = by_session(&trace);
    let first_block_of_image = ((cfg.tool_tokens + cfg.system_tokens) / cfg.block_size) as usize;
    let mut by_image = std::collections::BTreeMap::<&str, Vec<&TraceRequest>>::new();
    for turns in sessions.values() {
        let image = &turns[0].images[..];
        assert_eq!(image.len(), 1, "one image per session");
        assert_eq!(image[0].length, cfg.image_tokens);
        assert!(turns.iter().all(|t| t.images == image), "on every turn");
        by_image.entry(&image[0].id).or_default().push(turns[0]);
    }
    assert!(by_image.len() > 1);
    let mut firsts = by_image.values().map(|s| s[0]);
    let (a, b) = (firsts.next().unwrap(), firsts.next().unwrap());
    // Another image: the same placeholder tokens, other blocks from the image on.
    let last = first_block_of_image + 1;
    assert_eq!(a.block_hashes[..=last], b.block_hashes[..=last]);
    assert_eq!(
        a.engine_blocks()[..first_block_of_image],
        b.engine_blocks()[..first_block_of_image]
    );
    assert_ne!(a.engine_blocks()[last], b.engine_blocks()[last]);
    // The same image in two sessions: shared through the image.
    let same = by_image
        .values()
        .find(|s| s.len() > 1)
        .expect("a repeated image");
    assert_eq!(same[0].engine_blocks()[last], same[1].engine_blocks()[last]);
    let plain = synthesize(&SynthConfig {
        system_prompts: 1,
        ..small()
    })
    .expect("trace");
    assert!(summarize(&trace).ideal_hit_rate < summarize(&plain).ideal_hit_rate);
}
