//! The etcd v3 API messages this backend sends and reads, as prost structs.
//!
//! Written by hand with the field numbers of etcd's `api/etcdserverpb/rpc.proto` and
//! `api/mvccpb/kv.proto` (stable since etcd 3.0; progress requests since 3.4), so that building
//! needs no `protoc` and no build script. Only the fields we set or read are declared: protobuf
//! decoders skip unknown fields, and an absent field encodes as its default, so a subset is
//! wire-compatible with the full messages.
//!
//! | RPC (full method path)                  | request                 | response                 |
//! |-----------------------------------------|-------------------------|--------------------------|
//! | `/etcdserverpb.KV/Range`                | [`RangeRequest`]        | [`RangeResponse`]        |
//! | `/etcdserverpb.KV/Put`                  | [`PutRequest`]          | [`PutResponse`]          |
//! | `/etcdserverpb.KV/Compact`              | [`CompactionRequest`]   | [`CompactionResponse`]   |
//! | `/etcdserverpb.Lease/LeaseGrant`        | [`LeaseGrantRequest`]   | [`LeaseGrantResponse`]   |
//! | `/etcdserverpb.Lease/LeaseRevoke`       | [`LeaseRevokeRequest`]  | [`LeaseRevokeResponse`]  |
//! | `/etcdserverpb.Lease/LeaseKeepAlive` ⇄   | [`LeaseKeepAliveRequest`] | [`LeaseKeepAliveResponse`] |
//! | `/etcdserverpb.Watch/Watch` ⇄            | [`WatchRequest`]        | [`WatchResponse`]        |
//!
//! ⇄ marks bidirectional streams.

/// `etcdserverpb.ResponseHeader`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ResponseHeader {
    /// The store revision when the request was applied.
    #[prost(int64, tag = "3")]
    pub revision: i64,
}

/// `mvccpb.KeyValue`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct KeyValue {
    #[prost(bytes = "vec", tag = "1")]
    pub key: Vec<u8>,
    /// Revision of the last modification of this key.
    #[prost(int64, tag = "3")]
    pub mod_revision: i64,
    #[prost(bytes = "vec", tag = "5")]
    pub value: Vec<u8>,
    /// The lease the key is attached to; 0 for none.
    #[prost(int64, tag = "6")]
    pub lease: i64,
}

/// `mvccpb.Event.EventType`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, prost::Enumeration)]
#[repr(i32)]
pub enum EventType {
    Put = 0,
    Delete = 1,
}

/// `mvccpb.Event`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Event {
    #[prost(enumeration = "EventType", tag = "1")]
    pub r#type: i32,
    /// For a delete, the key and the deletion's revision (no value).
    #[prost(message, optional, tag = "2")]
    pub kv: Option<KeyValue>,
}

/// `etcdserverpb.RangeRequest`: the keys in `[key, range_end)` (only `key` when `range_end` is
/// empty).
#[derive(Clone, PartialEq, prost::Message)]
pub struct RangeRequest {
    #[prost(bytes = "vec", tag = "1")]
    pub key: Vec<u8>,
    #[prost(bytes = "vec", tag = "2")]
    pub range_end: Vec<u8>,
}

/// `etcdserverpb.RangeResponse`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct RangeResponse {
    #[prost(message, optional, tag = "1")]
    pub header: Option<ResponseHeader>,
    #[prost(message, repeated, tag = "2")]
    pub kvs: Vec<KeyValue>,
}

/// `etcdserverpb.PutRequest`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct PutRequest {
    #[prost(bytes = "vec", tag = "1")]
    pub key: Vec<u8>,
    #[prost(bytes = "vec", tag = "2")]
    pub value: Vec<u8>,
    /// The lease to attach the key to; 0 for none.
    #[prost(int64, tag = "3")]
    pub lease: i64,
}

/// `etcdserverpb.PutResponse`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct PutResponse {
    #[prost(message, optional, tag = "1")]
    pub header: Option<ResponseHeader>,
}

/// `etcdserverpb.CompactionRequest`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct CompactionRequest {
    #[prost(int64, tag = "1")]
    pub revision: i64,
    /// Wait until the compaction is physically applied.
    #[prost(bool, tag = "2")]
    pub physical: bool,
}

/// `etcdserverpb.CompactionResponse`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct CompactionResponse {
    #[prost(message, optional, tag = "1")]
    pub header: Option<ResponseHeader>,
}

/// `etcdserverpb.LeaseGrantRequest`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct LeaseGrantRequest {
    /// Time to live in seconds.
    #[prost(int64, tag = "1")]
    pub ttl: i64,
    /// Requested id; 0 lets the server choose.
    #[prost(int64, tag = "2")]
    pub id: i64,
}

/// `etcdserverpb.LeaseGrantResponse`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct LeaseGrantResponse {
    #[prost(message, optional, tag = "1")]
    pub header: Option<ResponseHeader>,
    #[prost(int64, tag = "2")]
    pub id: i64,
    #[prost(int64, tag = "3")]
    pub ttl: i64,
    /// Set by the server when the grant failed.
    #[prost(string, tag = "4")]
    pub error: String,
}

/// `etcdserverpb.LeaseRevokeRequest`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct LeaseRevokeRequest {
    #[prost(int64, tag = "1")]
    pub id: i64,
}

/// `etcdserverpb.LeaseRevokeResponse`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct LeaseRevokeResponse {
    #[prost(message, optional, tag = "1")]
    pub header: Option<ResponseHeader>,
}

/// `etcdserverpb.LeaseKeepAliveRequest`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct LeaseKeepAliveRequest {
    #[prost(int64, tag = "1")]
    pub id: i64,
}

/// `etcdserverpb.LeaseKeepAliveResponse`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct LeaseKeepAliveResponse {
    #[prost(message, optional, tag = "1")]
    pub header: Option<ResponseHeader>,
    #[prost(int64, tag = "2")]
    pub id: i64,
    /// The renewed TTL in seconds; 0 or less when the lease no longer exists.
    #[prost(int64, tag = "3")]
    pub ttl: i64,
}

/// `etcdserverpb.WatchRequest`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct WatchRequest {
    #[prost(oneof = "WatchRequestUnion", tags = "1")]
    pub request_union: Option<WatchRequestUnion>,
}

/// `etcdserverpb.WatchRequest.request_union` (only creation is sent).
#[derive(Clone, PartialEq, prost::Oneof)]
pub enum WatchRequestUnion {
    #[prost(message, tag = "1")]
    CreateRequest(WatchCreateRequest),
}

/// `etcdserverpb.WatchCreateRequest`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct WatchCreateRequest {
    #[prost(bytes = "vec", tag = "1")]
    pub key: Vec<u8>,
    #[prost(bytes = "vec", tag = "2")]
    pub range_end: Vec<u8>,
    /// First revision to deliver (inclusive); 0 means "from now".
    #[prost(int64, tag = "3")]
    pub start_revision: i64,
    /// Ask for periodic empty responses whose header revision says every earlier event was sent.
    #[prost(bool, tag = "4")]
    pub progress_notify: bool,
}

/// `etcdserverpb.WatchResponse`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct WatchResponse {
    #[prost(message, optional, tag = "1")]
    pub header: Option<ResponseHeader>,
    #[prost(int64, tag = "2")]
    pub watch_id: i64,
    #[prost(bool, tag = "3")]
    pub created: bool,
    #[prost(bool, tag = "4")]
    pub canceled: bool,
    /// Set on a cancel because the start revision was compacted: the oldest revision left.
    #[prost(int64, tag = "5")]
    pub compact_revision: i64,
    #[prost(string, tag = "6")]
    pub cancel_reason: String,
    #[prost(message, repeated, tag = "11")]
    pub events: Vec<Event>,
}

/// The end of the key range holding every key that starts with `prefix` (etcd's convention: the
/// prefix with its last byte that is not 0xff incremented; `\0` for "every key" when none is).
pub fn prefix_range_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0]
}

#[cfg(test)]
mod tests {
    use super::*;
    use prost::Message as _;

    #[test]
    fn a_prefix_range_ends_after_its_last_key() {
        assert_eq!(prefix_range_end(b"/infera/workers/"), b"/infera/workers0");
        assert_eq!(prefix_range_end(b"a\xff\xff"), b"b");
        assert_eq!(prefix_range_end(b"\xff"), b"\0");
    }

    #[test]
    fn messages_carry_the_field_numbers_of_rpc_proto() {
        // PutRequest{key: "k" (1), value: "v" (2), lease: 5 (3)}, bytes as protoc encodes them.
        let put = PutRequest {
            key: b"k".to_vec(),
            value: b"v".to_vec(),
            lease: 5,
        };
        assert_eq!(put.encode_to_vec(), [0x0a, 1, b'k', 0x12, 1, b'v', 0x18, 5]);
        // WatchRequest{create_request (1): {key (1), start_revision (3): 7, progress_notify (4)}}.
        let watch = WatchRequest {
            request_union: Some(WatchRequestUnion::CreateRequest(WatchCreateRequest {
                key: b"p".to_vec(),
                range_end: Vec::new(),
                start_revision: 7,
                progress_notify: true,
            })),
        };
        assert_eq!(
            watch.encode_to_vec(),
            [0x0a, 7, 0x0a, 1, b'p', 0x18, 7, 0x20, 1]
        );
        // WatchResponse{created (3), fragment (7, not declared here), compact_revision (5): 9}.
        let bytes = [0x18, 1, 0x38, 1, 0x28, 9];
        let response = WatchResponse::decode(&bytes[..]).expect("decodes");
        assert!(response.created);
        assert_eq!(response.compact_revision, 9);
        // Event{type (1): DELETE, kv (2): {key (1): "x", mod_revision (3): 4}}.
        let event = Event::decode(&[0x08, 1, 0x12, 5, 0x0a, 1, b'x', 0x18, 4][..]).expect("event");
        assert_eq!(event.r#type(), EventType::Delete);
        assert_eq!(event.kv.map(|kv| kv.mod_revision), Some(4));
    }
}
