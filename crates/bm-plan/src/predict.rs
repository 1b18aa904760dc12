//! Predicted speed of a plan: time of the first forward pass, seconds per
//! generated token and bytes streamed per token, from a cost model fed by
//! a calibration of the machine (`bigmodel devices --calibrate`, passed in
//! as data: bm-plan measures nothing).
//!
//! The cost model (docs/guide.md, "Predicting speed", explains it for users):
//!
//! * A pass runs the blocks in order (embedding, layers, final norm, head;
//!   [`Pass`]). On the CPU a block's **compute** time is the sum of
//!   - its linears: one row (a decoding step of one sequence) streams each
//!     weight through a dot product, `max(flops / gemm_rate, bytes /
//!     gemv_rate)` (the cached read rate when the weights a pass reads fit
//!     in the last-level cache); several rows (a prompt, a batch) pack each
//!     weight once per call and then multiply, `bytes / packing_rate +
//!     flops / gemm_rate`. The packing term is what makes a short prompt
//!     cost far more per FLOP than a long one;
//!   - its attention: per score (a query row, a head, a key it sees)
//!     `4 · head_dim` FLOPs at the attention rate (scalar loops, several
//!     times below the GEMM rate) and a fixed cost (the softmax's
//!     exponential, loop overheads), which dominates narrow heads;
//!   - its element-wise ops (norms, rotations, residual adds, the MLP's
//!     product and activation), per element of every row, at the
//!     calibrated rates;
//!   - a fixed cost per parallel op (handing work to the thread pool: the
//!     projections and attention, and over several rows the norms too)
//!     and per tensor the
//!     dispatcher hands out (calibrated for resident and for disk-offloaded,
//!     mapped tensors), which dominate small models;
//!   - on the first pass of a process only, the page faults of weights used
//!     in place through a mapping (CPU-resident weights are views of the
//!     checkpoint unless cast at load; disk weights are views of their
//!     file), at the calibrated first-touch rate of cached pages.
//!
//!   The first pass on the CPU also pays, once, the process's start-up of
//!   its compute: the thread pool's threads start and the GEMM's
//!   per-thread buffers are allocated and faulted in on the first parallel
//!   op and the first linear. Measured in `bigmodel run` traces as layer
//!   0 of the first pass taking several milliseconds more than layers 1 to
//!   3 in its first norm, projections and MLP linears (about 5 ms at a
//!   load average of 3 on a 2-core VM), and calibrated as what a small
//!   layer's norm and linears take as the first ops of a fresh process
//!   beyond the same calls warm, the median over a few fresh processes (a
//!   process measures it once, and one timing swings by several times on
//!   a loaded machine).
//!
//!   On a GPU it is `flops / gpu_gemm_rate`.
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
//! * The first pass has `batch · prompt_len` rows, position `i` attending
//!   to `i + 1` positions; the head computes the last position of each
//!   sequence only. A decoding pass has `batch` rows attending to the
//!   prompt plus half the generated tokens. `first_forward_seconds` is the
//!   first pass (what `bigmodel run` reports as its first forward: the
//!   prompt's pass after loading, with the page cache warm);
//!   `seconds_per_token` a decoding pass; `bytes_streamed_per_token` every
//!   offloaded byte, which each pass brings in once.
//! * A sparse (mixture-of-experts) layer is two blocks: the layer without
//!   its experts, then its experts list ([`BlockKind::Experts`]). Each row
//!   runs the `top_k` experts its router picks, and only the experts some
//!   row picked are fetched: of `E` experts, `E · (1 − (1 − k/E)^rows)`
//!   on average (routing taken as uniform), exactly `k` for one row. The
//!   runtime (bm-models `moe.rs`, bm-dispatch `Forward::weight`) hands
//!   those out one tensor at a time; on the CPU a disk expert is used in
//!   place through its file mapping, so only the picked experts' pages are
//!   read when the cache is cold. An experts list on its layer's device
//!   streams with the layer (the layer's hook loads the whole subtree:
//!   every expert's tensors are handed out, and to a GPU every expert is
//!   copied); on its own device only the picked experts move, each when
//!   the op that uses it asks (uploaded to a GPU from pageable memory, not
//!   overlapped with compute). `bytes_streamed_per_token` counts what the
//!   runtime counts, the offloaded weights a pass fetches, averaged over
//!   the workload's passes (the prompt's, then one per further token), as
//!   `bigmodel run --json` averages it.

use bm_tensor::DType;

use crate::Error;
use crate::device::Device;
use crate::hf::HfModel;
use crate::ledger::{ModelShape, Workload};
use crate::plan::{DeviceMap, PlanOptions};
use crate::sizes::SizeRule;
use crate::tree::{ModuleId, Node, TensorKind};

/// Parallel ops a decoder layer runs on one row (seven projections and
/// attention), each paying the calibrated fixed cost of an op (handing
/// work to the thread pool); norms, rotations and element-wise ops over a
/// row run on the calling thread.
const OPS_PER_LAYER: f64 = 8.0;
/// The same over several rows: the two norms split their rows over the
/// pool too.
const OPS_PER_LAYER_ROWS: f64 = 10.0;
/// Parallel ops of the embedding, the final norm or the head.
const OPS_PER_SMALL_BLOCK: f64 = 1.0;
/// Parallel ops of one picked expert: its three projections (a sparse
/// layer runs them per picked expert instead of the MLP's).
const OPS_PER_EXPERT: f64 = 3.0;
/// Parallel ops of a sparse layer's router.
const OPS_OF_ROUTER: f64 = 1.0;

/// Measured rates of the host's CPU.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CpuRates {
    /// Dense f32 GEMM throughput of a linear of several rows, in FLOP/s
    /// (fitted with the weight-read rate over a small model's linear
    /// shapes and a few row counts). Also what F16 weights run at: they
    /// are widened in registers and multiplied as f32.
    pub gemm_flops: f64,
    /// Bytes of f32 weight a linear of several rows reads per second
    /// besides its FLOPs (a cost per call, whatever the row count: what
    /// makes a short prompt's products slower per FLOP than a long one's).
    pub gemm_weight_bytes_per_second: f64,
    /// [`CpuRates::gemm_flops`] for BF16 weights times BF16 inputs, which
    /// run on the CPU's bf16 dot product where it has one (None in
    /// documents calibrated before it was measured: the f32 rate is used).
    pub bf16_gemm_flops: Option<f64>,
    /// [`CpuRates::gemm_weight_bytes_per_second`] for BF16 weights (None as
    /// above).
    pub bf16_gemm_weight_bytes_per_second: Option<f64>,
    /// Bytes of weights a one-row linear reads per second from memory
    /// (distinct weights, twice the cache in all, read one after another
    /// as a decoding pass reads a model larger than the cache). The
    /// kernels read weights in place in their loaded format, so a pass
    /// reads its weights' bytes, not four per parameter.
    pub gemv_bytes_per_second: f64,
    /// The same for a weight that stays in the cache.
    pub gemv_cached_bytes_per_second: f64,
    /// The last-level cache: a model whose weights per pass fit in it reads
    /// them at the cached rate (0 when unknown).
    pub last_level_cache_bytes: u64,
    /// Attention throughput in FLOP/s (`4 · head_dim` per score, a score
    /// being a query row, head and key: scalar loops, far below the GEMM
    /// rate).
    pub attention_flops: f64,
    /// Seconds per attention score besides its FLOPs (the softmax's
    /// exponential, loop overheads): what makes narrow heads slow.
    pub attention_score_seconds: f64,
    /// Seconds per element of an element-wise op over many rows (a
    /// residual add, the MLP's product, a norm, a rotation).
    pub elementwise_seconds: f64,
    /// Seconds per element of the MLP's activation (an exponential each).
    pub activation_seconds: f64,
    /// Fixed seconds of one small op.
    pub op_seconds: f64,
    /// Sequential read bandwidth of host memory, bytes per second.
    pub memory_bytes_per_second: f64,
    /// Seconds the dispatcher spends per resident tensor a block reads
    /// (entering, handing out, leaving).
    pub tensor_seconds: f64,
    /// Seconds the first pass of a process spends once starting its
    /// compute (the thread pool, the GEMM's per-thread buffers): a small
    /// layer's norm and linears as the first ops of a fresh process,
    /// beyond the same calls warm (the median over a few processes).
    pub startup_seconds: f64,
}

/// Measured read rates of the offload folder's file system.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DiskRates {
    /// Bytes per second with the page cache dropped (None when it could
    /// not be dropped).
    pub cold_bytes_per_second: Option<f64>,
    /// Bytes per second from the page cache.
    pub warm_bytes_per_second: f64,
    /// Bytes per second of a first read of a mapped file whose pages are
    /// in the page cache (the page faults of the first pass over weights
    /// used in place).
    pub first_touch_bytes_per_second: f64,
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
pub const CALIBRATION_FORMAT: &str = "bigmodel-calibration/3";

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
                "gemm_weight_gb_per_s": self.cpu.gemm_weight_bytes_per_second / GB,
                "bf16_gemm_gflops": self.cpu.bf16_gemm_flops.map(|f| f / GB),
                "bf16_gemm_weight_gb_per_s": self.cpu.bf16_gemm_weight_bytes_per_second.map(|b| b / GB),
                "gemv_gb_per_s": self.cpu.gemv_bytes_per_second / GB,
                "gemv_cached_gb_per_s": self.cpu.gemv_cached_bytes_per_second / GB,
                "last_level_cache_bytes": self.cpu.last_level_cache_bytes,
                "attention_gflops": self.cpu.attention_flops / GB,
                "attention_score_nanoseconds": self.cpu.attention_score_seconds * 1e9,
                "elementwise_nanoseconds": self.cpu.elementwise_seconds * 1e9,
                "activation_nanoseconds": self.cpu.activation_seconds * 1e9,
                "op_microseconds": self.cpu.op_seconds * 1e6,
                "memory_gb_per_s": self.cpu.memory_bytes_per_second / GB,
                "tensor_microseconds": self.cpu.tensor_seconds * 1e6,
                "startup_microseconds": self.cpu.startup_seconds * 1e6,
            },
            "host_available_bytes": self.host_available_bytes,
            "disk": self.disk.map(|d| serde_json::json!({
                "cold_read_gb_per_s": d.cold_bytes_per_second.map(|r| r / GB),
                "warm_read_gb_per_s": d.warm_bytes_per_second / GB,
                "first_touch_gb_per_s": d.first_touch_bytes_per_second / GB,
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
        match doc.get("format").and_then(|f| f.as_str()) {
            Some(CALIBRATION_FORMAT) => {}
            Some(old) if old.starts_with("bigmodel-calibration/") => {
                return Err(bad(
                    "format",
                    &format!(
                        "{old:?} was written by an older bigmodel and lacks rates this one \
                         predicts with ({CALIBRATION_FORMAT:?} expected): calibrate again with \
                         `bigmodel devices --calibrate --json`"
                    ),
                ));
            }
            _ => return Err(bad("format", &format!("expected {CALIBRATION_FORMAT:?}"))),
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
                Err(bad(
                    key,
                    "must be a time of at least 0, in the unit its name says",
                ))
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
            gemm_weight_bytes_per_second: rate(cpu, "cpu.gemm_weight_gb_per_s", GB)?,
            bf16_gemm_flops: optional(cpu, "cpu.bf16_gemm_gflops", GB)?,
            bf16_gemm_weight_bytes_per_second: optional(cpu, "cpu.bf16_gemm_weight_gb_per_s", GB)?,
            gemv_bytes_per_second: rate(cpu, "cpu.gemv_gb_per_s", GB)?,
            gemv_cached_bytes_per_second: rate(cpu, "cpu.gemv_cached_gb_per_s", GB)?,
            last_level_cache_bytes: cpu
                .get("last_level_cache_bytes")
                .and_then(|v| v.as_u64())
                .ok_or_else(|| bad("cpu.last_level_cache_bytes", "missing or not a byte count"))?,
            attention_flops: rate(cpu, "cpu.attention_gflops", GB)?,
            attention_score_seconds: seconds(cpu, "cpu.attention_score_nanoseconds")? * 1e-3,
            elementwise_seconds: seconds(cpu, "cpu.elementwise_nanoseconds")? * 1e-3,
            activation_seconds: seconds(cpu, "cpu.activation_nanoseconds")? * 1e-3,
            op_seconds: seconds(cpu, "cpu.op_microseconds")?,
            memory_bytes_per_second: rate(cpu, "cpu.memory_gb_per_s", GB)?,
            tensor_seconds: seconds(cpu, "cpu.tensor_microseconds")?,
            startup_seconds: seconds(cpu, "cpu.startup_microseconds")?,
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
                first_touch_bytes_per_second: rate(d, "disk.first_touch_gb_per_s", GB)?,
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

/// What a block of a pass computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlockKind {
    /// A repeated layer: its linears and attention.
    Layer,
    /// The head: the last position of each sequence only.
    Head,
    /// Anything else (embedding, final norm): reads a few rows of its
    /// weights, costs one op.
    Other,
    /// The experts list of the sparse layer just before it, `experts`
    /// alike experts: each row runs the ones its router picks, and only
    /// those are fetched.
    Experts {
        /// Experts in the list.
        experts: u64,
    },
}

/// One block of a pass: a device-map key and its sizes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Block {
    /// The module's name, as a device map names it.
    pub name: String,
    /// Bytes of the weights in their loaded format: what a pass streams
    /// when the block is offloaded, and what the CPU kernels read in place
    /// when it runs there.
    pub bytes: u64,
    /// Parameters.
    pub params: u64,
    /// Tensors the dispatcher hands out.
    pub tensors: u64,
    /// What it computes.
    pub kind: BlockKind,
    /// Its first tensor streamed: where a map keys the block below its
    /// name (a layer split around its experts), the block rests where
    /// this tensor does.
    pub probe: String,
}

/// The blocks of a model's forward pass in execution order (every
/// top-level child of the model's trunk before the layers, the layers,
/// what follows, the head), sized under a plan's dtype options. Sizing is
/// done once; [`Pass::predict`] then costs any placement of the blocks.
#[derive(Clone, Debug)]
pub struct Pass {
    blocks: Vec<Block>,
    /// The weights are cast at load (another dtype than stored), so the
    /// CPU-resident ones are owned copies, not views of the checkpoint.
    cast: bool,
    /// The dtype the weights are loaded and computed in.
    dtype: DType,
}

impl Pass {
    /// The blocks of `model` under `options` (dtype, special dtypes,
    /// whether buffers are offloaded).
    pub fn of(model: &HfModel, options: &PlanOptions) -> Pass {
        let tree = &model.tree;
        let sizes = options.sizes(tree, SizeRule::Loaded);
        let mut blocks = Vec::new();
        let layer_set: std::collections::HashSet<usize> = model.layers.iter().copied().collect();
        let lists = crate::experts::expert_lists(tree);
        // The block `name` of the tensors within the modules `within`
        // accepts. Buffers stay on the execution device unless offloaded
        // too, as the dispatcher keeps them.
        let block = |name: &str, kind: BlockKind, within: &dyn Fn(ModuleId) -> bool| {
            let streamed: Vec<(u64, u64, &str)> = tree
                .tensors()
                .enumerate()
                .filter(|(_, t)| within(t.module))
                .filter(|(_, t)| options.offload_buffers || t.kind == TensorKind::Param)
                .map(|(i, t)| (t.meta.numel() as u64, sizes.tensor[i], t.name))
                .collect();
            Block {
                name: name.to_string(),
                bytes: streamed.iter().map(|(_, b, _)| b).sum(),
                params: streamed.iter().map(|(n, _, _)| n).sum(),
                tensors: streamed.len() as u64,
                kind,
                probe: streamed.first().map_or(name, |(_, _, t)| t).to_string(),
            }
        };
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
                // A sparse layer's experts lists are blocks of their own,
                // after the rest of the layer.
                let own: Vec<ModuleId> = match is_layer {
                    true => lists
                        .iter()
                        .copied()
                        .filter(|&l| tree.is_within(l, m))
                        .collect(),
                    false => Vec::new(),
                };
                let in_list = |t: ModuleId| own.iter().any(|&l| tree.is_within(t, l));
                let kind = if is_layer {
                    BlockKind::Layer
                } else if module.name == "lm_head" {
                    BlockKind::Head
                } else {
                    BlockKind::Other
                };
                blocks.push(block(module.name, kind, &|t| {
                    tree.is_within(t, m) && !in_list(t)
                }));
                for &l in &own {
                    let experts = tree.module(l).children.len() as u64;
                    let list = block(tree.module(l).name, BlockKind::Experts { experts }, &|t| {
                        tree.is_within(t, l)
                    });
                    if list.tensors > 0 {
                        blocks.push(list);
                    }
                }
                continue;
            }
            stack.extend(module.children.iter().rev());
        }
        Pass {
            blocks,
            cast: options.dtype.is_some_and(|d| d != model.dtype),
            dtype: options.dtype.unwrap_or(model.dtype),
        }
    }

    /// The blocks, in execution order.
    pub fn blocks(&self) -> &[Block] {
        &self.blocks
    }

    /// Where `map` puts each block's weights: a block keyed below its name
    /// rests where its probe tensor does, an experts list keyed expert by
    /// expert where most of its experts do.
    pub fn placement(&self, map: &DeviceMap) -> Result<Vec<Device>, Error> {
        let lookup = map.lookup();
        self.blocks
            .iter()
            .map(|b| {
                let found = lookup.device_of(&b.name).or_else(|| match b.kind {
                    BlockKind::Experts { experts } => {
                        let mut count: Vec<(Device, u64)> = Vec::new();
                        for e in 0..experts {
                            let Some(d) = lookup.device_of(&format!("{}.{e}", b.name)) else {
                                continue;
                            };
                            match count.iter_mut().find(|(x, _)| *x == d) {
                                Some((_, n)) => *n += 1,
                                None => count.push((d, 1)),
                            }
                        }
                        count
                            .iter()
                            .fold(None, |best: Option<(Device, u64)>, &(d, n)| match best {
                                Some((_, most)) if most >= n => best,
                                _ => Some((d, n)),
                            })
                            .map(|(d, _)| d)
                    }
                    _ => lookup.device_of(&b.probe),
                });
                found.ok_or_else(|| Error::BadDeviceMap(format!("no device for {:?}", b.name)))
            })
            .collect()
    }

    /// Predicts the pass with block `i`'s weights on `placement[i]`,
    /// `prefetch_depth` as the dispatcher runs it, for `workload` on the
    /// machine `calibration` describes. The execution device is the
    /// lowest GPU the placement uses, else the CPU; it must be in the
    /// calibration.
    pub fn predict(
        &self,
        shape: &ModelShape,
        placement: &[Device],
        prefetch_depth: usize,
        workload: &Workload,
        calibration: &Calibration,
    ) -> Result<Prediction, Error> {
        let blocks = &self.blocks;
        debug_assert_eq!(blocks.len(), placement.len());
        let exec = Device::execution(placement.iter().copied());
        let gpu = match exec {
            Device::Gpu(i) => Some(calibration.gpu(i).ok_or_else(|| {
                Error::BadDeviceMap(format!(
                    "the calibration has no GPU {i}: calibrate on the machine the plan is for"
                ))
            })?),
            _ => None,
        };
        let gpu_gemm = |g: &GpuRates| {
            g.gemm_flops.ok_or_else(|| {
                Error::BadDeviceMap(format!(
                    "the calibration has no GEMM rate for GPU {}",
                    g.ordinal
                ))
            })
        };
        let executes = |d: Device| d == exec || d.is_gpu();
        // An experts list on its layer's device streams with the layer.
        let with_layer = |i: usize| {
            matches!(blocks[i].kind, BlockKind::Experts { .. })
                && i > 0
                && placement[i] == placement[i - 1]
        };
        let is_sparse = |i: usize| {
            matches!(
                blocks.get(i + 1).map(|b| b.kind),
                Some(BlockKind::Experts { .. })
            )
        };
        let top_k = shape.experts_per_token;
        let host_bytes: u64 = blocks
            .iter()
            .zip(placement)
            .filter(|(_, d)| **d == Device::Cpu || **d == Device::Disk)
            .map(|(b, _)| b.bytes)
            .sum();
        // Offloaded bytes stay in the page cache between passes when the
        // memory available holds them with the resident ones.
        let warm = calibration.host_available_bytes >= host_bytes;
        let disk_rate = || -> Result<f64, Error> {
            let disk = calibration.disk.ok_or_else(|| {
                Error::BadDeviceMap("the map uses disk but the calibration measured no disk".into())
            })?;
            Ok(match (warm, disk.cold_bytes_per_second) {
                (false, Some(cold)) => cold,
                _ => disk.warm_bytes_per_second,
            })
        };
        let cpu = calibration.cpu;
        // Weights the CPU reads per pass: from the cache when they fit in it.
        let read_per_pass: u64 = blocks
            .iter()
            .map(|b| match b.kind {
                BlockKind::Other => 0,
                BlockKind::Experts { experts } => {
                    let one = b.bytes / experts.max(1);
                    (routed(experts, top_k, workload.batch) * one as f64) as u64
                }
                _ => b.bytes,
            })
            .sum();
        let gemv_rate = if read_per_pass <= cpu.last_level_cache_bytes {
            cpu.gemv_cached_bytes_per_second
        } else {
            cpu.gemv_bytes_per_second
        };
        // The multi-row rates of the pass's weights: BF16 runs on the bf16
        // dot product; F32 and F16 (widened in registers) at the f32 rate.
        let (gemm_flops, gemm_weight_rate) = match (
            self.dtype,
            cpu.bf16_gemm_flops,
            cpu.bf16_gemm_weight_bytes_per_second,
        ) {
            (DType::BF16, Some(flops), Some(bytes)) => (flops, bytes),
            _ => (cpu.gemm_flops, cpu.gemm_weight_bytes_per_second),
        };
        // A CPU linear over `rows` rows reading `read` bytes of weights
        // doing `flops`: one row streams the weight through a dot product;
        // more rows multiply at the GEMM rate plus a read of the weight.
        let cpu_linear = |rows: u64, read: u64, flops: f64| -> f64 {
            if rows <= 1 {
                (flops / gemm_flops).max(read as f64 / gemv_rate)
            } else {
                flops / gemm_flops + read as f64 / gemm_weight_rate
            }
        };
        // Seconds the dispatcher spends per tensor of a block on `on`.
        let per_tensor = |on: Device| {
            if on == Device::Disk {
                calibration
                    .disk
                    .map_or(cpu.tensor_seconds, |d| d.mapped_tensor_seconds)
            } else {
                cpu.tensor_seconds
            }
        };
        // Weights used in place through a mapping fault their pages in on
        // the first pass that reads them (`bytes` of them).
        let first_touch = |on: Device, first: bool, bytes: f64| match calibration.disk {
            Some(d) if first && (on == Device::Disk || !self.cast) => {
                bytes / d.first_touch_bytes_per_second
            }
            _ => 0.0,
        };
        // (compute seconds, transfer seconds) of the experts list `i` of
        // `experts` on a pass of `rows` rows.
        let experts_cost = |i: usize, experts: u64, rows: u64, first: bool| {
            let (b, on) = (&blocks[i], placement[i]);
            let n = experts.max(1);
            let (params, bytes, tensors) = (b.params / n, b.bytes / n, b.tensors / n);
            let picked = routed(experts, top_k, rows);
            let flops = 2.0 * (rows * top_k) as f64 * params as f64;
            let moved = picked * bytes as f64;
            let compute = match gpu {
                Some(g) => flops / gpu_gemm(g)?,
                None => {
                    // Each picked expert runs its three projections over
                    // the rows routed to it, its MLP `width` wide.
                    let rows_each = ((rows * top_k) as f64 / picked.max(1.0)).ceil() as u64;
                    let width = params as f64 / (3 * shape.hidden.max(1)) as f64;
                    let elementwise = (rows * top_k) as f64
                        * width
                        * (cpu.elementwise_seconds + cpu.activation_seconds);
                    // Loaded with the layer, every expert is handed out;
                    // on their own, only the picked ones.
                    let handed = if with_layer(i) && !executes(on) {
                        b.tensors as f64
                    } else {
                        picked * tensors as f64
                    };
                    let read = picked * bytes as f64;
                    cpu_linear(rows_each, read as u64, flops)
                        + elementwise
                        + OPS_PER_EXPERT * picked * cpu.op_seconds
                        + handed * per_tensor(on)
                        + first_touch(on, first, read.min(moved))
                }
            };
            let transfer = match (gpu, on) {
                (_, d) if executes(d) => 0.0,
                // With the layer: every expert, as the rest of the layer.
                (Some(g), Device::Cpu) if with_layer(i) => {
                    b.bytes as f64 / g.pinned_h2d_bytes_per_second
                }
                (Some(g), _) if with_layer(i) => {
                    b.bytes as f64 / disk_rate()?.min(g.pinned_h2d_bytes_per_second)
                }
                // On their own: the picked ones, brought to host memory and
                // uploaded by the op that uses them, while nothing else runs.
                (Some(g), Device::Cpu) => {
                    return Ok((compute + moved / g.pageable_h2d_bytes_per_second, 0.0));
                }
                (Some(g), _) => {
                    let rate = disk_rate()?.min(g.pageable_h2d_bytes_per_second);
                    return Ok((compute + moved / rate, 0.0));
                }
                (None, _) if warm => 0.0,
                // Mapped in place: the picked experts' pages are read.
                (None, _) => return Ok((compute + moved / disk_rate()?, 0.0)),
            };
            Ok((compute, transfer))
        };
        // (compute seconds, transfer seconds) of block `i` for a pass of
        // `rows` rows attending to `context` positions on average; `first`
        // marks the first pass of a process.
        let cost = |i: usize, rows: u64, context: f64, first: bool| -> Result<(f64, f64), Error> {
            let (b, on) = (&blocks[i], placement[i]);
            let sparse = is_sparse(i);
            let (rows, linear_flops, attention_flops) = match b.kind {
                BlockKind::Experts { experts } => return experts_cost(i, experts, rows, first),
                // The rest of a sparse layer: its projections and router
                // (and any shared expert), two FLOPs per parameter a row.
                BlockKind::Layer if sparse => (
                    rows,
                    2.0 * rows as f64 * b.params as f64,
                    shape.attention_flops(rows, context),
                ),
                BlockKind::Layer => (
                    rows,
                    shape.linear_flops(rows),
                    shape.attention_flops(rows, context),
                ),
                BlockKind::Head => (workload.batch, shape.head_flops(workload.batch), 0.0),
                BlockKind::Other => (rows, 0.0, 0.0),
            };
            let compute = match gpu {
                Some(g) => (linear_flops + attention_flops) / gpu_gemm(g)?,
                None => {
                    let (ops, read) = match b.kind {
                        BlockKind::Layer if rows > 1 => (OPS_PER_LAYER_ROWS, b.bytes),
                        BlockKind::Layer => (OPS_PER_LAYER, b.bytes),
                        BlockKind::Head => (OPS_PER_SMALL_BLOCK, b.bytes),
                        // The embedding reads only its rows.
                        _ => (OPS_PER_SMALL_BLOCK, 0),
                    };
                    let ops = match sparse {
                        true => ops - OPS_PER_EXPERT + OPS_OF_ROUTER,
                        false => ops,
                    };
                    let scores = attention_flops / (4.0 * shape.head_dim as f64);
                    let (simple, activation) = match b.kind {
                        // The MLP's product and activation run in the
                        // experts of a sparse layer.
                        BlockKind::Layer if sparse => {
                            let (simple, activation) = shape.elementwise_per_row();
                            (simple.saturating_sub(activation), 0)
                        }
                        BlockKind::Layer => shape.elementwise_per_row(),
                        _ => (0, 0),
                    };
                    let elementwise = rows as f64
                        * (simple as f64 * cpu.elementwise_seconds
                            + activation as f64 * cpu.activation_seconds);
                    cpu_linear(rows, read, linear_flops)
                        + attention_flops / cpu.attention_flops
                        + scores * cpu.attention_score_seconds
                        + elementwise
                        + ops * cpu.op_seconds
                        + b.tensors as f64 * per_tensor(on)
                        + first_touch(on, first, read.min(b.bytes) as f64)
                }
            };
            let transfer = match (gpu, on) {
                (_, d) if executes(d) => 0.0,
                (Some(g), Device::Cpu) => b.bytes as f64 / g.pinned_h2d_bytes_per_second,
                (Some(g), _) => b.bytes as f64 / disk_rate()?.min(g.pinned_h2d_bytes_per_second),
                // Mapped in place on the CPU: free when warm, read while the
                // block computes when cold (an embedding reads only the
                // pages of its rows).
                (None, _) if warm => 0.0,
                (None, _) => {
                    let read = match b.kind {
                        BlockKind::Other if b.params > 0 => b
                            .bytes
                            .min(rows * shape.hidden * (b.bytes / b.params).max(1)),
                        _ => b.bytes,
                    };
                    return Ok((compute + read as f64 / disk_rate()?, 0.0));
                }
            };
            Ok((compute, transfer))
        };
        let pass = |rows: u64, context: f64, first: bool| -> Result<f64, Error> {
            let mut costs: Vec<(f64, f64)> = Vec::with_capacity(blocks.len());
            for i in 0..blocks.len() {
                let (c, t) = cost(i, rows, context, first)?;
                match costs.last_mut() {
                    // Loaded with its layer: one unit.
                    Some(layer) if with_layer(i) => {
                        layer.0 += c;
                        layer.1 += t;
                    }
                    _ => costs.push((c, t)),
                }
            }
            // The CPU's compute starts up once, on the first pass.
            let startup = if first && gpu.is_none() {
                cpu.startup_seconds
            } else {
                0.0
            };
            if prefetch_depth == 0 {
                return Ok(startup + costs.iter().map(|(c, t)| c + t).sum::<f64>());
            }
            let mut seconds = startup + costs.first().map_or(0.0, |(_, t)| *t);
            for (i, (c, _)) in costs.iter().enumerate() {
                let next = costs.get(i + 1).map_or(0.0, |(_, t)| *t);
                seconds += c.max(next);
            }
            Ok(seconds)
        };
        let batch = workload.batch;
        let prompt = workload.prompt_len;
        let generated = workload.max_seq_len.saturating_sub(prompt);
        // What the runtime counts: every offloaded weight a pass fetches,
        // averaged over the passes (the prompt's, then one per further
        // token): the picked experts of an offloaded list, all of any other
        // offloaded block.
        let passes = generated.max(1);
        let mut whole = 0u64;
        let mut experts_bytes = 0.0;
        for (b, on) in blocks.iter().zip(placement) {
            match b.kind {
                _ if executes(*on) => {}
                BlockKind::Experts { experts } => {
                    let picked = routed(experts, top_k, batch.saturating_mul(prompt))
                        + (passes - 1) as f64 * routed(experts, top_k, batch);
                    experts_bytes += picked / passes as f64 * (b.bytes / experts.max(1)) as f64;
                }
                _ => whole += b.bytes,
            }
        }
        Ok(Prediction {
            // Causal: prompt position i attends to i + 1 positions.
            first_forward_seconds: pass(
                batch.saturating_mul(prompt),
                (prompt as f64 + 1.0) / 2.0,
                true,
            )?,
            seconds_per_token: pass(batch, prompt as f64 + generated as f64 / 2.0, false)?,
            bytes_streamed_per_token: whole + experts_bytes.round() as u64,
        })
    }
}

/// Experts `rows` rows pick together, each `top_k` of `experts` (routing
/// taken as uniform): `E · (1 − (1 − k/E)^rows)` on average, exactly `k`
/// for one row.
fn routed(experts: u64, top_k: u64, rows: u64) -> f64 {
    let k = top_k.min(experts);
    if rows <= 1 || k == experts {
        return (k * rows.min(1)) as f64;
    }
    let e = experts as f64;
    e * (1.0 - (1.0 - k as f64 / e).powf(rows as f64))
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
    let pass = Pass::of(model, options);
    let placement = pass.placement(map)?;
    pass.predict(
        &model.shape,
        &placement,
        options.prefetch_depth,
        workload,
        calibration,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::HfConfig;
    use crate::hf::tree_from_config;

    fn calibration_json() -> serde_json::Value {
        serde_json::json!({
            "format": CALIBRATION_FORMAT,
            "cpu": {
                "gemm_gflops": 20.0, "gemm_weight_gb_per_s": 8.0, "gemv_gb_per_s": 4.0,
                "gemv_cached_gb_per_s": 8.0, "last_level_cache_bytes": 0,
                "attention_gflops": 2.0, "attention_score_nanoseconds": 5.0,
                "elementwise_nanoseconds": 1.0, "activation_nanoseconds": 3.0,
                "op_microseconds": 5.0, "memory_gb_per_s": 8.0, "tensor_microseconds": 1.0,
                "startup_microseconds": 3000.0
            },
            "host_available_bytes": 1u64 << 40,
            "disk": null,
            "gpus": []
        })
    }

    #[test]
    fn the_calibration_document_round_trips() {
        let calibration = Calibration::from_json(&calibration_json(), "c.json").unwrap();
        assert_eq!(calibration.cpu.startup_seconds, 3e-3);
        // Written and read again: equal up to the unit conversions' rounding.
        let again = Calibration::from_json(&calibration.to_json(), "c.json").unwrap();
        assert!((again.cpu.startup_seconds - 3e-3).abs() < 1e-15);
        assert!((again.cpu.attention_score_seconds - 5e-9).abs() < 1e-20);
    }

    #[test]
    fn an_older_calibration_is_refused_by_name_with_what_to_do() {
        let mut doc = calibration_json();
        doc["format"] = serde_json::json!("bigmodel-calibration/2");
        let message = Calibration::from_json(&doc, "old.json")
            .unwrap_err()
            .to_string();
        assert!(
            message.contains("old.json")
                && message.contains("bigmodel-calibration/2")
                && message.contains("bigmodel devices --calibrate"),
            "{message}"
        );
        doc["format"] = serde_json::json!("something else");
        let message = Calibration::from_json(&doc, "odd.json")
            .unwrap_err()
            .to_string();
        assert!(
            message.contains("odd.json") && message.contains("expected"),
            "{message}"
        );
    }

    #[test]
    fn the_cpu_reads_weights_in_their_loaded_format() {
        // A model large enough for its weight reads to dominate a token.
        let config = serde_json::json!({
            "model_type": "llama", "hidden_size": 1024, "intermediate_size": 4096,
            "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 8,
            "vocab_size": 256, "max_position_embeddings": 128, "torch_dtype": "float32",
        });
        let model =
            tree_from_config(&HfConfig::from_value(config, "config.json").unwrap()).unwrap();
        let workload = Workload {
            batch: 1,
            prompt_len: 64,
            max_seq_len: 72,
            all_logits: false,
        };
        let mut calibration = Calibration::from_json(&calibration_json(), "c.json").unwrap();
        calibration.cpu.startup_seconds = 0.0;
        let predict = |dtype: DType, c: &Calibration| {
            let options = PlanOptions {
                dtype: Some(dtype),
                ..PlanOptions::default()
            };
            let pass = Pass::of(&model, &options);
            let placement = vec![Device::Cpu; pass.blocks().len()];
            pass.predict(&model.shape, &placement, 0, &workload, c)
                .unwrap()
        };
        let (f32, bf16) = (
            predict(DType::F32, &calibration),
            predict(DType::BF16, &calibration),
        );
        // Decoding reads half the bytes; without bf16 GEMM rates a prompt
        // costs about what f32's does (its FLOPs dominate).
        let ratio = f32.seconds_per_token / bf16.seconds_per_token;
        assert!(ratio > 1.8 && ratio <= 2.0, "{ratio}");
        let prompt = f32.first_forward_seconds / bf16.first_forward_seconds;
        assert!((1.0..1.2).contains(&prompt), "{prompt}");
        // With them, the bf16 prompt runs at its own (here twice) the rate.
        calibration.cpu.bf16_gemm_flops = Some(2.0 * calibration.cpu.gemm_flops);
        calibration.cpu.bf16_gemm_weight_bytes_per_second =
            Some(calibration.cpu.gemm_weight_bytes_per_second);
        let faster = predict(DType::BF16, &calibration);
        assert!(faster.first_forward_seconds < 0.7 * bf16.first_forward_seconds);
        assert_eq!(faster.seconds_per_token, bf16.seconds_per_token);
        assert_eq!(predict(DType::F32, &calibration), f32);
    }

    #[test]
    fn the_cpu_start_up_is_paid_once_by_the_first_pass() {
        let config = serde_json::json!({
            "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "vocab_size": 256, "max_position_embeddings": 128, "torch_dtype": "float32",
        });
        let model =
            tree_from_config(&HfConfig::from_value(config, "config.json").unwrap()).unwrap();
        let options = PlanOptions::default();
        let pass = Pass::of(&model, &options);
        let placement = vec![Device::Cpu; pass.blocks().len()];
        let workload = Workload {
            batch: 1,
            prompt_len: 8,
            max_seq_len: 16,
            all_logits: false,
        };
        let with = Calibration::from_json(&calibration_json(), "c.json").unwrap();
        let mut without = with.clone();
        without.cpu.startup_seconds = 0.0;
        let predict = |c: &Calibration, depth: usize| {
            pass.predict(&model.shape, &placement, depth, &workload, c)
                .unwrap()
        };
        for depth in [0, 1] {
            let (a, b) = (predict(&with, depth), predict(&without, depth));
            assert!((a.first_forward_seconds - b.first_forward_seconds - 3e-3).abs() < 1e-12);
            assert_eq!(a.seconds_per_token, b.seconds_per_token);
        }
    }
}
