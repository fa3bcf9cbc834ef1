//! Decoding of request frames (the daemon) and reply frames (the client).

use super::fields::{Fields, as_sint, as_uint, parse_map};
use super::{
    DecodedRequest, DecodedResponse, ExtendedStats, FrameError, PROTOCOL_VERSION, Request,
    RequestError, Response, SetAck, SetItem, SharedSlot, StatsReply,
};
use bytes::Bytes;
use infera_core::event::Retention;
use rmpv::ValueRef;

/// Decodes a request frame body (without its length prefix).
///
/// # Errors
/// [`FrameError::Malformed`] when the body is not one msgpack map; the caller answers and closes.
pub fn decode_request(frame: &Bytes) -> Result<DecodedRequest, FrameError> {
    let (id, f) = parse_map(frame)?;
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
            keys: f.bin_list("keys")?,
        },
        "exists" => Request::Exists {
            ns: f.ns()?,
            keys: f.bin_list("keys")?,
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
            keys: f.bin_list("keys")?,
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
    let keys = f.bin_list("keys")?;
    let values = f.bin_list("values")?;
    let retentions = f.array("retentions")?;
    let metadatas = f.opt_array("metadatas")?;
    let ttls = f.opt_array("ttls_seconds")?;
    let n = keys.len();
    let arity_ok = values.len() == n
        && retentions.len() == n
        && metadatas.is_none_or(|m| m.len() == n)
        && ttls.is_none_or(|t| t.len() == n);
    if !arity_ok {
        return Err(RequestError {
            code: "batch_set_arity_mismatch",
            message: format!(
                "batch_set arrays disagree: keys={n} values={} retentions={} metadatas={} \
                 ttls_seconds={}",
                values.len(),
                retentions.len(),
                metadatas.map_or_else(|| "nil".to_owned(), |m| m.len().to_string()),
                ttls.map_or_else(|| "nil".to_owned(), |t| t.len().to_string()),
            ),
        });
    }
    let mut items = Vec::with_capacity(n);
    for (i, (key, value)) in keys.into_iter().zip(values).enumerate() {
        items.push(SetItem {
            key,
            value,
            retention: f.retention(
                Some(&retentions[i]).filter(|v| !matches!(v, ValueRef::Nil)),
                "retentions",
            )?,
            metadata: f.metadata(metadatas.map(|m| &m[i]), "metadatas")?,
            ttl_seconds: f.ttl(ttls.map(|t| &t[i]), "ttls_seconds")?,
        });
    }
    Ok(Request::BatchSet { ns: f.ns()?, items })
}

/// Decodes a reply frame body (without its length prefix); used by the client.
///
/// # Errors
/// A [`FrameError`] when the body is not a map or a field does not have the documented type.
pub fn decode_response(frame: &Bytes) -> Result<DecodedResponse, FrameError> {
    let (id, f) = parse_map(frame)?;
    let response = response_from(&f).map_err(|e| FrameError::Malformed(e.message))?;
    Ok(DecodedResponse { id, response })
}

fn opt_retention_of(
    f: &Fields<'_>,
    v: &ValueRef<'_>,
    name: &str,
) -> Result<Option<Retention>, RequestError> {
    match v {
        ValueRef::Nil => Ok(None),
        ValueRef::String(s) => s
            .as_str()
            .and_then(Retention::parse)
            .map(Some)
            .ok_or_else(|| f.bad(name, "a retention class")),
        _ => Err(f.bad(name, "a retention class or nil")),
    }
}

fn opt_string_of(
    f: &Fields<'_>,
    v: &ValueRef<'_>,
    name: &str,
) -> Result<Option<String>, RequestError> {
    match v {
        ValueRef::Nil => Ok(None),
        ValueRef::String(s) => Ok(Some(s.as_str().unwrap_or_default().to_owned())),
        _ => Err(f.bad(name, "a string or nil")),
    }
}

fn response_from(f: &Fields<'_>) -> Result<Response, RequestError> {
    let nil = ValueRef::Nil;
    let field = |name: &str| f.get(name).unwrap_or(&nil);
    Ok(match f.op.as_str() {
        "hello_ack" => Response::HelloAck {
            server_id: f.string("server_id", "")?,
            protocol_version: f.uint("protocol_version", Some(PROTOCOL_VERSION))?,
            shared_arena: match f.opt_array("shared_arena")? {
                None => None,
                Some([a, b, c]) => Some([a, b, c].map(|v| as_uint(v).unwrap_or_default())),
                Some(_) => return Err(f.bad("shared_arena", "three integers or nil")),
            },
        },
        "get_response" => Response::Get {
            value: match field("value") {
                ValueRef::Nil => None,
                v => Some(
                    f.to_bytes(v)
                        .ok_or_else(|| f.bad("value", "binary or nil"))?,
                ),
            },
            retention: opt_retention_of(f, field("retention"), "retention")?,
        },
        "batch_get_response" => {
            let values = f
                .array("values")?
                .iter()
                .map(|v| match v {
                    ValueRef::Nil => Ok(None),
                    v => f
                        .to_bytes(v)
                        .map(Some)
                        .ok_or_else(|| f.bad("values", "binary or nil")),
                })
                .collect::<Result<_, _>>()?;
            let retentions = f
                .array("retentions")?
                .iter()
                .map(|v| opt_retention_of(f, v, "retentions"))
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
                .iter()
                .zip(reasons)
                .map(|(a, r)| {
                    Ok(SetAck {
                        accepted: matches!(a, ValueRef::Boolean(true)),
                        reason: opt_string_of(f, r, "reasons")?,
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
                .iter()
                .map(|v| matches!(v, ValueRef::Boolean(true)))
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
    for i in 0..n {
        let offset = as_sint(&offsets[i]).ok_or_else(|| f.bad("offsets", "integers"))?;
        let length = as_uint(&lengths[i]).ok_or_else(|| f.bad("lengths", "integers"))?;
        let version = as_uint(&versions[i]).ok_or_else(|| f.bad("versions", "integers"))?;
        slots.push(if offset < 0 {
            None
        } else {
            Some(SharedSlot {
                slot_offset: offset as u64,
                length,
                version,
                retention: opt_retention_of(f, &retentions[i], "retentions")?,
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
