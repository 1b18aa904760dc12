//! `bigmodel devices --calibrate`: measures what the speed prediction
//! needs on this machine (bm-plan's cost model, `bm_plan::predict`): CPU
//! GEMM throughput and per-call weight reads for F32 and BF16 weights
//! (fitted over a small model's linear shapes), one-row linear throughput
//! from memory,
//! attention throughput, the fixed cost of a small op, the start-up of
//! the compute on a process's first pass (in fresh processes of this
//! program), host memory bandwidth, the offload folder's disk read rate
//! (cold and warm) and the first touch of a mapped file's cached pages,
//! and per CUDA GPU its context size, pinned and pageable host-to-device
//! rates and GEMM throughput. Each figure is the fastest of several short
//! probes (see [`fastest_seconds`]), so calibrating takes seconds and gives
//! the same figures on a busy machine as on an idle one.

use std::hint::black_box;
use std::io::{Read, Write};
use std::path::Path;
use std::time::{Duration, Instant};

use bigmodel::device::{DeviceSet, Gpu, GpuKind};
use bigmodel::plan::Calibration;
use bigmodel::plan::predict::{CpuRates, DiskRates, GpuRates};
use bigmodel::tensor::DType;
use bm_models::{Tensor, ops};

/// Seconds per call of `f`: the fastest of `probes` short timings (at
/// least one), each repeating `f` until it has taken `min_time`. The
/// fastest, not the median: other processes only ever slow a probe down,
/// so the fastest of several short ones is what the machine does when the
/// work has the cores, a figure that stays put between calibrations made
/// at different loads, where a median follows the load of the moment (and
/// a prediction made from it, the load of a calibration long gone).
fn fastest_seconds(probes: usize, min_time: Duration, mut f: impl FnMut()) -> f64 {
    let mut fastest = f64::INFINITY;
    for _ in 0..probes.max(1) {
        let started = Instant::now();
        let mut calls = 0u32;
        while calls == 0 || started.elapsed() < min_time {
            f();
            calls += 1;
        }
        fastest = fastest.min(started.elapsed().as_secs_f64() / f64::from(calls));
    }
    fastest
}

/// Probes per figure, and how long each runs at least.
const PROBES: usize = 7;
const PROBE_TIME: Duration = Duration::from_millis(25);

fn random_tensor(shape: &[usize], seed: u32) -> Result<Tensor, String> {
    let n: usize = shape.iter().product();
    let mut state = seed.wrapping_mul(2_654_435_761).max(1);
    let values: Vec<f32> = (0..n)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 17;
            state ^= state << 5;
            (state as f32 / u32::MAX as f32) - 0.5
        })
        .collect();
    Tensor::from_f32(DType::F32, shape, &values).map_err(|e| e.to_string())
}

fn linear_seconds(x: &Tensor, w: &Tensor) -> Result<f64, String> {
    let mut failed = None;
    let seconds = fastest_seconds(PROBES, PROBE_TIME, || {
        if let Err(e) = ops::linear(x, w, None) {
            failed = Some(e.to_string());
        }
    });
    match failed {
        Some(e) => Err(format!("calibrating the CPU: {e}")),
        None => Ok(seconds),
    }
}

/// Seconds of causal attention of `rows` new positions against a cache
/// of `past + rows` (8 query heads of `head_dim` over 4 key/value heads),
/// and its scores (query row × head × key it sees).
fn attention_seconds(rows: usize, past: usize, head_dim: usize) -> Result<(f64, f64), String> {
    use bm_models::ops::{Heads, LayerCache, Mask};
    let what = |e: &dyn std::fmt::Display| format!("calibrating CPU attention: {e}");
    let heads = Heads {
        heads: 8,
        kv_heads: 4,
        head_dim,
    };
    let total = past + rows;
    let kv_width = heads.kv_heads * heads.head_dim;
    let mut cache = LayerCache::new();
    cache
        .append(
            &random_tensor(&[total, kv_width], 11)?,
            &random_tensor(&[total, kv_width], 12)?,
        )
        .map_err(|e| what(&e))?;
    let q = random_tensor(&[rows, heads.heads * heads.head_dim], 13)?;
    let mut failed = None;
    let seconds = fastest_seconds(PROBES, PROBE_TIME, || {
        if let Err(e) = ops::attention(&q, &cache, heads, Mask::Causal) {
            failed = Some(what(&e));
        }
    });
    if let Some(e) = failed {
        return Err(e);
    }
    // Query row i sees past + i + 1 keys.
    let keys: usize = (0..rows).map(|i| past + i + 1).sum();
    Ok((seconds, (heads.heads * keys) as f64))
}

/// CPU attention as the cost model counts it: seconds per score (the
/// softmax's exponential, the loops) and FLOP/s of the `4 · head_dim`
/// FLOPs per score (the dot product with the key, the sum of values),
/// from two head widths over the same positions.
fn attention_rates() -> Result<(f64, f64), String> {
    let (narrow, wide) = (16, 128);
    let (narrow_seconds, scores) = attention_seconds(64, 64, narrow)?;
    let (wide_seconds, _) = attention_seconds(64, 64, wide)?;
    let flops = |head_dim: usize| 4.0 * (head_dim as f64) * scores;
    let rate = if wide_seconds > narrow_seconds {
        (flops(wide) - flops(narrow)) / (wide_seconds - narrow_seconds)
    } else {
        flops(wide) / wide_seconds
    };
    let per_score = ((narrow_seconds - flops(narrow) / rate) / scores).max(0.0);
    Ok((per_score, rate))
}

/// Weights (inputs, outputs) and row counts the multi-row linear is
/// calibrated on: a model's projections and MLP linears, both ways round,
/// over a short prompt, a typical one and a long one. Fitted together, so
/// no one noisy pair of timings sets the rates (the difference of two row
/// counts over one weight gave FLOP rates above what the cores sustain).
const GEMM_WEIGHTS: [(usize, usize); 3] = [(512, 512), (512, 1408), (1408, 512)];
const GEMM_ROWS: [usize; 3] = [16, 64, 256];

/// `(seconds per FLOP, seconds per weight byte)` of the least-squares fit
/// of `seconds ≈ a · flops + b · bytes` over `samples` (flops, bytes,
/// seconds), each weighed by its relative error, so short calls count as
/// much as long ones. Both are positive: where the fit gives no positive
/// packing cost, `min_byte_seconds` (a cached read of the weight) is
/// taken and the FLOP cost fitted alone.
fn fit_linear_costs(samples: &[(f64, f64, f64)], min_byte_seconds: f64) -> (f64, f64) {
    let (mut ff, mut fb, mut bb, mut fy, mut by) = (0.0, 0.0, 0.0, 0.0, 0.0);
    for &(f, b, y) in samples {
        let w = 1.0 / (y * y).max(f64::MIN_POSITIVE);
        ff += w * f * f;
        fb += w * f * b;
        bb += w * b * b;
        fy += w * f * y;
        by += w * b * y;
    }
    let det = ff * bb - fb * fb;
    if det > 0.0 {
        let a = (fy * bb - by * fb) / det;
        let b = (by * ff - fy * fb) / det;
        if a > 0.0 && b >= min_byte_seconds {
            return (a, b);
        }
    }
    let b = min_byte_seconds;
    let (mut num, mut den) = (0.0, 0.0);
    for &(f, bytes, y) in samples {
        let w = 1.0 / (y * y).max(f64::MIN_POSITIVE);
        num += w * f * (y - b * bytes);
        den += w * f * f;
    }
    ((num / den).max(f64::MIN_POSITIVE), b)
}

/// `(seconds per FLOP, seconds per weight byte)` of multi-row linears
/// with `dtype` weights and inputs over [`GEMM_WEIGHTS`] × [`GEMM_ROWS`],
/// less `op_seconds` a call; `min_byte_rate` bounds the weight-read rate
/// (a cached read).
fn gemm_costs(dtype: DType, op_seconds: f64, min_byte_rate: f64) -> Result<(f64, f64), String> {
    let cast = |t: Tensor| t.to_dtype(dtype).map_err(|e| e.to_string());
    let mut samples = Vec::new();
    for (seed, &(k, n)) in (22..).zip(&GEMM_WEIGHTS) {
        let weight = cast(random_tensor(&[n, k], seed)?)?;
        for &m in &GEMM_ROWS {
            let x = cast(random_tensor(&[m, k], seed + 10)?)?;
            let seconds = linear_seconds(&x, &weight)?;
            samples.push((
                2.0 * (m * k * n) as f64,
                (k * n * dtype.size_in_bytes()) as f64,
                (seconds - op_seconds).max(f64::MIN_POSITIVE),
            ));
        }
    }
    Ok(fit_linear_costs(&samples, 1.0 / min_byte_rate))
}

/// The CPU's rates.
fn cpu_rates() -> Result<CpuRates, String> {
    // Two small linears whose weights stay in the cache: the difference
    // of their times is the cached read rate, the rest a fixed cost per op.
    let small = linear_seconds(&random_tensor(&[1, 64], 5)?, &random_tensor(&[64, 64], 6)?)?;
    let large = linear_seconds(
        &random_tensor(&[1, 256], 9)?,
        &random_tensor(&[256, 256], 10)?,
    )?;
    let (small_bytes, large_bytes) = ((64 * 64 * 4) as f64, (256 * 256 * 4) as f64);
    let cached_rate = if large > small {
        (large_bytes - small_bytes) / (large - small)
    } else {
        large_bytes / large
    };
    let op_seconds = (small - small_bytes / cached_rate).max(0.0);
    // A linear of several rows multiplies at the GEMM rate and reads its
    // weight once per chunk of rows (a cost in the weight's bytes), fitted
    // over the shapes above, less each call's fixed cost: for F32 weights
    // (F16 runs the same kernels) and for BF16 (the bf16 dot product).
    let (flop_seconds, byte_seconds) = gemm_costs(DType::F32, op_seconds, cached_rate)?;
    let (bf16_flop_seconds, bf16_byte_seconds) = gemm_costs(DType::BF16, op_seconds, cached_rate)?;
    let (attention_score_seconds, attention_flops) = attention_rates()?;
    // Element-wise ops over many rows (residual adds, the MLP's product,
    // and its activation, whose exponential costs more).
    let wide = random_tensor(&[256, 1024], 15)?;
    let elements = (256 * 1024) as f64;
    let mut failed = None;
    let mut element_op = |f: &dyn Fn() -> Result<Tensor, String>| {
        fastest_seconds(PROBES, PROBE_TIME, || {
            if let Err(e) = f() {
                failed = Some(format!("calibrating the CPU: {e}"));
            }
        }) / elements
    };
    let elementwise_seconds = element_op(&|| ops::add(&wide, &wide).map_err(|e| e.to_string()));
    let activation_seconds = element_op(&|| ops::silu(&wide).map_err(|e| e.to_string()));
    if let Some(e) = failed {
        return Err(e);
    }
    let words = vec![1u64; 32 << 20];
    let read = fastest_seconds(PROBES, PROBE_TIME, || {
        black_box(
            black_box(&words)
                .iter()
                .fold(0u64, |a, b| a.wrapping_add(*b)),
        );
    });
    // One row streams each weight from memory, as a decoding pass reads a
    // model larger than the cache: distinct MLP-sized weights, twice the
    // last-level cache in all, one after the other, less each call's
    // fixed cost.
    let (k1, n1) = (512, 1408);
    let weight_bytes = k1 * n1 * 4;
    let llc = usize::try_from(last_level_cache_bytes()).unwrap_or(usize::MAX);
    let count = (2 * llc.max(32 << 20)).div_ceil(weight_bytes).min(64);
    let weights = (0..count)
        .map(|i| random_tensor(&[n1, k1], 40 + i as u32))
        .collect::<Result<Vec<_>, _>>()?;
    let row = random_tensor(&[1, k1], 3)?;
    let mut failed = None;
    let gemv = fastest_seconds(PROBES, PROBE_TIME, || {
        for w in &weights {
            if let Err(e) = ops::linear(&row, w, None) {
                failed = Some(format!("calibrating the CPU: {e}"));
            }
        }
    }) / count as f64;
    if let Some(e) = failed {
        return Err(e);
    }
    let gemv_rate =
        weight_bytes as f64 / (gemv - op_seconds).max(weight_bytes as f64 / cached_rate);
    Ok(CpuRates {
        gemm_flops: 1.0 / flop_seconds,
        gemm_weight_bytes_per_second: 1.0 / byte_seconds,
        bf16_gemm_flops: Some(1.0 / bf16_flop_seconds),
        bf16_gemm_weight_bytes_per_second: Some(1.0 / bf16_byte_seconds),
        gemv_bytes_per_second: gemv_rate,
        gemv_cached_bytes_per_second: cached_rate,
        last_level_cache_bytes: last_level_cache_bytes(),
        attention_flops,
        attention_score_seconds,
        elementwise_seconds,
        activation_seconds,
        op_seconds,
        memory_bytes_per_second: (words.len() * 8) as f64 / read,
        tensor_seconds: 0.0,
        startup_seconds: 0.0,
    })
}

/// Seconds the first norm and linears of this process take beyond the
/// same calls warm: what a process's first pass pays once to start its
/// compute (the thread pool's threads; the GEMM's per-thread buffers,
/// allocated and faulted in, and grown again by each larger shape). Must
/// run before any other CPU op of the process. The calls are a prompt's
/// rows through a small layer: its norm, projections of two widths and
/// its MLP's wide and narrow linears. (Traces of `bigmodel run` show the
/// first pass's layer 0 slower than the later layers in exactly those
/// calls, by about twice what a lone norm and linear measure.)
pub fn startup_seconds() -> Result<f64, String> {
    let (rows, hidden, kv, mlp) = (64, 512, 256, 1408);
    let x = random_tensor(&[rows, hidden], 16)?;
    let norm = random_tensor(&[hidden], 17)?;
    let weights = [
        random_tensor(&[hidden, hidden], 18)?,
        random_tensor(&[kv, hidden], 19)?,
        random_tensor(&[mlp, hidden], 20)?,
    ];
    let down = random_tensor(&[hidden, mlp], 21)?;
    let mut failed = None;
    let mut pass = || {
        let out = ops::rms_norm(&x, &norm, 1e-5).and_then(|h| {
            let mut wide = None;
            for w in &weights {
                wide = Some(ops::linear(&h, w, None)?);
            }
            let wide = wide.expect("three weights");
            ops::linear(&wide, &down, None)
        });
        if let Err(e) = out {
            failed = Some(format!("calibrating the CPU's start-up: {e}"));
        }
    };
    let started = Instant::now();
    pass();
    let first = started.elapsed().as_secs_f64();
    let warm = fastest_seconds(PROBES, PROBE_TIME, &mut pass);
    match failed {
        Some(e) => Err(e),
        None => Ok((first - warm).max(0.0)),
    }
}

/// Fresh processes [`fresh_startup_seconds`] measures the start-up in.
const STARTUP_PROCESSES: usize = 5;

/// The start-up of a fresh process's compute, [`startup_seconds`] in
/// each of a few fresh processes of this program (`bigmodel devices
/// --calibrate --startup-only`): the median, as the prediction is checked
/// against the median of a few `run`s. A process measures its start-up
/// once, and one such timing swings by several times on a loaded machine.
fn fresh_startup_seconds() -> Result<f64, String> {
    let exe = std::env::current_exe()
        .map_err(|e| format!("calibrating the CPU's start-up: finding this program: {e}"))?;
    let mut seconds = Vec::with_capacity(STARTUP_PROCESSES);
    for _ in 0..STARTUP_PROCESSES {
        let what = |why: &dyn std::fmt::Display| {
            format!(
                "calibrating the CPU's start-up: {} devices --calibrate --startup-only: {why}",
                exe.display()
            )
        };
        let out = std::process::Command::new(&exe)
            .args(["devices", "--calibrate", "--startup-only"])
            .stdin(std::process::Stdio::null())
            .output()
            .map_err(|e| what(&e))?;
        if !out.status.success() {
            return Err(what(&String::from_utf8_lossy(&out.stderr).trim()));
        }
        let text = String::from_utf8_lossy(&out.stdout);
        let s = text
            .trim()
            .parse::<f64>()
            .map_err(|_| what(&format!("printed {:?}, not seconds", text.trim())))?;
        seconds.push(s);
    }
    seconds.sort_by(f64::total_cmp);
    Ok(seconds[seconds.len() / 2])
}

/// The size of the CPU's last-level cache (sysfs; 0 where unknown).
fn last_level_cache_bytes() -> u64 {
    let base = Path::new("/sys/devices/system/cpu/cpu0/cache");
    let Ok(entries) = std::fs::read_dir(base) else {
        return 0;
    };
    let read = |p: &Path| std::fs::read_to_string(p).map(|t| t.trim().to_string());
    let mut best = (0u32, 0u64);
    for entry in entries.flatten() {
        let dir = entry.path();
        let (Ok(level), Ok(size)) = (read(&dir.join("level")), read(&dir.join("size"))) else {
            continue;
        };
        let Ok(level) = level.parse::<u32>() else {
            continue;
        };
        let bytes = match size.strip_suffix('K') {
            Some(k) => k.parse::<u64>().map(|k| k << 10),
            None => match size.strip_suffix('M') {
                Some(m) => m.parse::<u64>().map(|m| m << 20),
                None => size.parse::<u64>(),
            },
        };
        if let Ok(bytes) = bytes
            && level >= best.0
        {
            best = (level, bytes);
        }
    }
    best.1
}

/// Asks the kernel to drop `file`'s cached pages; false where it cannot.
#[cfg(target_os = "linux")]
fn drop_page_cache(file: &std::fs::File) -> bool {
    use std::os::fd::AsRawFd;
    // SAFETY: posix_fadvise only reads its arguments; the descriptor is
    // open for the duration of the call.
    unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) == 0 }
}

#[cfg(not(target_os = "linux"))]
fn drop_page_cache(_file: &std::fs::File) -> bool {
    false
}

/// Read rates of a 256 MiB file written in `folder` (then removed).
fn disk_rates(folder: &Path) -> Result<DiskRates, String> {
    const LEN: usize = 256 << 20;
    std::fs::create_dir_all(folder).map_err(|e| {
        format!(
            "calibrating the disk: cannot create {}: {e}",
            folder.display()
        )
    })?;
    // A temporary folder of bm-shard's: removed on an interrupt, and by a
    // later write into `folder` if this process is killed.
    let probe = bigmodel::shard::create_temp_folder(folder)
        .map_err(|e| format!("calibrating the disk: {e}"))?;
    let path = probe.path().join("probe");
    let context = |e: std::io::Error| format!("calibrating the disk at {}: {e}", path.display());
    let result = (|| {
        let mut file = std::fs::File::create(&path).map_err(context)?;
        let chunk: Vec<u8> = (0..(4 << 20))
            .map(|i: usize| (i * 31 % 251) as u8)
            .collect();
        for _ in 0..LEN / chunk.len() {
            file.write_all(&chunk).map_err(context)?;
        }
        file.sync_all().map_err(context)?;
        let read_all = || -> Result<f64, String> {
            let mut file = std::fs::File::open(&path).map_err(context)?;
            let mut buffer = vec![0u8; 4 << 20];
            let started = Instant::now();
            while file.read(&mut buffer).map_err(context)? > 0 {}
            Ok(LEN as f64 / started.elapsed().as_secs_f64())
        };
        let cold = if drop_page_cache(&file) {
            Some(read_all()?)
        } else {
            None
        };
        read_all()?;
        let warm = read_all()?.max(read_all()?);
        // Weights a block reads in place from a mapping (resident CPU
        // weights are views of the checkpoint, disk weights of their file)
        // fault their pages in on the first pass that reads them, from the
        // page cache: the file is cached now, each mapping is fresh.
        let mut first_touch = f64::INFINITY;
        for _ in 0..3 {
            let view = bigmodel::tensor::MmapView::open(&path)
                .map_err(|e| format!("calibrating the disk: {e}"))?;
            let started = Instant::now();
            let bytes = view.as_bytes();
            let mut sum = 0u8;
            for page in bytes.chunks(4096) {
                sum = sum.wrapping_add(page[0]);
            }
            black_box(sum);
            first_touch = first_touch.min(started.elapsed().as_secs_f64());
        }
        Ok(DiskRates {
            cold_bytes_per_second: cold,
            warm_bytes_per_second: warm,
            first_touch_bytes_per_second: LEN as f64 / first_touch,
            mapped_tensor_seconds: 0.0,
        })
    })();
    drop(probe);
    result
}

/// One CUDA GPU's context size, copy rates and GEMM throughput.
fn gpu_rates(devices: &DeviceSet, gpu: &Gpu) -> Result<GpuRates, String> {
    let what = |e: &dyn std::fmt::Display| format!("calibrating GPU {}: {e}", gpu.ordinal());
    let memory = gpu.memory().map_err(|e| what(&e))?;
    const LEN: usize = 64 << 20;
    let mut pinned = devices.alloc_pinned(LEN).map_err(|e| what(&e))?;
    pinned.as_mut_slice().map_err(|e| what(&e))?.fill(1);
    let pageable = vec![1u8; LEN];
    let mut target = gpu.alloc(LEN).map_err(|e| what(&e))?;
    let mut failed: Option<String> = None;
    let pinned_seconds = fastest_seconds(PROBES, PROBE_TIME, || {
        let copied = target
            .copy_from_pinned(0, &pinned, 0..LEN, gpu.copy_stream())
            .and_then(|event| event.synchronize());
        if let Err(e) = copied {
            failed = Some(what(&e));
        }
    });
    let pageable_seconds = fastest_seconds(PROBES, PROBE_TIME, || {
        if let Err(e) = target.copy_from_host(0, &pageable) {
            failed = Some(what(&e));
        }
    });
    let (m, k, n) = (2048, 4096, 4096);
    let gemm = (|| -> Result<f64, String> {
        let x = random_tensor(&[m, k], 7)?
            .to_dtype(DType::BF16)
            .map_err(|e| what(&e))?;
        let w = random_tensor(&[n, k], 8)?
            .to_dtype(DType::BF16)
            .map_err(|e| what(&e))?;
        let (x, w) = (
            x.to_gpu(gpu).map_err(|e| what(&e))?,
            w.to_gpu(gpu).map_err(|e| what(&e))?,
        );
        let mut failed = None;
        let seconds = fastest_seconds(PROBES, PROBE_TIME, || {
            let done = ops::linear(&x, &w, None)
                .map_err(|e| what(&e))
                .and_then(|_| gpu.synchronize().map_err(|e| what(&e)));
            if let Err(e) = done {
                failed = Some(e);
            }
        });
        match failed {
            Some(e) => Err(e),
            None => Ok(2.0 * (m * k * n) as f64 / seconds),
        }
    })();
    if let Some(e) = failed {
        return Err(e);
    }
    Ok(GpuRates {
        ordinal: gpu.ordinal() as u32,
        pinned_h2d_bytes_per_second: LEN as f64 / pinned_seconds,
        pageable_h2d_bytes_per_second: LEN as f64 / pageable_seconds,
        gemm_flops: gemm.ok(),
        // Right after this process created the context, on an otherwise
        // idle GPU, what is not free is the context.
        context_bytes: memory.total.saturating_sub(memory.free),
    })
}

/// Blocks and tensors per block of the dispatch calibration model.
const BLOCKS: usize = 8;
const TENSORS: usize = 4;

/// Seconds per tensor that a block's weights cost the dispatcher on the
/// CPU: entering, handing out and leaving blocks of a small model whose
/// weights are resident, then disk-offloaded (used in place through the
/// mapping, as a decoder's are), in `folder`.
fn dispatch_rates(folder: &Path) -> Result<(f64, f64), String> {
    use bigmodel::dispatch::{Activations, ModelBuilder};
    use bigmodel::plan::DeviceMap;
    use bigmodel::{DeviceMapSpec, Options};
    let what = |e: &dyn std::fmt::Display| format!("calibrating the dispatcher: {e}");
    std::fs::create_dir_all(folder).map_err(|e| what(&e))?;
    let temp = bigmodel::shard::create_temp_folder(folder).map_err(|e| what(&e))?;
    let dir = temp.path().to_path_buf();
    let result = (|| -> Result<(f64, f64), String> {
        let width = 64usize;
        let len = width * width * 4;
        let mut entries = serde_json::Map::new();
        let mut names = Vec::new();
        for b in 0..BLOCKS {
            for t in 0..TENSORS {
                let at = names.len() * len;
                let name = format!("blocks.{b}.{t}.weight");
                entries.insert(
                    name.clone(),
                    serde_json::json!({"dtype": "F32", "shape": [width, width], "data_offsets": [at, at + len]}),
                );
                names.push(name);
            }
        }
        let mut header = serde_json::Value::Object(entries).to_string();
        while !header.len().is_multiple_of(8) {
            header.push(' ');
        }
        let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(header.as_bytes());
        bytes.resize(bytes.len() + names.len() * len, 0);
        bigmodel::shard::write_atomic(&dir.join("model.safetensors"), &bytes)
            .map_err(|e| what(&e))?;
        let tree = || -> Result<_, String> {
            let mut builder = ModelBuilder::new("Calibration");
            let list = builder
                .module(ModelBuilder::ROOT, "blocks", "ModuleList")
                .map_err(|e| what(&e))?;
            for b in 0..BLOCKS {
                let block = builder
                    .module(list, &b.to_string(), "Block")
                    .map_err(|e| what(&e))?;
                for t in 0..TENSORS {
                    builder
                        .linear(block, &t.to_string(), width, width, false, DType::F32)
                        .map_err(|e| what(&e))?;
                }
            }
            builder.build().map_err(|e| what(&e))
        };
        let seconds_per_tensor = |place: &str| -> Result<f64, String> {
            let map = DeviceMap::from_json(&serde_json::json!({"blocks": place}))
                .map_err(|e| what(&e))?;
            let options = Options {
                device_map: Some(DeviceMapSpec::Map(map)),
                offload_folder: Some(dir.join("offload")),
                ..Options::default()
            };
            let devices = std::sync::Arc::new(DeviceSet::cpu_only());
            let model = bigmodel::load_checkpoint_and_dispatch(tree()?, &dir, devices, &options)
                .map_err(|e| what(&e))?;
            let mut failed = None;
            let pass = || -> Result<(), String> {
                for b in 0..BLOCKS {
                    let mut block = model
                        .enter(&format!("blocks.{b}"), Activations::default())
                        .map_err(|e| what(&e))?;
                    for t in 0..TENSORS {
                        black_box(block.weight(&format!("{t}.weight")).map_err(|e| what(&e))?);
                    }
                    block.exit(Activations::default()).map_err(|e| what(&e))?;
                }
                Ok(())
            };
            let seconds = fastest_seconds(PROBES, PROBE_TIME, || {
                if let Err(e) = pass() {
                    failed = Some(e);
                }
            });
            match failed {
                Some(e) => Err(e),
                None => Ok(seconds / (BLOCKS * TENSORS) as f64),
            }
        };
        let resident = seconds_per_tensor("cpu")?;
        let offloaded = seconds_per_tensor("disk")?;
        Ok((resident, offloaded))
    })();
    drop(temp);
    result
}

/// Calibrates this machine, the disk at `offload_folder`.
pub fn calibrate(offload_folder: &Path) -> Result<Calibration, String> {
    let startup = fresh_startup_seconds()?;
    let devices = DeviceSet::probe();
    let mut gpus = Vec::new();
    for gpu in devices.gpus() {
        if gpu.kind() == GpuKind::Cuda {
            gpus.push(gpu_rates(&devices, gpu)?);
        }
    }
    let host = devices
        .memory_info()
        .map_err(|e| format!("calibrating: reading host memory: {e}"))?
        .host;
    let (resident_tensor, offloaded_tensor) = dispatch_rates(offload_folder)?;
    let mut disk = disk_rates(offload_folder)?;
    disk.mapped_tensor_seconds = offloaded_tensor;
    Ok(Calibration {
        cpu: CpuRates {
            tensor_seconds: resident_tensor,
            startup_seconds: startup,
            ..cpu_rates()?
        },
        host_available_bytes: host.available,
        disk: Some(disk),
        gpus,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Samples of `a · flops + b · bytes` at the calibrated shapes.
    fn samples(a: f64, b: f64) -> Vec<(f64, f64, f64)> {
        let mut out = Vec::new();
        for &(k, n) in &GEMM_WEIGHTS {
            for &m in &GEMM_ROWS {
                let (f, bytes) = (2.0 * (m * k * n) as f64, (k * n * 4) as f64);
                out.push((f, bytes, a * f + b * bytes));
            }
        }
        out
    }

    #[test]
    fn the_linear_fit_recovers_the_rates_it_was_made_of() {
        let (a, b) = fit_linear_costs(&samples(1.0 / 40e9, 1.0 / 5e9), 1.0 / 50e9);
        assert!((a * 40e9 - 1.0).abs() < 1e-9, "{}", 1.0 / a);
        assert!((b * 5e9 - 1.0).abs() < 1e-9, "{}", 1.0 / b);
    }

    #[test]
    fn a_packing_cost_below_a_cached_read_is_not_taken() {
        // Timings that fall with the weight's bytes (noise) would fit a
        // negative packing cost: the cached read is taken instead, and the
        // FLOP rate fitted alone stays positive.
        let noisy: Vec<(f64, f64, f64)> = samples(1.0 / 40e9, 0.0)
            .into_iter()
            .map(|(f, bytes, y)| (f, bytes, y * (1.0 - bytes * 1e-8)))
            .collect();
        let (a, b) = fit_linear_costs(&noisy, 1.0 / 50e9);
        assert_eq!(b, 1.0 / 50e9);
        assert!(a > 0.0 && 1.0 / a > 30e9 && 1.0 / a < 60e9, "{}", 1.0 / a);
    }
}
