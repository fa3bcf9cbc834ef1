//! The gRPC health service (`grpc.health.v1.Health/Check`), as the Kubernetes gRPC probe and
//! the gateway's health check call it: `SERVING` for the server as a whole (`""`) and for
//! [`SERVICE`], `NOT_FOUND` for any other service. It is served only once the picker is ready
//! (its discovery is watching the fleet), so answering at all means ready. `Watch` is not
//! served (`UNIMPLEMENTED`).

use super::proto::{HealthCheckRequest, HealthCheckResponse, ServingStatus};
use futures::future::BoxFuture;
use std::convert::Infallible;
use std::task::{Context, Poll};
use tonic::Status;
use tonic::server::{Grpc, NamedService, UnaryService};

/// The service name the Inference Gateway's probes ask for.
pub const SERVICE: &str = "inference-extension";
const CHECK: &str = "/grpc.health.v1.Health/Check";

/// The health service. See the module docs.
#[derive(Debug, Clone, Copy, Default)]
pub struct Health;

impl NamedService for Health {
    const NAME: &'static str = "grpc.health.v1.Health";
}

impl tower_service::Service<http::Request<tonic::body::Body>> for Health {
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = BoxFuture<'static, Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<tonic::body::Body>) -> Self::Future {
        Box::pin(async move {
            if request.uri().path() != CHECK {
                return Ok(Status::unimplemented(format!(
                    "{} is not served here",
                    request.uri().path()
                ))
                .into_http());
            }
            let mut grpc = Grpc::new(tonic_prost::ProstCodec::default());
            Ok(grpc.unary(Check, request).await)
        })
    }
}

struct Check;

impl UnaryService<HealthCheckRequest> for Check {
    type Response = HealthCheckResponse;
    type Future = BoxFuture<'static, Result<tonic::Response<HealthCheckResponse>, Status>>;

    fn call(&mut self, request: tonic::Request<HealthCheckRequest>) -> Self::Future {
        let service = request.into_inner().service;
        Box::pin(async move {
            if service.is_empty() || service == SERVICE {
                Ok(tonic::Response::new(HealthCheckResponse {
                    status: ServingStatus::Serving as i32,
                }))
            } else {
                Err(Status::not_found(format!(
                    "unknown service {service:?} (this server reports \"\" and {SERVICE:?})"
                )))
            }
        })
    }
}
