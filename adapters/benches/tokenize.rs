//! Plain `tokenizers` encode vs `infera_adapters::tokenize::Tokenizer` on the DeepSeek fixture.
//!
//! * `cold/{plain,ours,ours-1t}/{1k,8k,32k}`: realistic mixed prompts; our chunk cache is
//!   cleared before every iteration (outside the timing). `plain` is the crate call, whose
//!   internal BPE word cache stays warm, as it does in a running router. `ours` is the router's
//!   tokenizer (native encoder; its word table is built at load, so nothing carries over
//!   between iterations but the chunk cache, which is cleared); `ours-1t` is the same with the
//!   rayon fan-out disabled, i.e. one core.
//! * `warm32k/{plain,ours}`: a ~32k-token prompt whose first ~30k tokens were encoded before;
//!   every iteration gets a fresh, never-seen ~2k-token tail.

use std::hint::black_box;
use std::path::Path;
use std::time::{Duration, Instant};

use criterion::{BatchSize, BenchmarkId, Criterion, criterion_group, criterion_main};
use infera_adapters::tokenize::{Tokenizer, TokenizerOptions};

const PARAGRAPHS: &[&str] = &[
    "The router tokenizes every request itself, so the cost of tokenization sits on the critical \
     path of each routing decision. Caching repeated prefixes keeps that cost proportional to \
     the new text rather than to the whole conversation, which matters for agents that resend \
     long histories on every turn.",
    "fn route(&self, req: &Request) -> Result<WorkerId, RouteError> {\n    let blocks = self.hash_blocks(&req.tokens);\n    let overlaps = self.index.overlap(&blocks);\n    self.policy.pick(&overlaps, &self.load)\n}\n",
    "{\"model\": \"deepseek-v4\", \"temperature\": 0.7, \"messages\": [{\"role\": \"user\", \"content\": \"Summarize the attached report in three bullet points.\"}], \"max_tokens\": 512}",
    "Kubernetes operators reconcile the desired state with the observed state in a loop; when a \
     pod is evicted, the controller notices the difference and schedules a replacement on a node \
     with enough free memory and a matching accelerator.",
    "路由器在每个请求到达时都会自行分词，以计算前缀块的哈希值，然后选择缓存命中最多的工作节点。",
    "def merge(a, b):\n    out = []\n    i = j = 0\n    while i < len(a) and j < len(b):\n        if a[i] <= b[j]:\n            out.append(a[i]); i += 1\n        else:\n            out.append(b[j]); j += 1\n    return out + a[i:] + b[j:]\n",
];

fn paragraph_text(paragraphs: usize, tag: &str) -> String {
    let mut text = String::new();
    for i in 0..paragraphs {
        text.push_str(&format!("{tag} note {i}: "));
        text.push_str(PARAGRAPHS[i % PARAGRAPHS.len()]);
        text.push_str("\n\n");
    }
    text
}

/// The longest prefix of `text` (at a char boundary) with at most `tokens` tokens, by bisection.
fn cut_to_tokens(tok: &Tokenizer, text: &str, tokens: usize) -> String {
    let bounds: Vec<usize> = text
        .char_indices()
        .map(|(i, _)| i)
        .chain([text.len()])
        .collect();
    let fits = |end: usize| {
        tok.encode_plain(&text[..end])
            .is_ok_and(|v| v.len() <= tokens)
    };
    let (mut lo, mut hi) = (0, bounds.len() - 1);
    while lo < hi {
        let mid = (lo + hi).div_ceil(2);
        if fits(bounds[mid]) {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    text[..bounds[lo]].to_string()
}

fn benches(c: &mut Criterion) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/tokenizers/deepseek-v4");
    let started = Instant::now();
    let _plain_only = tokenizers::Tokenizer::from_file(dir.join("tokenizer.json")).expect("loads");
    let crate_load = started.elapsed();
    let started = Instant::now();
    let tok = Tokenizer::from_path(&dir).expect("fixture loads");
    let ours_load = started.elapsed();
    eprintln!(
        "load: tokenizers::Tokenizer::from_file {crate_load:.1?}, Tokenizer::from_path {ours_load:.1?} \
         (fast path: {})",
        tok.fast_path()
    );
    let single = Tokenizer::from_path_with(
        &dir,
        TokenizerOptions {
            parallel_min_bytes: usize::MAX,
            ..TokenizerOptions::default()
        },
    )
    .expect("fixture loads");
    let chat_prefix = "<｜begin▁of▁sentence｜>You are a careful assistant.<｜User｜>";
    let big = format!("{chat_prefix}{}", paragraph_text(900, "base"));

    let mut cold = c.benchmark_group("cold");
    cold.sample_size(20)
        .measurement_time(Duration::from_secs(4));
    for (label, tokens) in [("1k", 1_000), ("8k", 8_000), ("32k", 32_000)] {
        let text = cut_to_tokens(&tok, &big, tokens);
        let n = tok.encode_plain(&text).map(|v| v.len()).unwrap_or(0);
        eprintln!("cold {label}: {n} tokens, {} bytes", text.len());
        cold.bench_with_input(BenchmarkId::new("plain", label), &text, |b, text| {
            b.iter(|| tok.encode_plain(black_box(text)).map(|v| v.len()))
        });
        for (name, tok) in [("ours", &tok), ("ours-1t", &single)] {
            cold.bench_with_input(BenchmarkId::new(name, label), &text, |b, text| {
                b.iter_batched(
                    || tok.clear_cache(),
                    |()| tok.encode(black_box(text)).map(|v| v.len()),
                    BatchSize::PerIteration,
                )
            });
        }
    }
    cold.finish();

    let prefix = cut_to_tokens(&tok, &big, 30_000);
    let tail_tokens = tok
        .encode_plain(&paragraph_text(34, "tail 0"))
        .map(|v| v.len())
        .unwrap_or(0);
    eprintln!("warm32k: 30k-token prefix + {tail_tokens}-token fresh tail");
    let mut counter = 0u64;
    let mut next_text = || {
        counter += 1;
        format!("{prefix}{}", paragraph_text(34, &format!("tail {counter}")))
    };
    let mut warm = c.benchmark_group("warm32k");
    warm.sample_size(30)
        .measurement_time(Duration::from_secs(4));
    warm.bench_function("plain", |b| {
        b.iter_batched(
            &mut next_text,
            |text| tok.encode_plain(black_box(&text)).map(|v| v.len()),
            BatchSize::PerIteration,
        )
    });
    tok.clear_cache();
    let _ = tok.encode(&prefix);
    warm.bench_function("ours", |b| {
        b.iter_batched(
            &mut next_text,
            |text| tok.encode(black_box(&text)).map(|v| v.len()),
            BatchSize::PerIteration,
        )
    });
    warm.finish();
    eprintln!("cache after warm32k: {:?}", tok.cache_stats());
}

criterion_group!(tokenize, benches);
criterion_main!(tokenize);
