//! Predicted speed of a plan: time of the first forward pass, seconds per
//! generated token and bytes streamed per token, from a cost model fed by
//! a calibration of the machine (`bigmodel devices --calibrate`, passed in
//! as data: bm-plan measures nothing).
//!
//! The cost model (docs/guide.md, "Predicting speed", explains it for users):
//!
//! * A pass runs the blocks in order (embedding, layers, final norm, head).
//!   A block's **compute** time on the CPU is
//!   `max(flops / gemm_rate, weight_bytes / gemv_rate) + ops · op_seconds`:
//!   prefill is bound by GEMM throughput, decoding by reading the weights
//!   (a one-row linear streams its weight once, at the cached rate when
//!   the weights a pass reads fit in the last-level cache), and every op pays a fixed
//!   cost (thread hand-off, allocation) that dominates small models, and
//!   the dispatcher a cost per tensor handed out (calibrated for resident
//!   and for disk-offloaded, mapped tensors). On a
//!   GPU it is `flops / gpu_gemm_rate`.
//! * A block whose weights sit on a device that does not execute (offloaded)
//!   **transfers** them to the execution device over the link they cross:
//!   host RAM to a GPU at the pinned host-to-device rate, disk to a GPU at
//!   the slower of the disk read and the pinned rate. On the CPU, disk
//!   weights are used in place through the file mapping: nothing is copied,
//!   so with the page cache warm (the offloaded bytes fit in the memory the
//!   calibration found available) there is no transfer at all, and cold
//!   every byte is read from disk at the cold rate while the block computes
//!   (a mapped read is not prefetched).
//! * Transfers overlap compute as the dispatcher overlaps them: with a
//!   prefetch depth of at least one, block `i + 1` is fetched while block
//!   `i` computes, so a pass takes `t₀ + Σ max(cᵢ, tᵢ₊₁)`; with depth 0 it
//!   takes `Σ (cᵢ + tᵢ)`.
//! * The first pass has `batch · prompt_len` rows whose attention spans
//!   half the prompt on average; a decoding pass has `batch` rows attending
//!   to the prompt plus half the generated tokens. `seconds_per_token` is
//!   a decoding pass; `bytes_streamed_per_token` every offloaded byte, which
//!   each pass brings in once.

use crate::Error;
use crate::device::Device;
use crate::hf::HfModel;
use crate::ledger::Workload;
use crate::plan::{DeviceMap, PlanOptions};
use crate::sizes::{ModuleSizes, SizeOptions, SizeRule};
use crate::tree::{Node, TensorKind};

/// Parallel ops a decoder layer runs (seven projections and attention),
/// each paying the calibrated fixed cost of an op; norms, rotations and
/// element-wise ops are single passes over a row and cost far less.
const OPS_PER_LAYER: f64 = 8.0;
/// Parallel ops of the embedding, the final norm or the head.
const OPS_PER_SMALL_BLOCK: f64 = 1.0;

/// Measured rates of the host's CPU.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CpuRates {
    /// Dense f32 GEMM throughput, in FLOP/s.
    pub gemm_flops: f64,
    /// Bytes of f32 weights a one-row linear reads per second from memory
    /// (a weight far larger than the cache).
    pub gemv_bytes_per_second: f64,
    /// The same for a weight that stays in the cache.
    pub gemv_cached_bytes_per_second: f64,
    /// The last-level cache: a model whose weights per pass fit in it reads
    /// them at the cached rate (0 when unknown).
    pub last_level_cache_bytes: u64,
    /// Fixed seconds of one small op.
    pub op_seconds: f64,
    /// Sequential read bandwidth of host memory, bytes per second.
    pub memory_bytes_per_second: f64,
    /// Seconds the dispatcher spends per resident tensor a block reads
    /// (entering, handing out, leaving).
    pub tensor_seconds: f64,
}

/// Measured read rates of the offload folder's file system.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DiskRates {
    /// Bytes per second with the page cache dropped (None when it could
    /// not be dropped).
    pub cold_bytes_per_second: Option<f64>,
    /// Bytes per second from the page cache.
    pub warm_bytes_per_second: f64,
    /// Seconds the dispatcher spends per disk-offloaded tensor a block
    /// reads on the CPU (mapped in place, warm; the prefetch hand-off
    /// included).
    pub mapped_tensor_seconds: f64,
}

/// Measured rates and overheads of one GPU.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GpuRates {
    /// The GPU's ordinal.
    pub ordinal: u32,
    /// Host-to-device bytes per second from page-locked memory.
    pub pinned_h2d_bytes_per_second: f64,
    /// Host-to-device bytes per second from pageable memory.
    pub pageable_h2d_bytes_per_second: f64,
    /// GEMM throughput in the model's dtype, FLOP/s (None when not measured).
    pub gemm_flops: Option<f64>,
    /// Bytes the CUDA context took on the GPU.
    pub context_bytes: u64,
}

/// What `bigmodel devices --calibrate --json` writes and
/// `bigmodel plan --calibration FILE` reads.
#[derive(Clone, Debug, PartialEq)]
pub struct Calibration {
    /// The CPU.
    pub cpu: CpuRates,
    /// Host memory available when calibrated, bytes.
    pub host_available_bytes: u64,
    /// The offload folder's file system.
    pub disk: Option<DiskRates>,
    /// The GPUs.
    pub gpus: Vec<GpuRates>,
}

/// The calibration document's format tag.
pub const CALIBRATION_FORMAT: &str = "bigmodel-calibration/1";

const GB: f64 = 1e9;

impl Calibration {
    /// The JSON document (rates in GB/s and GFLOP/s, as people read them).
    pub fn to_json(&self) -> serde_json::Value {
        let gpus: Vec<serde_json::Value> = self
            .gpus
            .iter()
            .map(|g| {
                serde_json::json!({
                    "device": g.ordinal,
                    "pinned_h2d_gb_per_s": g.pinned_h2d_bytes_per_second / GB,
                    "pageable_h2d_gb_per_s": g.pageable_h2d_bytes_per_second / GB,
                    "gemm_tflops": g.gemm_flops.map(|f| f / 1e12),
                    "cuda_context_bytes": g.context_bytes,
                })
            })
            .collect();
        serde_json::json!({
            "format": CALIBRATION_FORMAT,
            "cpu": {
                "gemm_gflops": self.cpu.gemm_flops / GB,
                "gemv_gb_per_s": self.cpu.gemv_bytes_per_second / GB,
                "gemv_cached_gb_per_s": self.cpu.gemv_cached_bytes_per_second / GB,
                "last_level_cache_bytes": self.cpu.last_level_cache_bytes,
                "op_microseconds": self.cpu.op_seconds * 1e6,
                "memory_gb_per_s": self.cpu.memory_bytes_per_second / GB,
                "tensor_microseconds": self.cpu.tensor_seconds * 1e6,
            },
            "host_available_bytes": self.host_available_bytes,
            "disk": self.disk.map(|d| serde_json::json!({
                "cold_read_gb_per_s": d.cold_bytes_per_second.map(|r| r / GB),
                "warm_read_gb_per_s": d.warm_bytes_per_second / GB,
                "mapped_tensor_microseconds": d.mapped_tensor_seconds * 1e6,
            })),
            "gpus": gpus,
        })
    }

    /// Reads the document [`Calibration::to_json`] writes; errors name the
    /// key (`file` names the document).
    pub fn from_json(doc: &serde_json::Value, file: &str) -> Result<Calibration, Error> {
        let bad = |key: &str, why: &str| Error::Config {
            file: file.into(),
            key: key.into(),
            message: why.into(),
        };
        if doc.get("format").and_then(|f| f.as_str()) != Some(CALIBRATION_FORMAT) {
            return Err(bad("format", &format!("expected {CALIBRATION_FORMAT:?}")));
        }
        let rate = |v: &serde_json::Value, key: &str, scale: f64| -> Result<f64, Error> {
            let x = v
                .get(key.rsplit('.').next().unwrap_or(key))
                .and_then(|x| x.as_f64())
                .ok_or_else(|| bad(key, "missing or not a number"))?;
            if x.is_finite() && x > 0.0 {
                Ok(x * scale)
            } else {
                Err(bad(key, "must be a positive number"))
            }
        };
        let seconds = |v: &serde_json::Value, key: &str| -> Result<f64, Error> {
            let x = v
                .get(key.rsplit('.').next().unwrap_or(key))
                .and_then(|x| x.as_f64())
                .ok_or_else(|| bad(key, "missing or not a number"))?;
            if x.is_finite() && x >= 0.0 {
                Ok(x * 1e-6)
            } else {
                Err(bad(key, "must be a number of microseconds, at least 0"))
            }
        };
        let optional =
            |v: &serde_json::Value, key: &str, scale: f64| -> Result<Option<f64>, Error> {
                match v.get(key.rsplit('.').next().unwrap_or(key)) {
                    None | Some(serde_json::Value::Null) => Ok(None),
                    Some(_) => rate(v, key, scale).map(Some),
                }
            };
        let cpu = doc.get("cpu").ok_or_else(|| bad("cpu", "missing"))?;
        let cpu = CpuRates {
            gemm_flops: rate(cpu, "cpu.gemm_gflops", GB)?,
            gemv_bytes_per_second: rate(cpu, "cpu.gemv_gb_per_s", GB)?,
            gemv_cached_bytes_per_second: rate(cpu, "cpu.gemv_cached_gb_per_s", GB)?,
            last_level_cache_bytes: cpu
                .get("last_level_cache_bytes")
                .and_then(|v| v.as_u64())
                .ok_or_else(|| bad("cpu.last_level_cache_bytes", "missing or not a byte count"))?,
            op_seconds: seconds(cpu, "cpu.op_microseconds")?,
            memory_bytes_per_second: rate(cpu, "cpu.memory_gb_per_s", GB)?,
            tensor_seconds: seconds(cpu, "cpu.tensor_microseconds")?,
        };
        let host_available_bytes = doc
            .get("host_available_bytes")
            .and_then(|v| v.as_u64())
            .ok_or_else(|| bad("host_available_bytes", "missing or not a byte count"))?;
        let disk = match doc.get("disk") {
            None | Some(serde_json::Value::Null) => None,
            Some(d) => Some(DiskRates {
                cold_bytes_per_second: optional(d, "disk.cold_read_gb_per_s", GB)?,
                warm_bytes_per_second: rate(d, "disk.warm_read_gb_per_s", GB)?,
                mapped_tensor_seconds: seconds(d, "disk.mapped_tensor_microseconds")?,
            }),
        };
        let mut gpus = Vec::new();
        if let Some(list) = doc.get("gpus") {
            let list = list.as_array().ok_or_else(|| bad("gpus", "not a list"))?;
            for (i, g) in list.iter().enumerate() {
                let key = |k: &str| format!("gpus[{i}].{k}");
                gpus.push(GpuRates {
                    ordinal: g
                        .get("device")
                        .and_then(|v| v.as_u64())
                        .and_then(|v| u32::try_from(v).ok())
                        .ok_or_else(|| bad(&key("device"), "missing or not an ordinal"))?,
                    pinned_h2d_bytes_per_second: rate(g, &key("pinned_h2d_gb_per_s"), GB)?,
                    pageable_h2d_bytes_per_second: rate(g, &key("pageable_h2d_gb_per_s"), GB)?,
                    gemm_flops: optional(g, &key("gemm_tflops"), 1e12)?,
                    context_bytes: g
                        .get("cuda_context_bytes")
                        .and_then(|v| v.as_u64())
                        .ok_or_else(|| bad(&key("cuda_context_bytes"), "missing"))?,
                });
            }
        }
        Ok(Calibration {
            cpu,
            host_available_bytes,
            disk,
            gpus,
        })
    }

    fn gpu(&self, ordinal: u32) -> Option<&GpuRates> {
        self.gpus.iter().find(|g| g.ordinal == ordinal)
    }
}

/// The prediction for one plan and workload.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Prediction {
    /// Seconds of the first forward pass (the prompt), the time to the
    /// first token.
    pub first_forward_seconds: f64,
    /// Seconds of one decoding pass.
    pub seconds_per_token: f64,
    /// Offloaded bytes brought to the execution device per pass.
    pub bytes_streamed_per_token: u64,
}

impl Prediction {
    /// `{first_forward_seconds, seconds_per_token, bytes_streamed_per_token}`.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "first_forward_seconds": self.first_forward_seconds,
            "seconds_per_token": self.seconds_per_token,
            "bytes_streamed_per_token": self.bytes_streamed_per_token,
        })
    }
}

/// One block of a pass: where its weights are, where it runs, its sizes.
struct Block {
    weights_on: Device,
    bytes: u64,
    params: u64,
    tensors: u64,
    layer: bool,
    head: bool,
}

/// Predicts `map` for `model` under `options` (dtype, prefetch depth) and
/// `workload` on the machine `calibration` describes. Every GPU the map
/// uses must be in the calibration.
pub fn predict(
    model: &HfModel,
    map: &DeviceMap,
    options: &PlanOptions,
    workload: &Workload,
    calibration: &Calibration,
) -> Result<Prediction, Error> {
    let tree = &model.tree;
    let sizes = ModuleSizes::compute(
        tree,
        &SizeOptions {
            dtype: options.dtype,
            special_dtypes: options.special_dtypes.clone(),
            rule: SizeRule::Loaded,
        },
    );
    let exec = map
        .iter()
        .map(|(_, d)| d)
        .filter(|d| d.is_gpu())
        .min()
        .unwrap_or(Device::Cpu);
    if let Device::Gpu(i) = exec
        && calibration.gpu(i).is_none()
    {
        return Err(Error::BadDeviceMap(format!(
            "the calibration has no GPU {i}: calibrate on the machine the plan is for"
        )));
    }
    // The blocks in execution order: every top-level child of the model's
    // trunk before the layers, the layers, what follows, the head.
    let mut blocks = Vec::new();
    let layer_set: std::collections::HashSet<usize> = model.layers.iter().copied().collect();
    let mut stack = vec![0usize];
    while let Some(m) = stack.pop() {
        let module = tree.module(m);
        let is_layer = layer_set.contains(&m);
        let whole = is_layer
            || module.children.is_empty()
            || (!module.params.is_empty()
                && module
                    .children
                    .iter()
                    .all(|c| tree.module(*c).children.is_empty()));
        if whole {
            if sizes.of(Node::Module(m)) == 0 {
                continue;
            }
            // Buffers stay on the execution device unless offloaded too,
            // as the dispatcher keeps them.
            let streamed: Vec<(u64, u64)> = tree
                .tensors()
                .iter()
                .enumerate()
                .filter(|(_, t)| tree.is_within(t.module, m))
                .filter(|(_, t)| options.offload_buffers || t.kind == TensorKind::Param)
                .map(|(i, t)| (t.meta.numel() as u64, sizes.tensor[i]))
                .collect();
            let params = streamed.iter().map(|(n, _)| n).sum();
            let bytes = streamed.iter().map(|(_, b)| b).sum();
            let tensors = streamed.len() as u64;
            let weights_on = map
                .device_of(&module.name)
                .ok_or_else(|| Error::BadDeviceMap(format!("no device for {:?}", module.name)))?;
            blocks.push(Block {
                weights_on,
                bytes,
                params,
                tensors,
                layer: is_layer,
                head: module.name == "lm_head",
            });
            continue;
        }
        stack.extend(module.children.iter().rev());
    }
    let executes = |d: Device| d == exec || d.is_gpu();
    let offloaded_bytes: u64 = blocks
        .iter()
        .filter(|b| !executes(b.weights_on))
        .map(|b| b.bytes)
        .sum();
    let disk_bytes: u64 = blocks
        .iter()
        .filter(|b| b.weights_on == Device::Disk)
        .map(|b| b.bytes)
        .sum();
    let cpu_bytes: u64 = blocks
        .iter()
        .filter(|b| b.weights_on == Device::Cpu)
        .map(|b| b.bytes)
        .sum();
    let warm = calibration.host_available_bytes >= cpu_bytes.saturating_add(disk_bytes);
    let disk_rate = |cold_ok: bool| -> Result<f64, Error> {
        let disk = calibration.disk.ok_or_else(|| {
            Error::BadDeviceMap("the map uses disk but the calibration measured no disk".into())
        })?;
        Ok(match (warm, disk.cold_bytes_per_second) {
            (false, Some(cold)) if cold_ok => cold,
            _ => disk.warm_bytes_per_second,
        })
    };
    let shape = &model.shape;
    let cpu = calibration.cpu;
    // Weights the CPU reads per pass: from the cache when they fit in it.
    let read_per_pass: u64 = blocks
        .iter()
        .filter(|b| b.layer || b.head)
        .map(|b| b.params * 4)
        .sum();
    let gemv_rate = if read_per_pass <= cpu.last_level_cache_bytes {
        cpu.gemv_cached_bytes_per_second
    } else {
        cpu.gemv_bytes_per_second
    };
    // (compute seconds, transfer seconds) of a block for `rows` rows
    // attending to `context` positions.
    // The head computes the last position of each sequence only.
    let cost = |b: &Block, rows: u64, context: u64| -> Result<(f64, f64), Error> {
        let flops = if b.layer {
            shape.block_flops(rows, context)
        } else if b.head {
            shape.head_flops(workload.batch)
        } else {
            0.0
        };
        let ops = if b.layer {
            OPS_PER_LAYER
        } else {
            OPS_PER_SMALL_BLOCK
        };
        // Elements read as f32 by the CPU kernels; the embedding reads
        // only its rows.
        let read = if b.layer || b.head { b.params * 4 } else { 0 };
        let compute = match exec {
            Device::Gpu(i) => {
                let gemm = calibration
                    .gpu(i)
                    .and_then(|g| g.gemm_flops)
                    .ok_or_else(|| {
                        Error::BadDeviceMap(format!("the calibration has no GEMM rate for GPU {i}"))
                    })?;
                flops / gemm
            }
            _ => {
                let per_tensor = if b.weights_on == Device::Disk {
                    calibration
                        .disk
                        .map_or(cpu.tensor_seconds, |d| d.mapped_tensor_seconds)
                } else {
                    cpu.tensor_seconds
                };
                (flops / cpu.gemm_flops).max(read as f64 / gemv_rate)
                    + ops * cpu.op_seconds
                    + b.tensors as f64 * per_tensor
            }
        };
        let transfer = match (exec, b.weights_on) {
            (_, d) if executes(d) => 0.0,
            (Device::Gpu(i), Device::Cpu) => {
                let g = calibration.gpu(i).expect("checked above");
                b.bytes as f64 / g.pinned_h2d_bytes_per_second
            }
            (Device::Gpu(i), _) => {
                let g = calibration.gpu(i).expect("checked above");
                b.bytes as f64 / disk_rate(true)?.min(g.pinned_h2d_bytes_per_second)
            }
            // Mapped in place on the CPU: free when warm, read while the
            // block computes when cold.
            _ if warm => 0.0,
            _ => return Ok((compute + b.bytes as f64 / disk_rate(true)?, 0.0)),
        };
        Ok((compute, transfer))
    };
    let pass = |rows: u64, context: u64| -> Result<f64, Error> {
        let costs = blocks
            .iter()
            .map(|b| cost(b, rows, context))
            .collect::<Result<Vec<_>, _>>()?;
        if options.prefetch_depth == 0 {
            return Ok(costs.iter().map(|(c, t)| c + t).sum());
        }
        let mut seconds = costs.first().map_or(0.0, |(_, t)| *t);
        for (i, (c, _)) in costs.iter().enumerate() {
            let next = costs.get(i + 1).map_or(0.0, |(_, t)| *t);
            seconds += c.max(next);
        }
        Ok(seconds)
    };
    let batch = workload.batch;
    let generated = workload.max_seq_len.saturating_sub(workload.prompt_len);
    Ok(Prediction {
        first_forward_seconds: pass(
            batch.saturating_mul(workload.prompt_len),
            workload.prompt_len.div_ceil(2),
        )?,
        seconds_per_token: pass(batch, workload.prompt_len + generated / 2)?,
        bytes_streamed_per_token: offloaded_bytes,
    })
}
