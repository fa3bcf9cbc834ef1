use super::*;

fn msg(headers: &[(&str, &str)], payload: &str) -> async_nats::Message {
    let mut map = async_nats::HeaderMap::new();
    for (k, v) in headers {
        map.insert(*k, *v);
    }
    async_nats::Message {
        subject: "_INBOX.x".into(),
        reply: None,
        payload: Bytes::from(payload.to_owned()),
        headers: (!headers.is_empty()).then_some(map),
        status: None,
        description: None,
        length: payload.len(),
    }
}

#[test]
fn replies_are_read_in_sequence() {
    let mut seq = 0;
    let data = parse_reply(
        &msg(&[("rs-type", "data"), ("rs-seq", "0")], "a"),
        &mut seq,
        "w",
    );
    assert_eq!(data.unwrap(), Chunk::Data(Bytes::from_static(b"a")));
    let done = parse_reply(
        &msg(
            &[("rs-type", "done"), ("rs-seq", "1"), ("rs-status", "429")],
            "",
        ),
        &mut seq,
        "w",
    );
    assert_eq!(
        done.unwrap(),
        Chunk::Done(http::StatusCode::TOO_MANY_REQUESTS)
    );
    assert_eq!(seq, 2);
}

#[test]
fn a_skipped_repeated_or_garbled_seq_is_a_sequence_error() {
    for (next, header) in [(0, "1"), (3, "2"), (1, "one"), (0, "-1"), (0, "")] {
        let mut seq = next;
        let err = parse_reply(
            &msg(&[("rs-type", "data"), ("rs-seq", header)], "x"),
            &mut seq,
            "w",
        )
        .unwrap_err();
        assert!(
            matches!(err, TransportError::Sequence(_)),
            "{header}: {err:?}"
        );
        assert_eq!(err.status(), 502);
    }
}

#[test]
fn python_replies_without_our_headers_are_accepted() {
    let mut seq = 0;
    // No headers at all: a data chunk; a done without a status: 200; a bad status: 200.
    assert_eq!(
        parse_reply(&msg(&[], "raw"), &mut seq, "w").unwrap(),
        Chunk::Data(Bytes::from_static(b"raw"))
    );
    assert_eq!(
        parse_reply(&msg(&[("rs-type", "done")], ""), &mut seq, "w").unwrap(),
        Chunk::Done(http::StatusCode::OK)
    );
    assert_eq!(
        parse_reply(
            &msg(&[("rs-type", "done"), ("rs-status", "abc")], ""),
            &mut seq,
            "w"
        )
        .unwrap(),
        Chunk::Done(http::StatusCode::OK)
    );
    assert_eq!(seq, 0);
}

#[test]
fn a_worker_timeout_is_a_504_not_a_failed_worker() {
    let mut seq = 0;
    let err = parse_reply(
        &msg(&[("rs-type", "error"), ("rs-status", "504")], "ran past 1s"),
        &mut seq,
        "w",
    )
    .unwrap_err();
    assert!(
        matches!(err, TransportError::Timeout(ref m) if m.contains("ran past 1s")),
        "{err:?}"
    );
    assert_eq!(err.status(), 504);
    assert!(!err.retry_elsewhere());
    // Any other status on an error is still a failure of the worker.
    let err = parse_reply(
        &msg(&[("rs-type", "error"), ("rs-status", "500")], "boom"),
        &mut seq,
        "w",
    )
    .unwrap_err();
    assert_eq!(err, TransportError::Failed("boom".to_owned()));
}

#[test]
fn errors_unknown_types_and_no_responders_are_told_apart() {
    let mut seq = 0;
    let err = parse_reply(&msg(&[("rs-type", "error")], "engine down"), &mut seq, "w");
    assert_eq!(
        err.unwrap_err(),
        TransportError::Failed("engine down".to_owned())
    );
    let err = parse_reply(&msg(&[("rs-type", "bogus")], ""), &mut seq, "w").unwrap_err();
    assert!(
        matches!(err, TransportError::Failed(ref m) if m.contains("bogus")),
        "{err:?}"
    );
    let mut none = msg(&[], "");
    none.status = Some(async_nats::StatusCode::NO_RESPONDERS);
    let err = parse_reply(&none, &mut seq, "w").unwrap_err();
    assert!(err.retry_elsewhere(), "{err:?}");
}

#[test]
fn a_jetstream_ack_on_a_core_inbox_is_stray_but_a_reply_never_is() {
    let ack = msg(&[], r#"{"stream":"INFERA_REQUESTS","seq":7}"#);
    assert!(is_stray_pub_ack(&ack));
    // The same bytes as a worker's reply (it always sets rs-type) are data.
    let reply = msg(
        &[("rs-type", "data")],
        r#"{"stream":"INFERA_REQUESTS","seq":7}"#,
    );
    assert!(!is_stray_pub_ack(&reply));
    assert!(!is_stray_pub_ack(&msg(&[], r#"{"ok":true}"#)));
}

#[test]
fn an_error_reply_with_a_429_status_is_a_failure_like_any_other() {
    // Workers no longer refuse by themselves; the servers read the JetStream backlog instead.
    let mut seq = 0;
    let err = parse_reply(
        &msg(&[("rs-type", "error"), ("rs-status", "429")], "busy"),
        &mut seq,
        "w",
    )
    .unwrap_err();
    assert_eq!(err, TransportError::Failed("busy".to_owned()));
}
