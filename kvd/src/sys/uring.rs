//! [`Ring`]: a blocking, batch-at-a-time io_uring loop for positioned reads and writes.
//!
//! [`Ring::run`] takes a batch of [`Op`]s that borrow their buffers, submits them all, and
//! returns only when every one has completed (short transfers are resubmitted for the rest), so
//! the kernel never holds a pointer to a buffer after the borrow ends: the API is safe. One
//! ring per I/O worker thread; `IORING_SETUP_*` flags are left at their defaults so it works on
//! any kernel that has io_uring at all.

use io_uring::{IoUring, opcode, types};
use std::io;
use std::os::fd::RawFd;

/// One positioned transfer.
#[derive(Debug)]
pub enum Op<'a> {
    /// Read `buf.len()` bytes at `offset`.
    Read {
        fd: RawFd,
        offset: u64,
        buf: &'a mut [u8],
    },
    /// Write `buf` at `offset`.
    Write {
        fd: RawFd,
        offset: u64,
        buf: &'a [u8],
    },
}

impl Op<'_> {
    fn len(&self) -> usize {
        match self {
            Op::Read { buf, .. } => buf.len(),
            Op::Write { buf, .. } => buf.len(),
        }
    }
}

/// See the module docs.
pub struct Ring {
    ring: IoUring,
    depth: usize,
}

impl std::fmt::Debug for Ring {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ring").field("depth", &self.depth).finish()
    }
}

impl Ring {
    /// A ring with `depth` submission entries.
    ///
    /// # Errors
    /// The kernel's error when io_uring is unavailable (`ENOSYS`, or `EPERM` under a seccomp
    /// policy or `kernel.io_uring_disabled`); callers fall back to `pread`/`pwrite`.
    pub fn new(depth: u32) -> io::Result<Self> {
        Ok(Self {
            ring: IoUring::new(depth)?,
            depth: depth as usize,
        })
    }

    /// Runs every op to completion; one result per op, in order: `Ok(())` when all its bytes
    /// moved, the kernel's error otherwise (`UnexpectedEof` for a read past the end).
    ///
    /// # Errors
    /// Only when submitting itself fails (the ring is unusable); per-op failures are in the
    /// returned vector.
    pub fn run(&mut self, ops: &mut [Op<'_>]) -> io::Result<Vec<io::Result<()>>> {
        // Lengths are read once, before any buffer is handed to the kernel.
        let lens: Vec<usize> = ops.iter().map(Op::len).collect();
        let mut done: Vec<usize> = vec![0; ops.len()];
        let mut result: Vec<Option<io::Result<()>>> = lens
            .iter()
            .map(|len| (*len == 0).then_some(Ok(())))
            .collect();
        loop {
            let pending: Vec<usize> = (0..ops.len()).filter(|i| result[*i].is_none()).collect();
            if pending.is_empty() {
                break;
            }
            let batch = &pending[..pending.len().min(self.depth)];
            for &i in batch {
                let at = done[i];
                let entry = match &mut ops[i] {
                    Op::Read { fd, offset, buf } => {
                        let rest = &mut buf[at..];
                        opcode::Read::new(types::Fd(*fd), rest.as_mut_ptr(), rest.len() as u32)
                            .offset(*offset + at as u64)
                            .build()
                    }
                    Op::Write { fd, offset, buf } => {
                        let rest = &buf[at..];
                        opcode::Write::new(types::Fd(*fd), rest.as_ptr(), rest.len() as u32)
                            .offset(*offset + at as u64)
                            .build()
                    }
                }
                .user_data(i as u64);
                // SAFETY: the entry points into `ops[i]`'s buffer, which `ops` borrows for the
                // whole call, and this function does not return before the kernel completes the
                // entry (the wait below collects every submitted entry); the batch never
                // exceeds the ring's depth, so the queue has room.
                let pushed = unsafe { self.ring.submission().push(&entry) };
                if pushed.is_err() {
                    return Err(io::Error::other(
                        "io_uring submission queue unexpectedly full",
                    ));
                }
            }
            self.ring.submit_and_wait(batch.len())?;
            let mut reaped = 0;
            while reaped < batch.len() {
                let completions: Vec<(u64, i32)> = self
                    .ring
                    .completion()
                    .map(|c| (c.user_data(), c.result()))
                    .collect();
                if completions.is_empty() {
                    self.ring.submit_and_wait(batch.len() - reaped)?;
                    continue;
                }
                for (user, res) in completions {
                    reaped += 1;
                    let i = user as usize;
                    if res < 0 {
                        result[i] = Some(Err(io::Error::from_raw_os_error(-res)));
                    } else if res == 0 {
                        result[i] = Some(Err(io::Error::new(
                            io::ErrorKind::UnexpectedEof,
                            "io_uring transfer moved no bytes",
                        )));
                    } else {
                        done[i] += res as usize;
                        if done[i] >= lens[i] {
                            result[i] = Some(Ok(()));
                        }
                    }
                }
            }
        }
        Ok(result.into_iter().map(|r| r.unwrap_or(Ok(()))).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;

    #[test]
    fn a_batch_of_writes_then_reads_round_trips() {
        let Ok(mut ring) = Ring::new(4) else {
            panic!("io_uring is required on this machine (kernel.io_uring_disabled=0)");
        };
        let file = tempfile::tempfile().unwrap();
        let fd = file.as_raw_fd();
        let blocks: Vec<Vec<u8>> = (0..6u8).map(|i| vec![i; 3000 + i as usize]).collect();
        let mut ops: Vec<Op<'_>> = blocks
            .iter()
            .enumerate()
            .map(|(i, b)| Op::Write {
                fd,
                offset: i as u64 * 8192,
                buf: b,
            })
            .collect();
        assert!(ring.run(&mut ops).unwrap().iter().all(|r| r.is_ok()));
        let mut back: Vec<Vec<u8>> = blocks.iter().map(|b| vec![0; b.len()]).collect();
        let mut ops: Vec<Op<'_>> = back
            .iter_mut()
            .enumerate()
            .map(|(i, b)| Op::Read {
                fd,
                offset: i as u64 * 8192,
                buf: b,
            })
            .collect();
        assert!(ring.run(&mut ops).unwrap().iter().all(|r| r.is_ok()));
        assert_eq!(back, blocks);
        let mut past = vec![0u8; 10];
        let mut ops = [Op::Read {
            fd,
            offset: 1 << 30,
            buf: &mut past,
        }];
        let r = ring.run(&mut ops).unwrap();
        assert_eq!(
            r[0].as_ref().unwrap_err().kind(),
            io::ErrorKind::UnexpectedEof
        );
    }
}
