use super::*;
use crate::clock::SystemClock;
use crate::event::WorkerRecord;
use crate::fleet::FleetConfig;
use crate::ids::RequestId;
use crate::policy::{RouteRequest, RouterConfig};
use crate::ports::transport::{Inbound, Outbound, RequestTransport};
use crate::service::test_support::record;
use crate::service::{ReplyBody, ServiceOptions, Share};
use bytes::Bytes;
use futures::FutureExt as _;
use std::sync::Arc;

fn w(id: &str) -> WorkerId {
    WorkerId::new(id)
}

fn health(unhealthy: u32, healthy: u32) -> Health {
    let h = Health::default();
    h.set_config(HealthConfig {
        unhealthy_threshold: unhealthy,
        healthy_threshold: healthy,
        ..HealthConfig::default()
    });
    h
}

#[test]
fn consecutive_failures_take_a_worker_out_and_passes_bring_it_back() {
    let h = health(3, 2);
    let a = w("a");
    assert_eq!(h.record(&a, false), None);
    assert_eq!(h.record(&a, true), None, "a pass resets the count");
    assert_eq!(h.record(&a, false), None);
    assert_eq!(h.record(&a, false), None);
    assert!(h.out().is_empty());
    assert_eq!(h.record(&a, false), Some(Change::Left));
    assert_eq!(h.out(), std::slice::from_ref(&a));
    assert_eq!(h.record(&a, false), None, "out once");
    assert_eq!(h.record(&a, true), None);
    assert_eq!(h.record(&a, true), Some(Change::Returned));
    assert!(h.out().is_empty());
    // A threshold of 0 never takes anyone out.
    let off = health(0, 2);
    for _ in 0..10 {
        assert_eq!(off.record(&a, false), None);
    }
    // Nothing an attempt watches is kept while the checks are off: no round would forget it.
    let (_, progress) = off.watch(&w("z"));
    assert_eq!(Arc::strong_count(&progress), 1);
}

#[test]
fn a_request_sees_its_worker_leave_even_after_it_registers_again() {
    let h = health(1, 1);
    let (a, b, c) = (w("a"), w("b"), w("c"));
    let mut left = Box::pin(h.watch(&a).0);
    assert!((&mut left).now_or_never().is_none());
    h.record(&a, false);
    assert!(left.now_or_never().is_some(), "resolved when it left");
    assert!(h.watch(&a).0.now_or_never().is_some(), "at once once out");
    // b's lease is lost and renewed between two rounds: its request still watches it, and its
    // stream's progress still counts on it.
    let (gone, progress) = h.watch(&b);
    let mut gone = Box::pin(gone);
    h.retain(|x| x != &b);
    assert!(
        Arc::ptr_eq(&progress, &h.watch(&b).1),
        "b's progress is kept"
    );
    assert!((&mut gone).now_or_never().is_none());
    h.record(&b, false);
    assert!(gone.now_or_never().is_some(), "the request sees b leave");
    // A worker that nothing holds is forgotten; the count follows what is kept.
    drop(h.watch(&c));
    h.retain(|x| x == &b);
    assert_eq!(h.out(), std::slice::from_ref(&b));
    drop(progress);
    h.retain(|x| x == &a);
    assert!(h.out().is_empty(), "b, held no more, is forgotten too");
}

/// A worker `wedged` that answers a stream's head and first chunk, or nothing at all, and
/// fails its probes; every other worker answers `ok` and passes.
#[derive(Debug)]
struct Fake {
    head_then_hang: bool,
}

#[async_trait::async_trait]
impl RequestTransport for Fake {
    fn name(&self) -> &'static str {
        "fake"
    }

    async fn send(&self, req: Outbound) -> Result<Inbound, TransportError> {
        if req.worker.as_str() != "wedged" {
            let body = futures::stream::iter([Ok(Bytes::from_static(b"ok"))]).boxed();
            return Ok(Inbound {
                status: http::StatusCode::OK,
                content_type: None,
                body,
            });
        }
        if !self.head_then_hang {
            std::future::pending::<()>().await;
        }
        let first = futures::stream::iter([Ok(Bytes::from_static(b"data: 1\n\n"))]);
        Ok(Inbound {
            status: http::StatusCode::OK,
            content_type: None,
            body: first.chain(futures::stream::pending()).boxed(),
        })
    }

    async fn probe(&self, worker: &WorkerRecord) -> Result<(), TransportError> {
        if worker.worker_id.as_str() == "wedged" {
            Err(TransportError::Failed("no answer".into()))
        } else {
            Ok(())
        }
    }
}

fn service(head_then_hang: bool) -> Service {
    let options = ServiceOptions {
        router: RouterConfig::default(),
        fleet: FleetConfig::default(),
        request_max_retries: 1,
        max_body_bytes: 1 << 16,
    };
    Service::new(
        options,
        Arc::new(Fake { head_then_hang }),
        Arc::new(SystemClock),
    )
}

fn request(st: &Service) -> RouteRequest {
    RouteRequest {
        request_id: RequestId::new(st.request_key("r")),
        model: "m".into(),
        prompt_tokens: 10,
        hashes: Vec::new(),
        retention: None,
        per_worker: Default::default(),
        exclude: Vec::new(),
        session: None,
        kvd: Vec::new(),
    }
}

#[tokio::test]
async fn a_request_waiting_on_a_wedged_worker_fails_over_when_it_leaves_routing() {
    let st = service(false);
    st.register_worker(record("wedged"));
    let forward = st.forward(
        request(&st),
        None,
        Share::default(),
        "/v1/completions",
        Bytes::new(),
        false,
    );
    let mut forward = Box::pin(forward);
    assert!(
        (&mut forward).now_or_never().is_none(),
        "it waits on the wedged worker"
    );
    st.register_worker(record("good"));
    for _ in 0..3 {
        assert!((&mut forward).now_or_never().is_none());
        st.check_health().await;
    }
    let reply = forward.await.expect("failed over to the good worker");
    let ReplyBody::Full(body) = reply.body else {
        panic!("a whole answer");
    };
    assert_eq!(&body[..], b"ok");
    assert_eq!(st.inner.health.out(), [w("wedged")]);
    assert!(
        st.render_metrics()
            .contains("infera_health_ejections_total 1")
    );
    // Out of routing: the next request goes to the good worker at once.
    let next = st.forward(
        request(&st),
        None,
        Share::default(),
        "/v1/completions",
        Bytes::new(),
        false,
    );
    assert!(next.now_or_never().is_some_and(|r| r.is_ok()));
}

#[tokio::test]
async fn a_stream_on_a_wedged_worker_ends_with_an_error_when_it_leaves_routing() {
    let st = service(true);
    st.register_worker(record("wedged"));
    let reply = st
        .forward(
            request(&st),
            None,
            Share::default(),
            "/v1/completions",
            Bytes::new(),
            true,
        )
        .await
        .expect("the head came");
    let ReplyBody::Stream(mut body) = reply.body else {
        panic!("a stream");
    };
    let first = body
        .next()
        .await
        .expect("a chunk")
        .expect("the first chunk");
    assert_eq!(&first[..], b"data: 1\n\n");
    let mut next = Box::pin(body.next());
    for _ in 0..3 {
        assert!((&mut next).now_or_never().is_none(), "the stream hangs");
        st.check_health().await;
    }
    let end = next
        .await
        .expect("an item")
        .expect_err("an error, never a silent end");
    assert!(end.to_string().contains("health checks"), "{end}");
    assert!(matches!(end, TransportError::Timeout(_)));
}

/// A prefill/decode worker of the MoRI-write protocol (both legs at once, no hand-off to read).
fn pd_record(id: &str, role: crate::event::Role) -> WorkerRecord {
    let mut r = record(id);
    r.disagg_mode = role;
    let ports = serde_json::json!({"kv_connector_extra_config":
        {"handshake_port": 6301, "notify_port": 6401, "tp_size": 1}});
    r.disagg_meta = Some(serde_json::json!({"protocol": "vllm-mori-write", "params": ports}));
    r
}

#[tokio::test]
async fn a_pd_pair_waiting_on_a_wedged_prefill_fails_over_when_it_leaves_routing() {
    use crate::event::Role;
    let st = service(false);
    st.register_worker(pd_record("wedged", Role::Prefill));
    st.register_worker(pd_record("decode", Role::Decode));
    let body = Bytes::from_static(br#"{"model": "m", "prompt": "x", "max_tokens": 4}"#);
    let forward = st.forward(
        request(&st),
        None,
        Share::default(),
        "/v1/completions",
        body,
        false,
    );
    let mut forward = Box::pin(forward);
    if let Some(r) = (&mut forward).now_or_never() {
        panic!(
            "it waits on the wedged prefill leg, not {:?}",
            r.map(|r| r.status)
        );
    }
    st.register_worker(pd_record("prefill", Role::Prefill));
    for _ in 0..3 {
        assert!((&mut forward).now_or_never().is_none());
        st.check_health().await;
    }
    let reply = tokio::time::timeout(std::time::Duration::from_secs(10), forward)
        .await
        .expect("the pair ended once its prefill worker left routing")
        .expect("failed over to the other prefill worker");
    let ReplyBody::Full(body) = reply.body else {
        panic!("a whole answer");
    };
    assert_eq!(&body[..], b"ok");
    assert_eq!(st.inner.health.out(), [w("wedged")]);
}

#[test]
fn at_most_the_capped_share_of_a_models_workers_is_ejected() {
    use crate::service::decide::capped;
    let st = service(false);
    for id in ["a", "b", "c", "d"] {
        st.register_worker(record(id));
    }
    let mut other = record("x");
    other.model_name = "other".into();
    st.register_worker(other);
    let ids = |v: &[&str]| v.iter().map(|i| w(i)).collect::<Vec<_>>();
    st.with_fleet(|f| {
        // Three of four out, at most half: the health checks' two first, the breaker's after.
        let (kept, released) = capped(f, "m", ids(&["a", "b"]), ids(&["b", "c", "x"]), 50);
        assert_eq!((kept, released), (ids(&["a", "b"]), 1));
        // Under the cap everything stays out; another model's worker never counts.
        assert_eq!(
            capped(f, "m", ids(&["a"]), ids(&["x"]), 50),
            (ids(&["a"]), 0)
        );
        // At least one, whatever the share.
        assert_eq!(
            capped(f, "m", ids(&["d", "c"]), Vec::new(), 10),
            (ids(&["d"]), 1)
        );
        assert_eq!(
            capped(f, "m", ids(&["a", "b", "c", "d"]), Vec::new(), 100).1,
            0
        );
    });
}

#[tokio::test]
async fn streams_that_relay_nothing_fail_the_probes_after_the_stall_timeout() {
    use futures::StreamExt as _;
    let h = health(3, 2);
    let a = w("a");
    let t0 = tokio::time::Instant::now();
    let secs = |n: u64| t0 + std::time::Duration::from_secs(n);
    assert!(!h.stalled(&a, t0), "no stream, no stall");
    assert!(!h.stalled(&a, secs(60)));
    let stream = |rx| -> BodyStream { Box::pin(rx) };
    let never = || std::future::pending::<WorkerId>();

    // A response before its first byte (a long prefill) is no stream.
    let (_prefilling, rx) = futures::channel::mpsc::unbounded();
    let waiting = guard_body(stream(rx), never(), h.watch(&a).1);
    assert!(!h.stalled(&a, secs(61)));
    assert!(!h.stalled(&a, secs(120)));

    // A stream past its first chunk that then relays nothing.
    let (tx, rx) = futures::channel::mpsc::unbounded();
    let mut body = guard_body(stream(rx), never(), h.watch(&a).1);
    tx.unbounded_send(Ok(Bytes::from("data: 1"))).unwrap();
    assert!(body.next().await.is_some());
    assert!(!h.stalled(&a, secs(200)), "it just relayed");
    assert!(!h.stalled(&a, secs(201)), "flat since 201");
    assert!(!h.stalled(&a, secs(206)));
    assert!(
        h.stalled(&a, secs(207)),
        "6 s flat: the default stall timeout"
    );
    tx.unbounded_send(Ok(Bytes::from("data: 2"))).unwrap();
    assert!(body.next().await.is_some());
    assert!(!h.stalled(&a, secs(208)), "a chunk is progress");
    assert!(!h.stalled(&a, secs(209)), "flat since 209");
    assert!(!h.stalled(&a, secs(214)));
    assert!(h.stalled(&a, secs(215)));
    // Ended streams are no longer held.
    drop(body);
    assert!(!h.stalled(&a, secs(300)));
    drop(waiting);

    // Off: never stalled.
    let off = Health::default();
    off.set_config(HealthConfig {
        stall_timeout: std::time::Duration::ZERO,
        ..HealthConfig::default()
    });
    let (tx, rx) = futures::channel::mpsc::unbounded();
    let mut body = guard_body(stream(rx), never(), off.watch(&a).1);
    tx.unbounded_send(Ok(Bytes::from("x"))).unwrap();
    assert!(body.next().await.is_some());
    assert!(!off.stalled(&a, secs(400)));
    assert!(!off.stalled(&a, secs(900)));
}
