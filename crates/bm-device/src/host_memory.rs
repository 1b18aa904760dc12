//! How much host RAM this process may still use.
//!
//! Inside a container the machine's `MemAvailable` overstates what we may
//! take: the cgroup's limit is what the OOM killer enforces. So the answer is
//! the smallest of `memory.max - memory.current` over the cgroup v2
//! hierarchy (or `memory.limit_in_bytes - memory.usage_in_bytes` for cgroup
//! v1) and `/proc/meminfo`'s `MemAvailable`. The smallest limit itself
//! (the cgroup's, else `MemTotal`) is kept too: the host's safety margin
//! scales with it ([`crate::cpu_safety_margin`]).

use std::fs;
use std::path::{Path, PathBuf};

use crate::{Error, Result};

/// Where the host-memory figure came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HostMemorySource {
    /// A cgroup v2 `memory.max` limit was the tighter bound.
    CgroupV2,
    /// A cgroup v1 `memory.limit_in_bytes` limit was the tighter bound.
    CgroupV1,
    /// `/proc/meminfo` `MemAvailable` (no cgroup limit, or a looser one).
    MemInfo,
}

impl std::fmt::Display for HostMemorySource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            HostMemorySource::CgroupV2 => "cgroup v2 memory.max - memory.current",
            HostMemorySource::CgroupV1 => "cgroup v1 memory.limit_in_bytes - memory.usage_in_bytes",
            HostMemorySource::MemInfo => "/proc/meminfo MemAvailable",
        })
    }
}

/// Host RAM this process may still allocate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HostMemory {
    /// Bytes available.
    pub available: u64,
    /// Which limit gave `available`.
    pub source: HostMemorySource,
    /// The smallest memory limit the process is under: a cgroup's limit
    /// (of its own cgroup or an ancestor) when one is set below the
    /// machine's `MemTotal`, else `MemTotal`.
    pub limit: u64,
}

/// Host RAM available to this process, respecting cgroup limits.
pub fn host_memory() -> Result<HostMemory> {
    host_memory_under(Path::new("/"))
}

/// [`host_memory`] reading `proc/` and `sys/fs/cgroup/` under `root`
/// instead of `/`, so tests can supply their own files.
pub(crate) fn host_memory_under(root: &Path) -> Result<HostMemory> {
    let meminfo = root.join("proc/meminfo");
    let (mem_available, mem_total) = read_meminfo(&meminfo)?;
    let mut best = HostMemory {
        available: mem_available,
        source: HostMemorySource::MemInfo,
        limit: mem_total,
    };
    let cgroup_file = root.join("proc/self/cgroup");
    // A process outside any cgroup (or a system without /proc/self/cgroup)
    // is bounded by MemAvailable alone.
    let Ok(cgroups) = fs::read_to_string(&cgroup_file) else {
        return Ok(best);
    };
    let cgroup_root = root.join("sys/fs/cgroup");
    let (cgroup, source) = match cgroup_v2_headroom(&cgroup_root, &cgroups)? {
        Some(v2) => (Some(v2), HostMemorySource::CgroupV2),
        None => (
            cgroup_v1_headroom(&cgroup_root, &cgroups)?,
            HostMemorySource::CgroupV1,
        ),
    };
    if let Some(cgroup) = cgroup {
        best.limit = best.limit.min(cgroup.limit);
        if cgroup.headroom < best.available {
            best.available = cgroup.headroom;
            best.source = source;
        }
    }
    Ok(best)
}

/// `MemAvailable` and `MemTotal` of a `/proc/meminfo` file, in bytes.
fn read_meminfo(path: &Path) -> Result<(u64, u64)> {
    let text = fs::read_to_string(path).map_err(|e| Error::HostMemoryInfo {
        path: path.to_path_buf(),
        reason: e.to_string(),
    })?;
    let bad = |reason: &str| Error::HostMemoryInfo {
        path: path.to_path_buf(),
        reason: reason.to_string(),
    };
    let field = |key: &str| {
        let line = text
            .lines()
            .find_map(|l| l.strip_prefix(key)?.strip_prefix(':'))
            .ok_or_else(|| bad(&format!("no {key} line")))?;
        let mut fields = line.split_whitespace();
        let kib: u64 = fields
            .next()
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| bad(&format!("{key} is not a number")))?;
        match fields.next() {
            Some("kB") | None => Ok(kib.saturating_mul(1024)),
            Some(unit) => Err(bad(&format!("unexpected {key} unit {unit:?}"))),
        }
    };
    Ok((field("MemAvailable")?, field("MemTotal")?))
}

/// Reads a cgroup value file: a byte count, or `None` for `max`/absent.
fn read_limit(path: &Path) -> Result<Option<u64>> {
    let Ok(text) = fs::read_to_string(path) else {
        return Ok(None);
    };
    let t = text.trim();
    if t == "max" {
        return Ok(None);
    }
    t.parse().map(Some).map_err(|_| Error::HostMemoryInfo {
        path: path.to_path_buf(),
        reason: format!("{t:?} is not a byte count"),
    })
}

/// The cgroup directory `rel` (as written in /proc/self/cgroup) and each of
/// its ancestors up to the mount point, innermost first.
fn cgroup_dirs(mount: &Path, rel: &str) -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    let mut rel = rel.trim_matches('/').to_string();
    loop {
        dirs.push(if rel.is_empty() {
            mount.to_path_buf()
        } else {
            mount.join(&rel)
        });
        match rel.rfind('/') {
            Some(i) => rel.truncate(i),
            None if !rel.is_empty() => rel.clear(),
            None => break,
        }
    }
    dirs
}

/// What a cgroup hierarchy allows the process.
struct CgroupRoom {
    /// The limit minus what is in use, the smallest over the hierarchy.
    headroom: u64,
    /// The smallest limit over the hierarchy.
    limit: u64,
}

/// Smallest `memory.max - memory.current` (and smallest `memory.max`)
/// over the process's cgroup v2 directory and its ancestors (a limit set
/// on a parent binds the child too); `None` when the hierarchy is not v2
/// or nothing is limited.
fn cgroup_v2_headroom(mount: &Path, cgroups: &str) -> Result<Option<CgroupRoom>> {
    let Some(rel) = cgroups.lines().find_map(|l| l.strip_prefix("0::")) else {
        return Ok(None);
    };
    let mut room: Option<CgroupRoom> = None;
    for dir in cgroup_dirs(mount, rel) {
        let Some(max) = read_limit(&dir.join("memory.max"))? else {
            continue;
        };
        let current = read_limit(&dir.join("memory.current"))?.unwrap_or(0);
        let headroom = max.saturating_sub(current);
        room = Some(match room {
            None => CgroupRoom {
                headroom,
                limit: max,
            },
            Some(r) => CgroupRoom {
                headroom: r.headroom.min(headroom),
                limit: r.limit.min(max),
            },
        });
    }
    Ok(room)
}

/// cgroup v1: `memory.limit_in_bytes - memory.usage_in_bytes` of the
/// process's memory cgroup; `None` when unlimited (v1 reports "no limit" as
/// a huge page-rounded number) or not mounted.
fn cgroup_v1_headroom(mount: &Path, cgroups: &str) -> Result<Option<CgroupRoom>> {
    let Some(rel) = cgroups.lines().find_map(|l| {
        let mut parts = l.splitn(3, ':');
        let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
        controllers
            .split(',')
            .any(|c| c == "memory")
            .then_some(path)
    }) else {
        return Ok(None);
    };
    let memory_mount = mount.join("memory");
    for dir in cgroup_dirs(&memory_mount, rel) {
        if let Some(limit) = read_limit(&dir.join("memory.limit_in_bytes"))? {
            // The kernel's "unlimited" is PAGE_COUNTER_MAX pages, about 2^63.
            if limit >= 1 << 60 {
                continue;
            }
            let usage = read_limit(&dir.join("memory.usage_in_bytes"))?.unwrap_or(0);
            return Ok(Some(CgroupRoom {
                headroom: limit.saturating_sub(usage),
                limit,
            }));
        }
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(root: &Path, rel: &str, text: &str) {
        let p = root.join(rel);
        fs::create_dir_all(p.parent().unwrap()).unwrap();
        fs::write(p, text).unwrap();
    }

    const MEMINFO: &str =
        "MemTotal:       16000000 kB\nMemFree:  1000 kB\nMemAvailable:    8000000 kB\n";

    #[test]
    fn meminfo_alone_when_no_cgroup() {
        let d = tempfile::tempdir().unwrap();
        write(d.path(), "proc/meminfo", MEMINFO);
        let m = host_memory_under(d.path()).unwrap();
        assert_eq!(m.available, 8_000_000 * 1024);
        assert_eq!(m.source, HostMemorySource::MemInfo);
        assert_eq!(m.limit, 16_000_000 * 1024);
    }

    #[test]
    fn cgroup_v2_limit_on_an_ancestor_binds() {
        let d = tempfile::tempdir().unwrap();
        write(d.path(), "proc/meminfo", MEMINFO);
        write(d.path(), "proc/self/cgroup", "0::/a/b\n");
        write(d.path(), "sys/fs/cgroup/a/b/memory.max", "max\n");
        write(d.path(), "sys/fs/cgroup/a/b/memory.current", "100\n");
        write(d.path(), "sys/fs/cgroup/a/memory.max", "3000000000\n");
        write(d.path(), "sys/fs/cgroup/a/memory.current", "1000000000\n");
        let m = host_memory_under(d.path()).unwrap();
        assert_eq!(m.available, 2_000_000_000);
        assert_eq!(m.source, HostMemorySource::CgroupV2);
        assert_eq!(m.limit, 3_000_000_000);
    }

    #[test]
    fn a_cgroup_limit_binds_the_limit_even_when_meminfo_is_tighter() {
        // A 1 GiB container on a busy machine: MemAvailable gives the
        // headroom, the cgroup the limit the margin scales with.
        let d = tempfile::tempdir().unwrap();
        write(
            d.path(),
            "proc/meminfo",
            "MemTotal: 16000000 kB\nMemAvailable: 500000 kB\n",
        );
        write(d.path(), "proc/self/cgroup", "0::/c\n");
        write(d.path(), "sys/fs/cgroup/c/memory.max", "1073741824\n");
        write(d.path(), "sys/fs/cgroup/c/memory.current", "10000000\n");
        let m = host_memory_under(d.path()).unwrap();
        assert_eq!(m.source, HostMemorySource::MemInfo);
        assert_eq!(m.available, 500_000 * 1024);
        assert_eq!(m.limit, 1 << 30);
    }

    #[test]
    fn cgroup_v2_namespace_root_and_loose_limit() {
        let d = tempfile::tempdir().unwrap();
        write(d.path(), "proc/meminfo", MEMINFO);
        write(d.path(), "proc/self/cgroup", "0::/\n");
        // Looser than MemAvailable: MemAvailable wins.
        write(d.path(), "sys/fs/cgroup/memory.max", "900000000000\n");
        write(d.path(), "sys/fs/cgroup/memory.current", "0\n");
        let m = host_memory_under(d.path()).unwrap();
        assert_eq!(m.source, HostMemorySource::MemInfo);
        assert_eq!(m.limit, 16_000_000 * 1024);
    }

    #[test]
    fn cgroup_v1_fallback_and_unlimited() {
        let d = tempfile::tempdir().unwrap();
        write(d.path(), "proc/meminfo", MEMINFO);
        write(
            d.path(),
            "proc/self/cgroup",
            "5:cpu,cpuacct:/x\n4:memory:/x\n",
        );
        write(
            d.path(),
            "sys/fs/cgroup/memory/x/memory.limit_in_bytes",
            "1073741824\n",
        );
        write(
            d.path(),
            "sys/fs/cgroup/memory/x/memory.usage_in_bytes",
            "73741824\n",
        );
        let m = host_memory_under(d.path()).unwrap();
        assert_eq!(m.available, 1_000_000_000);
        assert_eq!(m.source, HostMemorySource::CgroupV1);
        assert_eq!(m.limit, 1 << 30);

        write(
            d.path(),
            "sys/fs/cgroup/memory/x/memory.limit_in_bytes",
            "9223372036854771712\n",
        );
        let m = host_memory_under(d.path()).unwrap();
        assert_eq!(m.source, HostMemorySource::MemInfo);
        assert_eq!(m.limit, 16_000_000 * 1024);
    }

    #[test]
    fn bad_files_name_the_file() {
        let d = tempfile::tempdir().unwrap();
        let err = host_memory_under(d.path()).unwrap_err().to_string();
        assert!(err.contains("proc/meminfo"), "{err}");
        write(d.path(), "proc/meminfo", "MemAvailable: lots kB\n");
        let err = host_memory_under(d.path()).unwrap_err().to_string();
        assert!(err.contains("not a number"), "{err}");
        write(d.path(), "proc/meminfo", "MemAvailable: 1000 kB\n");
        let err = host_memory_under(d.path()).unwrap_err().to_string();
        assert!(err.contains("no MemTotal line"), "{err}");
        write(d.path(), "proc/meminfo", MEMINFO);
        write(d.path(), "proc/self/cgroup", "0::/\n");
        write(d.path(), "sys/fs/cgroup/memory.max", "12 apples\n");
        let err = host_memory_under(d.path()).unwrap_err().to_string();
        assert!(
            err.contains("memory.max") && err.contains("not a byte count"),
            "{err}"
        );
    }

    #[test]
    fn this_machine_reports_something() {
        let m = host_memory().unwrap();
        assert!(m.available > 0 && m.limit > 0);
    }
}
