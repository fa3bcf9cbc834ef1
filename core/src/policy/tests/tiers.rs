//! Routing with kvd tiers: a prefix held by a node's kvd attracts its turn to that node's
//! worker, by what loading it costs (`policy::tiers`).

use super::*;
use crate::event::{KvCacheCleared, TierLoadMeasured};
use crate::hashing::KvIdentity;
use crate::kv_events::kvd::{self, KVD_EVENTS_ENDPOINT};

/// Workers `a:1` on node `na` and `b:1` on node `nb`, each naming its node's kvd.
fn two_nodes(roles: [Role; 2]) -> World {
    let mut w = World::new(&[]);
    for (id, node, role) in [("a:1", "na", roles[0]), ("b:1", "nb", roles[1])] {
        let mut r = record(id, role);
        r.url = format!("http://{node}:8000");
        r.extra
            .insert(KVD_EVENTS_ENDPOINT.into(), "tcp://*:5590".into());
        w.apply(Event::WorkerRegistered(WorkerRegistered { record: r }));
    }
    w
}

fn kvd_of(node: &str) -> WorkerRank {
    kvd::source_rank(&format!("tcp://{node}:5590"))
}

fn kvd_hashes(tokens: &[u32]) -> Vec<BlockHash> {
    kvd::request_hashes("m", "", tokens, 4, &KvIdentity::default())
}

impl World {
    fn kvd_store(&mut self, node: &str, tier: Tier, hashes: &[BlockHash]) {
        self.apply(Event::KvBlocksStored(KvBlocksStored {
            worker: kvd_of(node),
            tier,
            block_size: 0,
            engine_hashes: hashes.iter().map(|h| EngineHash(h.0)).collect(),
            router_hashes: hashes.to_vec(),
            parent: None,
        }));
    }

    fn measured(&mut self, node: &str, tier: Tier, bytes_per_s: f64) {
        self.apply(Event::TierLoadMeasured(TierLoadMeasured {
            source: kvd_of(node),
            tier,
            bytes_per_s,
            block_bytes: 1 << 20,
        }));
    }
}

/// `tokens` as the server prepares it for a fleet of kvd-backed workers.
fn tiered_request(w: &World, id: &str, tokens: &[u32]) -> RouteRequest {
    let mut req = request(id, tokens);
    assert_eq!(w.fleet.kvd_namespaces("m").len(), 1);
    req.kvd = vec![KvdHashes {
        block_size: 4,
        compat_key: "".into(),
        hashes: kvd_hashes(tokens),
    }];
    req
}

fn decide(w: &World, req: &RouteRequest, seed: u64) -> RoutedLeg {
    let mut r = Router::new(RouterConfig {
        seed,
        ..RouterConfig::default()
    });
    r.decide(&w.fleet, req, 0).expect("decision").legs[0].clone()
}

#[test]
fn a_prefix_in_a_nodes_kvd_host_ram_attracts_the_turn_to_that_node() {
    let mut w = two_nodes([Role::Mixed, Role::Mixed]);
    let tokens: Vec<u32> = (0..64).collect();
    w.kvd_store("nb", Tier::Host, &kvd_hashes(&tokens)[..12]);
    for seed in 0..8 {
        let leg = decide(&w, &tiered_request(&w, "r", &tokens), seed);
        assert_eq!(leg.worker, WorkerRank::new("b:1", 0), "seed {seed}");
    }
    // Without the inventory hashes (a server that did not compute them) nothing is credited:
    // the pick is a coin toss between two cold workers.
    let picks: std::collections::BTreeSet<WorkerRank> = (0..16)
        .map(|seed| decide(&w, &request("r", &tokens), seed).worker)
        .collect();
    assert_eq!(picks.len(), 2);
}

#[test]
fn a_gpu_hit_outweighs_a_tier_hit_of_the_same_length() {
    let mut w = two_nodes([Role::Mixed, Role::Mixed]);
    let tokens: Vec<u32> = (0..64).collect();
    w.store("a:1", &hash_blocks(&tokens, 4, None)[..8]);
    w.kvd_store("nb", Tier::Host, &kvd_hashes(&tokens)[..8]);
    // Unmeasured, host RAM is credited at its prior (0.75): the GPU hit wins.
    for seed in 0..8 {
        let leg = decide(&w, &tiered_request(&w, "r", &tokens), seed);
        assert_eq!(leg.worker, WorkerRank::new("a:1", 0), "seed {seed}");
    }
    // Even a free load only ties with the GPU hit.
    w.measured("nb", Tier::Host, 1e15);
    let mut r = Router::new(RouterConfig::default());
    let d = r
        .decide(&w.fleet, &tiered_request(&w, "r", &tokens), 0)
        .expect("decision");
    assert!((d.top[0].cost - d.top[1].cost).abs() < 1e-3, "{:?}", d.top);
    // A longer run in the kvd wins over a shorter GPU prefix.
    w.kvd_store("nb", Tier::Host, &kvd_hashes(&tokens)[..16]);
    let leg = decide(&w, &tiered_request(&w, "r", &tokens), 0);
    assert_eq!(leg.worker, WorkerRank::new("b:1", 0));
}

#[test]
fn a_tier_slower_than_recompute_earns_nothing() {
    let mut w = two_nodes([Role::Mixed, Role::Mixed]);
    let tokens: Vec<u32> = (0..64).collect();
    // 1 MiB blocks of 4 tokens at 16k tokens/s: 0.25 ms to prefill, 1 s to load at 1 MiB/s.
    w.measured("nb", Tier::Disk, f64::from(1u32 << 20));
    w.kvd_store("nb", Tier::Disk, &kvd_hashes(&tokens));
    let picks: std::collections::BTreeSet<WorkerRank> = (0..16)
        .map(|seed| decide(&w, &tiered_request(&w, "r", &tokens), seed).worker)
        .collect();
    assert_eq!(picks.len(), 2, "both workers cost the same: {picks:?}");
}

#[test]
fn a_prefix_in_the_shared_store_is_credited_on_every_node() {
    let mut w = two_nodes([Role::Mixed, Role::Mixed]);
    let tokens: Vec<u32> = (0..64).collect();
    // Published by node a's kvd; node b's worker can load it just as well.
    w.kvd_store("na", Tier::External, &kvd_hashes(&tokens));
    let req = tiered_request(&w, "r", &tokens);
    let mut r = Router::new(RouterConfig::default());
    let d = r.decide(&w.fleet, &req, 0).expect("decision");
    assert_eq!(d.top.len(), 2);
    assert_eq!(d.top[0].cost, d.top[1].cost, "{:?}", d.top);
    // A third worker without a kvd is not credited at all.
    w.apply(Event::WorkerRegistered(WorkerRegistered {
        record: record("c:1", Role::Mixed),
    }));
    for seed in 0..8 {
        let leg = decide(&w, &tiered_request(&w, "r", &tokens), seed);
        assert_ne!(leg.worker, WorkerRank::new("c:1", 0));
    }
}

#[test]
fn a_kvd_clear_or_its_last_worker_leaving_forgets_its_blocks() {
    let mut w = two_nodes([Role::Mixed, Role::Mixed]);
    let tokens: Vec<u32> = (0..64).collect();
    let hashes = kvd_hashes(&tokens);
    w.kvd_store("nb", Tier::Host, &hashes);
    let kvd = w.fleet.index().slot(&kvd_of("nb")).expect("kvd slot");
    assert_eq!(
        w.fleet.lower_tier_run(kvd, &hashes, 0)[Tier::Host.index()],
        16
    );
    w.apply(Event::KvCacheCleared(KvCacheCleared {
        worker: kvd_of("nb"),
        tier: None,
    }));
    assert_eq!(w.fleet.lower_tier_run(kvd, &hashes, 0), [0; 4]);
    w.kvd_store("nb", Tier::Host, &hashes);
    w.measured("nb", Tier::Host, 1e9);
    w.apply(Event::WorkerDeregistered(
        crate::event::WorkerDeregistered {
            worker: WorkerId::new("b:1"),
            reason: String::new(),
        },
    ));
    assert!(!w.fleet.links_kvd(&kvd_of("nb").worker));
    assert_eq!(w.fleet.index().blocks_of(&kvd_of("nb"), Tier::Host), 0);
    assert_eq!(w.fleet.kvd_sources().len(), 1);
}

#[test]
fn the_prefill_leg_of_a_pd_pair_counts_its_tier_hits() {
    let mut w = two_nodes([Role::Prefill, Role::Prefill]);
    w.apply(Event::WorkerRegistered(WorkerRegistered {
        record: record("d:1", Role::Decode),
    }));
    let tokens: Vec<u32> = (0..64).collect();
    w.kvd_store("na", Tier::Host, &kvd_hashes(&tokens));
    for seed in 0..8 {
        let mut r = Router::new(RouterConfig {
            seed,
            ..RouterConfig::default()
        });
        let d = r
            .decide(&w.fleet, &tiered_request(&w, "r", &tokens), 0)
            .expect("decision");
        let prefill = d
            .legs
            .iter()
            .find(|l| l.role == Role::Prefill)
            .expect("leg");
        assert_eq!(prefill.worker, WorkerRank::new("a:1", 0));
    }
}

#[test]
fn a_snapshot_keeps_the_measured_speeds_and_the_kvd_inventory() {
    let mut w = two_nodes([Role::Mixed, Role::Mixed]);
    let tokens: Vec<u32> = (0..64).collect();
    w.kvd_store("nb", Tier::Disk, &kvd_hashes(&tokens));
    w.measured("nb", Tier::Disk, 3e9);
    let mut rebuilt = World::new(&[]);
    for event in w.fleet.dump() {
        rebuilt.apply(event);
    }
    assert!(rebuilt.fleet == w.fleet);
    let kvd = rebuilt.fleet.index().slot(&kvd_of("nb")).expect("slot");
    assert_eq!(
        rebuilt
            .fleet
            .tier_load(kvd, Tier::Disk)
            .map(|l| l.bytes_per_s),
        Some(3e9)
    );
}
