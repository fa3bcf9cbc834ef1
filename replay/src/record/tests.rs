use super::*;
use crate::trace::{LoadOptions, load};
use arrow_array::Array as _;
use infera_core::event::{
    Engine, Event, KvBlocksStored, RequestFinished, RequestRouted, RequestTransport, Role,
    RoutedLeg, Tier, WorkerRecord, WorkerRegistered,
};
use infera_core::hashing::identity::MmRun;
use infera_core::ids::{BlockHash, EngineHash, RequestId, WorkerId, WorkerRank};
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;

const BS: u32 = 16;

pub(crate) fn env(seq: u64, ts_us: u64, event: Event) -> Envelope {
    Envelope {
        v: 2,
        seq,
        ts_us,
        source: None,
        event,
    }
}

pub(crate) fn registered(id: &str) -> Event {
    Event::WorkerRegistered(WorkerRegistered {
        record: WorkerRecord {
            worker_id: WorkerId::new(id),
            url: format!("http://{id}"),
            model_name: "m".into(),
            engine: Engine::Vllm,
            disagg_mode: Role::Mixed,
            disagg_meta: None,
            kv_events_endpoint: None,
            kv_block_size: BS,
            dp_rank: 0,
            dp_size: 1,
            request_transport: RequestTransport::Http,
            kv: None,
            extra: serde_json::Map::new(),
        },
    })
}

pub(crate) fn routed(id: &str, worker: &str, at_us: u64, prompt_tokens: u32) -> Event {
    let blocks = (0..u64::from(prompt_tokens / BS)).map(BlockHash).collect();
    Event::RequestRouted(RequestRouted {
        request_id: RequestId::new(id),
        model: "m".into(),
        legs: vec![RoutedLeg {
            worker: WorkerRank::new(worker, 0),
            role: Role::Mixed,
            overlap_blocks: 1,
        }],
        blocks,
        prompt_tokens,
        policy: "kv-aware".into(),
        weights: Vec::new(),
        top: Vec::new(),
        retention: None,
        at_us,
        tenant: None,
        session: None,
    })
}

pub(crate) fn finished(id: &str, status: RequestStatus) -> Event {
    Event::RequestFinished(RequestFinished {
        request_id: RequestId::new(id),
        status,
        ttft_us: Some(1_500),
        tokens_in: 64,
        tokens_out: 7,
        cached_tokens: Some(32),
    })
}

struct Rig {
    dir: tempfile::TempDir,
    rec: Recorder,
    seq: u64,
}

impl Rig {
    fn new(configure: impl FnOnce(&mut RecorderOptions)) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut opts = RecorderOptions::new(dir.path().join("rec"));
        configure(&mut opts);
        let mut rig = Self {
            rec: Recorder::new(opts, 1_000).expect("recorder"),
            dir,
            seq: 0,
        };
        rig.feed(0, registered("w1"));
        rig.feed(0, registered("w2"));
        rig
    }

    fn feed(&mut self, ts_us: u64, event: Event) {
        self.seq += 1;
        self.rec.feed(&env(self.seq, ts_us, event));
    }

    fn path(&self) -> PathBuf {
        self.dir.path().join("rec")
    }

    fn segments(&self) -> Vec<PathBuf> {
        let mut files: Vec<PathBuf> = std::fs::read_dir(self.path())
            .expect("dir")
            .map(|e| e.expect("entry").path())
            .filter(|p| p.extension().is_some_and(|e| e == "parquet"))
            .collect();
        files.sort();
        files
    }

    fn ids(&self) -> Vec<String> {
        load(&self.path(), &LoadOptions::default())
            .expect("the recording loads as a trace")
            .requests
            .into_iter()
            .map(|r| r.request_id)
            .collect()
    }
}

#[test]
fn rows_come_out_in_arrival_order_whatever_order_requests_finish_in() {
    let mut rig = Rig::new(|_| {});
    rig.feed(10, routed("a", "w1", 10, 64));
    let mut b = routed("b", "w2", 20, 40);
    if let Event::RequestRouted(r) = &mut b {
        r.tenant = Some("team-b".into());
    }
    rig.feed(20, b);
    rig.feed(30, routed("c", "w1", 30, 16));
    rig.feed(40, finished("c", RequestStatus::Ok));
    rig.feed(50, finished("b", RequestStatus::Ok));
    // `a` is still in flight: nothing after it may be written yet.
    rig.rec.tick(120_000_000);
    assert!(rig.segments().is_empty(), "{:?}", rig.segments());
    rig.feed(60, finished("a", RequestStatus::Ok));
    rig.rec.tick(240_000_000);
    assert_eq!(rig.ids(), ["a", "b", "c"]);
    let trace = load(&rig.path(), &LoadOptions::default()).expect("load");
    let a = &trace.requests[0];
    assert_eq!(
        (a.arrival_us, a.input_length, a.output_length, a.block_size),
        (10, 64, 7, BS)
    );
    assert_eq!(a.block_hashes, vec![0, 1, 2, 3]);
    assert_eq!(a.token_ids, None, "prompts are never recorded");
    let tenants: Vec<Option<&str>> = trace.requests.iter().map(|r| r.tenant.as_deref()).collect();
    assert_eq!(tenants, [None, Some("team-b"), None]);
    let stats = rig.rec.stats();
    assert_eq!((stats.rows_written, stats.segments_written), (3, 1));
}

#[test]
fn decision_and_outcome_columns_sit_beside_the_trace_columns() {
    let mut rig = Rig::new(|_| {});
    rig.feed(10, routed("a", "w2", 10, 32));
    rig.feed(20, finished("a", RequestStatus::Ok));
    let (stats, errors) = rig.rec.finish(100);
    assert!(errors.is_empty(), "{errors:?}");
    assert_eq!(stats.rows_written, 1);
    let file = std::fs::File::open(&rig.segments()[0]).expect("segment");
    let reader = ParquetRecordBatchReaderBuilder::try_new(file)
        .expect("parquet")
        .build()
        .expect("reader");
    let batch = reader.into_iter().next().expect("a batch").expect("batch");
    let string = |name: &str| {
        batch
            .column_by_name(name)
            .and_then(|c| c.as_any().downcast_ref::<arrow_array::StringArray>())
            .map(|a| a.value(0).to_owned())
    };
    assert_eq!(string("worker").as_deref(), Some("w2"));
    assert_eq!(string("status").as_deref(), Some("ok"));
    assert_eq!(string("policy").as_deref(), Some("kv-aware"));
    let cached = batch
        .column_by_name("cached_tokens")
        .and_then(|c| c.as_any().downcast_ref::<arrow_array::UInt32Array>())
        .map(|a| a.value(0));
    assert_eq!(cached, Some(32));
}

#[test]
fn a_retried_request_is_one_row_with_its_first_arrival() {
    let mut rig = Rig::new(|_| {});
    // Attempt ids as the server makes them: `<client id>#<request n>.<attempt n>`.
    rig.feed(10, routed("x#5.6", "w1", 10, 32));
    rig.feed(11, finished("x#5.6", RequestStatus::WorkerError));
    rig.feed(12, routed("x#5.9", "w2", 12, 32));
    rig.feed(30, finished("x#5.9", RequestStatus::Ok));
    // A plain failure that nobody retried is recorded as it ended.
    rig.feed(40, routed("y#7.8", "w1", 40, 16));
    rig.feed(41, finished("y#7.8", RequestStatus::WorkerError));
    let (stats, _) = rig.rec.finish(100);
    assert_eq!(stats.rows_written, 2);
    let trace = load(&rig.path(), &LoadOptions::default()).expect("load");
    assert_eq!(trace.requests[0].request_id, "x");
    assert_eq!(trace.requests[0].arrival_us, 10);
    assert_eq!(trace.requests[1].request_id, "y");
}

#[test]
fn concurrent_requests_sent_with_one_client_id_are_each_a_row() {
    let mut rig = Rig::new(|_| {});
    // Ten streams under one `x-infera-request-id`, all in flight at once, one retried.
    for k in 0..10u64 {
        rig.feed(10 + k, routed(&format!("same#{k}.{k}"), "w1", 10 + k, 32));
    }
    rig.feed(21, finished("same#3.3", RequestStatus::WorkerError));
    rig.feed(22, routed("same#3.40", "w2", 22, 32));
    for k in 0..10u64 {
        let attempt = if k == 3 { 40 } else { k };
        rig.feed(
            30 + k,
            finished(&format!("same#{k}.{attempt}"), RequestStatus::Ok),
        );
    }
    rig.rec
        .note_request(meta("same#4", Some("s4".into()), None), 50);
    let (stats, _) = rig.rec.finish(100);
    assert_eq!((stats.rows_written, stats.rows_unhashed), (10, 0));
    let trace = load(&rig.path(), &LoadOptions::default()).expect("load");
    let arrivals: Vec<u64> = trace.requests.iter().map(|r| r.arrival_us).collect();
    assert_eq!(
        arrivals,
        (10..20).collect::<Vec<_>>(),
        "the retry keeps its first arrival"
    );
    assert!(trace.requests.iter().all(|r| r.request_id == "same"));
    let sessions: Vec<Option<&str>> = trace
        .requests
        .iter()
        .map(|r| r.session_id.as_deref())
        .collect();
    let mut want = vec![None; 10];
    want[4] = Some("s4");
    assert_eq!(
        sessions, want,
        "a request's metadata lands on its own row only"
    );
}

#[test]
fn a_request_in_flight_too_long_stops_holding_rows_back_and_is_dropped_late() {
    let mut rig = Rig::new(|o| o.max_in_flight_us = 1_000);
    rig.feed(0, routed("slow", "w1", 0, 16));
    rig.feed(10, routed("fast", "w2", 10, 16));
    rig.feed(20, finished("fast", RequestStatus::Ok));
    rig.rec.tick(120_000_000);
    assert_eq!(rig.ids(), ["fast"]);
    rig.feed(130_000_000, finished("slow", RequestStatus::Ok));
    let (stats, _) = rig.rec.finish(130_000_001);
    assert_eq!((stats.rows_written, stats.rows_late), (1, 1));
    assert_eq!(rig.ids(), ["fast"], "the late row never breaks the order");
}

#[test]
fn requests_without_consistent_hashes_are_counted_not_recorded() {
    let mut rig = Rig::new(|_| {});
    let Event::RequestRouted(mut r) = routed("rr", "w1", 10, 64) else {
        unreachable!()
    };
    r.blocks.clear(); // round-robin does not tokenize
    rig.feed(10, Event::RequestRouted(r));
    rig.feed(20, finished("rr", RequestStatus::Ok));
    rig.feed(30, routed("unknown-worker", "w9", 30, 64));
    rig.feed(40, finished("unknown-worker", RequestStatus::Ok));
    let (stats, _) = rig.rec.finish(100);
    assert_eq!((stats.rows_written, stats.rows_unhashed), (0, 2));
}

#[test]
fn segments_rotate_by_size_and_age_and_read_back_as_one_trace() {
    let mut rig = Rig::new(|o| {
        o.segment_max_bytes = 600;
        o.segment_max_age_us = 1_000_000;
    });
    for i in 0..20u64 {
        let id = format!("r{i:02}");
        rig.feed(i * 100, routed(&id, "w1", i * 100, 64));
        rig.feed(i * 100 + 50, finished(&id, RequestStatus::Ok));
        rig.rec.tick(i * 100 + 50);
    }
    let by_size = rig.segments().len();
    assert!(by_size >= 3, "{by_size} segments");
    rig.feed(5_000, routed("last", "w1", 5_000, 64));
    rig.feed(5_001, finished("last", RequestStatus::Ok));
    rig.rec.tick(5_002);
    rig.rec.tick(2_000_000);
    assert_eq!(rig.segments().len(), by_size + 1, "rotated by age");
    let ids = rig.ids();
    let mut want: Vec<String> = (0..20).map(|i| format!("r{i:02}")).collect();
    want.push("last".into());
    assert_eq!(ids, want);
}

#[test]
fn other_events_go_to_the_event_files() {
    let mut rig = Rig::new(|_| {});
    let stored = Event::KvBlocksStored(KvBlocksStored {
        worker: WorkerRank::new("w1", 0),
        tier: Tier::Gpu,
        block_size: BS,
        engine_hashes: vec![EngineHash(5)],
        router_hashes: vec![BlockHash(9)],
        parent: None,
    });
    rig.feed(10, stored);
    let (stats, errors) = rig.rec.finish(100);
    assert!(errors.is_empty(), "{errors:?}");
    assert_eq!(stats.events_written, 3, "two registrations and one store");
    let events: Vec<PathBuf> = std::fs::read_dir(rig.path().join("events"))
        .expect("events dir")
        .map(|e| e.expect("entry").path())
        .collect();
    assert_eq!(events.len(), 1);
    let file = std::fs::File::open(&events[0]).expect("open");
    let batch = ParquetRecordBatchReaderBuilder::try_new(file)
        .expect("parquet")
        .build()
        .expect("reader")
        .next()
        .expect("batch")
        .expect("batch");
    let kinds = batch
        .column_by_name("kind")
        .and_then(|c| c.as_any().downcast_ref::<arrow_array::StringArray>())
        .expect("kind column");
    let kinds: Vec<&str> = (0..kinds.len()).map(|i| kinds.value(i)).collect();
    assert_eq!(
        kinds,
        ["worker_registered", "worker_registered", "kv_blocks_stored"]
    );
}

#[test]
fn a_segment_that_cannot_be_written_is_counted_and_loses_nothing_else() {
    let mut rig = Rig::new(|_| {});
    rig.feed(10, routed("a", "w1", 10, 32));
    rig.feed(20, finished("a", RequestStatus::Ok));
    // The directory disappears under the recorder (a full or unmounted disk looks alike).
    std::fs::remove_dir_all(rig.path()).expect("remove");
    rig.rec.tick(120_000_000);
    assert_eq!(
        rig.rec.stats().write_errors,
        2,
        "the segment and its events"
    );
    assert_eq!(rig.rec.take_errors().len(), 2);
    std::fs::create_dir_all(rig.path().join("events")).expect("recreate");
    rig.feed(130_000_000, routed("b", "w1", 130_000_000, 32));
    rig.feed(130_000_001, finished("b", RequestStatus::Ok));
    let (stats, errors) = rig.rec.finish(130_000_002);
    assert!(errors.is_empty(), "{errors:?}");
    assert_eq!(stats.rows_written, 1);
    assert_eq!(rig.ids(), ["b"]);
}

#[test]
fn sessions_and_prompts_join_their_rows_whenever_they_arrive() {
    let mut rig = Rig::new(|_| {});
    rig.rec
        .note_request(meta("early", Some("s1".into()), Some(vec![7; 32])), 5);
    rig.feed(10, routed("early", "w1", 10, 32));
    rig.feed(20, finished("early", RequestStatus::Ok));
    rig.feed(30, routed("late", "w1", 30, 16));
    rig.feed(40, finished("late", RequestStatus::Ok));
    rig.rec
        .note_request(meta("late", Some("s2".into()), None), 45);
    // A prompt that does not match the routed length is left out.
    rig.feed(50, routed("odd", "w1", 50, 16));
    rig.rec
        .note_request(meta("odd", None, Some(vec![1, 2, 3])), 50);
    rig.feed(60, finished("odd", RequestStatus::Ok));
    rig.rec.finish(100);
    let trace = load(&rig.path(), &LoadOptions::default()).expect("load");
    let got: Vec<(Option<&str>, Option<usize>)> = trace
        .requests
        .iter()
        .map(|r| (r.session_id.as_deref(), r.token_ids.as_ref().map(Vec::len)))
        .collect();
    assert_eq!(
        got,
        [(Some("s1"), Some(32)), (Some("s2"), None), (None, None)]
    );
}

#[test]
fn an_adapters_salted_request_with_an_image_is_recorded_with_its_identity_and_priority() {
    let mut rig = Rig::new(|_| {});
    rig.feed(10, routed("sql-req", "w1", 10, 32));
    rig.rec.note_request(
        RequestMeta {
            adapter: Some(("sql".into(), "base".into())),
            cache_salt: Some("tenant-a".into()),
            images: vec![MmRun {
                offset: 4,
                length: 20,
                id: "sha256-ab".into(),
            }],
            priority: Some(-3),
            ..meta("sql-req", None, None)
        },
        12,
    );
    rig.feed(20, finished("sql-req", RequestStatus::Ok));
    rig.rec.finish(100);
    let trace = load(&rig.path(), &LoadOptions::default()).expect("load");
    let r = &trace.requests[0];
    assert_eq!(
        (r.model.as_str(), r.lora.as_deref(), r.cache_salt.as_deref()),
        ("base", Some("sql"), Some("tenant-a"))
    );
    let image = crate::trace::TraceImage {
        offset: 4,
        length: 20,
        id: "sha256-ab".into(),
    };
    assert_eq!(r.images, [image], "the image's run, as the router keyed it");
    assert_eq!(r.priority, Some(-3), "the priority it asked for");
}

#[test]
fn a_sessions_later_turn_records_its_think_time() {
    let mut rig = Rig::new(|_| {});
    for (id, at) in [("t0", 10), ("t1", 100), ("t2", 150)] {
        rig.rec.note_request(meta(id, Some("s".into()), None), at);
    }
    rig.feed(10, routed("t0", "w1", 10, 32));
    rig.feed(60, finished("t0", RequestStatus::Ok));
    rig.feed(100, routed("t1", "w1", 100, 48));
    // t2 is sent while t1 still runs: no think time, it replays on the timeline.
    rig.feed(150, routed("t2", "w1", 150, 48));
    rig.feed(170, finished("t1", RequestStatus::Ok));
    rig.feed(180, finished("t2", RequestStatus::Ok));
    rig.rec.finish(200);
    let trace = load(&rig.path(), &LoadOptions::default()).expect("load");
    let think: Vec<Option<u64>> = trace.requests.iter().map(|r| r.think_time_us).collect();
    assert_eq!(think, [None, Some(40), None]);
}

/// The request metadata of `id`: its session and prompt, no adapter or salt.
fn meta(id: &str, session_id: Option<String>, token_ids: Option<Vec<u32>>) -> RequestMeta {
    RequestMeta {
        request_id: id.to_owned(),
        session_id,
        token_ids,
        adapter: None,
        cache_salt: None,
        images: Vec::new(),
        priority: None,
    }
}
