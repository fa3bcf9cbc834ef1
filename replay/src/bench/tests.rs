use super::*;

fn req(input_length: u32, hashes: &[u64]) -> TraceRequest {
    TraceRequest {
        arrival_us: 0,
        request_id: "r".into(),
        model: "m".into(),
        input_length,
        output_length: 4,
        block_size: 4,
        block_hashes: hashes.to_vec(),
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
    }
}

#[test]
fn shared_block_hashes_give_shared_token_prefixes() {
    let a = prompt_tokens(&req(10, &[1, 2, 3]), 0);
    let b = prompt_tokens(&req(12, &[1, 2, 9]), 1);
    let c = prompt_tokens(&req(8, &[7, 2]), 2);
    assert_eq!((a.len(), b.len(), c.len()), (10, 12, 8));
    assert_eq!(a[..8], b[..8]);
    assert_ne!(a[8..10], b[8..10]);
    // Block 1 has the same id but a different prefix: chained ids never repeat like this,
    // and the tokens follow the id alone.
    assert_ne!(a[..4], c[..4]);
    assert!(
        a.iter()
            .all(|t| (TOKEN_BASE..TOKEN_BASE + TOKEN_RANGE).contains(t))
    );
    // Deterministic, and a trailing partial block is its full block's beginning.
    assert_eq!(a, prompt_tokens(&req(10, &[1, 2, 3]), 5));
    assert_eq!(a[8..10], prompt_tokens(&req(12, &[1, 2, 3]), 0)[8..10]);
}

#[test]
fn tokens_past_the_last_hash_are_private_to_the_request() {
    let a = prompt_tokens(&req(10, &[1, 2]), 0);
    let b = prompt_tokens(&req(10, &[1, 2]), 1);
    assert_eq!(a[..8], b[..8]);
    assert_ne!(a[8..], b[8..]);
    let mut recorded = req(3, &[]);
    recorded.token_ids = Some(vec![5, 6, 7]);
    assert_eq!(prompt_tokens(&recorded, 0), vec![5, 6, 7]);
}

#[test]
fn chat_text_shares_prefixes_word_by_word() {
    let a = prompt_text(&req(8, &[1, 2]), 0);
    let b = prompt_text(&req(8, &[1, 3]), 1);
    let words = |s: &str| s.split(' ').skip(1).map(str::to_owned).collect::<Vec<_>>();
    let (wa, wb) = (words(&a), words(&b));
    assert_eq!((wa.len(), wb.len()), (8, 8));
    assert_eq!(wa[..4], wb[..4]);
    assert_ne!(wa[4..], wb[4..]);
}

#[test]
fn sse_events_survive_any_split() {
    let body = b"data: {\"a\":1}\r\n\r\n: comment\n\ndata: x\ndata: y\n\ndata: [DONE]\n\n";
    for cut in 0..body.len() {
        let mut p = SseParser::default();
        let mut got = Vec::new();
        p.feed(&body[..cut], |e| got.push(e.to_owned()));
        p.feed(&body[cut..], |e| got.push(e.to_owned()));
        assert_eq!(got, vec!["{\"a\":1}", "x\ny", "[DONE]"], "cut at {cut}");
    }
}

#[test]
fn chunks_of_both_apis() {
    assert_eq!(parse_chunk("[DONE]"), Chunk::Done);
    assert_eq!(
        parse_chunk(r#"{"choices":[{"index":0,"text":" the","finish_reason":null}]}"#),
        Chunk::Data {
            text: true,
            usage: None
        }
    );
    assert_eq!(
        parse_chunk(r#"{"choices":[{"delta":{"role":"assistant","content":""}}]}"#),
        Chunk::Data {
            text: false,
            usage: None
        }
    );
    assert_eq!(
        parse_chunk(
            r#"{"choices":[],"usage":{"prompt_tokens":10,"completion_tokens":3,"total_tokens":13,"prompt_tokens_details":{"cached_tokens":8}}}"#
        ),
        Chunk::Data {
            text: false,
            usage: Some(Usage {
                prompt_tokens: 10,
                completion_tokens: 3,
                cached_tokens: Some(8)
            })
        }
    );
    assert_eq!(
        parse_chunk(r#"{"error":{"message":"boom","code":500}}"#),
        Chunk::Error("boom".into())
    );
    assert_eq!(parse_chunk("not json"), Chunk::Invalid);
}

fn record(i: usize, status: Status, cached: u32) -> RequestRecord {
    RequestRecord {
        index: i,
        request_id: format!("r{i}"),
        scheduled_us: i as u64 * 1000,
        sent_us: i as u64 * 1000 + 10,
        wait_us: 0,
        status,
        ttft_us: Some(1000 * (i as u64 + 1)),
        itl_us: vec![100, 300],
        e2e_us: 5000,
        input_length: 16,
        blocks: 4,
        block_size: 4,
        usage: Some(Usage {
            prompt_tokens: 16,
            completion_tokens: 3,
            cached_tokens: Some(cached),
        }),
        text_chunks: 3,
    }
}

#[test]
fn summary_counts_errors_and_the_reported_hit_rate() {
    let records = vec![
        record(0, Status::Ok, 0),
        record(1, Status::Ok, 8),
        record(2, Status::Http(429), 0),
        record(3, Status::Transport("refused".into()), 0),
    ];
    let s = BenchSummary::of(&records);
    assert_eq!((s.requests, s.ok, s.errors), (4, 2, 2));
    assert_eq!((s.http_429, s.transport_errors, s.http_other), (1, 1, 0));
    assert_eq!(s.hit_rate, Some(0.25));
    assert_eq!(s.ttft_ms.p50, 1.5);
    assert_eq!(s.itl_ms.max, 0.3);
    assert!((s.duration_s - 0.00801).abs() < 1e-9, "{}", s.duration_s);
    let sim = to_sim_result(&records);
    assert_eq!(sim.requests[1].gpu_hit_blocks, 2);
    assert!(sim.requests[2].rejected);
    assert_eq!(sim.requests[1].tpot_us, 200.0);
    assert!(s.render().contains("25.0 %"));
}
