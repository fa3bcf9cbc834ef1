//! LMCache's `lm://` server protocol, spoken natively (read from LMCache's
//! `lmcache/v1/protocol.py` and `lmcache/v1/server/__main__.py`).
//!
//! A request is a fixed 186-byte header — nine little-endian `i32` (command, length, memory
//! format, dtype, location, shape[4]) and the key, UTF-8, space-padded to 150 bytes — followed,
//! for `PUT`, by `length` value bytes. Commands: `PUT` 1 (no reply), `GET` 2, `EXIST` 3,
//! `HEALTH` 5. A reply is a 36-byte header — nine `i32` (code, length, format, dtype, shape[4],
//! location) — with code 200 (success) or 400 (fail), followed for a successful `GET` by
//! `length` bytes. One connection answers in order, so requests are pipelined; a batch of
//! `PUT`s ends with a `HEALTH` whose answer says the server consumed them all.
//!
//! The protocol has no delete: a removal is a `PUT` of an empty value, which kvd reads as a miss.

use super::frame::{self, Framed};
use super::remote::{RemoteError, RemoteStore};
use bytes::{Bytes, BytesMut};
use std::sync::Mutex;
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader, BufWriter};
use tokio::net::TcpStream;

/// The key field's size.
pub const MAX_KEY_LENGTH: usize = 150;
/// A request header's size.
pub const REQUEST_BYTES: usize = 9 * 4 + MAX_KEY_LENGTH;
/// A reply header's size.
pub const REPLY_BYTES: usize = 9 * 4;
pub const PUT: i32 = 1;
pub const GET: i32 = 2;
pub const EXIST: i32 = 3;
pub const HEALTH: i32 = 5;
pub const SUCCESS: i32 = 200;
pub const FAIL: i32 = 400;
/// `MemoryFormat.BINARY`, `torch.uint8`: what kvd's opaque blocks are declared as.
const FORMAT_BINARY: i32 = 4;
const DTYPE_UINT8: i32 = 6;

/// The request header for `command` on `key` with a value of `length` bytes.
///
/// # Errors
/// A key longer than [`MAX_KEY_LENGTH`] bytes.
pub fn request(command: i32, key: &str, length: usize) -> Result<[u8; REQUEST_BYTES], RemoteError> {
    if key.len() > MAX_KEY_LENGTH {
        return Err(RemoteError::Protocol(format!(
            "key {key:?} is longer than lm://'s {MAX_KEY_LENGTH} bytes"
        )));
    }
    let length = i32::try_from(length)
        .map_err(|_| RemoteError::Protocol("a value over 2 GiB".to_owned()))?;
    let mut out = [b' '; REQUEST_BYTES];
    let ints = [
        command,
        length,
        FORMAT_BINARY,
        DTYPE_UINT8,
        0,
        length,
        0,
        0,
        0,
    ];
    for (i, v) in ints.into_iter().enumerate() {
        out[i * 4..i * 4 + 4].copy_from_slice(&v.to_le_bytes());
    }
    out[36..36 + key.len()].copy_from_slice(key.as_bytes());
    Ok(out)
}

/// `(code, length)` of a reply header.
pub fn reply(header: &[u8; REPLY_BYTES]) -> (i32, i32) {
    let int = |at: usize| {
        i32::from_le_bytes([header[at], header[at + 1], header[at + 2], header[at + 3]])
    };
    (int(0), int(4))
}

type Stream = (
    BufReader<tokio::net::tcp::OwnedReadHalf>,
    BufWriter<tokio::net::tcp::OwnedWriteHalf>,
);

/// An LMCache server.
#[derive(Debug)]
pub struct LmStore {
    host: String,
    port: u16,
    max_value: usize,
    idle: Mutex<Vec<Stream>>,
}

impl LmStore {
    /// A client of `host:port`; values over `max_value` bytes are refused on read.
    pub fn new(host: String, port: u16, max_value: usize) -> Self {
        Self {
            host,
            port,
            max_value,
            idle: Mutex::new(Vec::new()),
        }
    }

    async fn take(&self) -> Result<Stream, RemoteError> {
        if let Some(s) = self.idle.lock().unwrap_or_else(|p| p.into_inner()).pop() {
            return Ok(s);
        }
        let stream = TcpStream::connect((self.host.as_str(), self.port)).await?;
        stream.set_nodelay(true)?;
        let (r, w) = stream.into_split();
        Ok((
            BufReader::with_capacity(256 * 1024, r),
            BufWriter::with_capacity(64 * 1024, w),
        ))
    }

    fn give(&self, stream: Stream) {
        let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
        if idle.len() < 16 {
            idle.push(stream);
        }
    }

    /// Runs `work` on a connection, returning it to the pool only when `work` succeeded.
    async fn with<T>(
        &self,
        work: impl AsyncFnOnce(&mut Stream) -> Result<T, RemoteError>,
    ) -> Result<T, RemoteError> {
        let mut stream = self.take().await?;
        match work(&mut stream).await {
            Ok(out) => {
                self.give(stream);
                Ok(out)
            }
            Err(error) => {
                self.idle.lock().unwrap_or_else(|p| p.into_inner()).clear();
                Err(error)
            }
        }
    }

    /// Sends one header-only request per key and reads each reply header.
    async fn ask(&self, command: i32, names: &[String]) -> Result<Vec<(i32, i32)>, RemoteError> {
        self.with(async |(r, w): &mut Stream| {
            for name in names {
                w.write_all(&request(command, name, 0)?).await?;
            }
            w.flush().await?;
            let mut out = Vec::with_capacity(names.len());
            for _ in names {
                let mut header = [0u8; REPLY_BYTES];
                r.read_exact(&mut header).await?;
                out.push(reply(&header));
            }
            Ok(out)
        })
        .await
    }

    /// PUTs each name's frame (`None`: an empty value), then asks HEALTH, whose answer comes
    /// after every PUT's; frames to seal are sealed as they go out ([`frame::write_to`]).
    async fn put_parts(&self, items: &[(&str, Option<&Framed>)]) -> Result<(), RemoteError> {
        self.with(async |(r, w): &mut Stream| {
            for (name, framed) in items {
                let len = framed.map_or(0, Framed::len);
                w.write_all(&request(PUT, name, len)?).await?;
                if let Some(f) = framed {
                    frame::write_to(f, w).await?;
                }
            }
            w.write_all(&request(HEALTH, "", 0)?).await?;
            w.flush().await?;
            let mut header = [0u8; REPLY_BYTES];
            r.read_exact(&mut header).await?;
            match reply(&header) {
                (SUCCESS, _) => Ok(()),
                (code, _) => Err(RemoteError::Protocol(format!("HEALTH answered {code}"))),
            }
        })
        .await
    }
}

#[async_trait::async_trait]
impl RemoteStore for LmStore {
    fn backend(&self) -> &'static str {
        "lmcache"
    }

    fn twin(&self) -> Option<std::sync::Arc<dyn RemoteStore>> {
        Some(std::sync::Arc::new(Self::new(
            self.host.clone(),
            self.port,
            self.max_value,
        )))
    }

    fn describe(&self) -> String {
        format!("lm://{}:{}", self.host, self.port)
    }

    async fn health(&self) -> Result<(), RemoteError> {
        match self.ask(HEALTH, &[String::new()]).await?.as_slice() {
            [(SUCCESS, _)] => Ok(()),
            other => Err(RemoteError::Protocol(format!("HEALTH answered {other:?}"))),
        }
    }

    /// Each frame's checksum is taken as it goes out ([`frame::write_to`]), as for Redis.
    fn seals(&self) -> bool {
        true
    }

    async fn put_batch(&self, items: &[(String, Framed)]) -> Result<Vec<usize>, RemoteError> {
        let parts: Vec<(&str, Option<&Framed>)> =
            items.iter().map(|(n, f)| (n.as_str(), Some(f))).collect();
        // The protocol answers no PUT: a server that cannot keep a value says so to nobody.
        self.put_parts(&parts).await.map(|()| Vec::new())
    }

    async fn get_batch(&self, names: &[String]) -> Result<Vec<Option<Bytes>>, RemoteError> {
        let max = self.max_value;
        self.with(async |(r, w): &mut Stream| {
            for name in names {
                w.write_all(&request(GET, name, 0)?).await?;
            }
            w.flush().await?;
            let mut out = Vec::with_capacity(names.len());
            for _ in names {
                let mut header = [0u8; REPLY_BYTES];
                r.read_exact(&mut header).await?;
                match reply(&header) {
                    (SUCCESS, len) => {
                        let len =
                            usize::try_from(len)
                                .ok()
                                .filter(|l| *l <= max)
                                .ok_or_else(|| {
                                    RemoteError::Protocol(format!("a value of {len} bytes"))
                                })?;
                        let mut buf = BytesMut::zeroed(len);
                        r.read_exact(&mut buf).await?;
                        out.push(Some(buf.freeze()));
                    }
                    _ => out.push(None),
                }
            }
            Ok(out)
        })
        .await
    }

    async fn exists_batch(&self, names: &[String]) -> Result<Vec<bool>, RemoteError> {
        Ok(self
            .ask(EXIST, names)
            .await?
            .into_iter()
            .map(|(code, _)| code == SUCCESS)
            .collect())
    }

    async fn remove_batch(&self, names: &[String]) -> Result<(), RemoteError> {
        let parts: Vec<(&str, Option<&Framed>)> =
            names.iter().map(|n| (n.as_str(), None)).collect();
        self.put_parts(&parts).await
    }
}
