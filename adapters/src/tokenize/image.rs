//! An image part of a chat, as the router keys it: an identifier and a size, never its pixels.
//!
//! vLLM keys an image's KV blocks by its multimodal hash, which is the `uuid` the request gives
//! the part when it gives one (`vllm/multimodal/processing/inputs.py`, `get_mm_hashes`, 0.33),
//! and otherwise a hash of the decoded pixels that the router cannot repeat. So the router
//! names each inline image (a `data:` URL) by its content, `sha256-` and the first 128 bits of
//! the SHA-256 of its base64 text, and the server stamps that `uuid` on the part it forwards:
//! the engine then keys the image as the router does. A client's own `uuid` is kept and used.
//!
//! The size comes from the image's header (PNG, JPEG, WebP, GIF, … as `imagesize` reads them),
//! turned as its EXIF orientation says, since vLLM transposes images by it before sizing them
//! (`vllm/multimodal/image.py`, `normalize_image`). An image behind an `http(s)` URL has no
//! size the router knows: such a prompt is routed by load.

use std::fmt::{self, Write as _};

use base64::Engine as _;
use serde::de::{self, Deserializer, MapAccess, Visitor};
use sha2::{Digest, Sha256};

/// How much of an image's start is decoded to find its size: its header, and the EXIF block
/// that may precede a JPEG's frame header (at most 64 KiB). The rest of the image is hashed, not
/// decoded.
const HEADER_BYTES: usize = 96 * 1024;

/// What the router knows of an image part's `image_url`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageRef {
    /// The content identifier of an inline image; `None` for a remote one.
    pub content_id: Option<Box<str>>,
    /// Width and height as the engine sizes the image, when its header could be read.
    pub size: Option<(u32, u32)>,
}

impl ImageRef {
    /// Reads an `image_url`'s `url`: a `data:[mime];base64,…` URL is identified and sized;
    /// anything else is remote.
    pub fn of_url(url: &str) -> Self {
        let remote = Self {
            content_id: None,
            size: None,
        };
        let Some(rest) = url.strip_prefix("data:") else {
            return remote;
        };
        let Some((meta, payload)) = rest.split_once(',') else {
            return remote;
        };
        if !meta.ends_with(";base64") {
            return remote;
        }
        let digest = Sha256::digest(payload.as_bytes());
        let mut id = String::with_capacity(7 + 32);
        id.push_str("sha256-");
        for b in &digest[..16] {
            let _ = write!(id, "{b:02x}");
        }
        Self {
            content_id: Some(id.into()),
            size: image_size(payload),
        }
    }
}

/// The width and height of a base64 image as the engine turns it, from its first bytes (all of
/// them when the header lies further in).
fn image_size(payload: &str) -> Option<(u32, u32)> {
    let engine = base64::engine::general_purpose::STANDARD;
    // Whole 4-character groups decode on their own.
    let cut = (HEADER_BYTES / 3 * 4).min(payload.len() / 4 * 4);
    let head = engine.decode(&payload[..cut]).ok();
    let sized = |bytes: &[u8]| -> Option<(u32, u32)> {
        let size = imagesize::blob_size(bytes).ok()?;
        let (w, h) = (
            u32::try_from(size.width).ok()?,
            u32::try_from(size.height).ok()?,
        );
        Some(if transposed(bytes) { (h, w) } else { (w, h) })
    };
    head.as_deref().and_then(sized).or_else(|| {
        (cut < payload.len())
            .then(|| engine.decode(payload).ok())
            .flatten()
            .as_deref()
            .and_then(sized)
    })
}

/// Whether the image's EXIF orientation (5 to 8) swaps its width and height.
fn transposed(bytes: &[u8]) -> bool {
    let mut cursor = std::io::Cursor::new(bytes);
    let Ok(exif) = exif::Reader::new().read_from_container(&mut cursor) else {
        return false;
    };
    exif.get_field(exif::Tag::Orientation, exif::In::PRIMARY)
        .and_then(|f| f.value.get_uint(0))
        .is_some_and(|o| (5..=8).contains(&o))
}

/// `image_url` as OpenAI (`{"url": …, "detail": …}`) or vLLM (a bare string) sends it.
impl<'de> serde::Deserialize<'de> for ImageRef {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = ImageRef;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an image URL or an object with `url`")
            }

            fn visit_str<E: de::Error>(self, url: &str) -> Result<ImageRef, E> {
                Ok(ImageRef::of_url(url))
            }

            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<ImageRef, A::Error> {
                let mut found = None;
                while let Some(key) = map.next_key::<std::borrow::Cow<'de, str>>()? {
                    if key == "url" {
                        found = Some(map.next_value::<UrlRef>()?.0);
                    } else {
                        map.next_value::<de::IgnoredAny>()?;
                    }
                }
                found.ok_or_else(|| de::Error::missing_field("url"))
            }
        }
        d.deserialize_any(V)
    }
}

/// A `url` read straight into an [`ImageRef`], without keeping the text.
struct UrlRef(ImageRef);

impl<'de> serde::Deserialize<'de> for UrlRef {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = UrlRef;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a URL string")
            }

            fn visit_str<E: de::Error>(self, url: &str) -> Result<UrlRef, E> {
                Ok(UrlRef(ImageRef::of_url(url)))
            }
        }
        d.deserialize_str(V)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A PNG's signature and header chunk for a `width × height` image (all `imagesize` reads).
    pub(crate) fn png(width: u32, height: u32) -> Vec<u8> {
        let mut out = b"\x89PNG\r\n\x1a\n\0\0\0\x0dIHDR".to_vec();
        out.extend(width.to_be_bytes());
        out.extend(height.to_be_bytes());
        out.extend([8, 2, 0, 0, 0, 0, 0, 0, 0]);
        out
    }

    /// A JPEG's start, an EXIF block with `orientation`, and a frame header of `width × height`.
    fn jpeg(width: u16, height: u16, orientation: u16) -> Vec<u8> {
        // TIFF, little-endian: one IFD of one entry, Orientation (0x0112), SHORT, count 1.
        let mut tiff = b"II*\0\x08\0\0\0\x01\0".to_vec();
        tiff.extend([0x12, 0x01, 3, 0, 1, 0, 0, 0]);
        tiff.extend(orientation.to_le_bytes());
        tiff.extend([0, 0, 0, 0, 0, 0]);
        let mut app1 = b"Exif\0\0".to_vec();
        app1.extend(tiff);
        let mut out = vec![0xFF, 0xD8, 0xFF, 0xE1];
        out.extend(u16::try_from(app1.len() + 2).expect("short").to_be_bytes());
        out.extend(app1);
        out.extend([0xFF, 0xC0, 0, 17, 8]);
        out.extend(height.to_be_bytes());
        out.extend(width.to_be_bytes());
        out.extend([3, 1, 0x22, 0, 2, 0x11, 1, 3, 0x11, 1]);
        out.extend([0xFF, 0xD9]);
        out
    }

    /// A data URL of `bytes`.
    pub(crate) fn data_url(mime: &str, bytes: &[u8]) -> String {
        format!(
            "data:{mime};base64,{}",
            base64::engine::general_purpose::STANDARD.encode(bytes)
        )
    }

    #[test]
    fn an_inline_image_is_named_by_its_content_and_sized_by_its_header() {
        let a = ImageRef::of_url(&data_url("image/png", &png(640, 480)));
        assert_eq!(a.size, Some((640, 480)));
        let id = a.content_id.clone().expect("inline");
        assert!(id.starts_with("sha256-") && id.len() == 39, "{id}");
        assert_eq!(a, ImageRef::of_url(&data_url("image/png", &png(640, 480))));
        let b = ImageRef::of_url(&data_url("image/png", &png(640, 481)));
        assert_ne!(b.content_id, a.content_id);
    }

    #[test]
    fn exif_orientation_turns_the_size_as_the_engine_does() {
        let upright = ImageRef::of_url(&data_url("image/jpeg", &jpeg(4032, 3024, 1)));
        assert_eq!(upright.size, Some((4032, 3024)));
        let turned = ImageRef::of_url(&data_url("image/jpeg", &jpeg(4032, 3024, 6)));
        assert_eq!(turned.size, Some((3024, 4032)));
    }

    #[test]
    fn a_header_past_the_first_bytes_is_still_found() {
        // A JPEG whose frame header follows 200 KiB of other segments.
        let mut bytes = vec![0xFF, 0xD8];
        for _ in 0..4 {
            bytes.extend([0xFF, 0xE2, 0xC8, 0x02]);
            bytes.extend(std::iter::repeat_n(0u8, 0xC800));
        }
        bytes.extend(&jpeg(800, 600, 1)[2..]);
        let r = ImageRef::of_url(&data_url("image/jpeg", &bytes));
        assert_eq!(r.size, Some((800, 600)));
    }

    #[test]
    fn remote_and_unreadable_images_have_no_size() {
        let remote = ImageRef::of_url("https://example.com/cat.png");
        assert_eq!((remote.content_id, remote.size), (None, None));
        let junk = ImageRef::of_url("data:image/png;base64,AAAA");
        assert!(junk.content_id.is_some() && junk.size.is_none());
    }

    #[test]
    fn image_url_reads_as_object_or_string() {
        let url = data_url("image/png", &png(3, 2));
        let v = serde_json::json!({"detail": "high", "url": url});
        let r: ImageRef = serde_json::from_value(v).expect("object");
        assert_eq!(r.size, Some((3, 2)));
        let s: ImageRef =
            serde_json::from_str(&serde_json::to_string(&url).expect("json")).expect("string");
        assert_eq!(s, r);
        let escaped = format!("\"{}\"", url.replace('/', "\\/"));
        let e: ImageRef = serde_json::from_str(&escaped).expect("escaped slashes");
        assert_eq!(e, r, "the same image whatever its JSON escapes");
        assert!(serde_json::from_str::<ImageRef>("{\"detail\": \"low\"}").is_err());
    }
}
