//! The L4 over a real S3-compatible server (moto's standalone server, started by the test on a
//! free loopback port, addressed path-style over plain HTTP with SigV4-signed requests): blocks
//! written as objects holding kvd's framed blocks read back byte-exact through a fresh daemon,
//! by prefetch hints and by gets; a foreign object under a block's name is a counted miss, never
//! its bytes; a missing bucket stops an L4 that is required, with the store's answer; HTTPS
//! verifies the server's certificate (one no system trusts is refused); a server killed mid-run
//! costs no client error, and once back the breaker closes and writes land.

#![allow(clippy::unwrap_used)]

mod common;
#[path = "support/l4_daemon.rs"]
mod l4_daemon;
#[path = "support/l4_outage.rs"]
mod l4_outage;
#[path = "support/s3.rs"]
mod s3_server;

use bytes::Bytes;
use infera_kvd::Namespace;
use infera_kvd::l4::frame::{self, Framed};
use infera_kvd::l4::{L4, RemoteStore, name};
use infera_kvd::store::key_hash;
use l4_outage::{Outage, block, key};
use s3_server::{BUCKET, S3Server, l4_config, l4_config_tls};
use std::sync::Arc;
use std::time::Duration;

const WITHIN: Duration = Duration::from_secs(30);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocks_stored_as_objects_read_back_byte_exact_through_a_fresh_daemon() {
    let server = S3Server::start();
    let l4 = l4_config(server.port, BUCKET);
    let ns = Namespace::new("llama", "fp8");
    let values: Vec<Bytes> = (0..6).map(|i| block(i, 200_000 + i * 4099)).collect();

    l4_daemon::write_through_a_daemon(&l4, &ns, &values).await;

    let names: Vec<String> = (0..values.len())
        .map(|i| name(&l4.prefix, key_hash(&ns, &key(i))))
        .collect();
    let stored = l4.store().get_batch(&names).await.unwrap();
    for (i, (v, object)) in values.iter().zip(&stored).enumerate() {
        let object = object.as_ref().expect("an object per block");
        let (back, _) = frame::decode(object, &ns, &key(i)).expect("kvd's frame of the block");
        assert_eq!(&back, v, "framed block");
    }
    // Another writer's object under block 5's name (unframed bytes of the right length).
    let foreign = Framed {
        head: Bytes::new(),
        body: Bytes::from(vec![9u8; stored[5].as_ref().unwrap().len()]),
        tail: Bytes::new(),
        seal: false,
    };
    l4.store()
        .put_batch(&[(names[5].clone(), foreign)])
        .await
        .unwrap();

    let (fresh, mut client) = l4_daemon::a_fresh_daemon_prefetching_three(&l4, &ns).await;
    for (i, v) in values.iter().enumerate().take(5) {
        let hit = client.get(&ns, &key(i)).await.unwrap().expect("an L4 hit");
        assert_eq!(&hit.value, v, "byte-exact");
    }
    assert!(
        client.get(&ns, &key(5)).await.unwrap().is_none(),
        "a foreign object is a miss"
    );
    let stats = client.stats(true).await.unwrap().extended.unwrap();
    assert_eq!(stats.l4.rejected_total, 1, "{stats:?}");
    assert_eq!(stats.l4.up, 1);
    fresh.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_bucket_stops_a_required_l4_with_the_stores_answer() {
    let server = S3Server::start();
    let cfg = l4_config(server.port, "no-such-bucket");
    let error = L4::open(cfg.store(), cfg.options(), true)
        .await
        .unwrap_err()
        .to_string();
    assert!(
        error.contains("127.0.0.1") && error.contains("404"),
        "{error}"
    );
    // Not required: a warning, and the L4 starts with its breaker open.
    let l4 = L4::open(cfg.store(), cfg.options(), false).await.unwrap();
    assert!(!l4.is_up());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_certificate_the_system_does_not_trust_is_refused() {
    let server = S3Server::start_self_signed();
    let cfg = l4_config_tls(server.port, BUCKET);
    let error = L4::open(cfg.store(), cfg.options(), true)
        .await
        .unwrap_err()
        .to_string();
    assert!(error.to_lowercase().contains("certificate"), "{error}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_server_costs_no_client_error_and_the_breaker_closes_when_it_is_back() {
    let mut server = S3Server::start();
    let mut options = l4_config(server.port, BUCKET).options();
    options.retry_interval = Duration::from_millis(50);
    let down = l4_outage::a_killed_store_costs_no_client_error(&mut server, options, WITHIN).await;
    assert!(down.dropped_total >= 1, "{down:?}");
}

impl Outage for S3Server {
    fn client(&self) -> Arc<dyn RemoteStore> {
        l4_config(self.port, BUCKET).store()
    }
    fn kill(&mut self) {
        S3Server::kill(self);
    }
    fn restart(&mut self) {
        *self = S3Server::start_on(self.port);
    }
}
