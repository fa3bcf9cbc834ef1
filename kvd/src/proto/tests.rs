//! Round trips of every request and reply, and the error classes of bad frames.

use super::*;
use rmpv::Value;

fn body(parts: Vec<Bytes>) -> Bytes {
    let mut all: Vec<u8> = parts.iter().flat_map(|p| p.iter().copied()).collect();
    let len = u32::from_be_bytes([all[0], all[1], all[2], all[3]]) as usize;
    assert_eq!(len, all.len() - 4, "the prefix counts the body");
    Bytes::from(all.split_off(4))
}

#[test]
fn every_request_round_trips() {
    let ns = Namespace::new("m", "fp8");
    let big = Bytes::from(vec![7u8; 100_000]);
    let requests = vec![
        Request::Hello {
            client_id: "c".into(),
            protocol_version: 1,
            prefers_shared_arena: true,
        },
        Request::Get {
            ns: ns.clone(),
            key: Bytes::from_static(b"k"),
        },
        Request::BatchGet {
            ns: ns.clone(),
            keys: vec![Bytes::from_static(b"a"), Bytes::from_static(b"b")],
        },
        Request::Set {
            ns: ns.clone(),
            item: SetItem::new(&b"k"[..], big.clone())
                .retention(Retention::Long)
                .ttl_seconds(2.5),
        },
        Request::BatchSet {
            ns: ns.clone(),
            items: vec![
                SetItem::new(&b"a"[..], &b"1"[..]),
                SetItem::new(&b"b"[..], &b"2"[..]).ttl_seconds(1.0),
            ],
        },
        Request::SetReserve { size: 9 },
        Request::SetCommit {
            ns: ns.clone(),
            lease_token: 3,
            key: Bytes::from_static(b"k"),
            length: 4,
            retention: Retention::Ephemeral,
            ttl_seconds: 5,
        },
        Request::SetCancel { lease_token: 3 },
        Request::PrefetchHint {
            ns: ns.clone(),
            keys: vec![Bytes::from_static(b"a")],
            deadline_ms: 50,
        },
        Request::Exists {
            ns: ns.clone(),
            keys: vec![],
        },
        Request::Clear { ns },
        Request::Stats { extended: true },
    ];
    for (i, req) in requests.into_iter().enumerate() {
        let id = Value::from(i as u64);
        let decoded = decode_request(&body(req.encode(Some(&id))), Limits::default()).unwrap();
        assert_eq!(decoded.id, Some(id));
        assert_eq!(decoded.request, Ok(req));
    }
}

#[test]
fn every_response_round_trips() {
    let mut stats = StatsReply {
        entries: 1,
        hits_total: 2,
        ..StatsReply::default()
    };
    let responses = vec![
        Response::HelloAck {
            server_id: "s".into(),
            protocol_version: 1,
            shared_arena: None,
            kv_events_endpoint: None,
            kv_events_replay_endpoint: None,
        },
        Response::HelloAck {
            server_id: "s".into(),
            protocol_version: 1,
            shared_arena: Some([1 << 30, 1 << 20, 42]),
            kv_events_endpoint: Some("tcp://0.0.0.0:5590".into()),
            kv_events_replay_endpoint: None,
        },
        Response::HelloAck {
            server_id: "s".into(),
            protocol_version: 1,
            shared_arena: None,
            kv_events_endpoint: Some("tcp://127.0.0.1:40123".into()),
            kv_events_replay_endpoint: Some("tcp://127.0.0.1:40124".into()),
        },
        Response::Get {
            value: Some(Bytes::from(vec![1u8; 20_000])),
            retention: Some(Retention::Long),
        },
        Response::Get {
            value: None,
            retention: None,
        },
        Response::BatchGet {
            values: vec![None, Some(Bytes::from_static(b"x"))],
            retentions: vec![None, Some(Retention::None)],
        },
        Response::SetAck(SetAck::rejected("would_displace_higher_priority")),
        Response::BatchSetAck(vec![SetAck::accepted(), SetAck::rejected("too_large")]),
        Response::SetReserve {
            lease_token: 0,
            slot_id: -1,
            payload_offset: 0,
            payload_max_size: 0,
            reason: "no_arena".into(),
        },
        Response::SetCommit {
            accepted: false,
            reason: "no_arena".into(),
        },
        Response::SetCancel,
        Response::Exists {
            present: vec![true, false],
        },
        Response::Clear { cleared_entries: 4 },
        Response::Stats(stats.clone()),
        Response::error("bad_request", "nope"),
    ];
    stats.extended = Some(ExtendedStats {
        class_entries: [1, 2, 3, 4],
        expired_total: 9,
        ..ExtendedStats::default()
    });
    for resp in responses.into_iter().chain([Response::Stats(stats)]) {
        let decoded = decode_response(&body(resp.encode(None))).unwrap();
        assert_eq!(decoded.id, None);
        assert_eq!(decoded.response, resp);
    }
}

#[test]
fn bad_fields_keep_the_frame_but_not_the_request() {
    let mut buf = Vec::new();
    let v = Value::Map(vec![
        (Value::from("op"), Value::from("set")),
        (Value::from("key"), Value::from(3)),
        (Value::from("id"), Value::from("x")),
    ]);
    rmpv::encode::write_value(&mut buf, &v).unwrap();
    let d = decode_request(&Bytes::from(buf), Limits::default()).unwrap();
    assert_eq!(d.id, Some(Value::from("x")));
    let err = d.request.unwrap_err();
    assert_eq!(err.code, "bad_request");
    assert!(err.message.contains("`key`"), "{}", err.message);

    let mut buf = Vec::new();
    rmpv::encode::write_value(&mut buf, &Value::from(vec![Value::from(1)])).unwrap();
    assert!(matches!(
        decode_request(&Bytes::from(buf), Limits::default()),
        Err(FrameError::Malformed(_))
    ));
    assert!(decode_request(&Bytes::from_static(&[0xc1]), Limits::default()).is_err());
}

#[test]
fn batch_set_arity_mismatch_is_named() {
    let v = Value::Map(vec![
        (Value::from("op"), Value::from("batch_set")),
        (
            Value::from("keys"),
            Value::from(vec![Value::from(&b"a"[..])]),
        ),
        (Value::from("values"), Value::Array(vec![])),
        (Value::from("retentions"), Value::Array(vec![])),
        (Value::from("metadatas"), Value::Array(vec![])),
    ]);
    let mut buf = Vec::new();
    rmpv::encode::write_value(&mut buf, &v).unwrap();
    let err = decode_request(&Bytes::from(buf), Limits::default())
        .unwrap()
        .request
        .unwrap_err();
    assert_eq!(err.code, "batch_set_arity_mismatch");
}

#[test]
fn hello_ack_names_the_inventory_endpoints_and_ignores_unknown_fields() {
    let ack = |extra: Vec<(Value, Value)>| {
        let mut map = vec![
            (Value::from("op"), Value::from("hello_ack")),
            (Value::from("server_id"), Value::from("kvd-1")),
            (Value::from("protocol_version"), Value::from(1)),
            (Value::from("shared_arena"), Value::Nil),
        ];
        map.extend(extra);
        let mut buf = Vec::new();
        rmpv::encode::write_value(&mut buf, &Value::Map(map)).unwrap();
        decode_response(&Bytes::from(buf)).unwrap().response
    };
    // The Python kvd's reply, without our fields.
    match ack(Vec::new()) {
        Response::HelloAck {
            kv_events_endpoint: None,
            kv_events_replay_endpoint: None,
            ..
        } => {}
        other => panic!("{other:?}"),
    }
    // A later daemon's reply, with a field this decoder does not know.
    let later = ack(vec![
        (
            Value::from("kv_events_endpoint"),
            Value::from("tcp://0.0.0.0:5590"),
        ),
        (Value::from("kv_events_codec"), Value::from(2)),
    ]);
    match later {
        Response::HelloAck {
            kv_events_endpoint: Some(endpoint),
            kv_events_replay_endpoint: None,
            ..
        } => assert_eq!(endpoint, "tcp://0.0.0.0:5590"),
        other => panic!("{other:?}"),
    }
    // Off: the fields are not on the wire at all.
    let off = Response::HelloAck {
        server_id: "s".into(),
        protocol_version: 1,
        shared_arena: None,
        kv_events_endpoint: None,
        kv_events_replay_endpoint: None,
    };
    let text = body(off.encode(None));
    assert!(!text.windows(9).any(|w| w == b"kv_events"));
}
