//! Round trips and damage detection of every on-disk format.

use super::*;

fn put(generation: u64) -> PutRecord {
    PutRecord {
        generation,
        hash: 0xabcdef << 64 | 7,
        ns: 3,
        class: Retention::Long,
        expires_at: Some(99),
        container: 1,
        start: 5,
        units: 2,
        value_len: 5000,
    }
}

#[test]
fn blocks_verify_only_under_their_own_key_and_generation() {
    let ns = Namespace::new("m", "fp8");
    let value = vec![9u8; 5000];
    let parts = BlockParts {
        generation: 4,
        hash: 77,
        class: Retention::Short,
        ns: &ns,
        key: b"key",
        metadata: b"\x80",
        value: &value,
    };
    assert_eq!(parts.units(), 2);
    let mut buf = vec![0xffu8; 8192];
    parts.encode_into(&mut buf);
    let want = Expect {
        generation: 4,
        hash: 77,
        value_len: 5000,
        ns: &ns,
        key: b"key",
    };
    let range = verify(&buf, &want).unwrap();
    assert_eq!(&buf[range], &value[..]);
    assert!(buf[parts.stored_len()..].iter().all(|b| *b == 0));
    let other = Namespace::new("m", "");
    for bad in [
        Expect {
            generation: 5,
            ..want
        },
        Expect { hash: 78, ..want },
        Expect {
            value_len: 4999,
            ..want
        },
        Expect {
            key: b"kez",
            ..want
        },
        Expect { ns: &other, ..want },
    ] {
        assert!(verify(&buf, &bad).is_err(), "{bad:?}");
    }
    let mut torn = buf.clone();
    torn[3000] ^= 1;
    assert_eq!(verify(&torn, &want), Err("checksum mismatch"));
    assert!(verify(&buf[..4096], &want).is_err());
}

#[test]
fn records_round_trip_and_torn_ones_are_refused() {
    let records = [
        Record::Put(put(1)),
        Record::Evict {
            generation: 1,
            hash: 5,
        },
        Record::Namespace {
            id: 2,
            ns: Namespace::new("llama", "int4"),
        },
    ];
    let mut b = Vec::new();
    records.iter().for_each(|r| r.encode(&mut b));
    let mut at = 0;
    for r in &records {
        let (got, used) = Record::decode(&b[at..]).unwrap();
        assert_eq!(&got, r);
        at += used;
    }
    assert_eq!(at, b.len());
    assert!(Record::decode(&b[..PUT_LEN + 13]).is_some());
    assert!(Record::decode(&b[..PUT_LEN + 12]).is_none());
    let mut bad = b.clone();
    bad[10] ^= 0x40;
    assert!(Record::decode(&bad).is_none());
    assert!(Record::decode(&b[..20]).is_none());
}

#[test]
fn checkpoints_and_meta_round_trip_and_detect_damage() {
    let c = Checkpoint {
        replay_from: 3,
        next_generation: 10,
        namespaces: vec![(0, Namespace::default()), (1, Namespace::new("a", "b"))],
        entries: vec![put(1), put(2)],
    };
    let b = c.encode(1);
    assert_eq!(Checkpoint::decode(&b, 1), Some(c));
    assert_eq!(Checkpoint::decode(&b, 0), None);
    let mut bad = b.clone();
    bad[60] ^= 1;
    assert_eq!(Checkpoint::decode(&bad, 1), None);
    assert_eq!(Checkpoint::decode(&b[..b.len() - 3], 1), None);
    let g = Geometry {
        shard: 1,
        shards: 2,
        container_bytes: 1 << 20,
        containers: 3,
    };
    assert_eq!(Geometry::decode(&g.encode()), Some(g));
    assert_eq!(g.container_units(), 256);
    let h = journal_header(1, 42);
    assert_eq!(parse_journal_header(&h, 1), Some(42));
    assert_eq!(parse_journal_header(&h, 2), None);
}

#[test]
fn a_value_summed_slice_by_slice_carries_the_documented_checksum() {
    let ns = Namespace::new("model", "fp8");
    for len in [0usize, 1, HASH_SLICE - 1, HASH_SLICE, 3 * HASH_SLICE + 17] {
        let value: Vec<u8> = (0..len).map(|i| (i * 31 % 251) as u8).collect();
        let parts = BlockParts {
            generation: 9,
            hash: 1 << 100,
            class: Retention::Long,
            ns: &ns,
            key: b"k",
            metadata: b"\x81\xa1a\x01",
            value: &value,
        };
        let mut buf = vec![0xeeu8; parts.units() as usize * UNIT as usize];
        parts.encode_into(&mut buf);
        let total = parts.stored_len();
        let seed = xxh3_64(&buf[..48]);
        assert_eq!(
            u64_at(&buf, 48),
            xxh3_64_with_seed(&buf[BLOCK_HEADER..total], seed),
            "{len}"
        );
        assert!(buf[total..].iter().all(|b| *b == 0), "padding is zeroed");
        let want = Expect {
            generation: 9,
            hash: 1 << 100,
            value_len: len as u32,
            ns: &ns,
            key: b"k",
        };
        let range = verify(&buf, &want).unwrap();
        assert_eq!(&buf[range], &value[..]);
    }
}

#[test]
fn checksums_are_the_reference_xxh3_64_so_old_regions_stay_readable() {
    assert_eq!(xxh3_64(b"infera kvd"), 0xc1d62c43d5e9b019);
    let data: Vec<u8> = (0..300_000usize).map(|i| (i * 31 % 251) as u8).collect();
    assert_eq!(
        xxh3_64_with_seed(&data, 0x1234_5678_9abc_def0),
        0xb0552057e7152d8a
    );
}
