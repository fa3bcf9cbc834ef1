//! Session affinity (`affinity`): where a named conversation's next request goes.

use super::*;

const TTL_S: u64 = 600;

fn router(mode: AffinityMode, seed: u64) -> Router {
    Router::new(RouterConfig {
        seed,
        sessions: SessionAffinity {
            mode,
            ttl_s: TTL_S,
            saturation: 4.0,
        },
        ..RouterConfig::default()
    })
}

fn in_session(id: &str, tokens: &[u32], session: &str) -> RouteRequest {
    RouteRequest {
        session: Some(SessionKey::of(session)),
        ..request(id, tokens)
    }
}

/// Four idle workers whose engines publish no KV events: every request's cost ties. A session's
/// second request with an unrelated prompt: where its first went, and where it went.
fn second_turn(mode: AffinityMode, seed: u64) -> (WorkerRank, WorkerRank) {
    let mut w = World::new(&[
        ("a:1", Role::Mixed),
        ("b:1", Role::Mixed),
        ("c:1", Role::Mixed),
        ("d:1", Role::Mixed),
    ]);
    let mut r = router(mode, seed);
    let first = serve(&mut w, &mut r, &in_session("t1", &[1; 32], "s"), 1_000);
    let second = serve(&mut w, &mut r, &in_session("t2", &[2; 32], "s"), 2_000_000);
    (first, second)
}

#[test]
fn a_session_wins_the_ties_of_kv_aware_routing_by_default() {
    assert_eq!(SessionAffinity::default().mode, AffinityMode::TieBreak);
    for seed in 0..16 {
        let (first, second) = second_turn(AffinityMode::default(), seed);
        assert_eq!(first, second, "seed {seed}");
    }
    // Without it the tie is a draw.
    assert!((0..16).any(|seed| {
        let (first, second) = second_turn(AffinityMode::Off, seed);
        first != second
    }));
}

/// Two workers; the session's first turn lands on `a:1` (which then holds it), and `b:1` holds
/// the whole prompt of its next request. Where that request goes.
fn cache_elsewhere(mode: AffinityMode) -> WorkerRank {
    let mut w = World::new(&[("a:1", Role::Mixed), ("b:1", Role::Mixed)]);
    let mut r = router(mode, 0);
    let mut first = in_session("t1", &[1; 32], "s");
    first.exclude = vec![WorkerRank::new("b:1", 0)];
    assert_eq!(
        serve(&mut w, &mut r, &first, 1_000),
        WorkerRank::new("a:1", 0)
    );
    let tokens: Vec<u32> = (0..64).collect();
    w.store("b:1", &hash_blocks(&tokens, 4, None));
    serve(&mut w, &mut r, &in_session("t2", &tokens, "s"), 2_000_000)
}

#[test]
fn the_cache_outweighs_a_session_unless_it_overrides() {
    assert_eq!(
        cache_elsewhere(AffinityMode::TieBreak),
        WorkerRank::new("b:1", 0)
    );
    assert_eq!(
        cache_elsewhere(AffinityMode::Off),
        WorkerRank::new("b:1", 0)
    );
    assert_eq!(
        cache_elsewhere(AffinityMode::Override),
        WorkerRank::new("a:1", 0)
    );
}

#[test]
fn an_overriding_session_moves_off_a_saturated_failed_or_departed_worker() {
    let pinned = || {
        let mut w = World::new(&[("a:1", Role::Mixed), ("b:1", Role::Mixed)]);
        let mut r = router(AffinityMode::Override, 0);
        let mut first = in_session("t1", &[1; 32], "s");
        first.exclude = vec![WorkerRank::new("b:1", 0)];
        serve(&mut w, &mut r, &first, 1_000);
        (w, r)
    };
    let next = in_session("t2", &[2; 32], "s");
    let a = WorkerRank::new("a:1", 0);
    let b = WorkerRank::new("b:1", 0);

    // Saturated: four prefill budgets (8192 tokens each) routed to a:1 and not prefilled; just
    // below that, the session stays.
    for (unprefilled, to) in [(4 * 8192, &b), (4 * 8192 - 1, &a)] {
        let (mut w, mut r) = pinned();
        let load = RouteRequest {
            prompt_tokens: unprefilled,
            exclude: vec![b.clone()],
            ..request("load", &[3; 32])
        };
        let d = r.decide(&w.fleet, &load, 1_500_000).expect("decision");
        w.apply_at(1_500_000, Event::RequestRouted(d));
        assert_eq!(
            serve(&mut w, &mut r, &next, 2_000_000),
            *to,
            "{unprefilled}"
        );
    }

    // Failed for this request (a retry, or out by its breaker or health checks).
    let (mut w, mut r) = pinned();
    let retry = RouteRequest {
        exclude: vec![a.clone()],
        ..next.clone()
    };
    assert_eq!(serve(&mut w, &mut r, &retry, 2_000_000), b);
    // The session now lives on b:1.
    assert_eq!(
        serve(&mut w, &mut r, &in_session("t3", &[4; 32], "s"), 3_000_000),
        b
    );

    // Gone.
    let (mut w, mut r) = pinned();
    w.apply(Event::WorkerDeregistered(
        crate::event::WorkerDeregistered {
            worker: WorkerId::new("a:1"),
            reason: "gone".into(),
        },
    ));
    assert_eq!(serve(&mut w, &mut r, &next, 2_000_000), b);
}

#[test]
fn a_session_lapses_after_its_ttl() {
    let ends_on = |gap_s: u64| {
        let mut w = World::new(&[("a:1", Role::Mixed), ("b:1", Role::Mixed)]);
        let mut r = router(AffinityMode::Override, 0);
        let mut first = in_session("t1", &[1; 32], "s");
        first.exclude = vec![WorkerRank::new("b:1", 0)];
        serve(&mut w, &mut r, &first, 1_000);
        // b:1 holds the next prompt: only the pin keeps the session on a:1.
        let tokens: Vec<u32> = (0..64).collect();
        w.store("b:1", &hash_blocks(&tokens, 4, None));
        let next = in_session("t2", &tokens, "s");
        serve(&mut w, &mut r, &next, 1_000 + gap_s * 1_000_000)
    };
    assert_eq!(ends_on(TTL_S), WorkerRank::new("a:1", 0));
    assert_eq!(ends_on(TTL_S + 1), WorkerRank::new("b:1", 0));
}

/// Round-robin through two workers: where a session's five turns went, each turn followed by
/// two requests without a session.
fn round_robin(mode: AffinityMode) -> Vec<WorkerRank> {
    let mut w = World::new(&[("a:1", Role::Mixed), ("b:1", Role::Mixed)]);
    let mut r = Router::new(RouterConfig {
        policy: PolicyKind::ROUND_ROBIN,
        sessions: SessionAffinity {
            mode,
            ..SessionAffinity::default()
        },
        ..RouterConfig::default()
    });
    let mut turns = Vec::new();
    for t in 0..5u64 {
        let at = (t + 1) * 1_000_000;
        let turn = in_session(&format!("t{t}"), &[1; 4], "s");
        turns.push(serve(&mut w, &mut r, &turn, at));
        // Requests without a session take turns.
        let other = serve(&mut w, &mut r, &request(&format!("o{t}"), &[1; 4]), at);
        let again = serve(&mut w, &mut r, &request(&format!("p{t}"), &[1; 4]), at);
        assert_ne!(other, again);
    }
    turns
}

#[test]
fn round_robin_has_no_ties_and_keeps_a_session_only_when_it_overrides() {
    let kept = round_robin(AffinityMode::Override);
    assert!(kept.iter().all(|w| *w == kept[0]), "{kept:?}");
    let turned = round_robin(AffinityMode::TieBreak);
    assert!(turned.iter().any(|w| *w != turned[0]), "{turned:?}");
}

#[test]
fn a_disaggregated_sessions_legs_are_pinned_per_role() {
    let mut w = World::new(&[
        ("p1:1", Role::Prefill),
        ("p2:1", Role::Prefill),
        ("d1:1", Role::Decode),
        ("d2:1", Role::Decode),
    ]);
    let mut r = router(AffinityMode::TieBreak, 7);
    let first = in_session("t1", &[1; 32], "s");
    let d = r.decide(&w.fleet, &first, 1_000).expect("decision");
    let legs: Vec<WorkerRank> = d.legs.iter().map(|l| l.worker.clone()).collect();
    w.apply_at(1_000, Event::RequestRouted(d));
    finish(&mut w, &first.request_id, 2_000);
    for t in 2..10u64 {
        let d = r
            .decide(
                &w.fleet,
                &in_session(&format!("t{t}"), &[t as u32; 32], "s"),
                t * 10_000,
            )
            .expect("decision");
        let now: Vec<WorkerRank> = d.legs.iter().map(|l| l.worker.clone()).collect();
        assert_eq!(now, legs, "turn {t}");
    }
}
