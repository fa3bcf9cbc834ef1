use super::*;

fn dev(name: &str, rotational: bool) -> Device {
    Device {
        name: name.to_owned(),
        rotational,
    }
}

#[test]
fn auto_picks_direct_only_on_nvme() {
    assert!(classify(0xef53, &[dev("nvme0n1", false)]).direct);
    assert!(classify(0xef53, &[dev("nvme0n1", false), dev("nvme1n1", false)]).direct);
    let mixed = classify(0xef53, &[dev("nvme0n1", false), dev("sda", false)]);
    assert!(
        !mixed.direct && mixed.reason.contains("not NVMe"),
        "{mixed:?}"
    );
    let spinning = classify(0xef53, &[dev("sdb", true)]);
    assert!(!spinning.direct && spinning.reason.contains("rotational"));
    let nfs = classify(0x6969, &[dev("nvme0n1", false)]);
    assert!(!nfs.direct && nfs.reason.contains("nfs"), "{nfs:?}");
    assert!(!classify(0x0102_1994, &[]).direct);
    assert!(!classify(0xef53, &[]).direct);
}

#[test]
fn this_machine_is_probed_and_explicit_modes_win() {
    let dir = tempfile::tempdir().unwrap();
    let auto = decide(IoMode::Auto, dir.path());
    assert!(!auto.reason.is_empty());
    assert!(decide(IoMode::Direct, dir.path()).direct);
    assert!(!decide(IoMode::Buffered, dir.path()).direct);
}

#[test]
fn pooled_buffers_come_back() {
    let pool = BufPool::new(1 << 20);
    let a = pool.get(5000);
    assert_eq!(a.as_ref().len(), 5000);
    let ptr = a.as_ref().as_ptr();
    drop(a);
    let b = pool.get(60_000);
    assert_eq!(b.as_ref().as_ptr(), ptr, "same 64 KiB capacity");
    let big = pool.get((4 << 20) + 4096);
    assert_eq!(big.as_ref().len(), (4 << 20) + 4096);
    let queue = IoQueue::default();
    queue.close();
    assert!(queue.pop_batch(4, 2).is_none());
}

fn write(units: u32) -> Job {
    Job::Write(WriteJob {
        generation: 1,
        hash: 1,
        class: Retention::Long,
        container: 0,
        start: 0,
        units,
        ns: Namespace::new("m", ""),
        key: Bytes::from_static(b"k"),
        metadata: None,
        value: Bytes::new(),
        _permit: WritePermit::unbounded(),
        landed: None,
    })
}

#[tokio::test]
async fn a_batch_holds_a_few_mib_of_writes_but_up_to_a_full_batch_of_reads() {
    let queue = IoQueue::default();
    let mib = (1 << 20) / UNIT as u32 + 1;
    for _ in 0..10 {
        queue.push(write(mib)).unwrap();
    }
    let writes = queue.pop_batch(BATCH, 1).unwrap();
    assert_eq!(
        writes.len(),
        4,
        "four blocks of just over 1 MiB reach 4 MiB"
    );
    assert_eq!(queue.pop_batch(BATCH, 1).unwrap().len(), 4);
    assert_eq!(queue.pop_batch(BATCH, 1).unwrap().len(), 2);
    let permits = Arc::new(tokio::sync::Semaphore::new(BATCH + 1));
    let mut replies = Vec::new();
    for _ in 0..=BATCH {
        let (reply, rx) = oneshot::channel();
        replies.push(rx);
        queue
            .push(Job::Read(ReadJob {
                container: 0,
                start: 0,
                units: mib,
                reply,
                _permit: permits.clone().acquire_owned().await.unwrap(),
            }))
            .unwrap();
    }
    assert_eq!(queue.pop_batch(BATCH, 1).unwrap().len(), BATCH);
    assert_eq!(queue.pop_batch(BATCH, 2).unwrap().len(), 1);
}
