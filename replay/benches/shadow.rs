//! The shadow replay's cost (`infera server --auto-tune`): one assessment of a window of the
//! synthesized agentic trace (2,834 requests of sessions at 48 open at once, 4 workers: the
//! current tunables and their four neighbours), as the server's niced thread runs it. Divided by
//! the window's requests it is the CPU a minute of traffic costs at a given rate; the server's
//! budget (a tenth of one core) sizes each replay by it.

use criterion::{Criterion, criterion_group, criterion_main};
use infera_core::event::{Engine, KV_CAPACITY_BLOCKS, WorkerRecord};
use infera_core::ids::WorkerId;
use infera_replay::shadow::{Observed, ShadowOptions, Window, assess};
use infera_replay::sim::{self, SimConfig};
use infera_replay::trace::synth::{SynthConfig, synthesize};
use std::time::Duration;

fn bench(c: &mut Criterion) {
    let trace = synthesize(&SynthConfig {
        sessions: 144,
        concurrency: 48.0,
        ..SynthConfig::default()
    })
    .expect("synthesized");
    let block_size = trace.requests[0].block_size;
    let mut base = SimConfig {
        workers: 4,
        ..SimConfig::default()
    };
    base.engine.gpu_blocks = (1 << 20) / block_size as usize;
    let workers: Vec<WorkerRecord> = (0..4)
        .map(|i| {
            let mut r = WorkerRecord::mixed(
                WorkerId::new(format!("w{i}:8000")),
                format!("http://w{i}:8000"),
                &trace.requests[0].model,
                Engine::Vllm,
                block_size,
            );
            r.extra
                .insert(KV_CAPACITY_BLOCKS.into(), base.engine.gpu_blocks.into());
            r
        })
        .collect();
    // The fleet's own outcomes, from the simulator standing in for it.
    let served = sim::run(&trace, &base).expect("simulated");
    let mut window = Window::new(ShadowOptions::default());
    for (r, o) in trace.requests.iter().zip(&served.requests) {
        window.push(Observed {
            request: r.clone(),
            cached_tokens: Some(o.cached_tokens),
            ttft_us: Some(o.ttft_us),
        });
    }
    let mut group = c.benchmark_group("shadow");
    group
        .sample_size(10)
        .measurement_time(Duration::from_secs(20));
    group.bench_function("assess_agentic_2834", |b| {
        b.iter(|| assess(&window, &base, &workers, usize::MAX).expect("replayed"));
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
