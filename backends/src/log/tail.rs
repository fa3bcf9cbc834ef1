//! `subscribe` for logs that can only be read by position (the SQL stores): read from the next
//! position; when nothing is there, wait for a wake-up, then read again.
//!
//! A [`Wakeup`] says "the log may have grown": a local watch on the tip bumped by appends in this
//! process, Postgres `NOTIFY`, and always a poll interval as the backstop for writers the other
//! signals cannot see (another process on the same SQLite file, a lost notification). Waking
//! spuriously is harmless: the next read is simply empty. Reads are bounded ([`TAIL_BATCH`]) and
//! buffered, so a subscriber far behind catches up in pages. A page that fails is read again one
//! envelope at a time: everything before a bad record is delivered, then its error.

use async_trait::async_trait;
use futures::stream::BoxStream;
use infera_core::event::{Envelope, Seq};
use infera_core::log::{EventLog, LogError};
use std::collections::VecDeque;
use std::time::Duration;
use tokio::sync::watch;

/// Envelopes read per page while tailing.
pub(crate) const TAIL_BATCH: usize = 1024;

/// A source of "the log may have grown" signals.
#[async_trait]
pub(crate) trait Wakeup: Send + 'static {
    /// Returns when new envelopes may be readable. An error ends the subscription.
    async fn wait(&mut self) -> Result<(), LogError>;
}

/// Wakes on appends made through any handle of this process (a shared tip), or every `poll`.
#[derive(Debug)]
pub(crate) struct TipOrPoll {
    pub(crate) tip: watch::Receiver<Seq>,
    pub(crate) poll: Duration,
}

#[async_trait]
impl Wakeup for TipOrPoll {
    async fn wait(&mut self) -> Result<(), LogError> {
        tokio::select! {
            changed = self.tip.changed() => changed.map_err(|_| LogError::Closed),
            () = tokio::time::sleep(self.poll) => Ok(()),
        }
    }
}

struct Tail<L> {
    log: L,
    next: Seq,
    /// Envelopes per read; drops to 1 after a failed read, so that the envelopes before a bad
    /// record are still delivered and the error names the record itself.
    page: usize,
    buf: VecDeque<Envelope>,
    wake: Box<dyn Wakeup>,
    done: bool,
}

/// Every envelope of `log` from `from` on, waiting on `wake` when caught up. Ends after the
/// first error (which it yields).
pub(crate) fn tail<L>(
    log: L,
    from: Seq,
    wake: Box<dyn Wakeup>,
) -> BoxStream<'static, Result<Envelope, LogError>>
where
    L: EventLog + 'static,
{
    let state = Tail {
        log,
        next: from.max(1),
        page: TAIL_BATCH,
        buf: VecDeque::new(),
        wake,
        done: false,
    };
    Box::pin(futures::stream::unfold(state, |mut s| async move {
        if s.done {
            return None;
        }
        loop {
            if let Some(env) = s.buf.pop_front() {
                return Some((Ok(env), s));
            }
            let step = match s.log.read(s.next, s.page).await {
                Ok(page) if page.is_empty() => s.wake.wait().await,
                Ok(page) => {
                    if let Some(last) = page.last() {
                        s.next = last.seq + 1;
                    }
                    s.buf.extend(page);
                    Ok(())
                }
                Err(LogError::Backend(_)) if s.page > 1 => {
                    s.page = 1;
                    Ok(())
                }
                Err(e) => Err(e),
            };
            if let Err(e) = step {
                s.done = true;
                return Some((Err(e), s));
            }
        }
    }))
}
