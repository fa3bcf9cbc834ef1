//! Typed access to the fields of one decoded msgpack map, borrowing the frame: the checks every
//! op shares (types, defaults, which field was wrong).

use super::{FrameError, MAX_DEPTH, Namespace, RequestError};
use bytes::Bytes;
use infera_core::event::Retention;
use rmpv::{Value, ValueRef};

/// The fields of one decoded map, borrowing the frame.
pub(super) struct Fields<'a> {
    frame: &'a Bytes,
    pub(super) op: String,
    map: Vec<(ValueRef<'a>, ValueRef<'a>)>,
}

pub(super) fn parse_map(frame: &Bytes) -> Result<(Option<Value>, Fields<'_>), FrameError> {
    let mut rd: &[u8] = &frame[..];
    let value = rmpv::decode::read_value_ref_with_max_depth(&mut rd, MAX_DEPTH)
        .map_err(|e| FrameError::Malformed(e.to_string()))?;
    if !rd.is_empty() {
        return Err(FrameError::Malformed(format!(
            "{} trailing bytes after the map",
            rd.len()
        )));
    }
    let ValueRef::Map(map) = value else {
        return Err(FrameError::Malformed(format!("got {}", kind_name(&value))));
    };
    let mut fields = Fields {
        frame,
        op: String::new(),
        map,
    };
    let id = fields
        .get("id")
        .filter(|v| !matches!(v, ValueRef::Map(_) | ValueRef::Array(_)))
        .map(ValueRef::to_owned);
    fields.op = match fields.get("op") {
        Some(ValueRef::String(s)) => s.as_str().unwrap_or_default().to_owned(),
        _ => String::new(),
    };
    Ok((id, fields))
}

fn kind_name(v: &ValueRef<'_>) -> &'static str {
    match v {
        ValueRef::Nil => "nil",
        ValueRef::Boolean(_) => "a boolean",
        ValueRef::Integer(_) => "an integer",
        ValueRef::F32(_) | ValueRef::F64(_) => "a float",
        ValueRef::String(_) => "a string",
        ValueRef::Binary(_) => "binary",
        ValueRef::Array(_) => "an array",
        ValueRef::Map(_) => "a map",
        ValueRef::Ext(..) => "an extension",
    }
}

impl<'a> Fields<'a> {
    /// The field's value; `nil` reads as absent.
    pub(super) fn get(&self, name: &str) -> Option<&ValueRef<'a>> {
        self.map
            .iter()
            .find(|(k, _)| matches!(k, ValueRef::String(s) if s.as_str() == Some(name)))
            .map(|(_, v)| v)
            .filter(|v| !matches!(v, ValueRef::Nil))
    }

    pub(super) fn bad(&self, field: &str, expected: &str) -> RequestError {
        RequestError::field(&self.op, field, expected)
    }

    pub(super) fn string(&self, name: &str, default: &str) -> Result<String, RequestError> {
        match self.get(name) {
            None => Ok(default.to_owned()),
            Some(ValueRef::String(s)) => s
                .as_str()
                .map(str::to_owned)
                .ok_or_else(|| self.bad(name, "valid UTF-8")),
            Some(_) => Err(self.bad(name, "a string")),
        }
    }

    pub(super) fn ns(&self) -> Result<Namespace, RequestError> {
        Ok(Namespace {
            model: self.string("model", "")?,
            compat_key: self.string("compat_key", "")?,
        })
    }

    pub(super) fn to_bytes(&self, v: &ValueRef<'a>) -> Option<Bytes> {
        let slice: &[u8] = match v {
            ValueRef::Binary(b) => b,
            ValueRef::String(s) => s.as_bytes(),
            _ => return None,
        };
        // A value much smaller than the frame is copied so it never pins the whole frame.
        if slice.len() * 2 >= self.frame.len() {
            Some(self.frame.slice_ref(slice))
        } else {
            Some(Bytes::copy_from_slice(slice))
        }
    }

    pub(super) fn bin(&self, name: &str) -> Result<Bytes, RequestError> {
        self.get(name)
            .and_then(|v| self.to_bytes(v))
            .ok_or_else(|| self.bad(name, "binary"))
    }

    pub(super) fn array(&self, name: &str) -> Result<&[ValueRef<'a>], RequestError> {
        match self.get(name) {
            Some(ValueRef::Array(items)) => Ok(items),
            _ => Err(self.bad(name, "an array")),
        }
    }

    pub(super) fn opt_array(&self, name: &str) -> Result<Option<&[ValueRef<'a>]>, RequestError> {
        match self.get(name) {
            None => Ok(None),
            Some(ValueRef::Array(items)) => Ok(Some(items)),
            Some(_) => Err(self.bad(name, "an array or nil")),
        }
    }

    pub(super) fn bin_list(&self, name: &str) -> Result<Vec<Bytes>, RequestError> {
        self.array(name)?
            .iter()
            .map(|v| self.to_bytes(v))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| self.bad(name, "an array of binary keys"))
    }

    pub(super) fn uint(&self, name: &str, default: Option<u64>) -> Result<u64, RequestError> {
        match self.get(name) {
            None => default.ok_or_else(|| self.bad(name, "present")),
            Some(v) => as_uint(v).ok_or_else(|| self.bad(name, "a non-negative integer")),
        }
    }

    pub(super) fn boolean(&self, name: &str) -> Result<bool, RequestError> {
        match self.get(name) {
            None => Ok(false),
            Some(ValueRef::Boolean(b)) => Ok(*b),
            Some(_) => Err(self.bad(name, "a boolean")),
        }
    }

    pub(super) fn retention(
        &self,
        v: Option<&ValueRef<'a>>,
        name: &str,
    ) -> Result<Retention, RequestError> {
        match v {
            None => Ok(Retention::Short),
            Some(ValueRef::String(s)) => match s.as_str() {
                Some("" | "default") => Ok(Retention::Short),
                Some(text) => Retention::parse(text)
                    .ok_or_else(|| self.bad(name, "one of none, ephemeral, short, long")),
                None => Err(self.bad(name, "valid UTF-8")),
            },
            Some(_) => Err(self.bad(name, "a retention string")),
        }
    }

    pub(super) fn ttl(
        &self,
        v: Option<&ValueRef<'a>>,
        name: &str,
    ) -> Result<Option<f64>, RequestError> {
        match v {
            None | Some(ValueRef::Nil) => Ok(None),
            Some(v) => as_float(v)
                .filter(|t| !t.is_nan())
                .map(Some)
                .ok_or_else(|| self.bad(name, "a number of seconds or nil")),
        }
    }

    pub(super) fn metadata(
        &self,
        v: Option<&ValueRef<'a>>,
        name: &str,
    ) -> Result<Option<Bytes>, RequestError> {
        match v {
            None | Some(ValueRef::Nil) => Ok(None),
            Some(ValueRef::Map(m)) if m.is_empty() => Ok(None),
            Some(v @ ValueRef::Map(_)) => {
                let mut out = Vec::new();
                rmpv::encode::write_value_ref(&mut out, v)
                    .map_err(|_| self.bad(name, "an encodable map"))?;
                Ok(Some(Bytes::from(out)))
            }
            Some(_) => Err(self.bad(name, "a map")),
        }
    }
}

pub(super) fn as_uint(v: &ValueRef<'_>) -> Option<u64> {
    match v {
        ValueRef::Integer(i) => i.as_u64(),
        _ => None,
    }
}

pub(super) fn as_sint(v: &ValueRef<'_>) -> Option<i64> {
    match v {
        ValueRef::Integer(i) => i.as_i64(),
        _ => None,
    }
}

pub(super) fn as_float(v: &ValueRef<'_>) -> Option<f64> {
    match v {
        ValueRef::Integer(i) => i.as_f64(),
        ValueRef::F32(f) => Some(f64::from(*f)),
        ValueRef::F64(f) => Some(*f),
        _ => None,
    }
}
