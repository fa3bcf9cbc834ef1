//! Writing frames to a socket: a frame is a list of [`Bytes`] parts (see
//! [`crate::proto::Encoder`]); [`write_parts`] sends them with as few `writev` calls as the
//! socket allows, so large values are never copied into a staging buffer.

use bytes::Bytes;
use std::io::{self, IoSlice};
use tokio::io::{AsyncWrite, AsyncWriteExt};

/// Writes every part, in order.
///
/// # Errors
/// The socket's error; `WriteZero` when it accepts nothing.
pub async fn write_parts<W: AsyncWrite + Unpin>(wr: &mut W, parts: &[Bytes]) -> io::Result<()> {
    let mut index = 0;
    let mut offset = 0;
    while index < parts.len() {
        let slices: Vec<IoSlice<'_>> = std::iter::once(&parts[index][offset..])
            .chain(parts[index + 1..].iter().map(|p| &p[..]))
            .take(64)
            .map(IoSlice::new)
            .collect();
        let mut n = wr.write_vectored(&slices).await?;
        if n == 0 && slices.iter().any(|s| !s.is_empty()) {
            return Err(io::ErrorKind::WriteZero.into());
        }
        while index < parts.len() && n >= parts[index].len() - offset {
            n -= parts[index].len() - offset;
            index += 1;
            offset = 0;
        }
        offset += n;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn every_part_arrives_in_order() {
        let parts: Vec<Bytes> = (0..100u8)
            .map(|i| Bytes::from(vec![i; usize::from(i) * 97]))
            .collect();
        let mut out = Vec::new();
        write_parts(&mut out, &parts).await.unwrap();
        let want: Vec<u8> = parts.iter().flat_map(|p| p.iter().copied()).collect();
        assert_eq!(out, want);
    }
}
