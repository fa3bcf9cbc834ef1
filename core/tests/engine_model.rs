//! Property tests of the engine model: conservation laws over random request streams.
//!
//! Streams draw prompts from a small pool of shared prefixes (so prefix hits happen), add private
//! blocks and a partial tail, and run on small caches (so eviction, waiting, preemption and
//! rejection happen). Every step's KV changes are replayed on a shadow set, the way the router's
//! index would consume them, and checked against the engine's own view.

use infera_core::engine::{
    EngineConfig, EngineModel, EngineStats, Finished, KvChange, SimRequest, StepReport,
    no_lower_tiers,
};
use infera_core::hashing::{hash_blocks, synthetic_block_tokens};
use infera_core::ids::BlockHash;
use proptest::prelude::*;
use std::collections::{HashMap, HashSet};

#[derive(Debug, Clone)]
struct ReqSpec {
    /// Which shared prefix, and how many of its blocks.
    pool: u64,
    prefix_blocks: usize,
    /// Private blocks after the prefix.
    own_blocks: usize,
    tail_tokens: u32,
    output: u32,
    /// Step count at which it is submitted.
    arrive: u32,
}

#[derive(Debug, Clone)]
struct Scenario {
    gpu_blocks: usize,
    block_size: u32,
    max_batched_tokens: u32,
    max_seqs: u32,
    /// Lower tiers hold the blocks whose hash is divisible by this (0: no lower tiers).
    lower_mod: u64,
    /// Call `clear()` before every step that is a multiple of this (0: never).
    clear_every: u32,
    reqs: Vec<ReqSpec>,
}

/// One event of a run, for the determinism check.
#[derive(Debug, PartialEq)]
enum Logged {
    Step(StepReport),
    Clear(Vec<KvChange>),
}

fn req_spec() -> impl Strategy<Value = ReqSpec> {
    (0u64..3, 0usize..=8, 0usize..=5, 0u32..4, 0u32..12, 0u32..40).prop_map(
        |(pool, prefix_blocks, own_blocks, tail_tokens, output, arrive)| ReqSpec {
            pool,
            prefix_blocks,
            own_blocks,
            tail_tokens,
            output,
            arrive,
        },
    )
}

fn scenario() -> impl Strategy<Value = Scenario> {
    (
        2usize..40,
        1u32..=4,
        1u32..48,
        1u32..8,
        prop_oneof![Just(0u64), Just(2), Just(3)],
        prop_oneof![3 => Just(0u32), 1 => 5u32..30],
        prop::collection::vec(req_spec(), 1..24),
    )
        .prop_map(
            |(
                gpu_blocks,
                block_size,
                max_batched_tokens,
                max_seqs,
                lower_mod,
                clear_every,
                reqs,
            )| {
                Scenario {
                    gpu_blocks,
                    block_size,
                    max_batched_tokens,
                    max_seqs,
                    lower_mod,
                    clear_every,
                    reqs,
                }
            },
        )
}

/// Builds request `id` of the scenario with real chained hashes.
fn build(spec: &ReqSpec, id: u64, bs: u32) -> SimRequest {
    let mut tokens = Vec::new();
    for j in 0..spec.prefix_blocks as u64 {
        synthetic_block_tokens(spec.pool * 1000 + j, bs as usize, &mut tokens);
    }
    for j in 0..spec.own_blocks as u64 {
        synthetic_block_tokens(1_000_000 + id * 100 + j, bs as usize, &mut tokens);
    }
    let tail = spec.tail_tokens.min(bs - 1);
    tokens.extend((0..tail).map(|t| 7 + t));
    SimRequest {
        id,
        blocks: hash_blocks(&tokens, bs as usize, None),
        prompt_tokens: tokens.len() as u32,
        output_tokens: spec.output,
    }
}

/// What the router would know, rebuilt from the engine's reports only.
#[derive(Default)]
struct Shadow {
    resident: HashSet<BlockHash>,
    stored: u64,
    removed: u64,
}

impl Shadow {
    fn apply(&mut self, changes: &[KvChange]) {
        for c in changes {
            match c {
                KvChange::Stored { parent, blocks } => {
                    assert!(!blocks.is_empty(), "empty Stored");
                    if let Some(p) = parent {
                        assert!(
                            self.resident.contains(p),
                            "parent {p:?} not resident: {c:?}"
                        );
                    }
                    for b in blocks {
                        assert!(self.resident.insert(*b), "{b:?} stored while resident");
                        self.stored += 1;
                    }
                }
                KvChange::Removed { blocks } => {
                    assert!(!blocks.is_empty(), "empty Removed");
                    for b in blocks {
                        assert!(self.resident.remove(b), "{b:?} removed but not resident");
                        self.removed += 1;
                    }
                }
                KvChange::Cleared => {
                    self.removed += self.resident.len() as u64;
                    self.resident.clear();
                }
            }
        }
    }
}

/// Runs `requests` (each with its arrival step) through a fresh engine, checking every law after
/// every step. Returns the full log and the final stats.
fn run(
    cfg: EngineConfig,
    lower_mod: u64,
    clear_every: u32,
    requests: Vec<(u32, SimRequest)>,
) -> (Vec<Logged>, EngineStats) {
    let gpu_blocks = cfg.gpu_blocks;
    let mut e = EngineModel::new(cfg);
    let mut lower = |_id: u64, blocks: &[BlockHash]| {
        if lower_mod == 0 {
            return no_lower_tiers(0, blocks);
        }
        blocks.iter().take_while(|h| h.0 % lower_mod == 0).count()
    };
    let mut pending = requests;
    pending.sort_by_key(|(arrive, r)| (*arrive, r.id));
    let mut pending = pending.into_iter().peekable();
    let mut outputs: HashMap<u64, u32> = HashMap::new();
    let mut prefilled: HashSet<u64> = HashSet::new();
    let mut finished: HashMap<u64, Finished> = HashMap::new();
    let mut shadow = Shadow::default();
    let mut log = Vec::new();
    let mut step_no = 0u32;
    loop {
        while let Some((_, r)) = pending.next_if(|(arrive, _)| *arrive <= step_no) {
            outputs.insert(r.id, r.output_tokens);
            e.submit(r);
        }
        if clear_every > 0 && step_no.is_multiple_of(clear_every) {
            let changes = e.clear();
            shadow.apply(&changes);
            log.push(Logged::Clear(changes));
        }
        step_no += 1;
        assert!(
            step_no < 50_000,
            "engine wedged: {} waiting, {} running",
            e.waiting(),
            e.running()
        );
        let Some(report) = e.step(&mut lower) else {
            if pending.peek().is_none() {
                break;
            }
            continue;
        };
        shadow.apply(&report.kv);
        for p in &report.prefilled {
            assert!(outputs.contains_key(&p.id), "unknown id {}", p.id);
            assert!(prefilled.insert(p.id), "prefilled twice: {}", p.id);
            assert!(!finished.contains_key(&p.id));
            assert!(
                p.cached_tokens
                    < e.config().block_size * (p.gpu_hit_blocks + p.lower_hit_blocks) + 1
            );
        }
        for f in &report.finished {
            assert!(
                finished.insert(f.id, *f).is_none(),
                "finished twice: {}",
                f.id
            );
            if f.rejected {
                assert!(
                    !prefilled.contains(&f.id),
                    "rejected after prefill: {}",
                    f.id
                );
                assert_eq!(f.output_tokens, 0);
            } else {
                assert!(
                    prefilled.contains(&f.id),
                    "finished without prefill: {}",
                    f.id
                );
                assert_eq!(f.output_tokens, outputs[&f.id]);
            }
        }
        if report.batch_tokens > 0 {
            assert!(report.duration_us > 0, "work takes time");
        }
        let stats = e.stats();
        assert_eq!(shadow.resident.len(), e.resident_blocks());
        assert_eq!(shadow.stored - shadow.removed, e.resident_blocks() as u64);
        assert_eq!(stats.blocks_stored, shadow.stored);
        assert_eq!(stats.blocks_removed, shadow.removed);
        assert!(
            e.used_blocks() <= gpu_blocks,
            "over capacity: {} > {gpu_blocks}",
            e.used_blocks()
        );
        assert!((0.0..=1.0).contains(&e.utilisation()));
        log.push(Logged::Step(report));
    }
    assert!(e.is_idle());
    assert_eq!(
        finished.len(),
        outputs.len(),
        "every request finishes exactly once"
    );
    assert_eq!(e.anonymous_blocks(), 0);
    assert_eq!(e.utilisation(), 0.0);
    assert_eq!(e.stats().requests_finished, outputs.len() as u64);
    (log, e.stats())
}

fn config(s: &Scenario) -> EngineConfig {
    EngineConfig {
        gpu_blocks: s.gpu_blocks,
        block_size: s.block_size,
        max_batched_tokens: s.max_batched_tokens,
        max_seqs: s.max_seqs,
        ..EngineConfig::default()
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1000))]

    #[test]
    fn conservation_laws_hold_on_random_streams(s in scenario()) {
        let requests = requests_of(&s);
        let first = run(config(&s), s.lower_mod, s.clear_every, requests.clone());
        let second = run(config(&s), s.lower_mod, s.clear_every, requests);
        prop_assert!(first == second, "same input, different reports");
    }

    /// Hashes that are not a consistent chain (repeats, blocks under other parents) must never
    /// break the laws: the engine keeps such blocks anonymous.
    #[test]
    fn inconsistent_hashes_keep_the_laws(
        gpu_blocks in 2usize..24,
        reqs in prop::collection::vec(
            (prop::collection::vec(0u64..6, 0..6), 0u32..24, 0u32..6, 0u32..10),
            1..16,
        ),
    ) {
        let requests: Vec<(u32, SimRequest)> = reqs
            .into_iter()
            .enumerate()
            .map(|(i, (hashes, prompt_tokens, output_tokens, arrive))| {
                let blocks = hashes.into_iter().map(BlockHash).collect();
                (arrive, SimRequest { id: i as u64, blocks, prompt_tokens, output_tokens })
            })
            .collect();
        let cfg = EngineConfig { gpu_blocks, block_size: 2, max_batched_tokens: 8, max_seqs: 4, ..EngineConfig::default() };
        run(cfg, 2, 0, requests);
    }
}

fn requests_of(s: &Scenario) -> Vec<(u32, SimRequest)> {
    s.reqs
        .iter()
        .enumerate()
        .map(|(i, spec)| (spec.arrive, build(spec, i as u64, s.block_size)))
        .collect()
}

/// The generator is only as good as the paths it reaches: sample it and check that hits,
/// lower-tier loads, evictions, preemptions, rejections, chunked prefills and clears all occur.
#[test]
fn random_streams_reach_every_path() {
    use proptest::strategy::ValueTree;
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    let mut total = EngineStats::default();
    let (mut clears, mut chunked) = (0u64, 0u64);
    for _ in 0..300 {
        let s = scenario().new_tree(&mut runner).expect("tree").current();
        let (log, st) = run(config(&s), s.lower_mod, s.clear_every, requests_of(&s));
        clears += log
            .iter()
            .filter(|l| matches!(l, Logged::Clear(c) if !c.is_empty()))
            .count() as u64;
        chunked += u64::from(s.reqs.iter().any(|r| {
            (r.prefix_blocks + r.own_blocks) as u32 * s.block_size > s.max_batched_tokens
        }));
        total.gpu_hit_blocks += st.gpu_hit_blocks;
        total.lower_hit_blocks += st.lower_hit_blocks;
        total.blocks_removed += st.blocks_removed;
        total.preemptions += st.preemptions;
        total.requests_rejected += st.requests_rejected;
        total.requests_finished += st.requests_finished;
    }
    println!("{total:?} clears={clears} chunked={chunked}");
    assert!(total.gpu_hit_blocks > 0 && total.lower_hit_blocks > 0);
    assert!(total.blocks_removed > 0 && total.preemptions > 0 && clears > 0 && chunked > 0);
    assert!(total.requests_rejected > 0 && total.requests_rejected * 3 < total.requests_finished);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1000))]

    /// Skipping quiet decode steps is indistinguishable from stepping through them.
    #[test]
    fn skipping_quiet_steps_changes_nothing_observable(
        reqs in prop::collection::vec((0u64..6, 1usize..6, 0u32..60, 1u32..40), 1..12),
        gpu_blocks in 8usize..64,
        skip_early in any::<bool>(),
    ) {
        let bs = 4u32;
        let cfg = EngineConfig { gpu_blocks, block_size: bs, max_batched_tokens: 32, max_seqs: 8, ..Default::default() };
        let mk = |i: usize, (pool, len, out, extra): &(u64, usize, u32, u32)| {
            let blocks: Vec<BlockHash> = (0..*len as u64).map(|b| BlockHash(pool * 100 + b)).collect();
            SimRequest { id: i as u64, prompt_tokens: blocks.len() as u32 * bs + extra % bs, blocks, output_tokens: *out }
        };
        // Reference: one step at a time, every report kept with its end time.
        let run = |skip: bool| {
            let mut e = EngineModel::new(cfg.clone());
            for (i, r) in reqs.iter().enumerate() {
                e.submit(mk(i, r));
            }
            let mut now = 0u64;
            let mut log = Vec::new();
            loop {
                if skip
                    && let Some((n, d)) = e.quiet_steps()
                {
                    let take = if skip_early { n.div_ceil(2) } else { n };
                    prop_assert_eq!(e.skip_quiet_steps(take), take);
                    now += take * d;
                    continue;
                }
                match e.step(&mut no_lower_tiers) {
                    Some(r) => {
                        now += r.duration_us;
                        let quiet = r.kv.is_empty() && r.prefilled.is_empty() && r.finished.is_empty() && r.admitted.is_empty();
                        if !quiet {
                            log.push((now, r));
                        }
                    }
                    None => break,
                }
            }
            Ok((log, e.stats(), e.resident_blocks()))
        };
        let plain = run(false)?;
        let skipped = run(true)?;
        prop_assert_eq!(plain, skipped);
    }
}
