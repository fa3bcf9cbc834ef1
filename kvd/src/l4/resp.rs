//! A small Redis (RESP2) client: pipelined commands over pooled TCP connections, every reply
//! bounded in size. Deadlines belong to the caller: a future dropped mid-command drops its
//! connection with it (a connection goes back to the pool only after a whole pipeline).

use super::frame::{self, Framed};
use super::remote::RemoteError;
use bytes::Bytes;
use std::sync::Mutex;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader, BufWriter};
use tokio::net::TcpStream;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};

/// Longest status, error or length line accepted.
const MAX_LINE: usize = 64 * 1024;
/// Idle connections kept per pool.
const MAX_IDLE: usize = 16;

/// One command argument: plain bytes, or a framed value written in its two parts.
#[derive(Debug, Clone, Copy)]
pub enum Arg<'a> {
    Plain(&'a [u8]),
    Framed(&'a Framed),
}

/// A reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    Status(String),
    /// An error reply (`-…`): the command failed, the connection is still in step.
    Error(String),
    Int(i64),
    Bulk(Option<Bytes>),
    Array(usize),
}

impl Reply {
    /// Whether the store refused a write for want of memory (`maxmemory` reached under a
    /// `noeviction` policy): it is up, it just keeps nothing more.
    pub fn is_out_of_memory(&self) -> bool {
        matches!(self, Reply::Error(e) if e.starts_with("OOM"))
    }

    /// The error of a reply its command did not expect.
    pub fn unexpected(&self) -> RemoteError {
        match self {
            Reply::Error(e) => protocol(format!("the store answered {e}")),
            other => protocol(format!("unexpected reply {other:?}")),
        }
    }
}

fn protocol(message: impl Into<String>) -> RemoteError {
    RemoteError::Protocol(message.into())
}

/// Where and how to connect.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    pub host: String,
    pub port: u16,
    pub password: Option<String>,
    pub username: Option<String>,
    pub db: Option<u32>,
}

/// One connection.
#[derive(Debug)]
pub struct Conn {
    reader: BufReader<OwnedReadHalf>,
    writer: BufWriter<OwnedWriteHalf>,
    max_bulk: usize,
}

impl Conn {
    async fn open(ep: &Endpoint, max_bulk: usize) -> Result<Self, RemoteError> {
        let stream = TcpStream::connect((ep.host.as_str(), ep.port)).await?;
        stream.set_nodelay(true)?;
        let (r, w) = stream.into_split();
        let mut conn = Self {
            reader: BufReader::with_capacity(256 * 1024, r),
            writer: BufWriter::with_capacity(64 * 1024, w),
            max_bulk,
        };
        if let Some(password) = &ep.password {
            let mut args = vec![Arg::Plain(b"AUTH")];
            if let Some(user) = &ep.username {
                args.push(Arg::Plain(user.as_bytes()));
            }
            args.push(Arg::Plain(password.as_bytes()));
            conn.expect_ok(&args).await?;
        }
        if let Some(db) = ep.db {
            let db = db.to_string();
            conn.expect_ok(&[Arg::Plain(b"SELECT"), Arg::Plain(db.as_bytes())])
                .await?;
        }
        Ok(conn)
    }

    async fn expect_ok(&mut self, args: &[Arg<'_>]) -> Result<(), RemoteError> {
        self.send(args).await?;
        self.writer.flush().await?;
        match self.read().await? {
            Reply::Status(_) => Ok(()),
            other => Err(other.unexpected()),
        }
    }

    /// Queues one command (flushed by [`Conn::flush`]); a framed value to seal is sealed as it
    /// goes out ([`frame::write_to`]).
    pub async fn send(&mut self, args: &[Arg<'_>]) -> Result<(), RemoteError> {
        let w = &mut self.writer;
        w.write_all(format!("*{}\r\n", args.len()).as_bytes())
            .await?;
        for arg in args {
            match arg {
                Arg::Plain(b) => {
                    w.write_all(format!("${}\r\n", b.len()).as_bytes()).await?;
                    w.write_all(b).await?;
                }
                Arg::Framed(f) => {
                    w.write_all(format!("${}\r\n", f.len()).as_bytes()).await?;
                    frame::write_to(f, w).await?;
                }
            }
            w.write_all(b"\r\n").await?;
        }
        Ok(())
    }

    /// Sends what is queued.
    pub async fn flush(&mut self) -> Result<(), RemoteError> {
        Ok(self.writer.flush().await?)
    }

    async fn line(&mut self) -> Result<String, RemoteError> {
        let mut line = Vec::new();
        let n = (&mut self.reader)
            .take(MAX_LINE as u64)
            .read_until(b'\n', &mut line)
            .await?;
        if n == 0 {
            return Err(protocol("the store closed the connection"));
        }
        if !line.ends_with(b"\r\n") {
            return Err(protocol("a reply line is too long or cut short"));
        }
        line.truncate(line.len() - 2);
        String::from_utf8(line).map_err(|_| protocol("a reply line is not UTF-8"))
    }

    /// Reads one reply (an array answers its length; its elements follow as replies). A store
    /// error (`-ERR ...`) is returned as an error.
    pub async fn read(&mut self) -> Result<Reply, RemoteError> {
        let line = self.line().await?;
        let (kind, rest) = line
            .split_at_checked(1)
            .ok_or_else(|| protocol("empty reply"))?;
        let int = || {
            rest.parse::<i64>()
                .map_err(|_| protocol(format!("bad length or integer {rest:?}")))
        };
        match kind {
            "+" => Ok(Reply::Status(rest.to_owned())),
            "-" => Ok(Reply::Error(rest.to_owned())),
            ":" => Ok(Reply::Int(int()?)),
            "*" => Ok(Reply::Array(usize::try_from(int()?).unwrap_or(0))),
            "$" => {
                let len = int()?;
                if len < 0 {
                    return Ok(Reply::Bulk(None));
                }
                let len = len as usize;
                if len > self.max_bulk {
                    return Err(protocol(format!(
                        "a value of {len} bytes is over the {} byte bound",
                        self.max_bulk
                    )));
                }
                // A large zeroed allocation is fresh pages from the kernel, not zeroed by
                // hand and then overwritten.
                let mut buf = vec![0u8; len + 2];
                self.reader.read_exact(&mut buf).await.map_err(|e| {
                    if e.kind() == std::io::ErrorKind::UnexpectedEof {
                        protocol("the store closed the connection mid-value")
                    } else {
                        RemoteError::Io(e)
                    }
                })?;
                if &buf[len..] != b"\r\n" {
                    return Err(protocol("a value is not followed by CRLF"));
                }
                buf.truncate(len);
                Ok(Reply::Bulk(Some(Bytes::from(buf))))
            }
            _ => Err(protocol(format!("unknown reply type {kind:?}"))),
        }
    }
}

/// Pooled connections to one endpoint.
#[derive(Debug)]
pub struct Pool {
    endpoint: Endpoint,
    max_bulk: usize,
    idle: Mutex<Vec<Conn>>,
}

impl Pool {
    /// A pool for `endpoint`; replies longer than `max_bulk` bytes are refused.
    pub fn new(endpoint: Endpoint, max_bulk: usize) -> Self {
        Self {
            endpoint,
            max_bulk,
            idle: Mutex::new(Vec::new()),
        }
    }

    /// The endpoint.
    pub fn endpoint(&self) -> &Endpoint {
        &self.endpoint
    }

    /// Another pool to the same endpoint, with no connection yet.
    pub fn twin(&self) -> Self {
        Self::new(self.endpoint.clone(), self.max_bulk)
    }

    /// An idle connection, or a new one.
    pub async fn take(&self) -> Result<Conn, RemoteError> {
        let idle = self.idle.lock().unwrap_or_else(|p| p.into_inner()).pop();
        match idle {
            Some(conn) => Ok(conn),
            None => Conn::open(&self.endpoint, self.max_bulk).await,
        }
    }

    /// Returns a connection whose last pipeline completed.
    pub fn give(&self, conn: Conn) {
        let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
        if idle.len() < MAX_IDLE {
            idle.push(conn);
        }
    }

    /// Drops every idle connection (after a failure: they may lead to a dead server).
    pub fn reset(&self) {
        self.idle.lock().unwrap_or_else(|p| p.into_inner()).clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::net::TcpListener;

    /// A store that answers any command with `reply` and then closes.
    async fn store_answering(reply: Vec<u8>) -> Endpoint {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let port = listener.local_addr().expect("addr").port();
        tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.expect("accept");
            let mut buf = [0u8; 256];
            let _ = s.read(&mut buf).await;
            s.write_all(&reply).await.expect("write");
        });
        Endpoint {
            host: "127.0.0.1".into(),
            port,
            password: None,
            username: None,
            db: None,
        }
    }

    async fn get(reply: &[u8], max_bulk: usize) -> Result<Reply, RemoteError> {
        let ep = store_answering(reply.to_vec()).await;
        let mut conn = Conn::open(&ep, max_bulk).await?;
        conn.send(&[Arg::Plain(b"GET"), Arg::Plain(b"k")]).await?;
        conn.flush().await?;
        conn.read().await
    }

    #[tokio::test]
    async fn a_value_reads_whole_and_a_missing_one_as_none() {
        let value: Vec<u8> = (0..300_000u32).map(|i| i as u8).collect();
        let mut reply = format!("${}\r\n", value.len()).into_bytes();
        reply.extend_from_slice(&value);
        reply.extend_from_slice(b"\r\n");
        let got = get(&reply, 1 << 20).await.expect("reply");
        assert_eq!(got, Reply::Bulk(Some(Bytes::from(value))));
        assert_eq!(get(b"$-1\r\n", 16).await.expect("nil"), Reply::Bulk(None));
    }

    #[tokio::test]
    async fn cut_oversized_and_unterminated_values_are_errors() {
        let message = |r: Result<Reply, RemoteError>| r.expect_err("an error").to_string();
        let cut = message(get(b"$10\r\n0123", 64).await);
        assert!(cut.contains("mid-value"), "{cut}");
        let big = message(get(b"$100\r\n", 64).await);
        assert!(big.contains("over the 64 byte bound"), "{big}");
        let unterminated = message(get(b"$4\r\nabcdXY", 64).await);
        assert!(
            unterminated.contains("not followed by CRLF"),
            "{unterminated}"
        );
    }
}
