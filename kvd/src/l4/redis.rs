//! LMCache's Redis/Valkey layout, spoken natively (read from LMCache's
//! `lmcache/v1/storage_backend/connector/redis_connector.py`): a block `N` is two keys, the
//! value under `N + "kv_bytes"` and a 28-byte `RemoteMetadata` under `N + "metadata"` (seven
//! little-endian `i32`: length, memory format, dtype, shape[4]). The value is written first
//! and the metadata last: the metadata key is the commit marker, so a value without one is
//! not there yet (or was half-evicted) and reads as a miss; `exists` asks for the metadata key.
//!
//! kvd writes its framed blocks as LMCache `BINARY` objects (format 4) of dtype `uint8` (6),
//! shape `[length, 0, 0, 0]`.

use super::frame::Framed;
use super::remote::{RemoteError, RemoteStore};
use super::resp::{Arg, Endpoint, Pool, Reply};
use bytes::Bytes;

const VALUE_SUFFIX: &str = "kv_bytes";
const META_SUFFIX: &str = "metadata";
/// LMCache's `MemoryFormat.BINARY`.
const FORMAT_BINARY: i32 = 4;
/// LMCache's dtype number of `torch.uint8`.
const DTYPE_UINT8: i32 = 6;

/// The `RemoteMetadata` LMCache stores beside a value of `len` bytes.
pub fn metadata(len: usize) -> [u8; 28] {
    let len = i32::try_from(len).unwrap_or(i32::MAX);
    let mut out = [0u8; 28];
    for (i, v) in [len, FORMAT_BINARY, DTYPE_UINT8, len, 0, 0, 0]
        .into_iter()
        .enumerate()
    {
        out[i * 4..i * 4 + 4].copy_from_slice(&v.to_le_bytes());
    }
    out
}

/// A Redis or Valkey server holding blocks in LMCache's layout.
#[derive(Debug)]
pub struct RedisStore {
    pool: Pool,
}

impl RedisStore {
    /// A client of `endpoint`; values over `max_value` bytes are refused on read.
    pub fn new(endpoint: Endpoint, max_value: usize) -> Self {
        Self {
            pool: Pool::new(endpoint, max_value),
        }
    }

    /// Sends `commands` in one pipeline and reads one reply each; framed values to seal are
    /// sealed as they go out ([`super::frame::write_to`]).
    async fn pipeline(&self, commands: &[Vec<Arg<'_>>]) -> Result<Vec<Reply>, RemoteError> {
        let mut conn = self.pool.take().await?;
        let result = async {
            for command in commands {
                conn.send(command).await?;
            }
            conn.flush().await?;
            let mut replies = Vec::with_capacity(commands.len());
            for _ in commands {
                replies.push(conn.read().await?);
            }
            Ok::<_, RemoteError>(replies)
        }
        .await;
        match result {
            Ok(replies) => {
                self.pool.give(conn);
                Ok(replies)
            }
            Err(error) => {
                self.pool.reset();
                Err(error)
            }
        }
    }
}

#[async_trait::async_trait]
impl RemoteStore for RedisStore {
    fn backend(&self) -> &'static str {
        "lmcache"
    }

    /// One connection: the server is single-threaded, and large values written on several
    /// connections at once cost it more than they overlap (16 puts of 1 or 4 MiB: 52–90 % of a
    /// plain pipelined client on two or four connections, 72–108 % on one). Reads keep four:
    /// copying large replies out of the sockets is the client's work, and it overlaps.
    fn write_streams(&self) -> usize {
        1
    }

    /// Each frame's checksum is taken as it goes out, piece by piece right before each piece
    /// is written ([`super::frame::write_to`]): one pass over the value from memory.
    fn seals(&self) -> bool {
        true
    }

    fn twin(&self) -> Option<std::sync::Arc<dyn RemoteStore>> {
        Some(std::sync::Arc::new(Self {
            pool: self.pool.twin(),
        }))
    }

    fn describe(&self) -> String {
        let ep = self.pool.endpoint();
        format!("redis://{}:{}", ep.host, ep.port)
    }

    async fn health(&self) -> Result<(), RemoteError> {
        match self.pipeline(&[vec![Arg::Plain(b"PING")]]).await?.pop() {
            Some(Reply::Status(_)) => Ok(()),
            other => Err(RemoteError::Protocol(format!("PING answered {other:?}"))),
        }
    }

    /// A value whose `SET`s the store refused for want of memory (`OOM`) is refused; any
    /// other error reply fails the batch.
    async fn put_batch(&self, items: &[(String, Framed)]) -> Result<Vec<usize>, RemoteError> {
        let names: Vec<(String, String, [u8; 28])> = items
            .iter()
            .map(|(n, f)| {
                (
                    format!("{n}{VALUE_SUFFIX}"),
                    format!("{n}{META_SUFFIX}"),
                    metadata(f.len()),
                )
            })
            .collect();
        let mut commands = Vec::with_capacity(items.len() * 2);
        for ((value, meta, md), (_, framed)) in names.iter().zip(items) {
            commands.push(vec![
                Arg::Plain(b"SET"),
                Arg::Plain(value.as_bytes()),
                Arg::Framed(framed),
            ]);
            commands.push(vec![
                Arg::Plain(b"SET"),
                Arg::Plain(meta.as_bytes()),
                Arg::Plain(md),
            ]);
        }
        let replies = self.pipeline(&commands).await?;
        let mut refused = Vec::new();
        // Two replies an item: its value's SET, then its metadata's (the commit marker).
        for (i, pair) in replies.chunks(2).enumerate() {
            if let Some(other) = pair
                .iter()
                .find(|r| !matches!(r, Reply::Status(_)) && !r.is_out_of_memory())
            {
                return Err(other.unexpected());
            }
            if pair.iter().any(Reply::is_out_of_memory) {
                refused.push(i);
            }
        }
        Ok(refused)
    }

    async fn get_batch(&self, names: &[String]) -> Result<Vec<Option<Bytes>>, RemoteError> {
        let keys: Vec<(String, String)> = names
            .iter()
            .map(|n| (format!("{n}{META_SUFFIX}"), format!("{n}{VALUE_SUFFIX}")))
            .collect();
        let mut commands = Vec::with_capacity(names.len() * 2);
        for (meta, value) in &keys {
            commands.push(vec![Arg::Plain(b"GET"), Arg::Plain(meta.as_bytes())]);
            commands.push(vec![Arg::Plain(b"GET"), Arg::Plain(value.as_bytes())]);
        }
        let mut replies = self.pipeline(&commands).await?.into_iter();
        let mut out = Vec::with_capacity(names.len());
        while let (Some(meta), Some(value)) = (replies.next(), replies.next()) {
            match (meta, value) {
                (Reply::Bulk(Some(_)), Reply::Bulk(value)) => out.push(value),
                (Reply::Bulk(None), Reply::Bulk(_)) => out.push(None),
                (Reply::Bulk(_), other) | (other, _) => return Err(other.unexpected()),
            }
        }
        Ok(out)
    }

    async fn exists_batch(&self, names: &[String]) -> Result<Vec<bool>, RemoteError> {
        let metas: Vec<String> = names.iter().map(|n| format!("{n}{META_SUFFIX}")).collect();
        let commands: Vec<Vec<Arg<'_>>> = metas
            .iter()
            .map(|m| vec![Arg::Plain(b"EXISTS"), Arg::Plain(m.as_bytes())])
            .collect();
        self.pipeline(&commands)
            .await?
            .into_iter()
            .map(|reply| match reply {
                Reply::Int(n) => Ok(n > 0),
                other => Err(other.unexpected()),
            })
            .collect()
    }

    async fn remove_batch(&self, names: &[String]) -> Result<(), RemoteError> {
        let keys: Vec<(String, String)> = names
            .iter()
            .map(|n| (format!("{n}{META_SUFFIX}"), format!("{n}{VALUE_SUFFIX}")))
            .collect();
        let commands: Vec<Vec<Arg<'_>>> = keys
            .iter()
            .map(|(meta, value)| {
                vec![
                    Arg::Plain(b"DEL"),
                    Arg::Plain(meta.as_bytes()),
                    Arg::Plain(value.as_bytes()),
                ]
            })
            .collect();
        for reply in self.pipeline(&commands).await? {
            if !matches!(reply, Reply::Int(_)) {
                return Err(reply.unexpected());
            }
        }
        Ok(())
    }
}
