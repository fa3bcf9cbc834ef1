//! AWS Signature Version 4 for S3 requests (read from AWS's published description: a
//! canonical request, a string to sign over its SHA-256, a key derived by HMAC-SHA256 from
//! the secret, the date, the region and the service).

use ring::{digest, hmac};
use std::fmt::Write as _;

/// What signs a request.
#[derive(Clone, PartialEq, Eq)]
pub struct Credentials {
    pub access_key: String,
    pub secret_key: String,
    /// A temporary credential's session token (`x-amz-security-token`).
    pub session_token: Option<String>,
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Credentials")
            .field("access_key", &self.access_key)
            .field("secret_key", &"***")
            .field("session_token", &self.session_token.as_ref().map(|_| "***"))
            .finish()
    }
}

/// The payload hash of a request whose body is not signed (S3 accepts it; TLS or the frame's
/// own checksum protect the bytes).
pub const UNSIGNED_PAYLOAD: &str = "UNSIGNED-PAYLOAD";

/// `text` as S3 wants it in a canonical URI: every byte but the unreserved ones (and `/`,
/// the key's separator) as `%XX`.
pub fn uri_encode(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for b in text.bytes() {
        if b.is_ascii_alphanumeric() || b"-_.~/".contains(&b) {
            out.push(b as char);
        } else {
            let _ = write!(out, "%{b:02X}");
        }
    }
    out
}

fn hex(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        let _ = write!(out, "{b:02x}");
    }
    out
}

fn mac(key: &[u8], text: &str) -> hmac::Tag {
    hmac::sign(&hmac::Key::new(hmac::HMAC_SHA256, key), text.as_bytes())
}

/// A request to sign: `method`, the encoded `path`, no query, and `headers` (lower-case names,
/// every one signed; `host`, `x-amz-date` and `x-amz-content-sha256` among them), at
/// `amz_date` (`YYYYMMDDTHHMMSSZ`).
#[derive(Debug)]
pub struct Request<'a> {
    pub method: &'a str,
    pub path: &'a str,
    pub headers: &'a [(&'a str, &'a str)],
    pub amz_date: &'a str,
    pub payload_hash: &'a str,
}

/// The `Authorization` header of `req` to `region`'s `service`.
pub fn authorization(
    creds: &Credentials,
    region: &str,
    service: &str,
    req: &Request<'_>,
) -> String {
    let Request {
        method,
        path,
        headers,
        amz_date,
        payload_hash,
    } = *req;
    let mut headers: Vec<(&str, &str)> = headers.to_vec();
    headers.sort_unstable();
    let mut request = format!("{method}\n{path}\n\n");
    for (name, value) in &headers {
        let _ = writeln!(request, "{name}:{}", value.trim());
    }
    let signed = headers
        .iter()
        .map(|(name, _)| *name)
        .collect::<Vec<_>>()
        .join(";");
    let _ = write!(request, "\n{signed}\n{payload_hash}");
    let day = &amz_date[..amz_date.len().min(8)];
    let scope = format!("{day}/{region}/{service}/aws4_request");
    let to_sign = format!(
        "AWS4-HMAC-SHA256\n{amz_date}\n{scope}\n{}",
        hex(digest::digest(&digest::SHA256, request.as_bytes()).as_ref())
    );
    let mut key = mac(format!("AWS4{}", creds.secret_key).as_bytes(), day);
    for part in [region, service, "aws4_request"] {
        key = mac(key.as_ref(), part);
    }
    let signature = hex(mac(key.as_ref(), &to_sign).as_ref());
    format!(
        "AWS4-HMAC-SHA256 Credential={}/{scope},SignedHeaders={signed},Signature={signature}",
        creds.access_key
    )
}

/// `secs` since the Unix epoch as `YYYYMMDDTHHMMSSZ`.
pub fn amz_date(secs: u64) -> String {
    let (days, rest) = (secs / 86_400, secs % 86_400);
    let (year, month, day) = infera_core::clock::civil_from_days(days as i64);
    format!(
        "{year:04}{month:02}{day:02}T{:02}{:02}{:02}Z",
        rest / 3600,
        rest / 60 % 60,
        rest % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn example() -> Credentials {
        // AWS's documented example credentials.
        Credentials {
            access_key: "AKIAIOSFODNN7EXAMPLE".into(),
            secret_key: "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY".into(),
            session_token: None,
        }
    }

    const EMPTY: &str = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";

    #[test]
    fn signatures_match_aws_published_examples() {
        // S3's "GET Object" example (signature version 4, header-based authentication).
        let auth = authorization(
            &example(),
            "us-east-1",
            "s3",
            &Request {
                method: "GET",
                path: "/test.txt",
                headers: &[
                    ("host", "examplebucket.s3.amazonaws.com"),
                    ("range", "bytes=0-9"),
                    ("x-amz-content-sha256", EMPTY),
                    ("x-amz-date", "20130524T000000Z"),
                ],
                amz_date: "20130524T000000Z",
                payload_hash: EMPTY,
            },
        );
        assert_eq!(
            auth,
            "AWS4-HMAC-SHA256 Credential=AKIAIOSFODNN7EXAMPLE/20130524/us-east-1/s3/aws4_request,\
             SignedHeaders=host;range;x-amz-content-sha256;x-amz-date,\
             Signature=f0e8bdb87c964420e857bd35b5d6ed310bd44f0170aba48dd91039c6036bdb41"
        );
        // The "PUT Object" example: an encoded key, headers given out of order.
        let body = "44ce7dd67c959e0d3524ffac1771dfbba87d2b6b4b4e99e42034a8b803f8b072";
        let auth = authorization(
            &example(),
            "us-east-1",
            "s3",
            &Request {
                method: "PUT",
                path: &uri_encode("/test$file.text"),
                headers: &[
                    ("x-amz-storage-class", "REDUCED_REDUNDANCY"),
                    ("date", "Fri, 24 May 2013 00:00:00 GMT"),
                    ("host", "examplebucket.s3.amazonaws.com"),
                    ("x-amz-date", "20130524T000000Z"),
                    ("x-amz-content-sha256", body),
                ],
                amz_date: "20130524T000000Z",
                payload_hash: body,
            },
        );
        assert!(
            auth.ends_with(
                "Signature=98ad721746da40c64f1a55b78f14c238d841ea1380cd77a1b5971af0ece108bd"
            ),
            "{auth}"
        );
    }

    #[test]
    fn dates_and_keys_are_written_as_s3_wants_them() {
        assert_eq!(amz_date(1_369_353_600), "20130524T000000Z");
        assert_eq!(amz_date(951_825_599), "20000229T115959Z");
        assert_eq!(
            uri_encode("/a/infera@kvd@0f:x y"),
            "/a/infera%40kvd%400f%3Ax%20y"
        );
        let shown = format!("{:?}", example());
        assert!(!shown.contains("wJalr"), "{shown}");
    }
}
