//! Decoding of request frames (the daemon) and reply frames (the client).

use super::fields::{Fields, Limits, as_sint, as_uint, parse_map};
use super::msgpack::{Head, Raw};
use super::{
    DecodedRequest, DecodedResponse, ExtendedStats, FrameError, PROTOCOL_VERSION, Request,
    RequestError, Response, SetAck, SetItem, SharedSlot, StatsReply,
};
use bytes::Bytes;
use infera_core::event::Retention;

/// Decodes a request frame body (without its length prefix), held to `limits`.
///
/// # Errors
/// [`FrameError::Malformed`] when the body is not one msgpack map (or nests too deep, or has
/// too many fields); the caller answers and closes. A batch over `limits` is a
/// [`RequestError`] (`too_many_keys`) in the result.
pub fn decode_request(frame: &Bytes, limits: Limits) -> Result<DecodedRequest, FrameError> {
    let (id, f) = parse_map(frame, limits)?;
    Ok(DecodedRequest {
        id,
        request: request_from(&f),
    })
}

fn request_from(f: &Fields<'_>) -> Result<Request, RequestError> {
    Ok(match f.op.as_str() {
        "hello" => Request::Hello {
            client_id: f.string("client_id", "")?,
            protocol_version: f.uint("protocol_version", Some(PROTOCOL_VERSION))?,
            prefers_shared_arena: f.boolean("prefers_shared_arena")?,
        },
        "get" => Request::Get {
            ns: f.ns()?,
            key: f.bin("key")?,
        },
        "batch_get" => Request::BatchGet {
            ns: f.ns()?,
            keys: f.lookup_keys("keys")?,
        },
        "exists" => Request::Exists {
            ns: f.ns()?,
            keys: f.lookup_keys("keys")?,
        },
        "set" => Request::Set {
            ns: f.ns()?,
            item: SetItem {
                key: f.bin("key")?,
                value: f.bin("value")?,
                retention: f.retention(f.get("retention"), "retention")?,
                metadata: f.metadata(f.get("metadata"), "metadata")?,
                ttl_seconds: f.ttl(f.get("ttl_seconds"), "ttl_seconds")?,
            },
        },
        "batch_set" => batch_set_from(f)?,
        "set_reserve" => Request::SetReserve {
            size: f.uint("size", None)?,
        },
        "set_commit" => Request::SetCommit {
            ns: f.ns()?,
            lease_token: f.uint("lease_token", None)?,
            key: f.bin("key")?,
            length: f.uint("length", None)?,
            retention: f.retention(f.get("retention"), "retention")?,
            ttl_seconds: f.uint("ttl_seconds", Some(0))?,
        },
        "set_cancel" => Request::SetCancel {
            lease_token: f.uint("lease_token", None)?,
        },
        "prefetch_hint" => Request::PrefetchHint {
            ns: f.ns()?,
            keys: f.kept_list("keys")?,
            deadline_ms: f.uint("deadline_ms", Some(1000))?,
        },
        "clear" => Request::Clear { ns: f.ns()? },
        "stats" => Request::Stats {
            extended: f.boolean("extended")?,
        },
        "" => {
            return Err(RequestError {
                code: "bad_request",
                message: "the frame has no string `op` field".to_owned(),
            });
        }
        other => {
            return Err(RequestError {
                code: "unknown_op",
                message: format!(
                    "unknown op `{other}`; known: hello, get, batch_get, set, batch_set, \
                     set_reserve, set_commit, set_cancel, prefetch_hint, exists, clear, stats"
                ),
            });
        }
    })
}

fn batch_set_from(f: &Fields<'_>) -> Result<Request, RequestError> {
    let keys = f.batch("keys")?;
    let values = f.batch("values")?;
    let retentions = f.batch("retentions")?;
    let metadatas = f.opt_array("metadatas")?;
    let ttls = f.opt_array("ttls_seconds")?;
    let n = keys.len();
    let arity_ok = values.len() == n
        && retentions.len() == n
        && metadatas.as_ref().is_none_or(|m| m.len() == n)
        && ttls.as_ref().is_none_or(|t| t.len() == n);
    if !arity_ok {
        return Err(RequestError {
            code: "batch_set_arity_mismatch",
            message: format!(
                "batch_set arrays disagree: keys={n} values={} retentions={} metadatas={} \
                 ttls_seconds={}",
                values.len(),
                retentions.len(),
                metadatas
                    .as_ref()
                    .map_or_else(|| "nil".to_owned(), |m| m.len().to_string()),
                ttls.as_ref()
                    .map_or_else(|| "nil".to_owned(), |t| t.len().to_string()),
            ),
        });
    }
    let mut metadatas = metadatas.into_iter().flatten();
    let mut ttls = ttls.into_iter().flatten();
    let mut items = Vec::with_capacity(n);
    for ((key, value), retention) in keys.zip(values).zip(retentions) {
        items.push(SetItem {
            key: f
                .to_bytes(key)
                .ok_or_else(|| f.bad("keys", "an array of binary values"))?,
            value: f
                .to_bytes(value)
                .ok_or_else(|| f.bad("values", "an array of binary values"))?,
            retention: f.retention(Some(retention), "retentions")?,
            metadata: f.metadata(metadatas.next(), "metadatas")?,
            ttl_seconds: f.ttl(ttls.next(), "ttls_seconds")?,
        });
    }
    Ok(Request::BatchSet { ns: f.ns()?, items })
}

/// Decodes a reply frame body (without its length prefix); used by the client.
///
/// # Errors
/// A [`FrameError`] when the body is not a map or a field does not have the documented type.
pub fn decode_response(frame: &Bytes) -> Result<DecodedResponse, FrameError> {
    // Replies are as long as the daemon made them: no batch limit on this side.
    let (id, f) = parse_map(
        frame,
        Limits {
            max_keys: usize::MAX,
        },
    )?;
    let response = response_from(&f).map_err(|e| FrameError::Malformed(e.message))?;
    Ok(DecodedResponse { id, response })
}

fn opt_retention_of(
    f: &Fields<'_>,
    v: Option<Raw<'_>>,
    name: &str,
) -> Result<Option<Retention>, RequestError> {
    match v.map(|v| v.head) {
        None | Some(Head::Nil) => Ok(None),
        Some(Head::Str(s)) => std::str::from_utf8(s)
            .ok()
            .and_then(Retention::parse)
            .map(Some)
            .ok_or_else(|| f.bad(name, "a retention class")),
        _ => Err(f.bad(name, "a retention class or nil")),
    }
}

fn opt_string_of(
    f: &Fields<'_>,
    v: Option<Raw<'_>>,
    name: &str,
) -> Result<Option<String>, RequestError> {
    match v.map(|v| v.head) {
        None | Some(Head::Nil) => Ok(None),
        Some(Head::Str(s)) => Ok(Some(String::from_utf8_lossy(s).into_owned())),
        _ => Err(f.bad(name, "a string or nil")),
    }
}

fn response_from(f: &Fields<'_>) -> Result<Response, RequestError> {
    let field = |name: &str| f.get(name);
    Ok(match f.op.as_str() {
        "hello_ack" => Response::HelloAck {
            server_id: f.string("server_id", "")?,
            protocol_version: f.uint("protocol_version", Some(PROTOCOL_VERSION))?,
            shared_arena: match f.opt_array("shared_arena")? {
                None => None,
                Some(items) if items.len() == 3 => {
                    let mut out = [0u64; 3];
                    for (slot, v) in out.iter_mut().zip(items) {
                        *slot = as_uint(v).unwrap_or_default();
                    }
                    Some(out)
                }
                Some(_) => return Err(f.bad("shared_arena", "three integers or nil")),
            },
            kv_events_endpoint: opt_string_of(
                f,
                field("kv_events_endpoint"),
                "kv_events_endpoint",
            )?,
            kv_events_replay_endpoint: opt_string_of(
                f,
                field("kv_events_replay_endpoint"),
                "kv_events_replay_endpoint",
            )?,
        },
        "get_response" => Response::Get {
            value: match field("value") {
                None => None,
                Some(v) => Some(
                    f.to_bytes(v)
                        .ok_or_else(|| f.bad("value", "binary or nil"))?,
                ),
            },
            retention: opt_retention_of(f, field("retention"), "retention")?,
        },
        "batch_get_response" => {
            let values = f
                .array("values")?
                .map(|v| match v.head {
                    Head::Nil => Ok(None),
                    _ => f
                        .to_bytes(v)
                        .map(Some)
                        .ok_or_else(|| f.bad("values", "binary or nil")),
                })
                .collect::<Result<_, _>>()?;
            let retentions = f
                .array("retentions")?
                .map(|v| opt_retention_of(f, Some(v), "retentions"))
                .collect::<Result<_, _>>()?;
            Response::BatchGet { values, retentions }
        }
        "get_shared_response" => Response::GetShared(SharedSlot {
            slot_offset: f.uint("slot_offset", None)?,
            length: f.uint("length", None)?,
            version: f.uint("version", None)?,
            retention: opt_retention_of(f, field("retention"), "retention")?,
            slot_size: f.uint("slot_size", Some(0))?,
        }),
        "batch_get_shared_response" => batch_shared_from(f)?,
        "set_ack" => Response::SetAck(SetAck {
            accepted: f.boolean("accepted")?,
            reason: opt_string_of(f, field("reason"), "reason")?,
        }),
        "batch_set_ack" => {
            let accepted = f.array("accepted")?;
            let reasons = f.array("reasons")?;
            let acks = accepted
                .zip(reasons)
                .map(|(a, r)| {
                    Ok(SetAck {
                        accepted: a.head == Head::Bool(true),
                        reason: opt_string_of(f, Some(r), "reasons")?,
                    })
                })
                .collect::<Result<_, RequestError>>()?;
            Response::BatchSetAck(acks)
        }
        "set_reserve_response" => Response::SetReserve {
            lease_token: f.uint("lease_token", Some(0))?,
            slot_id: f.get("slot_id").and_then(as_sint).unwrap_or(-1),
            payload_offset: f.uint("payload_offset", Some(0))?,
            payload_max_size: f.uint("payload_max_size", Some(0))?,
            reason: f.string("reason", "")?,
        },
        "set_commit_response" => Response::SetCommit {
            accepted: f.boolean("accepted")?,
            reason: f.string("reason", "")?,
        },
        "set_cancel_response" => Response::SetCancel,
        "exists_response" => Response::Exists {
            present: f
                .array("present")?
                .map(|v| v.head == Head::Bool(true))
                .collect(),
        },
        "clear_ack" => Response::Clear {
            cleared_entries: f.uint("cleared_entries", Some(0))?,
        },
        "stats_response" => Response::Stats(stats_from(f)?),
        "error" => Response::Error {
            code: f.string("code", "")?,
            message: f.string("message", "")?,
        },
        other => return Err(f.bad("op", &format!("a known reply op, not `{other}`"))),
    })
}

fn batch_shared_from(f: &Fields<'_>) -> Result<Response, RequestError> {
    let offsets = f.array("offsets")?;
    let lengths = f.array("lengths")?;
    let versions = f.array("versions")?;
    let retentions = f.array("retentions")?;
    let n = offsets.len();
    if lengths.len() != n || versions.len() != n || retentions.len() != n {
        return Err(f.bad("offsets", "as long as lengths, versions and retentions"));
    }
    let slot_size = f.uint("slot_size", Some(0))?;
    let mut slots = Vec::with_capacity(n);
    let columns = offsets.zip(lengths).zip(versions).zip(retentions);
    for (((offset, length), version), retention) in columns {
        let offset = as_sint(offset).ok_or_else(|| f.bad("offsets", "integers"))?;
        let length = as_uint(length).ok_or_else(|| f.bad("lengths", "integers"))?;
        let version = as_uint(version).ok_or_else(|| f.bad("versions", "integers"))?;
        slots.push(if offset < 0 {
            None
        } else {
            Some(SharedSlot {
                slot_offset: offset as u64,
                length,
                version,
                retention: opt_retention_of(f, Some(retention), "retentions")?,
                slot_size,
            })
        });
    }
    Ok(Response::BatchGetShared { slots, slot_size })
}

fn stats_from(f: &Fields<'_>) -> Result<StatsReply, RequestError> {
    let u = |name: &str| f.uint(name, Some(0));
    let extended = if f.get("expired_total").is_some() {
        Some(ExtendedStats::from_fields(|name| {
            f.get(name).and_then(as_uint).unwrap_or_default()
        }))
    } else {
        None
    };
    Ok(StatsReply {
        entries: u("entries")?,
        host_bytes: u("host_bytes")?,
        spillover_bytes: u("spillover_bytes")?,
        long_bytes: u("long_bytes")?,
        gets_total: u("gets_total")?,
        sets_total: u("sets_total")?,
        hits_total: u("hits_total")?,
        misses_total: u("misses_total")?,
        evictions_total: u("evictions_total")?,
        extended,
    })
}
