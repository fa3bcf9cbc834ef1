//! The gRPC messages of the endpoint picker, as prost structs written by hand with the field
//! numbers of Envoy's `envoy/service/ext_proc/v3/external_processor.proto` (and the
//! `envoy.config.core.v3` / `envoy.type.v3` types it uses) and of gRPC's
//! `grpc/health/v1/health.proto`, so that building needs no `protoc` and no build script.
//! Only the fields the picker reads or writes are declared: decoders skip unknown fields, and an
//! absent field encodes as its default, so the subset is wire-compatible with the full messages.
//!
//! | RPC (full method path)                                     | request / response |
//! |------------------------------------------------------------|--------------------|
//! | `/envoy.service.ext_proc.v3.ExternalProcessor/Process` ⇄    | [`ProcessingRequest`] / [`ProcessingResponse`] |
//! | `/grpc.health.v1.Health/Check`                             | [`HealthCheckRequest`] / [`HealthCheckResponse`] |
//!
//! ⇄ marks a bidirectional stream.

/// `envoy.config.core.v3.HeaderValue`: Envoy sends values in `raw_value`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct HeaderValue {
    #[prost(string, tag = "1")]
    pub key: String,
    #[prost(string, tag = "2")]
    pub value: String,
    #[prost(bytes = "vec", tag = "3")]
    pub raw_value: Vec<u8>,
}

/// `envoy.config.core.v3.HeaderValueOption.HeaderAppendAction`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, prost::Enumeration)]
#[repr(i32)]
pub enum HeaderAppendAction {
    AppendIfExistsOrAdd = 0,
    AddIfAbsent = 1,
    OverwriteIfExistsOrAdd = 2,
    OverwriteIfExists = 3,
}

/// `envoy.config.core.v3.HeaderValueOption`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct HeaderValueOption {
    #[prost(message, optional, tag = "1")]
    pub header: Option<HeaderValue>,
    #[prost(enumeration = "HeaderAppendAction", tag = "3")]
    pub append_action: i32,
}

/// `envoy.config.core.v3.HeaderMap`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct HeaderMap {
    #[prost(message, repeated, tag = "1")]
    pub headers: Vec<HeaderValue>,
}

/// `envoy.service.ext_proc.v3.HttpHeaders`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct HttpHeaders {
    #[prost(message, optional, tag = "1")]
    pub headers: Option<HeaderMap>,
    #[prost(bool, tag = "3")]
    pub end_of_stream: bool,
}

/// `envoy.service.ext_proc.v3.HttpBody`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct HttpBody {
    #[prost(bytes = "bytes", tag = "1")]
    pub body: bytes::Bytes,
    #[prost(bool, tag = "2")]
    pub end_of_stream: bool,
}

/// `envoy.service.ext_proc.v3.HttpTrailers`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct HttpTrailers {
    #[prost(message, optional, tag = "1")]
    pub trailers: Option<HeaderMap>,
}

/// `envoy.service.ext_proc.v3.ProcessingRequest`: one phase of the HTTP request.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ProcessingRequest {
    #[prost(oneof = "processing_request::Phase", tags = "2, 3, 4, 5, 6, 7")]
    pub request: Option<processing_request::Phase>,
}

/// The phases of [`ProcessingRequest`].
pub mod processing_request {
    /// `ProcessingRequest.request`.
    #[derive(Clone, PartialEq, prost::Oneof)]
    #[allow(clippy::enum_variant_names)] // Envoy's names
    pub enum Phase {
        #[prost(message, tag = "2")]
        RequestHeaders(super::HttpHeaders),
        #[prost(message, tag = "3")]
        ResponseHeaders(super::HttpHeaders),
        #[prost(message, tag = "4")]
        RequestBody(super::HttpBody),
        #[prost(message, tag = "5")]
        ResponseBody(super::HttpBody),
        #[prost(message, tag = "6")]
        RequestTrailers(super::HttpTrailers),
        #[prost(message, tag = "7")]
        ResponseTrailers(super::HttpTrailers),
    }
}

/// `envoy.service.ext_proc.v3.HeaderMutation`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct HeaderMutation {
    #[prost(message, repeated, tag = "1")]
    pub set_headers: Vec<HeaderValueOption>,
}

/// `envoy.service.ext_proc.v3.StreamedBodyResponse` (FULL_DUPLEX_STREAMED bodies).
#[derive(Clone, PartialEq, prost::Message)]
pub struct StreamedBodyResponse {
    #[prost(bytes = "bytes", tag = "1")]
    pub body: bytes::Bytes,
    #[prost(bool, tag = "2")]
    pub end_of_stream: bool,
}

/// `envoy.service.ext_proc.v3.BodyMutation`, the streamed form only.
#[derive(Clone, PartialEq, prost::Message)]
pub struct BodyMutation {
    #[prost(message, optional, tag = "3")]
    pub streamed_response: Option<StreamedBodyResponse>,
}

/// `envoy.service.ext_proc.v3.CommonResponse` (status `CONTINUE`, the default).
#[derive(Clone, PartialEq, prost::Message)]
pub struct CommonResponse {
    #[prost(message, optional, tag = "2")]
    pub header_mutation: Option<HeaderMutation>,
    #[prost(message, optional, tag = "3")]
    pub body_mutation: Option<BodyMutation>,
    #[prost(bool, tag = "5")]
    pub clear_route_cache: bool,
}

/// `envoy.service.ext_proc.v3.HeadersResponse`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct HeadersResponse {
    #[prost(message, optional, tag = "1")]
    pub response: Option<CommonResponse>,
}

/// `envoy.service.ext_proc.v3.BodyResponse`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct BodyResponse {
    #[prost(message, optional, tag = "1")]
    pub response: Option<CommonResponse>,
}

/// `envoy.service.ext_proc.v3.TrailersResponse`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct TrailersResponse {
    #[prost(message, optional, tag = "1")]
    pub header_mutation: Option<HeaderMutation>,
}

/// `envoy.type.v3.HttpStatus`: `code` is the HTTP status number (`envoy.type.v3.StatusCode`).
#[derive(Clone, PartialEq, prost::Message)]
pub struct HttpStatus {
    #[prost(int32, tag = "1")]
    pub code: i32,
}

/// `envoy.service.ext_proc.v3.ImmediateResponse`: Envoy answers the client with this instead
/// of sending the request upstream.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ImmediateResponse {
    #[prost(message, optional, tag = "1")]
    pub status: Option<HttpStatus>,
    #[prost(message, optional, tag = "2")]
    pub headers: Option<HeaderMutation>,
    #[prost(bytes = "vec", tag = "3")]
    pub body: Vec<u8>,
    #[prost(string, tag = "5")]
    pub details: String,
}

/// `envoy.service.ext_proc.v3.ProcessingResponse`: the answer to one phase.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ProcessingResponse {
    #[prost(oneof = "processing_response::Answer", tags = "1, 2, 3, 4, 5, 6, 7")]
    pub response: Option<processing_response::Answer>,
}

/// The answers of [`ProcessingResponse`].
pub mod processing_response {
    /// `ProcessingResponse.response`.
    #[derive(Clone, PartialEq, prost::Oneof)]
    #[allow(clippy::enum_variant_names)] // Envoy's names
    pub enum Answer {
        #[prost(message, tag = "1")]
        RequestHeaders(super::HeadersResponse),
        #[prost(message, tag = "2")]
        ResponseHeaders(super::HeadersResponse),
        #[prost(message, tag = "3")]
        RequestBody(super::BodyResponse),
        #[prost(message, tag = "4")]
        ResponseBody(super::BodyResponse),
        #[prost(message, tag = "5")]
        RequestTrailers(super::TrailersResponse),
        #[prost(message, tag = "6")]
        ResponseTrailers(super::TrailersResponse),
        #[prost(message, tag = "7")]
        ImmediateResponse(super::ImmediateResponse),
    }
}

/// `grpc.health.v1.HealthCheckRequest`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct HealthCheckRequest {
    #[prost(string, tag = "1")]
    pub service: String,
}

/// `grpc.health.v1.HealthCheckResponse.ServingStatus`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, prost::Enumeration)]
#[repr(i32)]
pub enum ServingStatus {
    Unknown = 0,
    Serving = 1,
    NotServing = 2,
}

/// `grpc.health.v1.HealthCheckResponse`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct HealthCheckResponse {
    #[prost(enumeration = "ServingStatus", tag = "1")]
    pub status: i32,
}

#[cfg(test)]
mod tests {
    use super::*;
    use prost::Message as _;

    #[test]
    fn a_request_body_phase_decodes_from_envoys_field_numbers() {
        // ProcessingRequest{request_body(4): HttpBody{body(1): "hi", end_of_stream(2): true}},
        // with an unknown field (observability_mode = 10) that must be skipped.
        let wire = [0x22, 0x06, 0x0a, 0x02, b'h', b'i', 0x10, 0x01, 0x50, 0x01];
        let request = ProcessingRequest::decode(&wire[..]).unwrap();
        let Some(processing_request::Phase::RequestBody(body)) = request.request else {
            panic!("not a request body: {request:?}");
        };
        assert_eq!((&body.body[..], body.end_of_stream), (&b"hi"[..], true));
    }

    #[test]
    fn an_immediate_response_encodes_at_field_seven() {
        let response = ProcessingResponse {
            response: Some(processing_response::Answer::ImmediateResponse(
                ImmediateResponse {
                    status: Some(HttpStatus { code: 400 }),
                    ..ImmediateResponse::default()
                },
            )),
        };
        // field 7, length 5: status(1){code(1): 400}
        assert_eq!(
            response.encode_to_vec(),
            vec![0x3a, 0x05, 0x0a, 0x03, 0x08, 0x90, 0x03]
        );
    }
}
