//! Typed access to the fields of one frame's map, borrowing the frame: the checks every op
//! shares (types, defaults, which field was wrong) and the limits every frame is held to.
//!
//! Parsing validates the whole frame once ([`super::msgpack`]) and keeps only the top-level
//! fields as slices (at most [`MAX_FIELDS`]). Typed accessors then build exactly what the
//! request needs, sized from validated lengths: a list of keys costs one [`Bytes`] handle
//! per key (32 bytes, for a key of at least 1 byte on the wire), and no list is longer than
//! the frame's `max_keys` ([`Limits`]).

use super::msgpack::{Head, Items, Raw, Reader};
use super::{FrameError, MAX_DEPTH, Namespace, RequestError};
use bytes::Bytes;
use infera_core::event::Retention;
use rmpv::Value;

/// The most top-level fields a frame may carry (requests and replies use at most 30).
pub const MAX_FIELDS: u32 = 64;

/// What one decoded frame may cost.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// The most keys (or items) in one batch (`batch_get`, `batch_set`, `exists`,
    /// `prefetch_hint`); more is refused with `too_many_keys` before any is decoded.
    pub max_keys: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_keys: super::DEFAULT_MAX_BATCH_KEYS,
        }
    }
}

/// The fields of one decoded map, borrowing the frame.
pub(super) struct Fields<'a> {
    frame: &'a Bytes,
    pub(super) op: String,
    map: Vec<(&'a str, Raw<'a>)>,
    limits: Limits,
}

pub(super) fn parse_map(
    frame: &Bytes,
    limits: Limits,
) -> Result<(Option<Value>, Fields<'_>), FrameError> {
    let malformed = |e: super::msgpack::MsgError| FrameError::Malformed(e.to_string());
    let mut rd = Reader::new(&frame[..]);
    let head = rd.head().map_err(malformed)?;
    let Head::Map(n) = head else {
        return Err(FrameError::Malformed(format!("got {}", head.kind())));
    };
    if n > MAX_FIELDS {
        return Err(FrameError::Malformed(format!(
            "the map has {n} fields; a frame carries at most {MAX_FIELDS}"
        )));
    }
    let mut map = Vec::with_capacity(n as usize);
    for _ in 0..n {
        let name = rd.value(MAX_DEPTH - 1).map_err(malformed)?;
        let value = rd.value(MAX_DEPTH - 1).map_err(malformed)?;
        // Fields are named by strings; anything else is ignored, like an unknown name.
        if let Head::Str(s) = name.head
            && let Ok(name) = std::str::from_utf8(s)
        {
            map.push((name, value));
        }
    }
    if rd.remaining() > 0 {
        return Err(FrameError::Malformed(format!(
            "{} trailing bytes after the map",
            rd.remaining()
        )));
    }
    let mut fields = Fields {
        frame,
        op: String::new(),
        map,
        limits,
    };
    let id = fields
        .get("id")
        .filter(|v| !matches!(v.head, Head::Map(_) | Head::Array(_)))
        .and_then(|v| rmpv::decode::read_value(&mut &v.bytes[..]).ok());
    fields.op = match fields.get("op").map(|v| v.head) {
        Some(Head::Str(s)) => String::from_utf8_lossy(s).into_owned(),
        _ => String::new(),
    };
    Ok((id, fields))
}

impl<'a> Fields<'a> {
    /// The field's value; `nil` reads as absent.
    pub(super) fn get(&self, name: &str) -> Option<Raw<'a>> {
        self.map
            .iter()
            .find(|(k, _)| *k == name)
            .map(|(_, v)| *v)
            .filter(|v| v.head != Head::Nil)
    }

    pub(super) fn bad(&self, field: &str, expected: &str) -> RequestError {
        RequestError::field(&self.op, field, expected)
    }

    pub(super) fn string(&self, name: &str, default: &str) -> Result<String, RequestError> {
        match self.get(name).map(|v| v.head) {
            None => Ok(default.to_owned()),
            Some(Head::Str(s)) => std::str::from_utf8(s)
                .map(str::to_owned)
                .map_err(|_| self.bad(name, "valid UTF-8")),
            Some(_) => Err(self.bad(name, "a string")),
        }
    }

    pub(super) fn ns(&self) -> Result<Namespace, RequestError> {
        Ok(Namespace {
            model: self.string("model", "")?.into(),
            compat_key: self.string("compat_key", "")?.into(),
        })
    }

    /// A `bin` (or `str`) value to keep: a value much smaller than the frame is copied, so it
    /// never pins the whole frame.
    pub(super) fn to_bytes(&self, v: Raw<'a>) -> Option<Bytes> {
        let slice = match v.head {
            Head::Bin(b) | Head::Str(b) => b,
            _ => return None,
        };
        if slice.len() * 2 >= self.frame.len() {
            Some(self.frame.slice_ref(slice))
        } else {
            Some(Bytes::copy_from_slice(slice))
        }
    }

    /// A `bin` (or `str`) value used only while the request is answered: a slice of the
    /// frame, never a copy.
    fn to_slice(&self, v: Raw<'a>) -> Option<Bytes> {
        match v.head {
            Head::Bin(b) | Head::Str(b) => Some(self.frame.slice_ref(b)),
            _ => None,
        }
    }

    pub(super) fn bin(&self, name: &str) -> Result<Bytes, RequestError> {
        self.get(name)
            .and_then(|v| self.to_bytes(v))
            .ok_or_else(|| self.bad(name, "binary"))
    }

    pub(super) fn array(&self, name: &str) -> Result<Items<'a>, RequestError> {
        match self.get(name) {
            Some(
                v @ Raw {
                    head: Head::Array(_),
                    ..
                },
            ) => Ok(v.items()),
            _ => Err(self.bad(name, "an array")),
        }
    }

    pub(super) fn opt_array(&self, name: &str) -> Result<Option<Items<'a>>, RequestError> {
        match self.get(name) {
            None => Ok(None),
            Some(
                v @ Raw {
                    head: Head::Array(_),
                    ..
                },
            ) => Ok(Some(v.items())),
            Some(_) => Err(self.bad(name, "an array or nil")),
        }
    }

    /// An array of a batch: refused with `too_many_keys` past [`Limits::max_keys`].
    pub(super) fn batch(&self, name: &str) -> Result<Items<'a>, RequestError> {
        let items = self.array(name)?;
        if items.len() > self.limits.max_keys {
            return Err(RequestError {
                code: "too_many_keys",
                message: format!(
                    "{}: `{name}` has {} entries; at most {} per request — split the batch",
                    self.op,
                    items.len(),
                    self.limits.max_keys
                ),
            });
        }
        Ok(items)
    }

    /// The keys of a lookup (`batch_get`, `exists`): slices of the frame.
    pub(super) fn lookup_keys(&self, name: &str) -> Result<Vec<Bytes>, RequestError> {
        self.batch(name)?
            .map(|v| self.to_slice(v))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| self.bad(name, "an array of binary keys"))
    }

    /// Keys or values to keep (`batch_set`, `prefetch_hint`), under [`Fields::to_bytes`].
    pub(super) fn kept_list(&self, name: &str) -> Result<Vec<Bytes>, RequestError> {
        self.batch(name)?
            .map(|v| self.to_bytes(v))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| self.bad(name, "an array of binary values"))
    }

    pub(super) fn uint(&self, name: &str, default: Option<u64>) -> Result<u64, RequestError> {
        match self.get(name) {
            None => default.ok_or_else(|| self.bad(name, "present")),
            Some(v) => as_uint(v).ok_or_else(|| self.bad(name, "a non-negative integer")),
        }
    }

    pub(super) fn boolean(&self, name: &str) -> Result<bool, RequestError> {
        match self.get(name).map(|v| v.head) {
            None => Ok(false),
            Some(Head::Bool(b)) => Ok(b),
            Some(_) => Err(self.bad(name, "a boolean")),
        }
    }

    pub(super) fn retention(
        &self,
        v: Option<Raw<'a>>,
        name: &str,
    ) -> Result<Retention, RequestError> {
        match v.map(|v| v.head) {
            None | Some(Head::Nil) => Ok(Retention::Short),
            Some(Head::Str(s)) => match std::str::from_utf8(s) {
                Ok("" | "default") => Ok(Retention::Short),
                Ok(text) => Retention::parse(text)
                    .ok_or_else(|| self.bad(name, "one of none, ephemeral, short, long")),
                Err(_) => Err(self.bad(name, "valid UTF-8")),
            },
            Some(_) => Err(self.bad(name, "a retention string")),
        }
    }

    pub(super) fn ttl(&self, v: Option<Raw<'a>>, name: &str) -> Result<Option<f64>, RequestError> {
        match v {
            None => Ok(None),
            Some(v) if v.head == Head::Nil => Ok(None),
            Some(v) => as_float(v)
                .filter(|t| !t.is_nan())
                .map(Some)
                .ok_or_else(|| self.bad(name, "a number of seconds or nil")),
        }
    }

    /// Engine metadata: a map kept as its msgpack encoding (copied), `None` for nil or `{}`.
    pub(super) fn metadata(
        &self,
        v: Option<Raw<'a>>,
        name: &str,
    ) -> Result<Option<Bytes>, RequestError> {
        match v.map(|v| (v.head, v.bytes)) {
            None | Some((Head::Nil | Head::Map(0), _)) => Ok(None),
            Some((Head::Map(_), bytes)) => Ok(Some(Bytes::copy_from_slice(bytes))),
            Some(_) => Err(self.bad(name, "a map")),
        }
    }
}

pub(super) fn as_uint(v: Raw<'_>) -> Option<u64> {
    match v.head {
        Head::Uint(u) => Some(u),
        Head::Int(i) => u64::try_from(i).ok(),
        _ => None,
    }
}

pub(super) fn as_sint(v: Raw<'_>) -> Option<i64> {
    match v.head {
        Head::Uint(u) => i64::try_from(u).ok(),
        Head::Int(i) => Some(i),
        _ => None,
    }
}

pub(super) fn as_float(v: Raw<'_>) -> Option<f64> {
    match v.head {
        Head::Uint(u) => Some(u as f64),
        Head::Int(i) => Some(i as f64),
        Head::Float(f) => Some(f),
        _ => None,
    }
}
