//! What an inline image costs the router per request: [`ImageRef::of_url`] on the `url` of an
//! `image_url` part, which hashes the base64 text (SHA-256) and decodes only the image's first
//! 96 KiB to read its size.
//!
//! * `of_url/png-1mp`: a 1000 × 1000 RGB PNG stored without compression (3 MB, 4 MB of base64):
//!   the heaviest 1 MP image a client sends.
//! * `of_url/jpeg-1mp`: a 1 MP photo's typical 300 KB as JPEG.
//!
//! Target: under 10 ms for the 3 MB PNG on one core, well below the engine's own decode and
//! vision-encoder time for it. After criterion's figures the bench prints each image's p50 and
//! p99 over 500 single calls, since a request pays one call, not an average.

use std::hint::black_box;
use std::time::Instant;

use base64::Engine as _;
use criterion::{Criterion, criterion_group, criterion_main};
use infera_adapters::tokenize::image::ImageRef;

/// A PNG of `side × side` RGB pixels, `filler` bytes after its header (as much as its IDAT).
fn png(side: u32, filler: usize) -> Vec<u8> {
    let mut bytes = b"\x89PNG\r\n\x1a\n\0\0\0\x0dIHDR".to_vec();
    bytes.extend(side.to_be_bytes());
    bytes.extend(side.to_be_bytes());
    bytes.extend([8, 2, 0, 0, 0, 0, 0, 0, 0]);
    let mut x = 0x9E37_79B9_u32;
    bytes.extend((0..filler).map(|_| {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        x.to_le_bytes()[0]
    }));
    bytes
}

/// A JPEG's start and frame header of `side × side`, then `filler` bytes.
fn jpeg(side: u16, filler: usize) -> Vec<u8> {
    let mut bytes = vec![0xFF, 0xD8, 0xFF, 0xC0, 0, 17, 8];
    bytes.extend(side.to_be_bytes());
    bytes.extend(side.to_be_bytes());
    bytes.extend([3, 1, 0x22, 0, 2, 0x11, 1, 3, 0x11, 1]);
    bytes.extend(std::iter::repeat_n(0x5A, filler));
    bytes
}

fn url(mime: &str, bytes: &[u8]) -> String {
    let b64 = base64::engine::general_purpose::STANDARD.encode(bytes);
    format!("data:{mime};base64,{b64}")
}

fn bench(c: &mut Criterion) {
    let mut group = c.benchmark_group("of_url");
    for (name, url) in [
        ("png-1mp", url("image/png", &png(1000, 3_000_000))),
        ("jpeg-1mp", url("image/jpeg", &jpeg(1000, 300_000))),
    ] {
        assert_eq!(ImageRef::of_url(&url).size, Some((1000, 1000)), "{name}");
        group.bench_function(name, |b| b.iter(|| ImageRef::of_url(black_box(&url))));
        let mut calls: Vec<f64> = (0..500)
            .map(|_| {
                let start = Instant::now();
                black_box(ImageRef::of_url(black_box(&url)));
                start.elapsed().as_secs_f64() * 1e3
            })
            .collect();
        calls.sort_by(f64::total_cmp);
        eprintln!(
            "of_url/{name}: p50 {:.3} ms, p99 {:.3} ms over {} calls",
            calls[calls.len() / 2],
            calls[calls.len() * 99 / 100],
            calls.len()
        );
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
