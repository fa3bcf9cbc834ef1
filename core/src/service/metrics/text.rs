//! The Prometheus exposition every `GET /metrics` of Infera answers, the server's and each
//! mock engine's: the text format 0.0.4 of one `prometheus_client` registry, with whole bucket
//! bounds written as floats as the Python client writes them.

use prometheus_client::encoding::prometheus_text;
use prometheus_client::registry::Registry;

/// The `Content-Type` of `GET /metrics`.
pub const CONTENT_TYPE: &str = prometheus_text::CONTENT_TYPE;

/// The text exposition of every family in `registry`.
pub fn render(registry: &Registry) -> String {
    let mut out = String::with_capacity(8192);
    // Writing to a String cannot fail.
    let _ = prometheus_text::encode(&mut out, registry);
    float_bounds(&out)
}

/// `text` with whole bucket bounds written as floats (`le="4"` → `le="4.0"`), as the Python
/// client writes them: a query or alert naming `le="1.0"` selects the same series on either.
fn float_bounds(text: &str) -> String {
    const LE: &str = "le=\"";
    let mut out = String::with_capacity(text.len() + text.len() / 16);
    let mut rest = text;
    while let Some(at) = rest.find(LE) {
        let (head, tail) = rest.split_at(at + LE.len());
        out.push_str(head);
        let digits = tail.bytes().take_while(u8::is_ascii_digit).count();
        out.push_str(&tail[..digits]);
        if digits > 0 && tail[digits..].starts_with('"') {
            out.push_str(".0");
        }
        rest = &tail[digits..];
    }
    out.push_str(rest);
    out
}
