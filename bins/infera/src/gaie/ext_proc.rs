//! The Envoy ext_proc service (`envoy.service.ext_proc.v3.ExternalProcessor/Process`) in
//! FULL_DUPLEX_STREAMED mode, as the Inference Gateway configures it. One `Process` stream is
//! one HTTP request; each phase Envoy sends is answered exactly once, never more:
//!
//! | Envoy sends | the picker answers |
//! |---|---|
//! | request headers | `CONTINUE` (the model and prompt are in the body) |
//! | request body chunks | nothing until `end_of_stream` (the chunks are buffered, at most [`MAX_BODY`]) |
//! | the last request body chunk | the decision: one request-body response with `x-gateway-destination-endpoint` (`<worker host>:<--destination-port>`), `x-worker-instance-id`, `x-prefill-instance-id` (a prefill/decode pair), `clear_route_cache`, and the whole body streamed back |
//! | response headers | `CONTINUE` (the worker's first byte: the prompt is processed) |
//! | response body chunks | each chunk streamed back as it came |
//! | trailers | an empty trailers response |
//!
//! A body the router cannot decide for (not JSON, no `model`, no `prompt`/`messages`, a model no
//! worker serves, no worker free) is answered with an immediate response carrying the status
//! and OpenAI-shaped error body `infera server` would answer; a body over [`MAX_BODY`] with 413.
//! A request with no body (headers with `end_of_stream`) is continued without a decision (the
//! router needs a model and a prompt). A phase-less message is refused with
//! `INVALID_ARGUMENT`, and a request body that has not ended [`BODY_DEADLINE`] after the stream
//! opened with `DEADLINE_EXCEEDED`.
//!
//! The decision's load is the router's ([`Pick`]): it is finished when the stream ends (a worker
//! error when the response status was 5xx), or as cancelled when the stream breaks.

use super::proto::{
    BodyMutation, BodyResponse, CommonResponse, HeaderMap, HeaderMutation, HeaderValue,
    HeaderValueOption, HeadersResponse, HttpBody, HttpHeaders, HttpStatus, ImmediateResponse,
    ProcessingRequest, ProcessingResponse, StreamedBodyResponse, TrailersResponse,
    processing_request::Phase, processing_response::Answer,
};
use bytes::{Bytes, BytesMut};
use futures::future::BoxFuture;
use futures::stream::BoxStream;
use infera_adapters::server::{Pick, PickError, ServerState};
use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::sync::mpsc;
use tonic::server::{Grpc, NamedService, StreamingService};
use tonic::{Status, Streaming};

/// The routed worker's gateway endpoint, `<host>:<destination port>`.
pub const DEST_HEADER: &str = "x-gateway-destination-endpoint";
/// The routed worker's id (read by a worker-side `infera server --router-mode direct`).
pub const WORKER_HEADER: &str = "x-worker-instance-id";
/// A prefill/decode pair's prefill worker id.
pub const PREFILL_HEADER: &str = "x-prefill-instance-id";
/// The largest request body buffered (the HTTP front's default `--max-body-bytes`).
pub const MAX_BODY: usize = 32 << 20;
/// How long after the stream opens the whole request body must have arrived.
pub const BODY_DEADLINE: Duration = Duration::from_secs(60);
/// Answers queued per stream before reading Envoy's next message waits.
const OUTBOX: usize = 16;
const PROCESS: &str = "/envoy.service.ext_proc.v3.ExternalProcessor/Process";

/// The ext_proc service: decides with `state`, answers `<host>:<destination_port>`.
#[derive(Debug, Clone)]
pub struct ExtProc(Arc<Picker>);

#[derive(Debug)]
struct Picker {
    state: ServerState,
    destination_port: u16,
}

impl ExtProc {
    /// The service over the router `state`.
    pub fn new(state: ServerState, destination_port: u16) -> Self {
        Self(Arc::new(Picker {
            state,
            destination_port,
        }))
    }
}

impl NamedService for ExtProc {
    const NAME: &'static str = "envoy.service.ext_proc.v3.ExternalProcessor";
}

impl tower_service::Service<http::Request<tonic::body::Body>> for ExtProc {
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = BoxFuture<'static, Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<tonic::body::Body>) -> Self::Future {
        let picker = Arc::clone(&self.0);
        Box::pin(async move {
            if request.uri().path() != PROCESS {
                return Ok(Status::unimplemented(format!(
                    "{} is not served here",
                    request.uri().path()
                ))
                .into_http());
            }
            let mut grpc = Grpc::new(tonic_prost::ProstCodec::default());
            Ok(grpc.streaming(Process(picker), request).await)
        })
    }
}

struct Process(Arc<Picker>);

type Answers = BoxStream<'static, Result<ProcessingResponse, Status>>;

impl StreamingService<ProcessingRequest> for Process {
    type Response = ProcessingResponse;
    type ResponseStream = Answers;
    type Future = BoxFuture<'static, Result<tonic::Response<Answers>, Status>>;

    fn call(&mut self, request: tonic::Request<Streaming<ProcessingRequest>>) -> Self::Future {
        let (tx, rx) = mpsc::channel(OUTBOX);
        tokio::spawn(run_stream(Arc::clone(&self.0), request.into_inner(), tx));
        let answers = futures::stream::unfold(rx, |mut rx| async move {
            rx.recv().await.map(|answer| (answer, rx))
        });
        Box::pin(async move { Ok(tonic::Response::new(Box::pin(answers) as Answers)) })
    }
}

type Outbox = mpsc::Sender<Result<ProcessingResponse, Status>>;

/// Reads Envoy's messages and answers them until the stream ends (see the module docs).
async fn run_stream(picker: Arc<Picker>, mut inbound: Streaming<ProcessingRequest>, tx: Outbox) {
    let mut stream = StreamState::default();
    let body_deadline = tokio::time::sleep(BODY_DEADLINE);
    tokio::pin!(body_deadline);
    loop {
        let message = tokio::select! {
            message = inbound.message() => message,
            () = tx.closed() => return,
            () = &mut body_deadline, if !stream.decided => {
                let status = Status::deadline_exceeded(format!(
                    "the request body did not end within {}s", BODY_DEADLINE.as_secs()));
                let _ = tx.send(Err(status)).await;
                return;
            }
        };
        match message {
            Ok(Some(message)) => match stream.answer(&picker, message).await {
                Ok(None) => {}
                Ok(Some(answer)) => {
                    if tx.send(Ok(answer)).await.is_err() {
                        return;
                    }
                }
                Err(status) => {
                    let _ = tx.send(Err(status)).await;
                    return;
                }
            },
            Ok(None) => {
                stream.ended();
                return;
            }
            // Envoy went away mid-request: the pick is dropped, finished as cancelled.
            Err(status) => {
                tracing::debug!(%status, "ext_proc stream broke");
                return;
            }
        }
    }
}

/// One request's progress.
#[derive(Debug, Default)]
struct StreamState {
    request_id: Option<String>,
    body: BytesMut,
    /// The request phase is over: a decision was answered (or the request had no body).
    decided: bool,
    pick: Option<Pick>,
    /// The worker answered 5xx.
    failed: bool,
}

static NEXT_STREAM: AtomicU64 = AtomicU64::new(0);

impl StreamState {
    /// The answer to one message of Envoy, if it gets one now.
    async fn answer(
        &mut self,
        picker: &Picker,
        message: ProcessingRequest,
    ) -> Result<Option<ProcessingResponse>, Status> {
        let Some(request) = message.request else {
            return Err(Status::invalid_argument(
                "a ProcessingRequest without a phase (request_headers, request_body, ...)",
            ));
        };
        Ok(match request {
            Phase::RequestHeaders(HttpHeaders {
                headers,
                end_of_stream,
            }) => {
                self.request_id = header(headers.as_ref(), "x-request-id")
                    .filter(|id| !id.is_empty() && id.len() <= 256);
                if end_of_stream {
                    self.decided = true;
                    tracing::debug!("ext_proc: a request without a body is continued undecided");
                }
                Some(answer(Answer::RequestHeaders(HeadersResponse {
                    response: Some(CommonResponse::default()),
                })))
            }
            Phase::RequestBody(HttpBody {
                body,
                end_of_stream,
            }) => {
                if self.decided {
                    return Err(Status::failed_precondition(
                        "request body after the request was decided",
                    ));
                }
                if self.body.len() + body.len() > MAX_BODY {
                    self.decided = true;
                    return Ok(Some(immediate(&PickError {
                        status: 413,
                        message: format!("request body exceeds {MAX_BODY} bytes"),
                    })));
                }
                self.body.extend_from_slice(&body);
                if !end_of_stream {
                    return Ok(None);
                }
                self.decided = true;
                Some(self.decide(picker).await)
            }
            Phase::ResponseHeaders(HttpHeaders { headers, .. }) => {
                self.failed = header(headers.as_ref(), ":status")
                    .and_then(|s| s.parse::<u16>().ok())
                    .is_some_and(|s| s >= 500);
                if let Some(pick) = &mut self.pick {
                    pick.first_byte();
                }
                Some(answer(Answer::ResponseHeaders(HeadersResponse {
                    response: Some(CommonResponse::default()),
                })))
            }
            Phase::ResponseBody(HttpBody {
                body,
                end_of_stream,
            }) => Some(answer(Answer::ResponseBody(BodyResponse {
                response: Some(streamed(body, end_of_stream, None)),
            }))),
            Phase::RequestTrailers(_) => {
                Some(answer(Answer::RequestTrailers(TrailersResponse::default())))
            }
            Phase::ResponseTrailers(_) => Some(answer(Answer::ResponseTrailers(
                TrailersResponse::default(),
            ))),
        })
    }

    /// Envoy closed the stream: the request is over (a worker error if it answered 5xx).
    fn ended(mut self) {
        if let Some(pick) = self.pick.take() {
            pick.finish(!self.failed);
        }
    }

    /// Decides for the buffered body: the routing headers and the body streamed back, or an
    /// immediate error response.
    async fn decide(&mut self, picker: &Picker) -> ProcessingResponse {
        let id = self
            .request_id
            .take()
            .unwrap_or_else(|| format!("gaie-{}", NEXT_STREAM.fetch_add(1, Ordering::Relaxed)));
        let body = std::mem::take(&mut self.body).freeze();
        match picker.state.pick(body.clone(), &id).await {
            Ok(pick) => {
                let endpoint = endpoint_of(&pick.url, picker.destination_port);
                tracing::info!(request_id = %id, %endpoint, worker = %pick.worker,
                    prefill = pick.prefill.as_deref().unwrap_or("-"), "ext_proc: routed");
                let mut headers = vec![
                    set(DEST_HEADER, &endpoint),
                    set(WORKER_HEADER, &pick.worker),
                ];
                if let Some(prefill) = &pick.prefill {
                    headers.push(set(PREFILL_HEADER, prefill));
                }
                self.pick = Some(pick);
                answer(Answer::RequestBody(BodyResponse {
                    response: Some(streamed(body, true, Some(headers))),
                }))
            }
            Err(error) => {
                tracing::warn!(request_id = %id, status = error.status,
                    error = %error.message, "ext_proc: not routed");
                immediate(&error)
            }
        }
    }
}

fn answer(response: Answer) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(response),
    }
}

/// A `CONTINUE` that streams `body` back, with routing headers (and a route-cache clear, so the
/// gateway routes on them).
fn streamed(
    body: Bytes,
    end_of_stream: bool,
    headers: Option<Vec<HeaderValueOption>>,
) -> CommonResponse {
    CommonResponse {
        clear_route_cache: headers.is_some(),
        header_mutation: headers.map(|set_headers| HeaderMutation { set_headers }),
        body_mutation: Some(BodyMutation {
            streamed_response: Some(StreamedBodyResponse {
                body,
                end_of_stream,
            }),
        }),
    }
}

/// An overwrite-or-add header mutation, its value in `raw_value` as current Envoy reads it.
fn set(key: &str, value: &str) -> HeaderValueOption {
    HeaderValueOption {
        header: Some(HeaderValue {
            key: key.to_owned(),
            value: String::new(),
            raw_value: value.as_bytes().to_vec(),
        }),
        append_action: super::proto::HeaderAppendAction::OverwriteIfExistsOrAdd as i32,
    }
}

/// Envoy answers the client `error` at once, with the HTTP front's OpenAI-shaped body.
fn immediate(error: &PickError) -> ProcessingResponse {
    let body = error.body();
    answer(Answer::ImmediateResponse(ImmediateResponse {
        status: Some(HttpStatus {
            code: i32::from(error.status),
        }),
        headers: Some(HeaderMutation {
            set_headers: vec![set("content-type", "application/json")],
        }),
        body: body.to_string().into_bytes(),
        details: format!("infera gaie: {}", error.message),
    }))
}

/// The value of header `name` (Envoy sends it in `raw_value`, older ones in `value`).
fn header(headers: Option<&HeaderMap>, name: &str) -> Option<String> {
    let found = headers?
        .headers
        .iter()
        .find(|h| h.key.eq_ignore_ascii_case(name))?;
    if found.raw_value.is_empty() {
        Some(found.value.clone())
    } else {
        String::from_utf8(found.raw_value.clone()).ok()
    }
}

/// `<host>:<port>` of a worker URL (`http://10.0.0.1:30000` → `10.0.0.1:<port>`): the gateway
/// routes to the Pod's frontend on `port`, not to the engine port the worker registered. A URL
/// without a host is answered as it is.
pub fn endpoint_of(url: &str, port: u16) -> String {
    match url
        .parse::<http::Uri>()
        .ok()
        .and_then(|u| u.host().map(str::to_owned))
    {
        Some(host) => format!("{host}:{port}"),
        None => url.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use infera_adapters::server::{ClientOptions, ServerOptions};
    use infera_adapters::tokenize::Tokenizer;
    use infera_core::event::{Engine, WorkerRecord};
    use infera_core::ids::{WorkerId, WorkerRank};
    use infera_core::service::ServiceOptions;

    fn picker() -> Picker {
        let dir = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../fixtures/tokenizers/deepseek-v4"
        );
        let options = ServerOptions {
            service: ServiceOptions {
                router: infera_core::policy::RouterConfig::default(),
                fleet: infera_core::fleet::FleetConfig::default(),
                request_max_retries: 0,
                max_body_bytes: MAX_BODY,
            },
            chat_template: None,
            template_defaults: Default::default(),
            per_worker_template_kwargs: true,
            model_tokenizers: Default::default(),
            lora_loading: None,
            direct: false,
            client: ClientOptions::default(),
        };
        let state = ServerState::new(
            options,
            Arc::new(Tokenizer::from_path(std::path::Path::new(dir)).unwrap()),
        );
        let id = WorkerId::new("10.0.0.1:30000");
        state.register_worker(WorkerRecord::mixed(
            id,
            "http://10.0.0.1:30000".to_owned(),
            "m",
            Engine::Vllm,
            16,
        ));
        Picker {
            state,
            destination_port: 8000,
        }
    }

    fn phase(phase: Phase) -> ProcessingRequest {
        ProcessingRequest {
            request: Some(phase),
        }
    }

    fn body(text: &str, end_of_stream: bool) -> HttpBody {
        HttpBody {
            body: Bytes::copy_from_slice(text.as_bytes()),
            end_of_stream,
        }
    }

    fn inflight(picker: &Picker) -> usize {
        let rank = WorkerRank::new(WorkerId::new("10.0.0.1:30000"), 0);
        picker.state.service().with_fleet(|f| f.inflight_on(&rank))
    }

    /// Drives one stream's request phase: headers, then the body in two chunks.
    async fn decided(picker: &Picker) -> StreamState {
        let mut stream = StreamState::default();
        let headers = phase(Phase::RequestHeaders(HttpHeaders::default()));
        assert!(stream.answer(picker, headers).await.unwrap().is_some());
        let first = phase(Phase::RequestBody(body(r#"{"model": "m", "#, false)));
        assert_eq!(stream.answer(picker, first).await.unwrap(), None);
        let last = phase(Phase::RequestBody(body(r#""prompt": "hi"}"#, true)));
        let decision = stream.answer(picker, last).await.unwrap().unwrap();
        let Some(Answer::RequestBody(BodyResponse {
            response: Some(common),
        })) = decision.response
        else {
            panic!("not a request-body answer: {decision:?}");
        };
        let set = &common.header_mutation.unwrap().set_headers;
        assert_eq!(set[0].header.as_ref().unwrap().raw_value, b"10.0.0.1:8000");
        stream
    }

    #[tokio::test]
    async fn the_decision_loads_the_worker_until_the_stream_ends_or_breaks() {
        let picker = picker();
        let mut stream = decided(&picker).await;
        assert_eq!(inflight(&picker), 1);
        let status = HeaderValue {
            key: ":status".to_owned(),
            value: String::new(),
            raw_value: b"200".to_vec(),
        };
        let headers = phase(Phase::ResponseHeaders(HttpHeaders {
            headers: Some(HeaderMap {
                headers: vec![status],
            }),
            end_of_stream: false,
        }));
        assert!(stream.answer(&picker, headers).await.unwrap().is_some());
        assert_eq!(inflight(&picker), 1, "answering is not finishing");
        stream.ended();
        assert_eq!(inflight(&picker), 0, "Envoy closed the stream: finished");

        // A stream that breaks (its state dropped) finishes its request too.
        drop(decided(&picker).await);
        assert_eq!(inflight(&picker), 0);
    }

    #[tokio::test]
    async fn a_body_over_the_bound_is_answered_413_and_nothing_after_it_is_taken() {
        let picker = picker();
        let mut stream = StreamState::default();
        let big = "x".repeat(MAX_BODY / 2 + 1);
        let first = phase(Phase::RequestBody(body(&big, false)));
        assert_eq!(stream.answer(&picker, first).await.unwrap(), None);
        let second = phase(Phase::RequestBody(body(&big, false)));
        let answer = stream.answer(&picker, second).await.unwrap().unwrap();
        let Some(Answer::ImmediateResponse(immediate)) = answer.response else {
            panic!("not an immediate response: {answer:?}");
        };
        assert_eq!(immediate.status, Some(HttpStatus { code: 413 }));
        let third = phase(Phase::RequestBody(body("x", true)));
        let refused = stream.answer(&picker, third).await.unwrap_err();
        assert_eq!(refused.code(), tonic::Code::FailedPrecondition);
        assert_eq!(inflight(&picker), 0);
    }

    #[test]
    fn the_endpoint_is_the_workers_host_at_the_destination_port() {
        assert_eq!(endpoint_of("http://10.0.0.1:30000", 8000), "10.0.0.1:8000");
        assert_eq!(endpoint_of("http://10.0.0.1:30000/", 8000), "10.0.0.1:8000");
        assert_eq!(endpoint_of("10.0.0.1:30000", 8001), "10.0.0.1:8001");
        assert_eq!(
            endpoint_of("http://worker-0.svc", 8000),
            "worker-0.svc:8000"
        );
        assert_eq!(
            endpoint_of("http://[fd00::1]:30000", 8000),
            "[fd00::1]:8000"
        );
    }
}
