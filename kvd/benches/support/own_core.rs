//! A CPU of their own for a bench's timed thread: every thread of the bench process and of the
//! processes it started (a store server, a sidecar) is kept off one CPU, which the timed thread
//! then takes. Threads and processes started later inherit their creator's CPUs, so they stay
//! off it too. This is a host with cores to spare, where the daemon's L4 writer and the store
//! never take the core a SET runs on, on a small machine.

use rustix::process::Pid;
use rustix::thread::{CpuSet, sched_getaffinity, sched_setaffinity};

/// The reservation; dropping it gives every thread of the family its CPUs back.
pub struct OwnCore {
    /// The reserved CPU.
    pub cpu: usize,
    all: CpuSet,
}

impl OwnCore {
    /// Reserves the last CPU this process may run on; `None` with a single CPU (or without
    /// `/proc`).
    pub fn reserve() -> Option<Self> {
        let Split { all, last, others } = Split::of_this_process()?;
        pin_family(&others).then_some(Self { cpu: last, all })
    }

    /// Pins the calling thread to the reserved CPU.
    pub fn enter(&self) {
        let mut one = CpuSet::new();
        one.set(self.cpu);
        sched_setaffinity(None, &one).expect("pinning the timed thread");
    }
}

impl Drop for OwnCore {
    fn drop(&mut self) {
        pin_family(&self.all);
    }
}

/// This process's CPUs split into its last one and the others.
pub struct Split {
    pub all: CpuSet,
    pub last: usize,
    pub others: CpuSet,
}

impl Split {
    /// `None` with a single CPU (or when the process's CPUs cannot be read).
    pub fn of_this_process() -> Option<Self> {
        let all = sched_getaffinity(None).ok()?;
        let cpus: Vec<usize> = (0..CpuSet::MAX_CPU).filter(|&c| all.is_set(c)).collect();
        let (&last, rest) = cpus.split_last()?;
        if rest.is_empty() {
            return None;
        }
        let mut others = CpuSet::new();
        for &c in rest {
            others.set(c);
        }
        Some(Self { all, last, others })
    }
}

/// Sets `cpus` on every thread of this process and of its descendants; whether `/proc` listed
/// them.
pub fn pin_family(cpus: &CpuSet) -> bool {
    let Ok(family) = descendants(std::process::id()) else {
        return false;
    };
    pin(&family, cpus);
    true
}

/// Sets `cpus` on every thread of the processes `pids`.
pub fn pin(pids: &[u32], cpus: &CpuSet) {
    for &pid in pids {
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
            continue; // gone meanwhile
        };
        for tid in tasks
            .flatten()
            .filter_map(|t| t.file_name().to_str()?.parse().ok())
        {
            // A thread that ended meanwhile cannot be pinned; nothing else fails here.
            let _ = sched_setaffinity(Pid::from_raw(tid), cpus);
        }
    }
}

/// `root` (first) and every process below it, from the parent ids in `/proc/<pid>/stat`.
pub fn descendants(root: u32) -> std::io::Result<Vec<u32>> {
    let mut parents = Vec::new();
    for entry in std::fs::read_dir("/proc")?.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // `pid (comm) state ppid ...`: the command may hold spaces and parentheses.
        let ppid = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().nth(1)?.parse::<u32>().ok());
        if let Some(ppid) = ppid {
            parents.push((pid, ppid));
        }
    }
    let mut family = vec![root];
    let mut at = 0;
    while at < family.len() {
        let parent = family[at];
        family.extend(
            parents
                .iter()
                .filter(|(_, p)| *p == parent)
                .map(|(c, _)| *c),
        );
        at += 1;
    }
    Ok(family)
}
