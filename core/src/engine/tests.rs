//! Behaviour tests of the engine model as a whole (cache and timing have their own beside them).

use super::*;
use crate::hashing::{hash_blocks, synthetic_block_tokens};

const BS: u32 = 4;

/// Tokens of a prompt made of the named synthetic blocks.
fn tokens(block_ids: &[u64]) -> Vec<u32> {
    let mut out = Vec::new();
    for &id in block_ids {
        synthetic_block_tokens(id, BS as usize, &mut out);
    }
    out
}

fn request(id: u64, block_ids: &[u64], extra_tokens: u32, output_tokens: u32) -> SimRequest {
    let toks = tokens(block_ids);
    SimRequest {
        id,
        blocks: hash_blocks(&toks, BS as usize, None),
        prompt_tokens: toks.len() as u32 + extra_tokens,
        output_tokens,
    }
}

fn engine(gpu_blocks: usize) -> EngineModel {
    EngineModel::new(EngineConfig {
        gpu_blocks,
        block_size: BS,
        ..EngineConfig::default()
    })
}

/// Steps until idle (bounded), returning every report.
fn drain(e: &mut EngineModel) -> Vec<StepReport> {
    let mut out = Vec::new();
    while let Some(r) = e.step(&mut no_lower_tiers) {
        assert!(e.used_blocks() <= e.config().gpu_blocks);
        out.push(r);
        assert!(out.len() < 100_000, "engine wedged");
    }
    out
}

/// Replays the KV log on a shadow set: no double store, parents resident, removals of resident
/// blocks only; the survivors must be what the engine says is resident.
fn check_kv_log(reports: &[StepReport], resident: usize) {
    let mut shadow = std::collections::HashSet::new();
    for c in reports.iter().flat_map(|r| &r.kv) {
        match c {
            KvChange::Stored { parent, blocks } => {
                assert!(
                    parent.is_none_or(|p| shadow.contains(&p)),
                    "parent not resident: {c:?}"
                );
                for b in blocks {
                    assert!(shadow.insert(*b), "stored twice: {b:?}");
                }
            }
            KvChange::Removed { blocks } => {
                for b in blocks {
                    assert!(shadow.remove(b), "removed while not resident: {b:?}");
                }
            }
            KvChange::Cleared => shadow.clear(),
        }
    }
    assert_eq!(shadow.len(), resident);
}

fn stored(reports: &[StepReport]) -> Vec<BlockHash> {
    let mut out = Vec::new();
    for r in reports {
        for c in &r.kv {
            if let KvChange::Stored { blocks, .. } = c {
                out.extend_from_slice(blocks);
            }
        }
    }
    out
}

fn removed(reports: &[StepReport]) -> Vec<BlockHash> {
    let mut out = Vec::new();
    for r in reports {
        for c in &r.kv {
            if let KvChange::Removed { blocks } = c {
                out.extend_from_slice(blocks);
            }
        }
    }
    out
}

fn prefilled(reports: &[StepReport]) -> Vec<Prefilled> {
    reports
        .iter()
        .flat_map(|r| r.prefilled.iter().copied())
        .collect()
}

fn finished(reports: &[StepReport]) -> Vec<Finished> {
    reports
        .iter()
        .flat_map(|r| r.finished.iter().copied())
        .collect()
}

#[test]
fn repeated_prompt_hits_the_prefix_cache() {
    let mut e = engine(64);
    let a = request(1, &[10, 11, 12], 2, 3);
    let blocks = a.blocks.clone();
    e.submit(a);
    let first = drain(&mut e);
    assert_eq!(stored(&first), blocks);
    assert_eq!(
        first[0].kv,
        vec![KvChange::Stored {
            parent: None,
            blocks: blocks.clone()
        }]
    );
    let p = prefilled(&first);
    assert_eq!((p[0].gpu_hit_blocks, p[0].cached_tokens), (0, 0));

    e.submit(request(2, &[10, 11, 12], 2, 3));
    let second = drain(&mut e);
    assert!(stored(&second).is_empty(), "nothing new to store");
    let p = prefilled(&second);
    assert_eq!(
        p,
        vec![Prefilled {
            id: 2,
            gpu_hit_blocks: 3,
            lower_hit_blocks: 0,
            cached_tokens: 12
        }]
    );
    // Only the 2 uncached tail tokens were computed.
    assert_eq!(second[0].batch_tokens, 2);
    assert_eq!(e.stats().gpu_hit_blocks, 3);
    assert_eq!(e.resident_blocks(), 3);
}

#[test]
fn a_fully_cached_prompt_still_recomputes_its_last_token() {
    let mut e = engine(64);
    e.submit(request(1, &[1, 2], 0, 1));
    drain(&mut e);
    e.submit(request(2, &[1, 2], 0, 1));
    let r = drain(&mut e);
    // vLLM hits whole blocks only: the last block is recomputed to produce the logits.
    assert_eq!(prefilled(&r)[0].cached_tokens, BS);
    assert_eq!(r[0].batch_tokens, BS);
}

#[test]
fn a_partial_prompt_hit_stores_only_the_new_tail_under_its_parent() {
    let mut e = engine(64);
    let a = request(1, &[1, 2], 0, 1);
    let ha = a.blocks.clone();
    e.submit(a);
    drain(&mut e);
    let b = request(2, &[1, 2, 3, 4], 0, 1);
    let hb = b.blocks.clone();
    e.submit(b);
    let r = drain(&mut e);
    assert_eq!(
        r[0].kv,
        vec![KvChange::Stored {
            parent: Some(ha[1]),
            blocks: hb[2..].to_vec()
        }]
    );
    assert_eq!(prefilled(&r)[0].gpu_hit_blocks, 2);
}

#[test]
fn leaf_first_lru_keeps_a_shared_root_longest() {
    // Cache of 4 blocks; R is shared by two prompts, then a third prompt needs 3 new blocks.
    let mut e = engine(4);
    let a = request(1, &[100, 1], 0, 1);
    let b = request(2, &[100, 2], 0, 1);
    let (r, la, lb) = (a.blocks[0], a.blocks[1], b.blocks[1]);
    e.submit(a);
    drain(&mut e);
    e.submit(b);
    drain(&mut e);
    assert_eq!(e.resident_blocks(), 3);
    e.submit(request(3, &[7, 8], 0, 1));
    let reports = drain(&mut e);
    // One block is free; one more is needed: the least recently used leaf (A's) goes, not R.
    assert_eq!(removed(&reports), vec![la]);
    e.submit(request(4, &[9, 10, 11], 0, 1));
    let reports = drain(&mut e);
    // R is older than the leaves of request 3, yet it goes only after its own leaf B.
    let gone = removed(&reports);
    let pos = |h: BlockHash| gone.iter().position(|&g| g == h);
    assert!(pos(lb).is_some() && pos(r).is_some());
    assert!(pos(lb) < pos(r), "leaf before its root: {gone:?}");
}

#[test]
fn referenced_blocks_are_never_evicted_and_the_next_request_waits() {
    let mut e = engine(6);
    // A holds 4 prompt blocks for many decode steps (footprint 5 blocks with its output).
    let a = request(1, &[1, 2, 3, 4], 0, 4);
    let ha = a.blocks.clone();
    e.submit(a);
    e.step(&mut no_lower_tiers);
    e.submit(request(2, &[5, 6], 0, 1));
    let reports = drain(&mut e);
    assert!(
        removed(&reports).iter().all(|h| !ha.contains(h)),
        "A's blocks were evicted"
    );
    let ids: Vec<u64> = finished(&reports).iter().map(|f| f.id).collect();
    assert_eq!(ids, vec![1, 2], "B waits for A's blocks: {ids:?}");
}

#[test]
fn capacity_is_never_exceeded_under_pressure() {
    let mut e = EngineModel::new(EngineConfig {
        gpu_blocks: 10,
        block_size: BS,
        max_batched_tokens: 16,
        max_seqs: 8,
        ..EngineConfig::default()
    });
    for i in 0..40u64 {
        let ids: Vec<u64> = (0..(i % 5)).map(|j| 1000 + (i % 3) * 10 + j).collect();
        e.submit(request(i, &ids, (i % 4) as u32, (i % 9) as u32));
    }
    let reports = drain(&mut e);
    check_kv_log(&reports, e.resident_blocks());
    assert_eq!(finished(&reports).len(), 40);
    assert!(
        e.stats().preemptions > 0,
        "the scenario should force preemptions"
    );
    assert_eq!(e.anonymous_blocks(), 0);
    assert_eq!(
        stored(&reports).len() - removed(&reports).len(),
        e.resident_blocks()
    );
}

#[test]
fn long_prompts_prefill_in_chunks_across_steps() {
    let mut e = EngineModel::new(EngineConfig {
        gpu_blocks: 64,
        block_size: BS,
        max_batched_tokens: 10,
        ..EngineConfig::default()
    });
    let ids: Vec<u64> = (1..=6).collect(); // 24 tokens: chunks of 10, 10, 4
    let req = request(1, &ids, 0, 2);
    let hashes = req.blocks.clone();
    e.submit(req);
    let r1 = e.step(&mut no_lower_tiers).expect("step");
    assert_eq!(r1.batch_tokens, 10);
    assert!(r1.prefilled.is_empty());
    // 10 tokens fill 2 blocks; the third (2 tokens in) is not published yet.
    assert_eq!(
        r1.kv,
        vec![KvChange::Stored {
            parent: None,
            blocks: hashes[..2].to_vec()
        }]
    );
    let r2 = e.step(&mut no_lower_tiers).expect("step");
    assert_eq!(r2.batch_tokens, 10);
    assert_eq!(
        r2.kv,
        vec![KvChange::Stored {
            parent: Some(hashes[1]),
            blocks: hashes[2..5].to_vec()
        }]
    );
    let r3 = e.step(&mut no_lower_tiers).expect("step");
    assert_eq!(r3.batch_tokens, 4);
    assert_eq!(
        r3.prefilled.len(),
        1,
        "first token when the last chunk is done"
    );
    let t = TimingModel::default();
    assert_eq!(r3.duration_us, (t.prefill_ms(4) * 1000.0).round() as u64);
    let r4 = e.step(&mut no_lower_tiers).expect("step");
    assert_eq!(r4.batch_tokens, 1);
    assert_eq!(
        r4.finished,
        vec![Finished {
            id: 1,
            output_tokens: 2,
            rejected: false
        }]
    );
    assert!(e.step(&mut no_lower_tiers).is_none());
}

#[test]
fn decode_and_prefill_share_a_step_and_its_duration() {
    let mut e = engine(100);
    e.submit(request(1, &[1, 2], 0, 5));
    e.step(&mut no_lower_tiers);
    e.submit(request(2, &[3, 4, 5], 1, 2));
    let r = e.step(&mut no_lower_tiers).expect("step");
    assert_eq!(r.batch_tokens, 1 + 13);
    assert!(r.finished.is_empty());
    // Request 1: 9 KV tokens = 3 blocks; request 2: 13 tokens = 4 blocks; of 100.
    assert!((e.utilisation() - 0.07).abs() < 1e-12);
    let t = TimingModel::default();
    let want = t.prefill_ms(13) + t.decode_ms(0.07);
    assert_eq!(r.duration_us, (want * 1000.0).round() as u64);
}

#[test]
fn speedup_divides_step_durations() {
    let run = |speedup: f64| {
        let mut e = EngineModel::new(EngineConfig {
            gpu_blocks: 64,
            block_size: BS,
            speedup,
            ..EngineConfig::default()
        });
        e.submit(request(1, &[1, 2, 3], 0, 3));
        drain(&mut e)
            .iter()
            .map(|r| r.duration_us)
            .collect::<Vec<_>>()
    };
    let slow = run(1.0);
    let fast = run(4.0);
    assert_eq!(slow.len(), fast.len());
    for (s, f) in slow.iter().zip(&fast) {
        assert!((*s as f64 / 4.0 - *f as f64).abs() <= 1.0, "{s} vs {f}");
    }
}

#[test]
fn lower_tier_blocks_are_loaded_stored_and_costed() {
    let mut e = engine(64);
    let req = request(1, &[1, 2, 3, 4], 2, 1);
    let hashes = req.blocks.clone();
    e.submit(req);
    let mut asked = Vec::new();
    let mut lower = |_id: u64, blocks: &[BlockHash]| {
        asked.push(blocks.to_vec());
        3
    };
    let r = e.step(&mut lower).expect("step");
    assert_eq!(asked, vec![hashes.clone()]);
    assert_eq!(
        r.kv,
        vec![KvChange::Stored {
            parent: None,
            blocks: hashes.clone()
        }]
    );
    assert_eq!(
        r.prefilled,
        vec![Prefilled {
            id: 1,
            gpu_hit_blocks: 0,
            lower_hit_blocks: 3,
            cached_tokens: 12
        }]
    );
    // 4 + 2 tokens computed, 3 blocks loaded.
    assert_eq!(r.batch_tokens, 6);
    let t = TimingModel::default();
    assert_eq!(
        r.duration_us,
        ((t.prefill_ms(6) + 3.0 * 0.02) * 1000.0).round() as u64
    );
    assert_eq!(e.stats().lower_hit_blocks, 3);

    // Next time, the GPU has them all; the hook is asked nothing past a full hit.
    e.submit(request(2, &[1, 2, 3, 4, 5], 0, 1));
    let mut asked2 = Vec::new();
    let r = e
        .step(&mut |_id: u64, b: &[BlockHash]| {
            asked2.push(b.len());
            usize::MAX
        })
        .expect("step");
    assert_eq!(
        asked2,
        vec![1],
        "asked only about the block after the GPU hit"
    );
    assert_eq!(r.prefilled[0].gpu_hit_blocks, 4);
    assert_eq!(
        r.prefilled[0].lower_hit_blocks, 1,
        "the answer is clamped to what was asked"
    );
    assert_eq!(r.prefilled[0].cached_tokens, 4 * BS);
}

#[test]
fn oversize_requests_are_rejected_without_wedging_the_queue() {
    let mut e = engine(4);
    e.submit(request(1, &[1, 2, 3, 4, 5], 0, 1)); // 5 blocks > 4
    e.submit(request(2, &[1, 2, 3], 0, 6)); // 3 prompt blocks + 5 decode tokens: 5 blocks > 4
    e.submit(request(3, &[1, 2], 0, 2));
    let reports = drain(&mut e);
    let f = finished(&reports);
    assert_eq!(f.len(), 3);
    assert_eq!(
        f[0],
        Finished {
            id: 1,
            output_tokens: 0,
            rejected: true
        }
    );
    assert_eq!(
        f[1],
        Finished {
            id: 2,
            output_tokens: 0,
            rejected: true
        }
    );
    assert_eq!(
        f[2],
        Finished {
            id: 3,
            output_tokens: 2,
            rejected: false
        }
    );
    assert!(prefilled(&reports).iter().all(|p| p.id == 3));
    assert_eq!(e.stats().requests_rejected, 2);
    // A request that fits exactly is not rejected.
    e.submit(request(4, &[6, 7, 8, 9], 0, 1));
    assert!(finished(&drain(&mut e)).iter().all(|f| !f.rejected));
}

#[test]
fn a_rejection_alone_is_reported_by_a_zero_length_step() {
    let mut e = engine(1);
    e.submit(request(9, &[1, 2], 0, 1));
    assert_eq!(e.waiting(), 0);
    assert!(!e.is_idle());
    let r = e.step(&mut no_lower_tiers).expect("step");
    assert_eq!(r.duration_us, 0);
    assert_eq!(r.finished.len(), 1);
    assert!(e.is_idle());
    assert!(e.step(&mut no_lower_tiers).is_none());
}

#[test]
fn output_of_zero_or_one_finishes_right_after_prefill() {
    for out in [0, 1] {
        let mut e = engine(16);
        e.submit(request(1, &[1], 0, out));
        let r = e.step(&mut no_lower_tiers).expect("step");
        assert_eq!(r.prefilled.len(), 1);
        assert_eq!(
            r.finished,
            vec![Finished {
                id: 1,
                output_tokens: out,
                rejected: false
            }]
        );
        assert!(e.is_idle());
    }
}

#[test]
fn generated_tokens_take_anonymous_blocks_that_are_never_published() {
    let mut e = engine(16);
    // KV grows to 4 + 10 tokens = 4 blocks; it has 13 (4 blocks) after the second-to-last step.
    e.submit(request(1, &[1], 0, 11));
    let mut max_anon = 0;
    let mut reports = Vec::new();
    while let Some(r) = e.step(&mut no_lower_tiers) {
        max_anon = max_anon.max(e.anonymous_blocks());
        reports.push(r);
    }
    assert_eq!(max_anon, 3);
    assert_eq!(stored(&reports).len(), 1);
    assert_eq!(e.anonymous_blocks(), 0);
    assert_eq!(
        e.utilisation(),
        0.0,
        "cached but unreferenced blocks are not utilised"
    );
}

#[test]
fn inconsistent_hashes_never_panic_and_stay_unpublished() {
    let mut e = engine(8);
    let h = |v| BlockHash(v);
    e.submit(SimRequest {
        id: 1,
        blocks: vec![h(1), h(2)],
        prompt_tokens: 8,
        output_tokens: 2,
    });
    e.submit(SimRequest {
        id: 2,
        blocks: vec![h(2), h(1), h(1)],
        prompt_tokens: 12,
        output_tokens: 2,
    });
    e.submit(SimRequest {
        id: 3,
        blocks: vec![h(3), h(3)],
        prompt_tokens: 0,
        output_tokens: 1,
    });
    let reports = drain(&mut e);
    assert_eq!(finished(&reports).len(), 3);
    check_kv_log(&reports, e.resident_blocks());
    assert_eq!(e.anonymous_blocks(), 0);
}

#[test]
fn clear_drops_every_unreferenced_block() {
    let mut e = engine(32);
    e.submit(request(1, &[1, 2, 3], 0, 1));
    drain(&mut e);
    assert_eq!(e.clear(), vec![KvChange::Cleared]);
    assert_eq!(e.resident_blocks(), 0);
    assert_eq!(e.stats().blocks_removed, 3);

    // With a sequence running, its blocks survive and the rest is reported as removed.
    e.submit(request(2, &[5, 6], 0, 1));
    drain(&mut e);
    let running = request(3, &[7], 0, 50);
    let kept = running.blocks.clone();
    e.submit(running);
    e.step(&mut no_lower_tiers);
    let changes = e.clear();
    assert_eq!(changes.len(), 1);
    let KvChange::Removed { blocks } = &changes[0] else {
        panic!("expected Removed, got {changes:?}")
    };
    assert_eq!(blocks.len(), 2);
    assert_eq!(e.resident_blocks(), kept.len());
    assert!(e.clear().is_empty(), "nothing left to drop");
    drain(&mut e);
}

#[test]
fn invalid_configs_are_refused_with_the_field_named() {
    let bad = EngineConfig {
        gpu_blocks: 0,
        ..EngineConfig::default()
    };
    let err = EngineModel::try_new(bad).expect_err("invalid");
    assert!(err.to_string().contains("gpu_blocks"), "{err}");
    for cfg in [
        EngineConfig {
            block_size: 0,
            ..EngineConfig::default()
        },
        EngineConfig {
            max_batched_tokens: 0,
            ..EngineConfig::default()
        },
        EngineConfig {
            max_seqs: 0,
            ..EngineConfig::default()
        },
        EngineConfig {
            speedup: 0.0,
            ..EngineConfig::default()
        },
        EngineConfig {
            speedup: f64::NAN,
            ..EngineConfig::default()
        },
    ] {
        assert!(EngineModel::try_new(cfg).is_err());
    }
    let e = EngineModel::new(EngineConfig::default());
    assert_eq!(e.config().gpu_blocks, 16_384);
    assert!(e.is_idle());
}

#[test]
fn max_seqs_limits_the_batch() {
    let mut e = EngineModel::new(EngineConfig {
        gpu_blocks: 64,
        block_size: BS,
        max_seqs: 2,
        ..EngineConfig::default()
    });
    for i in 0..5 {
        e.submit(request(i, &[i + 1], 0, 4));
    }
    e.step(&mut no_lower_tiers);
    assert_eq!((e.running(), e.waiting()), (2, 3));
    drain(&mut e);
}

#[test]
fn abort_frees_a_running_request_and_drops_a_queued_one() {
    let mut e = engine(64);
    e.submit(request(1, &[1, 2, 3], 0, 50));
    e.submit(request(2, &[7, 8], 0, 50));
    let first = e.step(&mut no_lower_tiers).expect("step");
    assert_eq!(first.admitted, vec![1, 2]);
    let busy = e.utilisation();
    assert!(e.abort(1), "running request found");
    assert!(e.utilisation() < busy, "its blocks were released");
    assert_eq!(e.resident_blocks(), 5, "published blocks stay cached");
    e.submit(request(3, &[9], 0, 5));
    assert!(e.abort(3), "queued request found");
    assert!(!e.abort(3) && !e.abort(42));
    let rest = drain(&mut e);
    let finished: Vec<u64> = rest
        .iter()
        .flat_map(|r| &r.finished)
        .map(|f| f.id)
        .collect();
    assert_eq!(finished, vec![2], "aborted requests never finish");
    assert_eq!(e.stats().requests_aborted, 2);
    // The cache is still usable: the aborted prompt's blocks are hits for the next request.
    e.submit(request(4, &[1, 2, 3], 1, 1));
    let r = drain(&mut e);
    assert_eq!(prefilled(&r)[0].gpu_hit_blocks, 3);
}
