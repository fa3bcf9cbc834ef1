//! A minimal msgpack reader over a borrowed frame, for the decoders: it validates a value in
//! one pass, allocating nothing, and hands back [`Raw`] slices of the frame with their first
//! item already decoded ([`Head`]).
//!
//! Cost bounds, whatever the bytes: the work is linear in the frame (every item consumes at
//! least one byte, and a container announcing more items than bytes remain is refused before
//! any is read); recursion stops at [`super::MAX_DEPTH`]; nothing is allocated here, so what a
//! decoded request costs is decided by the typed decoders (`fields.rs`), which size their
//! vectors from validated lengths only.

use std::fmt;

/// The first item of an encoded value: a scalar, the bytes of a `str`/`bin`, or the item
/// count of a container (whose items follow in the encoding).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) enum Head<'a> {
    Nil,
    Bool(bool),
    Uint(u64),
    Int(i64),
    Float(f64),
    Str(&'a [u8]),
    Bin(&'a [u8]),
    Array(u32),
    Map(u32),
    Ext,
}

impl Head<'_> {
    /// The kind, for error messages.
    pub(super) fn kind(&self) -> &'static str {
        match self {
            Head::Nil => "nil",
            Head::Bool(_) => "a boolean",
            Head::Uint(_) | Head::Int(_) => "an integer",
            Head::Float(_) => "a float",
            Head::Str(_) => "a string",
            Head::Bin(_) => "binary",
            Head::Array(_) => "an array",
            Head::Map(_) => "a map",
            Head::Ext => "an extension",
        }
    }
}

/// One whole, validated encoded value: its bytes and its first item.
#[derive(Debug, Clone, Copy)]
pub(super) struct Raw<'a> {
    pub head: Head<'a>,
    pub bytes: &'a [u8],
}

impl<'a> Raw<'a> {
    /// The items of an array value, in order; empty for anything else.
    pub(super) fn items(self) -> Items<'a> {
        match self.head {
            Head::Array(n) => {
                let mut rd = Reader::new(self.bytes);
                // Skips the array header; the value was validated, so this cannot fail.
                let ok = rd.head().is_ok();
                Items {
                    rd,
                    left: if ok { n } else { 0 },
                }
            }
            _ => Items {
                rd: Reader::new(&[]),
                left: 0,
            },
        }
    }
}

/// The items of a validated array ([`Raw::items`]).
#[derive(Debug, Clone)]
pub(super) struct Items<'a> {
    rd: Reader<'a>,
    left: u32,
}

impl<'a> Iterator for Items<'a> {
    type Item = Raw<'a>;

    fn next(&mut self) -> Option<Raw<'a>> {
        if self.left == 0 {
            return None;
        }
        self.left -= 1;
        // Validated when the frame was parsed: nesting is within bounds.
        self.rd.value(usize::MAX).ok()
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        (self.left as usize, Some(self.left as usize))
    }
}

impl ExactSizeIterator for Items<'_> {}

/// Why bytes are not msgpack (or nest too deep).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct MsgError(String);

impl fmt::Display for MsgError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Reads items off the front of a byte slice.
#[derive(Debug, Clone)]
pub(super) struct Reader<'a> {
    buf: &'a [u8],
    consumed: usize,
}

impl<'a> Reader<'a> {
    pub(super) fn new(buf: &'a [u8]) -> Self {
        Self { buf, consumed: 0 }
    }

    /// Bytes not read yet.
    pub(super) fn remaining(&self) -> usize {
        self.buf.len()
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], MsgError> {
        if n > self.buf.len() {
            return Err(MsgError(format!(
                "truncated: {n} bytes needed at offset {}, {} left",
                self.consumed,
                self.buf.len()
            )));
        }
        let (head, rest) = self.buf.split_at(n);
        self.buf = rest;
        self.consumed += n;
        Ok(head)
    }

    fn be<const N: usize>(&mut self) -> Result<[u8; N], MsgError> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }

    fn len_of(&mut self, width: usize) -> Result<usize, MsgError> {
        Ok(match width {
            1 => usize::from(self.be::<1>()?[0]),
            2 => usize::from(u16::from_be_bytes(self.be()?)),
            _ => u32::from_be_bytes(self.be()?) as usize,
        })
    }

    /// Reads one item: a scalar, a `str`/`bin`/`ext` with its payload, or a container's header.
    ///
    /// # Errors
    /// Truncated input or the reserved marker `0xc1`.
    pub(super) fn head(&mut self) -> Result<Head<'a>, MsgError> {
        let at = self.consumed;
        let m = self.be::<1>()?[0];
        Ok(match m {
            0x00..=0x7f => Head::Uint(u64::from(m)),
            0x80..=0x8f => Head::Map(u32::from(m & 0x0f)),
            0x90..=0x9f => Head::Array(u32::from(m & 0x0f)),
            0xa0..=0xbf => Head::Str(self.take(usize::from(m & 0x1f))?),
            0xc0 => Head::Nil,
            0xc2 => Head::Bool(false),
            0xc3 => Head::Bool(true),
            0xc4..=0xc6 => {
                let n = self.len_of(1 << (m - 0xc4))?;
                Head::Bin(self.take(n)?)
            }
            0xc7..=0xc9 => {
                let n = self.len_of(1 << (m - 0xc7))?;
                self.take(n + 1)?;
                Head::Ext
            }
            0xca => Head::Float(f64::from(f32::from_be_bytes(self.be()?))),
            0xcb => Head::Float(f64::from_be_bytes(self.be()?)),
            0xcc => Head::Uint(u64::from(self.be::<1>()?[0])),
            0xcd => Head::Uint(u64::from(u16::from_be_bytes(self.be()?))),
            0xce => Head::Uint(u64::from(u32::from_be_bytes(self.be()?))),
            0xcf => Head::Uint(u64::from_be_bytes(self.be()?)),
            0xd0 => Head::Int(i64::from(i8::from_be_bytes(self.be()?))),
            0xd1 => Head::Int(i64::from(i16::from_be_bytes(self.be()?))),
            0xd2 => Head::Int(i64::from(i32::from_be_bytes(self.be()?))),
            0xd3 => Head::Int(i64::from_be_bytes(self.be()?)),
            0xd4..=0xd8 => {
                self.take(1 + (1 << (m - 0xd4)))?;
                Head::Ext
            }
            0xd9..=0xdb => {
                let n = self.len_of(1 << (m - 0xd9))?;
                Head::Str(self.take(n)?)
            }
            0xdc => Head::Array(u32::from(u16::from_be_bytes(self.be()?))),
            0xdd => Head::Array(u32::from_be_bytes(self.be()?)),
            0xde => Head::Map(u32::from(u16::from_be_bytes(self.be()?))),
            0xdf => Head::Map(u32::from_be_bytes(self.be()?)),
            0xe0..=0xff => Head::Int(i64::from(m as i8)),
            0xc1 => {
                return Err(MsgError(format!("reserved marker 0xc1 at offset {at}")));
            }
        })
    }

    /// Reads one whole value, containers included, nested at most `depth` levels below it.
    ///
    /// # Errors
    /// Truncated input, a reserved marker, a container announcing more items than bytes
    /// remain, or nesting deeper than `depth`.
    pub(super) fn value(&mut self, depth: usize) -> Result<Raw<'a>, MsgError> {
        let start = self.buf;
        let at = self.consumed;
        let head = self.head()?;
        let items = match head {
            Head::Array(n) => u64::from(n),
            Head::Map(n) => 2 * u64::from(n),
            _ => 0,
        };
        if items > 0 {
            if depth == 0 {
                return Err(MsgError(format!(
                    "nesting deeper than {} levels at offset {at}",
                    super::MAX_DEPTH
                )));
            }
            if items > self.buf.len() as u64 {
                return Err(MsgError(format!(
                    "{} at offset {at} announces {items} items but only {} bytes follow",
                    head.kind(),
                    self.buf.len()
                )));
            }
            for _ in 0..items {
                self.value(depth - 1)?;
            }
        }
        Ok(Raw {
            head,
            bytes: &start[..self.consumed - at],
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn encode(v: &rmpv::Value) -> Vec<u8> {
        let mut out = Vec::new();
        rmpv::encode::write_value(&mut out, v).unwrap();
        out
    }

    #[test]
    fn scalars_and_containers_read_like_rmpv_writes_them() {
        use rmpv::Value as V;
        let cases = [
            (V::Nil, Head::Nil),
            (V::from(true), Head::Bool(true)),
            (V::from(5u64), Head::Uint(5)),
            (V::from(300u64), Head::Uint(300)),
            (V::from(u64::MAX), Head::Uint(u64::MAX)),
            (V::from(-3i64), Head::Int(-3)),
            (V::from(-300i64), Head::Int(-300)),
            (V::from(i64::MIN), Head::Int(i64::MIN)),
            (V::from(1.5f64), Head::Float(1.5)),
            (V::F32(0.25), Head::Float(0.25)),
            (V::from("op"), Head::Str(b"op")),
            (V::Binary(vec![1; 300]), Head::Bin(&[1; 300])),
            (V::Array(vec![V::Nil; 20]), Head::Array(20)),
            (V::Map(vec![(V::Nil, V::Nil); 3]), Head::Map(3)),
            (V::Ext(1, vec![0; 3]), Head::Ext),
        ];
        for (value, want) in cases {
            let bytes = encode(&value);
            let mut rd = Reader::new(&bytes);
            let raw = rd.value(4).unwrap();
            assert_eq!(raw.head, want, "{value:?}");
            assert_eq!(raw.bytes, &bytes[..], "{value:?}");
            assert_eq!(rd.remaining(), 0);
        }
    }

    #[test]
    fn lying_lengths_and_deep_nesting_are_refused_before_reading_items() {
        // An array32 of 2^32-1 items in 5 bytes: refused by its header alone.
        let err = Reader::new(&[0xdd, 0xff, 0xff, 0xff, 0xff]).value(32);
        assert!(err.unwrap_err().0.contains("announces 4294967295 items"));
        let deep = [0x91u8; 40];
        assert!(
            Reader::new(&deep)
                .value(32)
                .unwrap_err()
                .0
                .contains("nesting")
        );
        assert!(
            Reader::new(&[0xc4, 10, 1])
                .value(1)
                .unwrap_err()
                .0
                .contains("truncated")
        );
        assert!(
            Reader::new(&[0xc1])
                .value(1)
                .unwrap_err()
                .0
                .contains("0xc1")
        );
    }

    #[test]
    fn items_walk_a_validated_array() {
        let v = rmpv::Value::Array(vec![
            rmpv::Value::from(1u64),
            rmpv::Value::Array(vec![rmpv::Value::Nil]),
            rmpv::Value::from("x"),
        ]);
        let bytes = encode(&v);
        let raw = Reader::new(&bytes).value(4).unwrap();
        let heads: Vec<Head<'_>> = raw.items().map(|r| r.head).collect();
        assert_eq!(heads, [Head::Uint(1), Head::Array(1), Head::Str(b"x")]);
        assert_eq!(raw.items().len(), 3);
    }
}
