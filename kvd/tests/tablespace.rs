//! The L3 tablespace on its own, on real files: round trips in every I/O mode, restart and
//! recovery, retention (a `short` block never evicts a `long` one, `none` never reaches disk,
//! TTL expiry frees space), and damage: corrupted containers and a journal that lost its tail
//! never make a read return another key's bytes — the bug upstream's L3 has.

#![allow(clippy::unwrap_used)]

use bytes::Bytes;
use infera_core::event::Retention;
use infera_kvd::long::{self, LongBlock, LongRejected, LongStore, WritePermit};
use infera_kvd::store::key_hash;
use infera_kvd::{IoMode, LongBackendConfig, Namespace, TablespaceConfig};
use std::path::{Path, PathBuf};
use std::sync::Arc;

const NOW: u64 = 1_700_000_000_000;

fn config(dirs: &[PathBuf], bytes: u64, mode: IoMode, uring: bool) -> TablespaceConfig {
    let mut c = TablespaceConfig::new(dirs.to_vec(), bytes);
    c.io_mode = mode;
    c.io_uring = uring;
    c.container_bytes = 1 << 20;
    c.workers_per_shard = 2;
    c.journal_flush = std::time::Duration::from_millis(1);
    c
}

async fn open(c: &TablespaceConfig) -> Arc<dyn LongStore> {
    long::open(&LongBackendConfig::Tablespace(c.clone()))
        .await
        .unwrap()
}

fn ns() -> Namespace {
    Namespace::new("m", "fp8")
}

fn block(key: &str, value: Bytes, class: Retention) -> LongBlock {
    LongBlock {
        hash: key_hash(&ns(), key.as_bytes()),
        ns: ns(),
        key: Bytes::copy_from_slice(key.as_bytes()),
        value,
        metadata: Some(Bytes::from_static(b"\x81\xa1a\x01")),
        class,
        expires_at: None,
    }
}

fn value(seed: u8, len: usize) -> Bytes {
    Bytes::from(
        (0..len)
            .map(|i| seed.wrapping_add(i as u8))
            .collect::<Vec<u8>>(),
    )
}

async fn get(ts: &Arc<dyn LongStore>, key: &str) -> Option<Bytes> {
    ts.get(&ns(), key.as_bytes(), key_hash(&ns(), key.as_bytes()), NOW)
        .await
        .map(|h| h.value)
}

async fn put(ts: &Arc<dyn LongStore>, b: LongBlock) -> Result<u64, LongRejected> {
    let permit = ts
        .write_permits(&[b.value.len() as u64])
        .await
        .pop()
        .unwrap();
    ts.put(b, permit, NOW, false).map(|put| put.generation)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocks_round_trip_in_every_mode_and_survive_a_restart() {
    for (mode, uring) in [
        (IoMode::Direct, true),
        (IoMode::Direct, false),
        (IoMode::Buffered, true),
        (IoMode::Auto, false),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let dirs = [dir.path().join("a"), dir.path().join("b")];
        let c = config(&dirs, 8 << 20, mode, uring);
        let ts = open(&c).await;
        let stats = ts.stats();
        assert_eq!(stats.io_uring, uring, "{mode:?}");
        assert_eq!(stats.direct_io, mode == IoMode::Direct);
        let sizes = [1usize, 4096, 4097, 65536, 300_000];
        for (i, len) in sizes.iter().enumerate() {
            let key = format!("k{i}");
            put(&ts, block(&key, value(i as u8, *len), Retention::Long))
                .await
                .unwrap();
            // Readable at once, from memory while the write is in flight.
            assert_eq!(get(&ts, &key).await.unwrap(), value(i as u8, *len));
        }
        ts.flush().await.unwrap();
        for (i, len) in sizes.iter().enumerate() {
            let got = get(&ts, &format!("k{i}")).await.unwrap();
            assert_eq!(got, value(i as u8, *len), "{mode:?} {len}");
        }
        assert!(ts.stats().reads_total >= sizes.len() as u64);
        assert_eq!(get(&ts, "never").await, None);
        assert!(
            ts.get(&Namespace::new("m", ""), b"k0", key_hash(&ns(), b"k0"), NOW)
                .await
                .is_none(),
            "another namespace under a forged hash is a miss"
        );
        ts.close().await.unwrap();
        drop(ts);

        let ts = open(&c).await;
        assert_eq!(ts.stats().entries, sizes.len() as u64, "{mode:?}");
        for (i, len) in sizes.iter().enumerate() {
            assert_eq!(
                get(&ts, &format!("k{i}")).await.unwrap(),
                value(i as u8, *len)
            );
        }
        ts.close().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_rules_hold_on_disk() {
    let dir = tempfile::tempdir().unwrap();
    // One 1 MiB container: room for 15 blocks of 64 KiB (each takes 17 units with its header).
    let c = config(&[dir.path().join("s")], 1 << 20, IoMode::Buffered, true);
    let ts = open(&c).await;
    for class in [Retention::None, Retention::Ephemeral] {
        let err = put(&ts, block("x", value(1, 10), class)).await.unwrap_err();
        assert_eq!(err, LongRejected::ClassNotStored);
    }
    for i in 0..15 {
        put(
            &ts,
            block(&format!("long{i}"), value(2, 65536), Retention::Long),
        )
        .await
        .unwrap();
    }
    ts.flush().await.unwrap();
    let before = ts.stats();
    assert_eq!((before.entries, before.evictions_total), (15, 0));
    let err = put(&ts, block("short", value(3, 65536), Retention::Short))
        .await
        .unwrap_err();
    assert_eq!(err, LongRejected::WouldDisplace);
    let after = ts.stats();
    assert_eq!(
        after.entries, before.entries,
        "a refused short write evicts nothing"
    );
    assert_eq!(after.evictions_total, 0);
    // A long write may displace the least recently used long block.
    put(&ts, block("long-new", value(4, 65536), Retention::Long))
        .await
        .unwrap();
    assert_eq!(ts.stats().evictions_total, 1);
    assert_eq!(get(&ts, "long0").await, None, "the LRU long block went");
    assert!(get(&ts, "long1").await.is_some());
    ts.close().await.unwrap();

    // TTL expiry frees space: an expired block is swept and its units reused.
    let dir = tempfile::tempdir().unwrap();
    let c = config(&[dir.path().join("s")], 1 << 20, IoMode::Buffered, false);
    let ts = open(&c).await;
    let n = 15;
    for i in 0..n {
        let mut b = block(&format!("t{i}"), value(5, 65536), Retention::Long);
        b.expires_at = Some(NOW + 1000);
        put(&ts, b).await.unwrap();
    }
    ts.flush().await.unwrap();
    let full = ts.put(
        block("full", value(6, 65536), Retention::Short),
        WritePermit::unbounded(),
        NOW,
        false,
    );
    assert_eq!(full.unwrap_err(), LongRejected::WouldDisplace);
    assert!(ts.class_of(key_hash(&ns(), b"t0"), NOW).is_some());
    assert_eq!(ts.class_of(key_hash(&ns(), b"t0"), NOW + 1000), None);
    assert_eq!(ts.sweep(NOW + 1000), n);
    assert_eq!(ts.stats().entries, 0);
    let permit = WritePermit::unbounded();
    ts.put(
        block("after", value(6, 65536), Retention::Short),
        permit,
        NOW + 1000,
        false,
    )
    .unwrap();
    ts.close().await.unwrap();
}

fn copy_dir(from: &Path, to: &Path, keep: impl Fn(&str) -> bool) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let name = e.file_name().to_string_lossy().into_owned();
        if keep(&name) {
            std::fs::copy(e.path(), to.join(&name)).unwrap();
        }
    }
}

fn is_index_file(name: &str) -> bool {
    name.starts_with("journal-") || name.starts_with("checkpoint")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_index_never_returns_the_new_tenant_of_its_slot() {
    let dir = tempfile::tempdir().unwrap();
    let shard = dir.path().join("s");
    let saved = dir.path().join("saved");
    let c = config(
        std::slice::from_ref(&shard),
        1 << 20,
        IoMode::Buffered,
        true,
    );
    let ts = open(&c).await;
    put(&ts, block("a", value(1, 50_000), Retention::Long))
        .await
        .unwrap();
    ts.close().await.unwrap();
    drop(ts);
    copy_dir(&shard, &saved, is_index_file);

    // `a` leaves and `b` takes its slot (best fit reuses the exact hole)...
    let ts = open(&c).await;
    assert!(ts.class_of(key_hash(&ns(), b"a"), 0).is_some());
    ts.remove(key_hash(&ns(), b"a"));
    put(&ts, block("b", value(2, 50_000), Retention::Long))
        .await
        .unwrap();
    ts.close().await.unwrap();
    drop(ts);
    // ...but the journal records of that never reached the disk (a crash, upstream's case).
    for e in std::fs::read_dir(&shard).unwrap() {
        let e = e.unwrap();
        if is_index_file(&e.file_name().to_string_lossy()) {
            std::fs::remove_file(e.path()).unwrap();
        }
    }
    copy_dir(&saved, &shard, |_| true);

    let ts = open(&c).await;
    assert_eq!(ts.stats().entries, 1, "the index still says `a`");
    assert_eq!(
        get(&ts, "a").await,
        None,
        "b's bytes are not returned as a's"
    );
    assert_eq!(get(&ts, "b").await, None);
    assert_eq!(ts.stats().verify_failures_total, 1);
    assert_eq!(ts.stats().entries, 0, "the stale entry is dropped");
    ts.close().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn corrupted_containers_and_journals_read_as_misses() {
    let dir = tempfile::tempdir().unwrap();
    let shard = dir.path().join("s");
    let c = config(
        std::slice::from_ref(&shard),
        2 << 20,
        IoMode::Buffered,
        true,
    );
    let ts = open(&c).await;
    for i in 0..20u8 {
        put(
            &ts,
            block(&format!("k{i}"), value(i, 20_000), Retention::Long),
        )
        .await
        .unwrap();
    }
    ts.flush().await.unwrap();
    drop(ts); // no checkpoint: the journal alone describes the index
    let container = shard.join("container-0000.dat");
    let mut bytes = std::fs::read(&container).unwrap();
    for b in &mut bytes[30_000..90_000] {
        *b ^= 0x5a;
    }
    std::fs::write(&container, &bytes).unwrap();
    let journal = std::fs::read_dir(&shard)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.to_string_lossy().contains("journal-"))
        .unwrap();
    let len = std::fs::metadata(&journal).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&journal)
        .unwrap()
        .set_len(len - 30)
        .unwrap();

    let ts = open(&c).await;
    let mut intact = 0;
    for i in 0..20u8 {
        if let Some(v) = get(&ts, &format!("k{i}")).await {
            assert_eq!(v, value(i, 20_000), "k{i} returned other bytes");
            intact += 1;
        }
    }
    assert!((14..20).contains(&intact), "{intact} blocks survived");
    assert!(ts.stats().verify_failures_total >= 2);
    // The torn tail was cut: a second restart reads the same prefix.
    ts.close().await.unwrap();
    drop(ts);
    let ts = open(&c).await;
    assert_eq!(ts.stats().entries, intact);
    ts.close().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_geometry_reinitializes_the_region() {
    let dir = tempfile::tempdir().unwrap();
    let shard = dir.path().join("s");
    let c = config(
        std::slice::from_ref(&shard),
        2 << 20,
        IoMode::Buffered,
        false,
    );
    let ts = open(&c).await;
    put(&ts, block("k", value(1, 100), Retention::Long))
        .await
        .unwrap();
    ts.close().await.unwrap();
    drop(ts);
    let bigger = config(
        std::slice::from_ref(&shard),
        3 << 20,
        IoMode::Buffered,
        false,
    );
    let ts = open(&bigger).await;
    assert_eq!(ts.stats().entries, 0);
    assert_eq!(ts.stats().capacity_bytes, 3 << 20);
    assert_eq!(get(&ts, "k").await, None);
    ts.close().await.unwrap();
    let err = long::open(&LongBackendConfig::Tablespace(config(
        &[shard],
        100,
        IoMode::Buffered,
        false,
    )))
    .await
    .unwrap_err();
    assert!(err.to_string().contains("too small"), "{err}");
}

fn mode_of(path: &Path) -> u32 {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(path).unwrap().permissions().mode() & 0o777
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn region_files_are_private_to_the_daemon_user() {
    use std::os::unix::fs::PermissionsExt;
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("nested").join("l3");
    let c = config(std::slice::from_ref(&dir), 2 << 20, IoMode::Buffered, false);
    let ts = open(&c).await;
    put(&ts, block("a", value(1, 5000), Retention::Long))
        .await
        .unwrap();
    ts.flush().await.unwrap();
    ts.checkpoint().await.unwrap();
    ts.close().await.unwrap();
    drop(ts);
    let check = |when: &str| {
        assert_eq!(mode_of(&dir), 0o700, "{when}: the region directory");
        let mut files = 0;
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            assert_eq!(mode_of(&path), 0o600, "{when}: {}", path.display());
            files += 1;
        }
        assert!(
            files >= 4,
            "{when}: meta, containers, journal and checkpoint: {files}"
        );
    };
    check("created");
    assert_eq!(
        mode_of(&tmp.path().join("nested")),
        0o700,
        "created parents"
    );
    // A region left world-readable (an older build) is narrowed when reopened.
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
    }
    let ts = open(&c).await;
    assert_eq!(get(&ts, "a").await, Some(value(1, 5000)));
    ts.checkpoint().await.unwrap();
    ts.close().await.unwrap();
    drop(ts);
    assert_eq!(mode_of(&dir), 0o700);
    for name in ["container-0000.dat", "checkpoint", "tablespace.meta"] {
        assert_eq!(mode_of(&dir.join(name)), 0o600, "{name} narrowed");
    }
}
