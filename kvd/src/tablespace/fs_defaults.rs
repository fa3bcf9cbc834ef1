//! The Python kvd's per-file-system defaults (its `--tablespace-auto-detect-fs`): the file
//! system type of a region directory, read from `/proc/self/mountinfo` as `findmnt -T` reports
//! it, picks O_DIRECT or buffered I/O and the group-commit window.
//!
//! | file system            | I/O      | flush interval          |
//! |------------------------|----------|-------------------------|
//! | ext4, xfs, btrfs       | O_DIRECT | 0 (durable per write)   |
//! | nfs, nfs4              | O_DIRECT | 20 ms                   |
//! | wekafs                 | buffered | 20 ms                   |
//! | tmpfs, overlay         | buffered | 0                       |
//! | anything else, unknown | buffered | 0                       |

use std::path::{Path, PathBuf};
use std::time::Duration;

/// What the table gives one file system.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FsDefaults {
    /// O_DIRECT (else buffered I/O).
    pub direct: bool,
    /// The group-commit window: zero means every `long` write is acknowledged only once
    /// durable, as `--durable-long-writes`.
    pub flush_interval: Duration,
}

/// The table of the module docs, by file system type (`unknown` and anything not listed fall
/// back to buffered I/O and per-write durability, as in the Python kvd).
pub fn fs_defaults(fs_type: &str) -> FsDefaults {
    let (direct, ms) = match fs_type {
        "ext4" | "xfs" | "btrfs" => (true, 0),
        "nfs" | "nfs4" => (true, 20),
        "wekafs" => (false, 20),
        _ => (false, 0),
    };
    FsDefaults {
        direct,
        flush_interval: Duration::from_millis(ms),
    }
}

/// The type of the file system holding `dir` (which need not exist yet: its nearest existing
/// ancestor is looked up), or `unknown`.
pub fn fs_type(dir: &Path) -> String {
    let mut path: PathBuf = std::path::absolute(dir).unwrap_or_else(|_| dir.to_path_buf());
    let existing = loop {
        if let Ok(real) = std::fs::canonicalize(&path) {
            break real;
        }
        if !path.pop() {
            break PathBuf::from("/");
        }
    };
    std::fs::read_to_string("/proc/self/mountinfo")
        .ok()
        .and_then(|info| mount_fs_type(&info, &existing))
        .unwrap_or_else(|| "unknown".to_owned())
}

/// The type of the innermost mount holding `path` (canonical) in a `mountinfo` text; of two
/// mounts on the same point, the later (the one on top).
fn mount_fs_type(mountinfo: &str, path: &Path) -> Option<String> {
    let mut best: Option<(usize, String)> = None;
    for line in mountinfo.lines() {
        let Some((mount, tail)) = line.split_once(" - ") else {
            continue;
        };
        let (Some(point), Some(fs)) = (
            mount.split(' ').nth(4),
            tail.split(' ').next().filter(|f| !f.is_empty()),
        ) else {
            continue;
        };
        let point = unescape(point);
        let depth = Path::new(&point).components().count();
        if path.starts_with(&point) && best.as_ref().is_none_or(|(d, _)| depth >= *d) {
            best = Some((depth, fs.to_owned()));
        }
    }
    best.map(|(_, fs)| fs)
}

/// Decodes mountinfo's octal escapes (`\040` for a space, `\134` for a backslash, ...).
fn unescape(field: &str) -> String {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let octal = bytes.get(i + 1..i + 4).and_then(|d| {
            d.iter()
                .all(|b| (b'0'..=b'7').contains(b))
                .then(|| d.iter().fold(0u32, |n, b| n * 8 + u32::from(b - b'0')))
        });
        match (bytes[i], octal) {
            (b'\\', Some(n)) if n <= 0xff => {
                out.push(n as u8);
                i += 4;
            }
            (b, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    const MOUNTINFO: &str = "\
22 1 259:2 / / rw,relatime shared:1 - ext4 /dev/nvme0n1p2 rw
30 22 0:26 / /tmp rw,nosuid shared:5 - tmpfs tmpfs rw
41 22 0:50 / /mnt/nfs rw,relatime shared:20 - nfs4 srv:/export rw,vers=4.2
42 22 259:5 / /mnt/nvme\\040data rw shared:21 - xfs /dev/nvme1n1 rw
43 22 0:60 / /mnt/weka rw shared:22 - wekafs default rw
44 41 0:61 / /mnt/nfs rw shared:23 - overlay overlay rw
";

    #[test]
    fn the_innermost_and_topmost_mount_wins() {
        let fs = |p: &str| mount_fs_type(MOUNTINFO, Path::new(p));
        assert_eq!(fs("/var/lib/kvd").as_deref(), Some("ext4"));
        assert_eq!(fs("/tmp/l3").as_deref(), Some("tmpfs"));
        assert_eq!(
            fs("/tmpfoo").as_deref(),
            Some("ext4"),
            "whole components only"
        );
        assert_eq!(fs("/mnt/nvme data/kvd").as_deref(), Some("xfs"));
        assert_eq!(fs("/mnt/weka").as_deref(), Some("wekafs"));
        assert_eq!(
            fs("/mnt/nfs/l3").as_deref(),
            Some("overlay"),
            "mounted on top"
        );
        assert_eq!(mount_fs_type("garbage\n", Path::new("/")), None);
    }

    #[test]
    fn the_table_is_the_python_kvds() {
        let ms = Duration::from_millis;
        let cases = [
            ("ext4", true, 0),
            ("xfs", true, 0),
            ("btrfs", true, 0),
            ("nfs", true, 20),
            ("nfs4", true, 20),
            ("wekafs", false, 20),
            ("tmpfs", false, 0),
            ("overlay", false, 0),
            ("zfs", false, 0),
            ("unknown", false, 0),
        ];
        for (fs, direct, flush) in cases {
            let want = FsDefaults {
                direct,
                flush_interval: ms(flush),
            };
            assert_eq!(fs_defaults(fs), want, "{fs}");
        }
    }

    #[test]
    fn this_machine_has_a_type_for_a_directory_not_yet_made() {
        let dir = tempfile::tempdir().unwrap();
        let fs = fs_type(&dir.path().join("not/yet"));
        assert!(!fs.is_empty());
        assert_eq!(fs, fs_type(dir.path()));
    }

    #[test]
    fn the_flush_interval_maps_to_durability_or_the_journal_sync() {
        use crate::tablespace::TablespaceConfig;
        let ms = Duration::from_millis;
        let base = TablespaceConfig::new(vec!["/l3".into()], 1 << 30);
        let mut zero = base.clone();
        zero.set_flush_interval(Duration::ZERO);
        assert!(zero.durable_writes);
        assert_eq!(
            (zero.journal_sync, zero.journal_flush),
            (base.journal_sync, base.journal_flush)
        );
        let mut nfs = base.clone();
        nfs.set_flush_interval(ms(20));
        assert!(!nfs.durable_writes);
        assert_eq!((nfs.journal_sync, nfs.journal_flush), (ms(20), ms(5)));
        let mut tight = base;
        tight.set_flush_interval(ms(1));
        assert_eq!((tight.journal_sync, tight.journal_flush), (ms(1), ms(1)));
    }

    #[test]
    fn a_region_takes_io_and_group_commit_from_its_file_system() {
        use crate::long::LongStore;
        use crate::tablespace::{IoMode, Tablespace, TablespaceConfig, decide};
        let dir = tempfile::tempdir().unwrap();
        let l3 = dir.path().join("l3");
        let want = fs_defaults(&fs_type(&l3));
        let decision = decide(IoMode::FileSystem, dir.path());
        assert_eq!(decision.direct, want.direct);
        assert!(
            decision.reason.contains("--tablespace-auto-detect-fs"),
            "{decision:?}"
        );

        let mut config = TablespaceConfig::new(vec![l3], 4 << 20);
        config.io_mode = IoMode::FileSystem;
        config.container_bytes = 1 << 20;
        config.workers_per_shard = 1;
        config.sync_by_file_system = true;
        let resolved = super::super::sync_by_file_system(&config);
        assert!(!resolved.sync_by_file_system);
        assert_eq!(resolved.durable_writes, want.flush_interval.is_zero());
        if !want.flush_interval.is_zero() {
            assert_eq!(resolved.journal_sync, want.flush_interval);
        }
        let ts = Tablespace::open(&config).unwrap();
        assert_eq!(ts.durable_writes(), want.flush_interval.is_zero());
    }

    #[test]
    fn escapes_decode() {
        assert_eq!(unescape(r"/a\040b\134c\011"), "/a b\\c\t");
        assert_eq!(unescape(r"/a\9b\04"), r"/a\9b\04");
    }
}
