//! The L3 tablespace's flags: the region's layout, the Python kvd's tablespace flags (slot
//! sizes, pools, container size, flush interval, I/O mode) resolved and validated as the Python
//! validates them.

use super::*;

/// The Python tablespace's default slot size (`--tablespace-slot-bytes`).
pub(super) const PYTHON_SLOT_BYTES: u64 = 64 << 10;
/// The O_DIRECT alignment the Python tablespace requires of a slot size.
pub(super) const DIRECT_ALIGN: u64 = 4096;
/// The container size without `--tablespace-container-bytes` (the Python kvd's too).
pub(super) const CONTAINER_BYTES: u64 = 1 << 30;

pub(super) const NO_SLOTS: &str = "this kvd's L3 has no fixed-size slots: each block takes an extent of \
                        its own size (4 KiB units) in one region, so blocks of every size fit";
pub(super) const NO_REGION: &str =
    "no L3 region without --long-path or --long-paths (as in the Python kvd)";

/// The L3 tier of `layout`, with the Python kvd's tablespace flags resolved and validated as
/// the Python validates them when it builds the region; `env_io_mode` is `INFERA_KVD_IO_MODE`.
pub(super) fn long_tier(
    args: &KvdArgs,
    layout: LongLayout,
    bytes: ByteSize,
    env_io_mode: Option<&str>,
    inert: &mut Vec<InertFlag>,
) -> Result<LongTierConfig, ConfigError> {
    // The Python's order: --tablespace-buffered-io, then --tablespace-auto-detect-fs, then
    // INFERA_KVD_IO_MODE, then --io-mode.
    let io_mode = if args.tablespace_buffered_io {
        tracing::info!("L3 io_mode buffered (--tablespace-buffered-io)");
        IoMode::Buffered
    } else if args.tablespace_auto_detect_fs {
        IoMode::FileSystem
    } else {
        io_mode(args.io_mode, env_io_mode)
    };
    let default_sync = JournalSync::Every(HumanDuration(
        infera_kvd::TablespaceConfig::new(Vec::new(), 0).journal_sync,
    ));
    let (journal_sync, durable_writes) = match args.tablespace_flush_interval_ms {
        Some(ms) if ms <= 0 => (default_sync, true),
        Some(ms) => (
            JournalSync::Every(HumanDuration(std::time::Duration::from_millis(ms as u64))),
            args.durable_long_writes,
        ),
        None if args.tablespace_auto_detect_fs => (
            JournalSync::Decided(SyncSource::FileSystem),
            args.durable_long_writes,
        ),
        None => (default_sync, args.durable_long_writes),
    };
    let container_bytes = positive(
        "--tablespace-container-bytes",
        args.tablespace_container_bytes
            .map_or(CONTAINER_BYTES, ByteSize::bytes),
    )?;
    let direct = io_mode == IoMode::Direct;
    let pools = match (pools_spec(args), &layout) {
        (Some(spec), LongLayout::Single { .. }) => Some(tablespace_pools(spec, direct)?),
        _ => None,
    };
    if pools.is_none() {
        let slot = args
            .tablespace_slot_bytes
            .map_or(PYTHON_SLOT_BYTES, ByteSize::bytes);
        let slot = positive("--tablespace-slot-bytes", slot)?;
        if container_bytes < slot {
            return Err(ConfigError::new(
                "--tablespace-container-bytes",
                format!(
                    "{} is smaller than --tablespace-slot-bytes {}, which the Python kvd \
                     refuses",
                    ByteSize(container_bytes),
                    ByteSize(slot)
                ),
            ));
        }
        if direct && !slot.is_multiple_of(DIRECT_ALIGN) {
            return Err(ConfigError::new(
                "--tablespace-slot-bytes",
                format!(
                    "{} is not a multiple of 4096, which the Python kvd refuses under O_DIRECT",
                    ByteSize(slot)
                ),
            ));
        }
    }
    if let Some(slot) = args.tablespace_slot_bytes {
        inert.push(InertFlag::new("--tablespace-slot-bytes", slot, NO_SLOTS));
    }
    if let Some(spec) = pools_spec(args) {
        inert.push(InertFlag::new("--tablespace-pools", spec.trim(), NO_SLOTS));
    }
    Ok(LongTierConfig {
        layout,
        bytes,
        io_mode,
        durable_writes,
        journal_sync,
        container_bytes: ByteSize(container_bytes),
    })
}

/// Lists the tablespace flags given without an L3 region (the Python ignores them too).
pub(super) fn no_region(args: &KvdArgs, inert: &mut Vec<InertFlag>) {
    let mut add = |flag: &str, value: Option<String>| {
        if let Some(value) = value {
            inert.push(InertFlag::new(flag, value, NO_REGION));
        }
    };
    let switch = |on: bool| on.then(String::new);
    add(
        "--tablespace-buffered-io",
        switch(args.tablespace_buffered_io),
    );
    add(
        "--tablespace-auto-detect-fs",
        switch(args.tablespace_auto_detect_fs),
    );
    add(
        "--tablespace-flush-interval-ms",
        args.tablespace_flush_interval_ms.map(|ms| ms.to_string()),
    );
    add(
        "--tablespace-container-bytes",
        args.tablespace_container_bytes.map(|b| b.to_string()),
    );
    add(
        "--tablespace-slot-bytes",
        args.tablespace_slot_bytes.map(|b| b.to_string()),
    );
    add(
        "--tablespace-pools",
        pools_spec(args).map(|p| p.trim().to_owned()),
    );
}

/// `--tablespace-pools`, unless empty: the Python reads `--tablespace-pools ''` as no pools.
pub(super) fn pools_spec(args: &KvdArgs) -> Option<&str> {
    args.tablespace_pools.as_deref().filter(|s| !s.is_empty())
}

/// One pool of `--tablespace-pools`: a slot size and its weight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Pool {
    pub(super) slot_bytes: u64,
    pub(super) weight: u64,
}

/// Checks a `--tablespace-pools` spec as the Python kvd does when it builds the pools:
/// `SIZE[*WEIGHT]` entries (a size is an integer with an optional K/M/G/T, powers of 1024; a
/// weight a positive integer), empty entries skipped, at least one pool, no size twice, and
/// under O_DIRECT every size a multiple of 4096.
pub(super) fn tablespace_pools(spec: &str, direct: bool) -> Result<Vec<Pool>, ConfigError> {
    let invalid = |why: String| ConfigError::new("--tablespace-pools", why);
    let mut pools: Vec<Pool> = Vec::new();
    for entry in spec.split(',').map(str::trim).filter(|e| !e.is_empty()) {
        let (size, weight) = match entry.split_once('*') {
            Some((size, weight)) => (size.trim(), Some(weight.trim())),
            None => (entry, None),
        };
        let slot_bytes = pool_size(size).ok_or_else(|| {
            invalid(format!(
                "has '{size}' in '{entry}', not a slot size: an integer with an optional \
                 K, M, G or T, e.g. 64K,1M"
            ))
        })?;
        let weight = match weight {
            None => 1,
            Some(w) => w.parse().ok().filter(|w| *w > 0).ok_or_else(|| {
                invalid(format!(
                    "has the weight '{w}' in '{entry}'; a weight is a positive integer, \
                     e.g. 64K*1,1M*4"
                ))
            })?,
        };
        if pools.iter().any(|p| p.slot_bytes == slot_bytes) {
            return Err(invalid(format!(
                "lists the slot size {} twice",
                ByteSize(slot_bytes)
            )));
        }
        if direct && !slot_bytes.is_multiple_of(DIRECT_ALIGN) {
            return Err(invalid(format!(
                "has the slot size {} under O_DIRECT, which the Python kvd refuses: it must \
                 be a multiple of 4096",
                ByteSize(slot_bytes)
            )));
        }
        pools.push(Pool { slot_bytes, weight });
    }
    if pools.is_empty() {
        return Err(invalid(format!(
            "'{spec}' names no pool; pass slot sizes such as 64K,1M"
        )));
    }
    Ok(pools)
}

/// A positive pool slot size as the Python reads it: `4096`, `64K`, `1M` (any case).
pub(super) fn pool_size(text: &str) -> Option<u64> {
    let upper = text.to_ascii_uppercase();
    let (digits, unit) = match upper.char_indices().last()? {
        (i, 'K') => (&upper[..i], 1u64 << 10),
        (i, 'M') => (&upper[..i], 1 << 20),
        (i, 'G') => (&upper[..i], 1 << 30),
        (i, 'T') => (&upper[..i], 1 << 40),
        _ => (upper.as_str(), 1),
    };
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits
        .parse::<u64>()
        .ok()?
        .checked_mul(unit)
        .filter(|n| *n > 0)
}

/// The variable that overrides `--io-mode` (the Python kvd's operator escape hatch).
pub const IO_MODE_ENV: &str = "INFERA_KVD_IO_MODE";

/// The L3 I/O mode: [`IO_MODE_ENV`] when it is `direct` or `buffered` (any case, trimmed),
/// else the flag. The environment wins, as the Python kvd reads it.
pub(super) fn io_mode(flag: IoMode, env: Option<&str>) -> IoMode {
    match env.map(|v| v.trim().to_ascii_lowercase()).as_deref() {
        Some("direct") => {
            tracing::info!("L3 io_mode direct ({IO_MODE_ENV})");
            IoMode::Direct
        }
        Some("buffered") => {
            tracing::info!("L3 io_mode buffered ({IO_MODE_ENV})");
            IoMode::Buffered
        }
        _ => flag,
    }
}

/// Splits the comma-separated shard list: no empty entry, no directory twice.
pub(super) fn striped_paths(list: &str) -> Result<Vec<PathBuf>, ConfigError> {
    let mut paths: Vec<PathBuf> = Vec::new();
    for entry in list.split(',').map(str::trim) {
        if entry.is_empty() {
            return Err(ConfigError::new(
                "--long-paths",
                format!(
                    "has an empty entry in '{list}'; pass comma-separated directories, \
                     e.g. /mnt/nvme0/kvd,/mnt/nvme1/kvd"
                ),
            ));
        }
        let path = PathBuf::from(entry);
        if paths.contains(&path) {
            return Err(ConfigError::new(
                "--long-paths",
                format!("lists {entry} twice; each shard needs its own directory"),
            ));
        }
        paths.push(path);
    }
    Ok(paths)
}
