//! `Client`: the Python face of [`Core`], one kvd connection with a deadline on every call.
//!
//! [`Core`] owns a current-thread tokio runtime and the connection. Every call runs under the
//! client's deadline; a transport failure or a passed deadline drops the connection (its
//! stream may hold half a reply) and the next call opens a fresh one, so a restarted daemon
//! costs the calls in flight (reported as [`ClientError`]s the Python side turns into misses),
//! never a hang or a stale reply. Idempotent calls made on a connection that turns out dead
//! are retried once on a fresh one. On each new connection the shared arena (when offered) is
//! mapped and, when asked, pinned ([`crate::pin`]).

use crate::pin::{self, Pinned};
use crate::views::{Lease, Slot};
use crate::{KvdError, KvdUnavailable};
use bytes::Bytes;
use infera_core::event::Retention;
use infera_kvd::client::{ClientArena, HelloAck, SharedGet};
use infera_kvd::proto::StatsReply;
use infera_kvd::{ClientError, KvdClient, Namespace, SetItem};
use pyo3::buffer::PyBuffer;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};
use std::future::Future;
use std::path::PathBuf;
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

/// Whether and how the current arena is pinned.
#[derive(Debug)]
pub enum PinState {
    /// Pinning was not asked for.
    Off,
    /// Registered with the CUDA driver or the HIP runtime.
    Pinned(Pinned),
    /// Plain host memory, and why.
    Unpinned(String),
}

impl PinState {
    fn backend(&self) -> &'static str {
        match self {
            PinState::Pinned(pinned) => pinned.runtime(),
            PinState::Off | PinState::Unpinned(_) => "none",
        }
    }
}

/// One connection and what came with it.
#[derive(Debug)]
struct Conn {
    // Declared first: the pin is released before the arena handle below may unmap.
    pin: PinState,
    client: KvdClient,
    ack: HelloAck,
}

/// Connection options.
#[derive(Debug, Clone)]
pub struct Options {
    pub path: PathBuf,
    pub client_id: String,
    pub deadline: Duration,
    pub shared_arena: bool,
    pub pin: bool,
}

/// See the module docs.
#[derive(Debug)]
pub struct Core {
    rt: tokio::runtime::Runtime,
    options: Options,
    conn: Option<Conn>,
    /// Bumped on every new connection (leases die with theirs).
    generation: u64,
    reconnects: u64,
}

impl Core {
    /// A client for `options`; connects on first use.
    ///
    /// # Errors
    /// When the runtime cannot start.
    pub fn new(options: Options) -> std::io::Result<Self> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        Ok(Self {
            rt,
            options,
            conn: None,
            generation: 0,
            reconnects: 0,
        })
    }

    fn deadline<T>(
        rt: &tokio::runtime::Runtime,
        deadline: Duration,
        work: impl Future<Output = Result<T, ClientError>>,
    ) -> Result<T, ClientError> {
        rt.block_on(async {
            tokio::time::timeout(deadline, work)
                .await
                .unwrap_or_else(|_| {
                    Err(ClientError::Io(std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        format!("no reply within {deadline:?}"),
                    )))
                })
        })
    }

    fn connect(&mut self) -> Result<(), ClientError> {
        if self.conn.is_some() {
            return Ok(());
        }
        let o = &self.options;
        let (client, ack) = if o.shared_arena {
            Self::deadline(
                &self.rt,
                o.deadline,
                KvdClient::connect_shared(&o.path, &o.client_id),
            )?
        } else {
            Self::deadline(&self.rt, o.deadline, async {
                let mut client = KvdClient::connect(&o.path).await?;
                let ack = client.hello(&o.client_id).await?;
                Ok((client, ack))
            })?
        };
        let pin = match (client.arena(), o.pin) {
            (Some(arena), true) => match pin::pin(arena.base(), arena.len()) {
                Ok(pinned) => PinState::Pinned(pinned),
                Err(why) => PinState::Unpinned(why),
            },
            (Some(_), false) => PinState::Off,
            (None, _) => PinState::Unpinned("the daemon offered no shared arena".to_owned()),
        };
        match &pin {
            PinState::Pinned(pinned) => tracing::info!(
                arena_bytes = client.arena().map_or(0, ClientArena::len),
                runtime = pinned.runtime(),
                "kvd arena pinned for DMA"
            ),
            PinState::Unpinned(why) => tracing::info!(%why, "kvd arena in plain host memory"),
            PinState::Off => {}
        }
        if self.generation > 0 {
            self.reconnects += 1;
        }
        self.generation += 1;
        self.conn = Some(Conn { pin, client, ack });
        Ok(())
    }

    /// Runs `call` on the connection (opened if needed) under the deadline; drops the
    /// connection on a retryable failure and, when `retry`, tries once more on a fresh one
    /// if the failed connection was an old one.
    fn with<T>(
        &mut self,
        retry: bool,
        call: impl Fn(
            &mut KvdClient,
        ) -> std::pin::Pin<Box<dyn Future<Output = Result<T, ClientError>> + '_>>,
    ) -> Result<T, ClientError> {
        for attempt in 0..2 {
            let fresh = self.conn.is_none();
            self.connect()?;
            let Some(conn) = self.conn.as_mut() else {
                return Err(ClientError::Closed);
            };
            let result = Self::deadline(&self.rt, self.options.deadline, call(&mut conn.client));
            match result {
                Err(e) if e.is_retryable() => {
                    self.conn = None;
                    if !(retry && !fresh && attempt == 0) {
                        return Err(e);
                    }
                }
                other => return other,
            }
        }
        Err(ClientError::Closed)
    }

    /// `hello` (the connection's own handshake when it is new).
    pub fn hello(&mut self) -> Result<HelloAck, ClientError> {
        let id = self.options.client_id.clone();
        if self.conn.is_none() {
            self.connect()?;
            if let Some(conn) = &self.conn {
                return Ok(conn.ack.clone());
            }
        }
        self.with(true, |c| {
            let id = id.clone();
            Box::pin(async move { c.hello(&id).await })
        })
    }

    /// `exists`, one flag per key.
    pub fn exists(&mut self, ns: &Namespace, keys: Vec<Bytes>) -> Result<Vec<bool>, ClientError> {
        self.with(true, |c| {
            let (ns, keys) = (ns.clone(), keys.clone());
            Box::pin(async move { c.exists(&ns, keys).await })
        })
    }

    /// `batch_get`, the bytes copied out.
    pub fn get(
        &mut self,
        ns: &Namespace,
        keys: Vec<Bytes>,
    ) -> Result<Vec<Option<Bytes>>, ClientError> {
        let hits = self.with(true, |c| {
            let (ns, keys) = (ns.clone(), keys.clone());
            Box::pin(async move { c.batch_get(&ns, keys).await })
        })?;
        Ok(hits.into_iter().map(|h| h.map(|h| h.value)).collect())
    }

    /// `batch_get` for in-place reads: arena slots (validated now) or inline values.
    pub fn lookup(
        &mut self,
        ns: &Namespace,
        keys: Vec<Bytes>,
    ) -> Result<Vec<Option<Slot>>, ClientError> {
        let found = self.with(true, |c| {
            let (ns, keys) = (ns.clone(), keys.clone());
            Box::pin(async move { c.batch_get_shared(&ns, keys).await })
        })?;
        let arena = self.conn.as_ref().and_then(|c| c.client.arena_handle());
        Ok(found
            .into_iter()
            .map(|f| match f {
                Some(SharedGet::Inline(hit)) => Some(Slot::inline(hit)),
                Some(SharedGet::Slot(slot)) => arena
                    .as_ref()
                    .filter(|a| a.is_valid(&slot))
                    .map(|a| Slot::arena(a.clone(), slot)),
                None => None,
            })
            .collect())
    }

    /// `batch_set` with one retention and TTL for all items; one acceptance flag per item.
    pub fn set(
        &mut self,
        ns: &Namespace,
        items: Vec<(Bytes, Bytes)>,
        retention: Retention,
        ttl_seconds: Option<f64>,
    ) -> Result<Vec<bool>, ClientError> {
        let items: Vec<SetItem> = items
            .into_iter()
            .map(|(k, v)| {
                let item = SetItem::new(k, v).retention(retention);
                match ttl_seconds {
                    Some(ttl) => item.ttl_seconds(ttl),
                    None => item,
                }
            })
            .collect();
        let acks = self.with(true, |c| {
            let (ns, items) = (ns.clone(), items.clone());
            Box::pin(async move { c.batch_set(&ns, items).await })
        })?;
        Ok(acks.into_iter().map(|a| a.accepted).collect())
    }

    /// `set_reserve`: a lease on an arena slot of at least `size` bytes, or `None` when there
    /// is no arena or the daemon refused (too large, full).
    pub fn reserve(&mut self, size: u64) -> Result<Option<Lease>, ClientError> {
        let reservation = self.with(false, |c| Box::pin(c.set_reserve(size)))?;
        let arena = self.conn.as_ref().and_then(|c| c.client.arena_handle());
        Ok(match arena {
            Some(arena) if reservation.lease_token != 0 => {
                Some(Lease::new(arena, reservation, self.generation))
            }
            _ => None,
        })
    }

    /// `set_commit` of `length` bytes written into the lease. False when the daemon refused,
    /// or the lease was already used or belongs to a connection that is gone.
    pub fn commit(
        &mut self,
        ns: &Namespace,
        lease: &Lease,
        key: Bytes,
        length: u64,
        retention: Retention,
        ttl_seconds: u64,
    ) -> Result<bool, ClientError> {
        if lease.generation != self.generation || self.conn.is_none() || !lease.take() {
            return Ok(false);
        }
        let token = lease.reservation().lease_token;
        let (accepted, _) = self.with(false, |c| {
            let (ns, key) = (ns.clone(), key.clone());
            Box::pin(async move {
                c.set_commit(&ns, token, key, length, retention, ttl_seconds)
                    .await
            })
        })?;
        Ok(accepted)
    }

    /// `set_cancel`; a no-op for a lease already used or of a dead connection.
    pub fn cancel(&mut self, lease: &Lease) -> Result<(), ClientError> {
        if lease.generation != self.generation || self.conn.is_none() || !lease.take() {
            return Ok(());
        }
        let token = lease.reservation().lease_token;
        self.with(false, |c| Box::pin(c.set_cancel(token)))
    }

    /// The daemon's `stats` (extended).
    pub fn stats(&mut self) -> Result<StatsReply, ClientError> {
        self.with(true, |c| Box::pin(c.stats(true)))
    }

    /// The current arena, its pin state, and the connection counters.
    pub fn arena_info(&self) -> (Option<(usize, u64)>, &'static str, Option<String>, u64) {
        let conn = self.conn.as_ref();
        let arena = conn
            .and_then(|c| c.client.arena())
            .map(|a| (a.len(), a.slot_size()));
        let (backend, why) = match conn.map(|c| &c.pin) {
            Some(pin @ PinState::Unpinned(why)) => (pin.backend(), Some(why.clone())),
            Some(pin) => (pin.backend(), None),
            None => ("none", Some("not connected".to_owned())),
        };
        (arena, backend, why, self.reconnects)
    }
}

fn py_err(e: ClientError) -> PyErr {
    if e.is_retryable() {
        KvdUnavailable::new_err(e.to_string())
    } else {
        KvdError::new_err(e.to_string())
    }
}

fn retention(name: &str) -> PyResult<Retention> {
    Retention::parse(name).ok_or_else(|| {
        pyo3::exceptions::PyValueError::new_err(format!(
            "unknown retention {name:?}: expected none, ephemeral, short or long"
        ))
    })
}

fn keys(list: &[Bound<'_, PyBytes>]) -> Vec<Bytes> {
    list.iter()
        .map(|k| Bytes::copy_from_slice(k.as_bytes()))
        .collect()
}

/// A kvd client. `Client(path, client_id="infera-kvd-py", timeout_s=5.0, shared_arena=True,
/// pin=True)`: every call finishes within `timeout_s`; `shared_arena` asks for the daemon's
/// arena (zero-copy `lookup`/`reserve`); `pin` registers it for DMA with the CUDA driver or the HIP runtime when one is present.
/// Connects on first use. Errors: `KvdUnavailable` (retry later), `KvdError` (refused).
#[pyclass(frozen, module = "infera_kvd._native")]
#[derive(Debug)]
pub struct Client {
    core: Mutex<Core>,
}

impl Client {
    fn core(&self) -> MutexGuard<'_, Core> {
        self.core.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[pymethods]
impl Client {
    #[new]
    #[pyo3(signature = (path, client_id = "infera-kvd-py", timeout_s = 5.0, shared_arena = true, pin = true))]
    fn new(
        path: PathBuf,
        client_id: &str,
        timeout_s: f64,
        shared_arena: bool,
        pin: bool,
    ) -> PyResult<Self> {
        if !(timeout_s.is_finite() && timeout_s > 0.0) {
            return Err(pyo3::exceptions::PyValueError::new_err(format!(
                "timeout_s must be a positive number of seconds, got {timeout_s}"
            )));
        }
        let core = Core::new(Options {
            path,
            client_id: client_id.to_owned(),
            deadline: Duration::from_secs_f64(timeout_s),
            shared_arena,
            pin,
        })
        .map_err(|e| KvdError::new_err(format!("cannot start the client runtime: {e}")))?;
        Ok(Self {
            core: Mutex::new(core),
        })
    }

    /// `hello`: `{"server_id", "protocol_version", "shared_arena": (size, slot, pid) | None,
    /// "kv_events_endpoint": str | None, "kv_events_replay_endpoint": str | None}` (where the
    /// daemon publishes its inventory, if it does).
    fn hello<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let ack = py.detach(|| self.core().hello()).map_err(py_err)?;
        let out = PyDict::new(py);
        out.set_item("server_id", ack.server_id)?;
        out.set_item("protocol_version", ack.protocol_version)?;
        out.set_item("shared_arena", ack.shared_arena.map(|a| (a[0], a[1], a[2])))?;
        out.set_item("kv_events_endpoint", ack.kv_events_endpoint)?;
        out.set_item("kv_events_replay_endpoint", ack.kv_events_replay_endpoint)?;
        Ok(out)
    }

    /// Which `keys` the namespace `(model, compat_key)` holds, one flag per key.
    fn exists(
        &self,
        py: Python<'_>,
        model: &str,
        compat_key: &str,
        keys: Vec<Bound<'_, PyBytes>>,
    ) -> PyResult<Vec<bool>> {
        let ns = Namespace::new(model, compat_key);
        let keys = self::keys(&keys);
        py.detach(|| self.core().exists(&ns, keys)).map_err(py_err)
    }

    /// The values of `keys` copied out as bytes (None per miss).
    fn get<'py>(
        &self,
        py: Python<'py>,
        model: &str,
        compat_key: &str,
        keys: Vec<Bound<'py, PyBytes>>,
    ) -> PyResult<Vec<Option<Bound<'py, PyBytes>>>> {
        let ns = Namespace::new(model, compat_key);
        let keys = self::keys(&keys);
        let values = py.detach(|| self.core().get(&ns, keys)).map_err(py_err)?;
        Ok(values
            .into_iter()
            .map(|v| v.map(|v| PyBytes::new(py, &v)))
            .collect())
    }

    /// Hits of `keys` for in-place reads: a `Slot` (buffer) per hit, None per miss.
    fn lookup(
        &self,
        py: Python<'_>,
        model: &str,
        compat_key: &str,
        keys: Vec<Bound<'_, PyBytes>>,
    ) -> PyResult<Vec<Option<Py<Slot>>>> {
        let ns = Namespace::new(model, compat_key);
        let keys = self::keys(&keys);
        let slots = py
            .detach(|| self.core().lookup(&ns, keys))
            .map_err(py_err)?;
        slots
            .into_iter()
            .map(|s| s.map(|s| Py::new(py, s)).transpose())
            .collect()
    }

    /// Stores `values` (any buffers) under `keys` with one retention class and TTL (seconds);
    /// one acceptance flag per key. `none` stays in memory only.
    #[pyo3(signature = (model, compat_key, keys, values, retention = "short", ttl_s = None))]
    #[allow(clippy::too_many_arguments)] // the Python keyword signature
    fn set(
        &self,
        py: Python<'_>,
        model: &str,
        compat_key: &str,
        keys: Vec<Bound<'_, PyBytes>>,
        values: Vec<Bound<'_, PyAny>>,
        retention: &str,
        ttl_s: Option<f64>,
    ) -> PyResult<Vec<bool>> {
        if keys.len() != values.len() {
            return Err(pyo3::exceptions::PyValueError::new_err(format!(
                "{} keys but {} values",
                keys.len(),
                values.len()
            )));
        }
        let class = self::retention(retention)?;
        let mut items = Vec::with_capacity(keys.len());
        for (k, v) in keys.iter().zip(&values) {
            let buffer = PyBuffer::<u8>::get(v)?;
            items.push((
                Bytes::copy_from_slice(k.as_bytes()),
                Bytes::from(buffer.to_vec(py)?),
            ));
        }
        let ns = Namespace::new(model, compat_key);
        py.detach(|| self.core().set(&ns, items, class, ttl_s))
            .map_err(py_err)
    }

    /// A writable arena slot of at least `size` bytes (`Lease`), or None when the daemon has
    /// no arena for it; fill it in place, then `commit` (or `cancel`).
    fn reserve(&self, py: Python<'_>, size: u64) -> PyResult<Option<Py<Lease>>> {
        let lease = py.detach(|| self.core().reserve(size)).map_err(py_err)?;
        lease.map(|l| Py::new(py, l)).transpose()
    }

    /// Publishes the first `length` bytes of `lease` under `key`; True when stored.
    #[pyo3(signature = (model, compat_key, key, lease, length, retention = "short", ttl_s = None))]
    #[allow(clippy::too_many_arguments)] // the Python keyword signature
    fn commit(
        &self,
        py: Python<'_>,
        model: &str,
        compat_key: &str,
        key: &Bound<'_, PyBytes>,
        lease: Py<Lease>,
        length: u64,
        retention: &str,
        ttl_s: Option<f64>,
    ) -> PyResult<bool> {
        let class = self::retention(retention)?;
        let ttl = ttl_s.map_or(0, |t| t.max(1.0).ceil() as u64);
        let ns = Namespace::new(model, compat_key);
        let key = Bytes::copy_from_slice(key.as_bytes());
        let lease = lease.get();
        py.detach(|| self.core().commit(&ns, lease, key, length, class, ttl))
            .map_err(py_err)
    }

    /// Gives an unused lease back.
    fn cancel(&self, py: Python<'_>, lease: Py<Lease>) -> PyResult<()> {
        let lease = lease.get();
        py.detach(|| self.core().cancel(lease)).map_err(py_err)
    }

    /// The daemon's counters (extended) as a dict.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = py.detach(|| self.core().stats()).map_err(py_err)?;
        let out = PyDict::new(py);
        for (name, value) in [
            ("entries", s.entries),
            ("host_bytes", s.host_bytes),
            ("spillover_bytes", s.spillover_bytes),
            ("long_bytes", s.long_bytes),
            ("gets_total", s.gets_total),
            ("sets_total", s.sets_total),
            ("hits_total", s.hits_total),
            ("misses_total", s.misses_total),
            ("evictions_total", s.evictions_total),
        ] {
            out.set_item(name, value)?;
        }
        for (name, value) in s.extended.map(|e| e.fields()).unwrap_or_default() {
            out.set_item(name, value)?;
        }
        Ok(out)
    }

    /// The client side: `{"arena_bytes", "slot_bytes", "pinned", "pin_backend", "pin_note",
    /// "reconnects"}` (arena fields None without an arena).
    fn arena_info<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let (arena, backend, why, reconnects) = self.core().arena_info();
        let out = PyDict::new(py);
        out.set_item("arena_bytes", arena.map(|a| a.0))?;
        out.set_item("slot_bytes", arena.map(|a| a.1))?;
        out.set_item("pinned", backend != "none")?;
        out.set_item("pin_backend", backend)?;
        out.set_item("pin_note", why)?;
        out.set_item("reconnects", reconnects)?;
        Ok(out)
    }

    /// Closes the connection (the next call opens a new one).
    fn close(&self) {
        self.core().conn = None;
    }
}
