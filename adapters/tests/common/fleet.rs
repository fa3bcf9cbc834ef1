//! An in-process fleet for the server tests: mock engines on loopback ports whose KV events a
//! test feeds in by hand, and the server front in front of them (workers registered directly
//! as `WorkerRegistered` events, no discovery backend).

use super::TIMEOUT;
use infera_adapters::mock::{MockConfig, MockError, MockPd, MockServer};
use infera_adapters::server::{ClientOptions, ServerOptions, ServerState, serve};
use infera_adapters::tokenize::Tokenizer;
use infera_core::engine::EngineConfig;
use infera_core::event::{Engine, RequestTransport, Role, WorkerRecord};
use infera_core::fleet::FleetConfig;
use infera_core::ids::{WorkerId, WorkerRank};
use infera_core::kv_events::EngineBatch;
use infera_core::policy::{PolicyKind, RouterConfig};
use infera_core::service::ServiceOptions;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::{Arc, OnceLock};
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;

pub const MODEL: &str = "mock-model";
pub const BLOCK: u32 = 16;
pub fn tokenizer() -> Arc<Tokenizer> {
    static TOK: OnceLock<Arc<Tokenizer>> = OnceLock::new();
    TOK.get_or_init(|| {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/tokenizers/deepseek-v4");
        Arc::new(Tokenizer::from_path(&dir).expect("fixture tokenizer loads"))
    })
    .clone()
}

pub struct Mock {
    pub addr: SocketAddr,
    pub events: mpsc::Receiver<EngineBatch>,
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<Result<(), MockError>>,
}

impl Mock {
    pub async fn start() -> Self {
        Self::start_as(None).await
    }

    /// A mock playing one leg of a PD pair.
    pub async fn start_pd(role: Role, protocol: &str) -> Self {
        Self::start_as(Some(MockPd {
            role,
            protocol: protocol.parse().expect("a PD protocol name"),
            engine_id: format!("eng-{}", role.as_str()),
            host: "127.0.0.1".to_owned(),
            port: 18998,
        }))
        .await
    }

    pub async fn start_as(pd: Option<MockPd>) -> Self {
        Self::start_configured(|config| config.pd = pd).await
    }

    /// A mixed mock whose configuration `configure` changes from the fleet's.
    pub async fn start_configured(configure: impl FnOnce(&mut MockConfig)) -> Self {
        let engine = EngineConfig {
            gpu_blocks: 4096,
            block_size: BLOCK,
            speedup: 1000.0,
            ..EngineConfig::default()
        };
        let mut config = MockConfig::new(MODEL, engine);
        config.tokenizer = Some(tokenizer());
        config.drain_timeout = Duration::from_secs(5);
        configure(&mut config);
        let (sink, events) = mpsc::channel(4096);
        let server = MockServer::bind("127.0.0.1:0", config, Some(sink))
            .await
            .expect("mock binds");
        let addr = server.local_addr();
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(server.serve(async move {
            let _ = stopped.await;
        }));
        Self {
            addr,
            events,
            stop: Some(stop),
            task,
        }
    }

    pub fn id(&self) -> WorkerId {
        WorkerId::new(self.addr.to_string())
    }

    /// Feeds every batch the sink holds now into the server; returns how many there were.
    pub fn feed(&mut self, server: &ServerState) -> usize {
        let rank = WorkerRank::new(self.id(), 0);
        let mut n = 0;
        while let Ok(batch) = self.events.try_recv() {
            let stats = server
                .ingest_kv_batch(&rank, None, &batch)
                .expect("worker registered");
            assert_eq!(stats.dropped(), 0, "{stats:?}");
            n += 1;
        }
        n
    }

    pub async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        tokio::time::timeout(TIMEOUT, &mut self.task)
            .await
            .expect("mock stops in time")
            .expect("mock task did not panic")
            .expect("mock served without error");
    }
}

pub fn record(addr: SocketAddr) -> WorkerRecord {
    WorkerRecord {
        worker_id: WorkerId::new(addr.to_string()),
        url: format!("http://{addr}"),
        model_name: MODEL.to_owned(),
        engine: Engine::Vllm,
        disagg_mode: Role::Mixed,
        disagg_meta: None,
        kv_events_endpoint: None,
        kv_block_size: BLOCK,
        dp_rank: 0,
        dp_size: 1,
        request_transport: RequestTransport::Http,
        kv: None,
        extra: serde_json::Map::new(),
    }
}

pub fn options(policy: PolicyKind, max_retries: u32, direct: bool) -> ServerOptions {
    ServerOptions {
        service: ServiceOptions {
            router: RouterConfig {
                policy,
                overlap_weight: 10.0,
                ..RouterConfig::default()
            },
            fleet: FleetConfig::default(),
            request_max_retries: max_retries,
            max_body_bytes: 64 << 10,
        },
        chat_template: None,
        template_defaults: Default::default(),
        per_worker_template_kwargs: true,
        model_tokenizers: Default::default(),
        lora_loading: None,
        direct,
        client: ClientOptions::default(),
    }
}

pub struct Front {
    pub addr: SocketAddr,
    pub state: ServerState,
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<std::io::Result<()>>,
}

impl Front {
    pub async fn start(policy: PolicyKind, max_retries: u32) -> Self {
        Self::start_with(policy, max_retries, false).await
    }

    pub async fn start_with(policy: PolicyKind, max_retries: u32, direct: bool) -> Self {
        Self::serve(ServerState::new(
            options(policy, max_retries, direct),
            tokenizer(),
        ))
        .await
    }

    pub async fn serve(state: ServerState) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(serve(listener, state.clone(), async move {
            let _ = stopped.await;
        }));
        Self {
            addr,
            state,
            stop: Some(stop),
            task,
        }
    }

    pub async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        tokio::time::timeout(TIMEOUT, &mut self.task)
            .await
            .expect("server stops in time")
            .expect("server task did not panic")
            .expect("server ended without error");
    }
}
