//! Passing the arena memfd over the socket (PROTOCOLS.md §6): right after `hello_ack`, one byte
//! `F` whose ancillary data is `SCM_RIGHTS` with exactly one descriptor. Both ends run on tokio
//! Unix streams: the call waits for readiness and retries on `EWOULDBLOCK`.
//!
//! The receiver must not have buffered past `hello_ack` (the kernel delivers the descriptor
//! only with the `F` byte's own `recvmsg`), so clients read the handshake reply with exact-size
//! reads before wrapping the stream in a buffer.

use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags, recvmsg, sendmsg,
};
use std::io::{self, IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{BorrowedFd, OwnedFd};
use tokio::io::Interest;
use tokio::net::UnixStream;

/// The one-byte payload that carries the descriptor.
pub const MARKER: u8 = b'F';

/// Sends `fd` with the `F` marker.
///
/// # Errors
/// The socket's error.
pub async fn send_fd(stream: &UnixStream, fd: BorrowedFd<'_>) -> io::Result<()> {
    loop {
        stream.writable().await?;
        let sent = stream.try_io(Interest::WRITABLE, || {
            let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
            let mut control = SendAncillaryBuffer::new(&mut space);
            let fds = [fd];
            if !control.push(SendAncillaryMessage::ScmRights(&fds)) {
                return Err(io::Error::other("no room for SCM_RIGHTS"));
            }
            let iov = [IoSlice::new(&[MARKER])];
            Ok(sendmsg(stream, &iov, &mut control, SendFlags::NOSIGNAL)?)
        });
        match sent {
            Ok(1) => return Ok(()),
            Ok(n) => return Err(io::Error::other(format!("sent {n} marker bytes, not 1"))),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(e),
        }
    }
}

/// Receives the descriptor sent by [`send_fd`] (any extra descriptors are closed).
///
/// # Errors
/// `UnexpectedEof` when the peer closed; `InvalidData` when the byte is not `F` or carries no
/// descriptor.
pub async fn recv_fd(stream: &UnixStream) -> io::Result<OwnedFd> {
    loop {
        stream.readable().await?;
        let got = stream.try_io(Interest::READABLE, || {
            let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
            let mut control = RecvAncillaryBuffer::new(&mut space);
            let mut byte = [0u8; 1];
            let mut iov = [IoSliceMut::new(&mut byte)];
            let msg = recvmsg(stream, &mut iov, &mut control, RecvFlags::CMSG_CLOEXEC)?;
            let mut fds: Vec<OwnedFd> = Vec::new();
            for message in control.drain() {
                if let RecvAncillaryMessage::ScmRights(received) = message {
                    fds.extend(received);
                }
            }
            Ok((msg.bytes, byte[0], fds))
        });
        match got {
            Ok((0, _, _)) => {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "kvd closed the connection before sending the arena descriptor",
                ));
            }
            Ok((_, MARKER, fds)) => {
                return fds.into_iter().next().ok_or_else(|| {
                    io::Error::new(
                        io::ErrorKind::InvalidData,
                        "the F marker carried no descriptor",
                    )
                });
            }
            Ok((_, other, _)) => {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("expected the F marker, got byte {other:#x}"),
                ));
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(e),
        }
    }
}
