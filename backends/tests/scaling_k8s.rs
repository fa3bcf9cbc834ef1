//! The Kubernetes scaling backend (`--enable-scaling-api`): the real `kube` client against the
//! in-process API server of `infera_backends::testing::kube_api`, holding the router's own Pod,
//! an InferaDeployment as the operator writes it, and the pools' Pods.
//!
//! What a caller relies on: the deployment is the one the router's Pod is labelled with; a
//! snapshot reports asked-for and achieved sizes, and why a short pool will not grow; a resize
//! is one patch of the named pools or nothing; refusals say what to fix, with the status the
//! Python Infera answers.

use infera_backends::discovery::KubernetesConfig;
use infera_backends::discovery::kubernetes::{DEPLOYMENT_LABEL, KubernetesScaler, SERVICE_LABEL};
use infera_backends::testing::kube_api::{KubeApiServer, worker_pod};
use infera_core::error::ErrorCode;
use infera_core::ports::scaling::{PoolScaler, PoolSize, ScalingError, parse_request};
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::time::Duration;

const NAMESPACE: &str = "infera";
const ROUTER_POD: &str = "router-abc";
const API_VERSION: &str = "infera.amd.com/v1alpha1";
const PLURAL: &str = "inferadeployments";

/// An API server with the router's Pod (labelled with deployment `qwen` unless `labelled` is
/// false), the `qwen` InferaDeployment (prefill 2 of 2 ready, decode 4 asked, 4 exist, 3 ready)
/// and one decode Pod the scheduler cannot place.
async fn cluster(labelled: bool) -> KubeApiServer {
    let server = KubeApiServer::start(NAMESPACE).await.expect("API server");
    let labels = if labelled {
        json!({"app": "infera-router", DEPLOYMENT_LABEL: "qwen"})
    } else {
        json!({"app": "infera-router"})
    };
    server.create_pod(worker_pod(ROUTER_POD, "10.1.0.2", labels));
    server.put_custom(
        PLURAL,
        json!({
            "apiVersion": API_VERSION, "kind": "InferaDeployment",
            "metadata": {"name": "qwen", "namespace": NAMESPACE},
            "spec": {"services": {
                "prefill": {"role": "prefill", "replicas": 2, "numberOfNodes": 1},
                "decode": {"role": "decode", "replicas": 4},
            }},
            "status": {"state": "Degraded", "services": {
                "prefill": {"replicas": 2, "readyReplicas": 2},
                "decode": {"replicas": 4, "readyReplicas": 3},
            }},
        }),
    );
    let mut pending = worker_pod(
        "qwen-decode-3",
        "10.1.0.9",
        json!({DEPLOYMENT_LABEL: "qwen", SERVICE_LABEL: "decode"}),
    );
    pending["status"] = json!({"phase": "Pending", "conditions": [{
        "type": "PodScheduled", "status": "False", "reason": "Unschedulable",
        "message": "0/4 nodes are available: 4 Insufficient amd.com/gpu.",
    }]});
    server.create_pod(pending);
    server
}

fn scaler(server: &KubeApiServer, pod_name: Option<&str>) -> KubernetesScaler {
    let config = KubernetesConfig {
        namespace: Some(NAMESPACE.to_owned()),
        pod_name: pod_name.map(str::to_owned),
        request_timeout: Duration::from_secs(5),
        ..KubernetesConfig::default()
    };
    KubernetesScaler::new(config.with_api_url(&server.url()).expect("API URL"))
}

fn request(body: Value) -> BTreeMap<String, Value> {
    parse_request(body.to_string().as_bytes()).expect("a well-formed body")
}

fn spec_replicas(server: &KubeApiServer) -> Value {
    let cr = server.custom(API_VERSION, PLURAL, "qwen").expect("the CR");
    json!({
        "prefill": cr["spec"]["services"]["prefill"]["replicas"],
        "decode": cr["spec"]["services"]["decode"]["replicas"],
    })
}

fn refused(result: Result<impl std::fmt::Debug, ScalingError>) -> ScalingError {
    result.expect_err("the request is refused")
}

#[tokio::test]
async fn a_snapshot_reports_asked_for_and_achieved_sizes_and_why_a_pool_is_short() {
    let server = cluster(true).await;
    let snapshot = scaler(&server, Some(ROUTER_POD)).snapshot().await.unwrap();
    assert_eq!(snapshot.deployment, "qwen");
    assert_eq!(snapshot.namespace, NAMESPACE);
    assert_eq!(snapshot.state, "Degraded");
    assert_eq!(
        snapshot.services["decode"],
        PoolSize {
            role: "decode".into(),
            replicas: 4,
            current_replicas: 4,
            ready_replicas: 3,
            nodes_per_replica: 1,
            blocked: Some(
                "Unschedulable: 0/4 nodes are available: 4 Insufficient amd.com/gpu.".into()
            ),
        }
    );
    assert_eq!(snapshot.services["prefill"].ready_replicas, 2);
    assert_eq!(snapshot.services["prefill"].blocked, None);
}

#[tokio::test]
async fn prefill_and_decode_move_in_one_patch_of_the_named_pools_only() {
    let server = cluster(true).await;
    let scaler = scaler(&server, Some(ROUTER_POD));
    let after = scaler
        .scale(&request(
            json!({"services": {"prefill": {"replicas": 4}, "decode": 8}}),
        ))
        .await
        .unwrap();
    assert_eq!(
        server.stats().custom_patches,
        vec![
            json!({"spec": {"services": {"decode": {"replicas": 8}, "prefill": {"replicas": 4}}}})
        ]
    );
    assert_eq!(spec_replicas(&server), json!({"prefill": 4, "decode": 8}));
    assert_eq!(
        (
            after.services["prefill"].replicas,
            after.services["decode"].replicas
        ),
        (4, 8)
    );
    assert_eq!(after.services["prefill"].role, "prefill");

    scaler
        .scale(&request(json!({"services": {"decode": 6}})))
        .await
        .unwrap();
    let last = server.stats().custom_patches.pop().unwrap();
    assert_eq!(
        last,
        json!({"spec": {"services": {"decode": {"replicas": 6}}}})
    );
    assert_eq!(spec_replicas(&server), json!({"prefill": 4, "decode": 6}));
}

#[tokio::test]
async fn a_refused_resize_writes_nothing() {
    let server = cluster(true).await;
    let scaler = scaler(&server, Some(ROUTER_POD));
    let typo = refused(
        scaler
            .scale(&request(json!({"services": {"decode": 5, "prefil": 2}})))
            .await,
    );
    assert_eq!(typo.code, ErrorCode::BadRequest);
    assert!(typo.message.contains("prefil") && typo.message.contains("decode, prefill"));
    for bad in [json!(0), json!(-1), json!("4"), json!(4.5)] {
        let error = refused(
            scaler
                .scale(&request(json!({"services": {"decode": bad}})))
                .await,
        );
        assert_eq!(error.code, ErrorCode::BadRequest, "{bad}");
    }
    assert!(server.stats().custom_patches.is_empty());
    assert_eq!(spec_replicas(&server), json!({"prefill": 2, "decode": 4}));
}

#[tokio::test]
async fn refused_permissions_say_what_to_grant() {
    let server = cluster(true).await;
    let scaler = scaler(&server, Some(ROUTER_POD));
    server.deny_on(PLURAL, "patch");
    let error = refused(
        scaler
            .scale(&request(json!({"services": {"decode": 5}})))
            .await,
    );
    assert_eq!(error.code, ErrorCode::Forbidden);
    assert!(
        error.message.contains("cannot patch InferaDeployments"),
        "{error}"
    );
    assert!(std::error::Error::source(&error).is_some());

    server.deny_on(PLURAL, "get");
    let error = refused(scaler.snapshot().await);
    assert_eq!(error.code, ErrorCode::Forbidden);
    assert!(
        error.message.contains("cannot read InferaDeployments"),
        "{error}"
    );

    let fresh = cluster(true).await;
    fresh.deny("get");
    let error = refused(self::scaler(&fresh, Some(ROUTER_POD)).snapshot().await);
    assert_eq!(error.code, ErrorCode::Forbidden);
    assert!(error.message.contains("cannot read its own Pod"), "{error}");
}

#[tokio::test]
async fn a_router_the_operator_did_not_create_has_nothing_to_scale() {
    let unlabelled = cluster(false).await;
    let error = refused(scaler(&unlabelled, Some(ROUTER_POD)).snapshot().await);
    assert_eq!(error.code, ErrorCode::Conflict);
    assert!(error.message.contains(DEPLOYMENT_LABEL), "{error}");

    let server = cluster(true).await;
    let error = refused(scaler(&server, None).snapshot().await);
    assert_eq!(error.code, ErrorCode::Unavailable);
    assert!(error.message.contains("POD_NAME"), "{error}");
    let error = refused(scaler(&server, Some("router-gone")).snapshot().await);
    assert_eq!(error.code, ErrorCode::Unavailable);
    assert!(
        error.message.contains("infera/router-gone not found"),
        "{error}"
    );
    assert!(server.stats().custom_patches.is_empty());
}

#[tokio::test]
async fn a_deployment_that_is_gone_is_a_404_and_an_absent_api_server_a_503() {
    let server = cluster(true).await;
    let scaler = scaler(&server, Some(ROUTER_POD));
    scaler.snapshot().await.unwrap();
    server.put_custom(
        PLURAL,
        json!({"apiVersion": API_VERSION, "kind": "InferaDeployment",
               "metadata": {"name": "other"}, "spec": {"services": {}}}),
    );
    server.modify_pod(ROUTER_POD, |pod| {
        pod["metadata"]["labels"][DEPLOYMENT_LABEL] = json!("other");
    });
    // The deployment is read once: a relabelled Pod does not move the router to another one.
    assert_eq!(scaler.snapshot().await.unwrap().deployment, "qwen");

    let missing = cluster(true).await;
    missing.modify_pod(ROUTER_POD, |pod| {
        pod["metadata"]["labels"][DEPLOYMENT_LABEL] = json!("deleted");
    });
    let error = refused(self::scaler(&missing, Some(ROUTER_POD)).snapshot().await);
    assert_eq!(error.code, ErrorCode::NotFound);
    assert_eq!(error.message, "InferaDeployment \"deleted\" not found");

    server.stop().await;
    let error = refused(scaler.snapshot().await);
    assert_eq!(error.code, ErrorCode::Unavailable);
    assert!(
        error
            .message
            .contains("cannot reach the Kubernetes API server"),
        "{error}"
    );
}
