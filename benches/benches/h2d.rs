//! Host-to-device bandwidth by transfer size, from pageable, pinned and
//! registered host memory and through the pinned staging ring, plus
//! copy/compute overlap. Each run prints a summary with ratios against
//! pageable copies measured in the same run. Every timed copy ends with a
//! wait for the destination buffer's last use, so the clock stops when the
//! bytes are on the device, for pageable copies too (whose call returns
//! once the source is read).
//!
//! Without a GPU it says so and measures emulated devices instead: host
//! memcpy (`emulated`), and behind a simulated 25 GB/s link whose copy
//! engine runs concurrently with the caller (`emulated-link`), so every
//! row and the overlap measurement exist in CI.

use std::time::{Duration, Instant};

use bigmodel::device::{
    DeviceBuffer, DeviceSet, Gpu, HostRegistration, PinnedBuffer, PinnedPool, SimulatedLink,
};
use criterion::{BenchmarkId, Criterion, Throughput};

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;

#[derive(Clone, Copy)]
enum Mode {
    Pageable,
    Pinned,
    Registered,
    Staged,
}

impl Mode {
    const ALL: [Mode; 4] = [Mode::Pageable, Mode::Pinned, Mode::Registered, Mode::Staged];

    fn name(self) -> &'static str {
        match self {
            Mode::Pageable => "pageable",
            Mode::Pinned => "pinned",
            Mode::Registered => "registered",
            Mode::Staged => "pool-staged",
        }
    }
}

/// Everything one size needs, allocated once outside the timed loops.
struct Setup {
    gpu: Gpu,
    src: Vec<u8>,
    dst: DeviceBuffer,
    pool: PinnedPool,
}

impl Setup {
    /// One complete host-to-device copy in `mode`, waited for.
    fn copy(&mut self, mode: Mode, pinned: &PinnedBuffer, reg: &HostRegistration<'_>) {
        let n = self.src.len();
        let stream = self.gpu.copy_stream().clone();
        match mode {
            Mode::Pageable => {
                self.dst.copy_from_host(0, &self.src).unwrap();
                self.dst.synchronize().unwrap()
            }
            Mode::Pinned => self
                .dst
                .copy_from_pinned(0, pinned, 0..n, &stream)
                .unwrap()
                .synchronize()
                .unwrap(),
            Mode::Registered => self
                .dst
                .copy_from_registered(0, reg, 0..n, &stream)
                .unwrap()
                .synchronize()
                .unwrap(),
            Mode::Staged => self
                .dst
                .upload(0, &self.src, &self.pool, &stream)
                .unwrap()
                .synchronize()
                .unwrap(),
        }
    }
}

fn sizes(emulated: bool) -> Vec<usize> {
    if emulated {
        vec![64 * KIB, MIB, 16 * MIB]
    } else {
        vec![64 * KIB, MIB, 16 * MIB, 256 * MIB]
    }
}

fn label(size: usize) -> String {
    if size >= MIB {
        format!("{}MiB", size / MIB)
    } else {
        format!("{}KiB", size / KIB)
    }
}

/// Median seconds of `runs` calls of `f`.
fn median_secs(runs: usize, mut f: impl FnMut()) -> f64 {
    f();
    let mut t: Vec<f64> = (0..runs)
        .map(|_| {
            let start = Instant::now();
            f();
            start.elapsed().as_secs_f64()
        })
        .collect();
    t.sort_by(f64::total_cmp);
    t[runs / 2]
}

fn bandwidth(c: &mut Criterion, set: &DeviceSet, kind: &str) {
    let gpu = set.gpu(0).unwrap().clone();
    let mut summary = Vec::new();
    for size in sizes(set.is_emulated()) {
        let src: Vec<u8> = (0..size).map(|i| (i % 251) as u8).collect();
        let mut pinned = set.alloc_pinned(size).unwrap();
        pinned.as_mut_slice().unwrap().copy_from_slice(&src);
        let src_for_reg = src.clone();
        let reg = set.register_host(&src_for_reg);
        let mut s = Setup {
            gpu: gpu.clone(),
            dst: gpu.alloc(size).unwrap(),
            pool: set
                .pinned_pool(PinnedPool::DEFAULT_SLOT_BYTES, PinnedPool::DEFAULT_SLOTS)
                .unwrap(),
            src,
        };
        let mut group = c.benchmark_group(format!("{kind}/h2d"));
        group.throughput(Throughput::Bytes(size as u64));
        for mode in Mode::ALL {
            group.bench_with_input(BenchmarkId::new(mode.name(), label(size)), &size, |b, _| {
                b.iter(|| s.copy(mode, &pinned, &reg))
            });
        }
        group.finish();
        let runs = if size >= 64 * MIB { 5 } else { 21 };
        let gbps: Vec<f64> = Mode::ALL
            .iter()
            .map(|&m| size as f64 / median_secs(runs, || s.copy(m, &pinned, &reg)) / 1e9)
            .collect();
        summary.push((
            size,
            gbps,
            pinned.is_pinned(),
            reg.is_registered(),
            s.pool.is_pinned(),
        ));
    }
    println!("\n{kind} host-to-device bandwidth, GB/s (median; x = ratio to pageable in this run)");
    println!(
        "{:>8}  {:>16}  {:>16}  {:>16}  {:>16}",
        "size", "pageable", "pinned", "registered", "pool-staged"
    );
    for (size, g, pinned, registered, pool_pinned) in &summary {
        let cell = |v: f64| format!("{v:7.2} ({:4.2}x)", v / g[0]);
        println!(
            "{:>8}  {:>16}  {:>16}  {:>16}  {:>16}{}",
            label(*size),
            cell(g[0]),
            cell(g[1]),
            cell(g[2]),
            cell(g[3]),
            if *pinned && *registered && *pool_pinned {
                ""
            } else {
                "  (pinning fell back to pageable)"
            }
        );
    }
}

/// Copy alone, busy kernel alone, both at once on the two streams.
fn overlap(set: &DeviceSet, kind: &str) {
    let gpu = set.gpu(0).unwrap();
    let size = if set.is_emulated() {
        16 * MIB
    } else {
        256 * MIB
    };
    let src: Vec<u8> = (0..size).map(|i| (i % 253) as u8).collect();
    let mut pinned = set.alloc_pinned(size).unwrap();
    pinned.as_mut_slice().unwrap().copy_from_slice(&src);
    let mut dst = gpu.alloc(size).unwrap();
    let pool = set
        .pinned_pool(PinnedPool::DEFAULT_SLOT_BYTES, PinnedPool::DEFAULT_SLOTS)
        .unwrap();
    let (copy, compute) = (gpu.copy_stream().clone(), gpu.compute_stream().clone());

    let copy_pinned =
        |dst: &mut DeviceBuffer| dst.copy_from_pinned(0, &pinned, 0..size, &copy).unwrap();
    let t_copy = median_secs(5, || copy_pinned(&mut dst).synchronize().unwrap());
    let t_staged = median_secs(5, || {
        dst.upload(0, &src, &pool, &copy)
            .unwrap()
            .synchronize()
            .unwrap()
    });
    let busy = Duration::from_secs_f64(t_copy.max(1e-3));
    let t_compute = median_secs(5, || {
        compute.busy_wait(busy).unwrap();
        compute.synchronize().unwrap();
    });
    // The copy is enqueued first, as a prefetch is, then the compute: on an
    // emulated GPU the "kernel" runs on the calling thread.
    let t_both = median_secs(5, || {
        let copied = copy_pinned(&mut dst);
        compute.busy_wait(busy).unwrap();
        copied.synchronize().unwrap();
        compute.synchronize().unwrap();
    });
    let t_both_staged = median_secs(5, || {
        let copied = dst.upload(0, &src, &pool, &copy).unwrap();
        compute.busy_wait(busy).unwrap();
        copied.synchronize().unwrap();
        compute.synchronize().unwrap();
    });
    println!(
        "\n{kind} copy/compute overlap ({} on the copy stream, busy kernel on the compute stream)",
        label(size)
    );
    println!(
        "  pinned copy   {:8.2} ms alone, busy kernel {:8.2} ms alone, together {:8.2} ms: overlap {:.2}",
        t_copy * 1e3,
        t_compute * 1e3,
        t_both * 1e3,
        overlap_ratio(t_copy, t_compute, t_both)
    );
    println!(
        "  staged upload {:8.2} ms alone, busy kernel {:8.2} ms alone, together {:8.2} ms: overlap {:.2}",
        t_staged * 1e3,
        t_compute * 1e3,
        t_both_staged * 1e3,
        overlap_ratio(t_staged, t_compute, t_both_staged)
    );
}

/// 1 when the copy hides entirely behind compute, 0 when the two run one
/// after the other.
fn overlap_ratio(copy_alone: f64, compute_alone: f64, together: f64) -> f64 {
    ((copy_alone + compute_alone - together) / copy_alone.min(compute_alone)).clamp(0.0, 1.0)
}

/// The link of the `emulated-link` rows: about a PCIe 4 x16 link.
const EMULATED_LINK: SimulatedLink = SimulatedLink {
    bytes_per_second: 25e9,
    latency: Duration::from_micros(10),
};

fn main() {
    let probed = DeviceSet::probe();
    let sets = if probed.gpu_count() > 0 {
        vec![(probed, "cuda")]
    } else {
        println!(
            "h2d: no GPU found ({}); measuring emulated devices (host memcpy, and a simulated \
             25 GB/s link) instead; every result below is labelled \"emulated\" and says nothing \
             about a GPU",
            probed
                .cuda_status()
                .error
                .as_deref()
                .unwrap_or("no CUDA device")
        );
        vec![
            (DeviceSet::emulated(&[1 << 30]), "emulated"),
            (
                DeviceSet::emulated_with_link(&[1 << 30], EMULATED_LINK),
                "emulated-link",
            ),
        ]
    };
    let mut c = Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(1))
        .configure_from_args();
    for (set, kind) in &sets {
        bandwidth(&mut c, set, kind);
        overlap(set, kind);
    }
    c.final_summary();
}
