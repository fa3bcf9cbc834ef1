//! The arena's zero-copy write path of [`Store`]: `set_reserve` leases a slot to a connection,
//! the client writes the value into the shared mapping, `set_commit` publishes the slot under a
//! key (admitted like an inline `set`) and `set_cancel` or the connection's end returns it.

use super::{Reservation, Store, Write};
use crate::arena::{HEADER_BYTES, TakeError};
use crate::proto::Namespace;
use crate::store::l2::{Stored, expiry};
use bytes::Bytes;
use infera_core::event::Retention;

impl Store {
    /// `set_reserve`: a slot leased to `conn`.
    ///
    /// # Errors
    /// `no_arena`, `invalid_size`, `oversize` (larger than a slot) or
    /// `arena_full_no_evictable` (every slot leased).
    pub fn reserve(&self, conn: u64, size: u64) -> Result<Reservation, &'static str> {
        let arena = self.arena.as_ref().ok_or("no_arena")?;
        if size == 0 {
            return Err("invalid_size");
        }
        let slot = loop {
            match arena.take(size) {
                Ok(slot) => break slot,
                Err(TakeError::Oversize) => return Err("oversize"),
                Err(TakeError::Full) => {
                    if !self.lock().demote() {
                        return Err("arena_full_no_evictable");
                    }
                }
            }
        };
        Ok(Reservation {
            lease_token: arena.open_lease(conn, slot),
            slot_id: slot,
            payload_offset: arena.payload_offset(slot),
            payload_max_size: arena.slot_size() - HEADER_BYTES,
        })
    }

    /// `set_commit`: publishes a leased slot under `key`; `(accepted, reason)`. A TTL of 0
    /// means none.
    #[allow(clippy::too_many_arguments)]
    pub async fn commit(
        &self,
        conn: u64,
        token: u64,
        ns: &Namespace,
        key: &Bytes,
        length: u64,
        class: Retention,
        ttl_seconds: u64,
        now: u64,
    ) -> (bool, String) {
        let Some(arena) = &self.arena else {
            return (false, "no_arena".to_owned());
        };
        let lease = match arena.end_lease(token, conn) {
            Ok(lease) => lease,
            Err(reason) => return (false, reason.to_owned()),
        };
        if length > lease.max_len {
            arena.release(lease.slot);
            return (false, "oversize_commit".to_owned());
        }
        let permit = match &self.long {
            // As in `set_many`: a backend that never makes a writer wait hands out no permits.
            Some(long) if class == Retention::Long && self.waits => {
                long.write_permits(&[length]).await.pop()
            }
            _ => None,
        };
        let version = arena.publish(lease.slot, length);
        let ttl = (ttl_seconds > 0).then_some(ttl_seconds as f64);
        let inventory = self.inventory.hash(ns, key);
        let (ack, landing) = {
            let mut st = self.lock();
            let admitted = self.admit(
                &mut st,
                Write {
                    ns,
                    key,
                    value: Stored::Arena {
                        slot: lease.slot,
                        version,
                    },
                    len: length,
                    metadata: None,
                    class,
                    expires_at: expiry(ttl, now).ok().flatten(),
                    permit,
                    inventory,
                },
                now,
            );
            self.drain_spills(&mut st, now);
            admitted
        };
        let mut acks = [ack];
        self.land(&mut acks, landing.map(|l| (0, l)).into_iter().collect())
            .await;
        let [ack] = acks;
        (ack.accepted, ack.reason.unwrap_or_default())
    }

    /// `set_cancel`.
    pub fn cancel(&self, conn: u64, token: u64) {
        if let Some(arena) = &self.arena {
            arena.cancel_lease(token, conn);
        }
    }

    /// Releases the leases of a closed connection; returns how many.
    pub fn drop_connection(&self, conn: u64) -> usize {
        self.arena.as_ref().map_or(0, |a| a.cancel_connection(conn))
    }
}
