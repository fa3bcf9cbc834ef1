use super::tablespace::{Pool, io_mode, tablespace_pools};
use super::*;
use crate::cli::{Cli, Command};
use clap::Parser;

fn parse(extra: &[&str]) -> Result<KvdConfig, ConfigError> {
    let mut argv = vec!["infera", "kvd"];
    argv.extend_from_slice(extra);
    match Cli::try_parse_from(argv).unwrap().command {
        Command::Kvd(args) => KvdConfig::try_from(args),
        other => panic!("parsed as {other:?}"),
    }
}

#[test]
fn defaults_resolve_the_arena_to_the_ram_budget() {
    let config = parse(&[]).unwrap();
    assert_eq!(config.socket, PathBuf::from("/var/run/infera-kvd.sock"));
    assert_eq!(config.max_bytes, ByteSize(8 << 30));
    assert_eq!(config.shared_arena_bytes, config.max_bytes);
    assert_eq!(config.long_tier, None);
    let config = parse(&["--max-bytes", "1G", "--shared-arena-bytes", "0"]).unwrap();
    assert_eq!(config.shared_arena_bytes, ByteSize(0));
    let config = parse(&["--max-bytes", "1G", "--shared-arena-bytes", "512MiB"]).unwrap();
    assert_eq!(config.shared_arena_bytes, ByteSize(512 << 20));
}

#[test]
fn long_path_makes_a_single_region() {
    let config = parse(&["--long-path", "/mnt/a", "--io-mode", "buffered"]).unwrap();
    assert_eq!(
        config.long_tier,
        Some(LongTierConfig {
            layout: LongLayout::Single {
                path: "/mnt/a".into()
            },
            bytes: ByteSize(32 << 30),
            io_mode: IoMode::Buffered,
            durable_writes: false,
            journal_sync: JournalSync::Every(HumanDuration(std::time::Duration::from_millis(200))),
            container_bytes: ByteSize(1 << 30),
        })
    );
}

#[test]
fn long_paths_make_a_striped_region_in_order() {
    let config = parse(&["--long-paths", "/b,/a", "--long-workers-per-shard", "2"]).unwrap();
    let tier = config.long_tier.unwrap();
    assert_eq!(
        tier.layout,
        LongLayout::Striped {
            paths: vec!["/b".into(), "/a".into()],
            workers_per_shard: 2
        }
    );
    assert_eq!(
        parse(&["--long-paths", "/a,/a"]).unwrap_err().flag,
        "--long-paths"
    );
    assert_eq!(
        parse(&["--long-paths", "/a,,/b"]).unwrap_err().flag,
        "--long-paths"
    );
    assert_eq!(
        parse(&["--long-paths", ""]).unwrap_err().flag,
        "--long-paths"
    );
}

#[test]
fn invalid_combinations_name_the_flag() {
    let cases: [(&[&str], &str); 12] = [
        (&["--max-bytes", "0"], "--max-bytes"),
        (&["--max-connections", "0"], "--max-connections"),
        (&["--max-batch-keys", "0"], "--max-batch-keys"),
        (&["--frame-timeout", "0"], "--frame-timeout"),
        (&["--long-bytes", "0"], "--long-bytes"),
        (
            &["--long-workers-per-shard", "0"],
            "--long-workers-per-shard",
        ),
        (
            &["--long-path", "/a", "--long-paths", "/b,/c"],
            "--long-path",
        ),
        (&["--long-backend", "mooncake"], "--mooncake-config"),
        (
            &["--long-backend", "lmcache", "--long-path", "/a"],
            "--long-backend",
        ),
        (
            &["--long-backend", "mooncake", "--long-path", "/a"],
            "--long-backend",
        ),
        (&["--l4-backend", "lmcache"], "--l4-backend"),
        (&["--l4-backend", "mooncake"], "--l4-backend"),
    ];
    for (argv, flag) in cases {
        assert_eq!(parse(argv).unwrap_err().flag, flag, "{argv:?}");
    }
}

#[test]
fn connection_limits_default_and_reach_the_daemon() {
    let config = parse(&[]).unwrap();
    assert_eq!(
        config.limits,
        ConnectionLimits {
            max_connections: 1024,
            idle_timeout: Some(HumanDuration(std::time::Duration::from_secs(600))),
            frame_timeout: HumanDuration(std::time::Duration::from_secs(30)),
            max_batch_keys: 131_072,
        }
    );
    let options = infera_kvd::KvdOptions::from(
        parse(&[
            "--max-connections",
            "8",
            "--idle-timeout",
            "0",
            "--frame-timeout",
            "2s",
            "--max-batch-keys",
            "100",
            "--long-path",
            "/a",
            "--durable-long-writes",
        ])
        .unwrap(),
    );
    assert_eq!(options.max_connections, 8);
    assert_eq!(options.idle_timeout, None);
    assert_eq!(options.frame_timeout, std::time::Duration::from_secs(2));
    assert_eq!(options.max_batch_keys, 100);
    let Some(infera_kvd::LongBackendConfig::Tablespace(ts)) = options.long else {
        panic!("{:?}", options.long);
    };
    assert!(ts.durable_writes);
}

fn tier(argv: &[&str]) -> LongTierConfig {
    let mut argv = argv.to_vec();
    argv.extend(["--long-path", "/l3"]);
    parse(&argv).unwrap().long_tier.unwrap()
}

fn ts(argv: &[&str]) -> infera_kvd::TablespaceConfig {
    let mut argv = argv.to_vec();
    argv.extend(["--long-path", "/l3"]);
    match infera_kvd::KvdOptions::from(parse(&argv).unwrap()).long {
        Some(infera_kvd::LongBackendConfig::Tablespace(ts)) => ts,
        other => panic!("{other:?}"),
    }
}

fn inert(argv: &[&str]) -> Vec<(String, String)> {
    parse(argv)
        .unwrap()
        .inert_flags
        .into_iter()
        .map(|f| (f.flag, f.value))
        .collect()
}

fn owned(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    pairs
        .iter()
        .map(|(f, v)| ((*f).to_owned(), (*v).to_owned()))
        .collect()
}

#[test]
fn every_python_kvd_flag_is_accepted() {
    let config = parse(&[
        "--long-path",
        "/l3",
        "--mooncake-config",
        "/etc/mooncake.yaml",
        "--tablespace-slot-bytes",
        "64K",
        "--tablespace-container-bytes",
        "2G",
        "--tablespace-flush-interval-ms",
        "20",
        "--tablespace-buffered-io",
        "--tablespace-auto-detect-fs",
        "--shared-arena-pin",
        "--no-shared-arena-pin",
        "--shared-arena-hugetlb",
        "--log-level",
        "DEBUG",
    ]);
    let config = config.unwrap();
    assert_eq!(config.log_level, LogLevel::Debug);
    assert!(config.shared_arena_hugetlb);
    let tier = config.long_tier.unwrap();
    assert_eq!(tier.io_mode, IoMode::Buffered);
    assert_eq!(tier.container_bytes, ByteSize(2 << 30));
    // The Python's --tablespace-pools is only read with one --long-path (the recipe's).
    let recipe = parse(&[
        "--long-path",
        "/kvd-l3",
        "--io-mode",
        "direct",
        "--use-tablespace",
        "--tablespace-pools",
        "1M,4M",
    ])
    .unwrap();
    assert_eq!(recipe.long_tier.unwrap().io_mode, IoMode::Direct);
    assert_eq!(
        recipe
            .inert_flags
            .iter()
            .map(|f| (f.flag.as_str(), f.value.as_str()))
            .collect::<Vec<_>>(),
        [("--tablespace-pools", "1M,4M")]
    );
    assert!(
        recipe.inert_flags[0]
            .reason
            .contains("extent of its own size")
    );
}

#[test]
fn log_level_takes_the_python_names_and_sets_the_filter() {
    assert_eq!(parse(&[]).unwrap().log_level, LogLevel::Info);
    for (name, level, directive) in [
        ("DEBUG", LogLevel::Debug, "debug"),
        ("INFO", LogLevel::Info, "info"),
        ("WARNING", LogLevel::Warning, "warn"),
        ("error", LogLevel::Error, "error"),
    ] {
        let config = parse(&["--log-level", name]).unwrap();
        assert_eq!((config.log_level, level.directive()), (level, directive));
    }
    let argv = ["infera", "kvd", "--log-level", "TRACE"];
    assert!(Cli::try_parse_from(argv).is_err(), "not a Python level");
    let json = serde_json::to_value(parse(&["--log-level", "warning"]).unwrap()).unwrap();
    assert_eq!(json["log_level"], "WARNING");
}

#[test]
fn flush_interval_is_the_journal_sync_or_durable_writes() {
    let ms = |n| JournalSync::Every(HumanDuration(std::time::Duration::from_millis(n)));
    let nfs = tier(&["--tablespace-flush-interval-ms", "20"]);
    assert_eq!((nfs.journal_sync, nfs.durable_writes), (ms(20), false));
    let options = ts(&["--tablespace-flush-interval-ms", "20"]);
    assert_eq!(options.journal_sync, std::time::Duration::from_millis(20));
    assert!(!options.durable_writes && !options.sync_by_file_system);
    for inline in ["0", "-5"] {
        let tier = tier(&["--tablespace-flush-interval-ms", inline]);
        assert_eq!((tier.journal_sync, tier.durable_writes), (ms(200), true));
        assert!(ts(&["--tablespace-flush-interval-ms", inline]).durable_writes);
    }
    let default = ts(&[]);
    assert_eq!(
        (
            default.journal_sync,
            default.journal_flush,
            default.durable_writes
        ),
        (
            std::time::Duration::from_millis(200),
            std::time::Duration::from_millis(5),
            false
        )
    );
    let argv = ["infera", "kvd", "--tablespace-flush-interval-ms", "2.5"];
    assert!(
        Cli::try_parse_from(argv).is_err(),
        "an integer, as in the Python"
    );
}

#[test]
fn io_mode_follows_the_pythons_precedence() {
    let mode = |argv: &[&str], env: Option<&str>| {
        let mut argv = argv.to_vec();
        argv.extend(["--long-path", "/l3"]);
        let mut full = vec!["infera", "kvd"];
        full.extend_from_slice(&argv);
        let Command::Kvd(args) = Cli::try_parse_from(full).unwrap().command else {
            panic!("not kvd");
        };
        let layout = LongLayout::Single { path: "/l3".into() };
        long_tier(&args, layout, ByteSize(1 << 30), env, &mut Vec::new())
            .unwrap()
            .io_mode
    };
    let buffered = ["--tablespace-buffered-io", "--io-mode", "direct"];
    assert_eq!(mode(&buffered, Some("direct")), IoMode::Buffered);
    let both = ["--tablespace-buffered-io", "--tablespace-auto-detect-fs"];
    assert_eq!(mode(&both, None), IoMode::Buffered);
    let fs = ["--tablespace-auto-detect-fs", "--io-mode", "direct"];
    assert_eq!(mode(&fs, Some("direct")), IoMode::FileSystem);
    assert_eq!(
        mode(&["--io-mode", "buffered"], Some("direct")),
        IoMode::Direct
    );
    assert_eq!(mode(&[], None), IoMode::Auto);

    let auto = tier(&["--tablespace-auto-detect-fs"]);
    assert_eq!(
        auto.journal_sync,
        JournalSync::Decided(SyncSource::FileSystem)
    );
    let options = ts(&["--tablespace-auto-detect-fs"]);
    assert_eq!(options.io_mode, infera_kvd::IoMode::FileSystem);
    assert!(options.sync_by_file_system && !options.durable_writes);
    let explicit = ts(&[
        "--tablespace-auto-detect-fs",
        "--tablespace-flush-interval-ms",
        "7",
    ]);
    assert!(!explicit.sync_by_file_system, "an explicit window wins");
    assert_eq!(explicit.journal_sync, std::time::Duration::from_millis(7));
    let json = serde_json::to_value(tier(&["--tablespace-auto-detect-fs"])).unwrap();
    assert_eq!(json["journal_sync"], "file_system");
    let mut argv = vec!["infera", "kvd", "--io-mode", "file-system"];
    assert!(
        Cli::try_parse_from(&argv).is_err(),
        "not an --io-mode value"
    );
    argv[3] = "file_system";
    assert!(
        Cli::try_parse_from(&argv).is_err(),
        "not an --io-mode value"
    );
}

#[test]
fn container_bytes_size_the_containers() {
    assert_eq!(tier(&[]).container_bytes, ByteSize(1 << 30));
    let options = ts(&["--tablespace-container-bytes", "256M"]);
    assert_eq!(options.container_bytes, 256 << 20);
    let cases: [(&[&str], &str); 4] = [
        (
            &["--tablespace-container-bytes", "0"],
            "--tablespace-container-bytes",
        ),
        (
            &["--tablespace-container-bytes", "32K"],
            "--tablespace-container-bytes",
        ),
        (
            &[
                "--tablespace-container-bytes",
                "32K",
                "--tablespace-slot-bytes",
                "16K",
            ],
            "",
        ),
        (&["--tablespace-slot-bytes", "0"], "--tablespace-slot-bytes"),
    ];
    for (argv, flag) in cases {
        let mut argv = argv.to_vec();
        argv.extend(["--long-path", "/l3"]);
        match parse(&argv) {
            Ok(_) => assert_eq!(flag, "", "{argv:?}"),
            Err(error) => assert_eq!(error.flag, flag, "{argv:?}"),
        }
    }
}

#[test]
fn slot_sizes_are_validated_as_the_python_does_and_listed_as_inert() {
    let direct = ["--long-path", "/l3", "--io-mode", "direct"];
    let with = |extra: &[&str]| {
        let mut argv = direct.to_vec();
        argv.extend_from_slice(extra);
        parse(&argv)
    };
    assert_eq!(
        with(&["--tablespace-slot-bytes", "6000"]).unwrap_err().flag,
        "--tablespace-slot-bytes"
    );
    assert!(with(&["--tablespace-slot-bytes", "8K"]).is_ok());
    assert_eq!(
        inert(&["--long-path", "/l3", "--tablespace-slot-bytes", "6000"]),
        owned(&[("--tablespace-slot-bytes", "6000B")]),
        "buffered I/O takes any size"
    );
    assert_eq!(inert(&["--long-path", "/l3", "--tablespace-pools", ""]), []);
    let refused = [
        " ", " , ", "64K,64k", "1MiB", "1.5M", "0", "64K*0", "64K*-1", "64K*x", "K", "6000",
    ];
    for spec in refused {
        let error = with(&["--tablespace-pools", spec]).unwrap_err();
        assert_eq!(error.flag, "--tablespace-pools", "{spec:?}");
    }
    let accepted = ["64K,1M", "64K*1, 1M*4 ,4M*1", "4096,,1m", "1M,4M"];
    for spec in accepted {
        assert!(with(&["--tablespace-pools", spec]).is_ok(), "{spec}");
    }
    assert_eq!(
        tablespace_pools("64K*1,1M*4", false).unwrap(),
        [
            Pool {
                slot_bytes: 64 << 10,
                weight: 1
            },
            Pool {
                slot_bytes: 1 << 20,
                weight: 4
            }
        ]
    );
    // Pools stand in for the slot size: the slot size is not then checked.
    assert!(
        with(&[
            "--tablespace-pools",
            "64K",
            "--tablespace-slot-bytes",
            "6000"
        ])
        .is_ok()
    );
    // The Python reads no pools for a striped region; it checks the slot size instead.
    let striped = [
        "--long-paths",
        "/a,/b",
        "--io-mode",
        "direct",
        "--tablespace-pools",
        "6000",
    ];
    assert!(parse(&striped).is_ok());
}

#[test]
fn flags_without_a_region_or_a_backend_are_inert_and_named() {
    assert_eq!(inert(&[]), []);
    assert_eq!(
        inert(&[
            "--tablespace-buffered-io",
            "--tablespace-auto-detect-fs",
            "--tablespace-flush-interval-ms",
            "20",
            "--tablespace-container-bytes",
            "0",
            "--tablespace-slot-bytes",
            "64K",
            "--tablespace-pools",
            " junk ",
        ]),
        owned(&[
            ("--tablespace-buffered-io", ""),
            ("--tablespace-auto-detect-fs", ""),
            ("--tablespace-flush-interval-ms", "20"),
            ("--tablespace-container-bytes", "0B"),
            ("--tablespace-slot-bytes", "64KiB"),
            ("--tablespace-pools", "junk"),
        ]),
        "the Python reads none of them without an L3 region"
    );
    assert_eq!(
        inert(&["--mooncake-config", "/m.yaml", "--shared-arena-pin"]),
        owned(&[("--mooncake-config", "/m.yaml"), ("--shared-arena-pin", ""),])
    );
    assert_eq!(inert(&["--no-shared-arena-pin"]), []);
    assert_eq!(
        inert(&["--shared-arena-pin", "--no-shared-arena-pin"]),
        [],
        "the last of the pair wins, as in argparse"
    );
    let error = parse(&["--long-backend", "mooncake", "--mooncake-config", "/m.yaml"]);
    let error = error.unwrap_err();
    assert_eq!(error.flag, "--mooncake-config");
    assert!(error.reason.contains("cannot read /m.yaml"), "{error:?}");
    let json = serde_json::to_value(parse(&["--shared-arena-pin"]).unwrap()).unwrap();
    assert!(
        json["inert_flags"][0]["reason"]
            .as_str()
            .unwrap()
            .contains("does not mlock")
    );
    let plain = serde_json::to_value(parse(&[]).unwrap()).unwrap();
    assert!(plain.get("inert_flags").is_none(), "omitted when none");
}

#[test]
fn a_mooncake_store_replaces_l3_or_stacks_behind_it() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("mooncake.yaml");
    std::fs::write(
        &path,
        "master_address: 127.0.0.1:50051\ncluster_id: team\nlocal_hostname: 127.0.0.1:14001\n",
    )
    .unwrap();
    let file = path.to_str().unwrap();
    let alone = parse(&["--long-backend", "mooncake", "--mooncake-config", file]).unwrap();
    let tier = alone.l4_tier.clone().unwrap();
    assert_eq!(
        (
            tier.store.as_str(),
            tier.placement.as_str(),
            tier.prefix.as_str()
        ),
        ("mooncake", "instead_of_l3", "team")
    );
    assert_eq!(tier.remote_url, "mooncake://127.0.0.1:50051");
    assert!(alone.inert_flags.is_empty(), "{:?}", alone.inert_flags);
    let options = infera_kvd::KvdOptions::from(alone);
    assert!(matches!(
        options.long,
        Some(infera_kvd::LongBackendConfig::L4(_))
    ));

    let stacked = parse(&[
        "--long-path",
        "/l3",
        "--l4-backend",
        "mooncake",
        "--mooncake-config",
        file,
    ]);
    let tier = stacked.unwrap().l4_tier.unwrap();
    assert_eq!(
        (tier.store.as_str(), tier.placement.as_str()),
        ("mooncake", "behind_l3")
    );
}

#[test]
fn hugetlb_comes_from_the_flag_or_the_pythons_variable() {
    let config = parse(&["--shared-arena-hugetlb"]).unwrap();
    assert!(config.shared_arena_hugetlb);
    let options = infera_kvd::KvdOptions::from(config);
    assert!(options.arena_backing.hugetlb);
    for yes in ["1", "TRUE", " yes ", "On"] {
        assert!(truthy(Some(yes)), "{yes}");
    }
    for no in ["0", "false", "2", "", "y"] {
        assert!(!truthy(Some(no)), "{no}");
    }
    assert!(!truthy(None));
}

#[test]
fn use_tablespace_is_a_no_op() {
    assert_eq!(parse(&["--use-tablespace"]).unwrap(), parse(&[]).unwrap());
}

#[test]
fn arena_size_parses_auto_and_sizes() {
    assert_eq!("AUTO".parse(), Ok(ArenaSize::Auto));
    assert_eq!("1K".parse(), Ok(ArenaSize::Bytes(ByteSize(1024))));
    assert!(
        "many"
            .parse::<ArenaSize>()
            .unwrap_err()
            .ends_with("or auto")
    );
    assert_eq!(ArenaSize::Auto.to_string(), "auto");
}

#[test]
fn options_carry_the_arena_and_the_l3_region() {
    let options = infera_kvd::KvdOptions::from(
        parse(&[
            "--max-bytes",
            "1G",
            "--long-paths",
            "/a,/b",
            "--io-mode",
            "direct",
        ])
        .unwrap(),
    );
    assert_eq!(options.max_bytes, 1 << 30);
    assert_eq!(options.shared_arena_bytes, 1 << 30);
    let Some(infera_kvd::LongBackendConfig::Tablespace(ts)) = options.long else {
        panic!("{:?}", options.long);
    };
    assert_eq!(ts.paths, [PathBuf::from("/a"), PathBuf::from("/b")]);
    assert_eq!(
        (ts.bytes, ts.io_mode),
        (32 << 30, infera_kvd::IoMode::Direct)
    );
    assert_eq!(ts.workers_per_shard, 8);
    let ram_only = infera_kvd::KvdOptions::from(parse(&["--shared-arena-bytes", "0"]).unwrap());
    assert_eq!((ram_only.shared_arena_bytes, ram_only.long), (0, None));
    assert!(!ram_only.long_tier_requested);
}

#[test]
fn the_config_round_trips_through_json() {
    let cases: [&[&str]; 3] = [
        &["--long-paths", "/a,/b"],
        &[
            "--long-path",
            "/a",
            "--tablespace-auto-detect-fs",
            "--shared-arena-pin",
        ],
        &["--long-path", "/a", "--tablespace-flush-interval-ms", "20"],
    ];
    for argv in cases {
        let config = parse(argv).unwrap();
        let json = serde_json::to_string(&config).unwrap();
        assert_eq!(serde_json::from_str::<KvdConfig>(&json).unwrap(), config);
    }
}

#[test]
fn the_io_mode_variable_overrides_the_flag_as_in_the_python_kvd() {
    assert_eq!(io_mode(IoMode::Auto, Some(" Direct ")), IoMode::Direct);
    assert_eq!(io_mode(IoMode::Direct, Some("buffered")), IoMode::Buffered);
    assert_eq!(io_mode(IoMode::Direct, Some("auto")), IoMode::Direct);
    assert_eq!(io_mode(IoMode::Buffered, Some("")), IoMode::Buffered);
    assert_eq!(io_mode(IoMode::Auto, None), IoMode::Auto);
}
