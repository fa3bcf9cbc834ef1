//! Splitting a PUB message into topic, seq and payload (layouts in [`super`]).

use bytes::Bytes;

/// One PUB message, split.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvFrames {
    /// The topic frame, if the engine sent one.
    pub topic: Option<Bytes>,
    /// The engine's sequence number (vLLM, SGLang); `None` for ATOM.
    pub seq: Option<u64>,
    pub payload: Bytes,
}

/// Why a message is not a KV-event message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    #[error("expected 1 to 3 frames ([payload], [topic, payload], [topic, seq, payload]), got {0}")]
    FrameCount(usize),
    #[error("seq frame must be 8 bytes (u64 big-endian), got {0}")]
    SeqLength(usize),
}

/// Splits the frames of one message.
///
/// # Errors
/// [`FrameError`] when the frame count or the seq frame's size is wrong.
pub fn split_frames(mut frames: Vec<Bytes>) -> Result<KvFrames, FrameError> {
    match frames.len() {
        1 => Ok(KvFrames {
            topic: None,
            seq: None,
            payload: frames.swap_remove(0),
        }),
        2 => {
            let payload = frames.swap_remove(1);
            Ok(KvFrames {
                topic: Some(frames.swap_remove(0)),
                seq: None,
                payload,
            })
        }
        3 => {
            let seq = seq_of(&frames[1]).ok_or(FrameError::SeqLength(frames[1].len()))?;
            let payload = frames.swap_remove(2);
            Ok(KvFrames {
                topic: Some(frames.swap_remove(0)),
                seq: Some(seq),
                payload,
            })
        }
        n => Err(FrameError::FrameCount(n)),
    }
}

/// A big-endian u64 from an 8-byte frame.
pub(crate) fn seq_of(frame: &[u8]) -> Option<u64> {
    <[u8; 8]>::try_from(frame).ok().map(u64::from_be_bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_layout_splits() {
        let p = Bytes::from_static(b"payload");
        let t = Bytes::from_static(b"kv-events");
        let s = Bytes::copy_from_slice(&7u64.to_be_bytes());
        assert_eq!(
            split_frames(vec![t.clone(), s.clone(), p.clone()]),
            Ok(KvFrames {
                topic: Some(t.clone()),
                seq: Some(7),
                payload: p.clone()
            })
        );
        assert_eq!(
            split_frames(vec![t.clone(), p.clone()]),
            Ok(KvFrames {
                topic: Some(t.clone()),
                seq: None,
                payload: p.clone()
            })
        );
        assert_eq!(
            split_frames(vec![p.clone()]),
            Ok(KvFrames {
                topic: None,
                seq: None,
                payload: p.clone()
            })
        );
        assert_eq!(
            split_frames(vec![t.clone(), Bytes::from_static(b"123"), p.clone()]),
            Err(FrameError::SeqLength(3))
        );
        assert_eq!(split_frames(vec![]), Err(FrameError::FrameCount(0)));
        assert_eq!(
            split_frames(vec![t.clone(), s, p.clone(), p]),
            Err(FrameError::FrameCount(4))
        );
    }
}
