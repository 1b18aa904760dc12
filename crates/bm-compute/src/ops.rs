//! The operations the reference models are made of.
//!
//! Each op checks its operands (shapes, dtypes), then runs on the backend
//! its inputs live on. Inputs may be F32, F16 or BF16 (weights and
//! activations need not agree); the result has the dtype of the activation
//! operand. Half-precision inputs are widened to f32 and results rounded
//! once, PyTorch's rule for CPU kernels that accumulate in f32.

use bm_device::BLayout;
use bm_tensor::DType;
use half::{bf16, f16};

use crate::tensor::is_compute_dtype;
use crate::{Backend, Error, Tensor, cpu, cuda};

pub use crate::moe::{ExpertSum, Routing, gather_rows, sigmoid_values};
pub use crate::quant::{linear_quantized, linear_quantized_on_gpu};
pub use bm_device::Activation;

/// Attention geometry: query heads, key/value heads (fewer under
/// grouped-query attention) and the width of one head.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Heads {
    /// Query heads.
    pub heads: usize,
    /// Key/value heads; divides `heads`.
    pub kv_heads: usize,
    /// Width of one head.
    pub head_dim: usize,
}

/// Which keys each query may attend to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mask {
    /// Every key (encoders).
    Bidirectional,
    /// Keys at or before the query's position (decoders).
    Causal,
    /// Causal, and only the last `n` positions including the query's own
    /// (Mistral's sliding window: key j is seen from position i when
    /// `i - n < j <= i`).
    SlidingWindow(usize),
}

/// How attention scores are formed from `q · k`: multiplied by `scale`,
/// then, with `softcap`, squashed into (-cap, cap) by `cap · tanh(s / cap)`
/// (Gemma 2's attention-logit soft-capping).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Scores {
    /// Factor on `q · k` (`1 / √head_dim` in most models).
    pub scale: f32,
    /// Soft-capping bound, if any.
    pub softcap: Option<f32>,
}

impl Scores {
    /// Standard scaled dot-product scores: `1 / √head_dim`, no capping.
    pub fn standard(head_dim: usize) -> Scores {
        Scores::scaled_by(head_dim as f32)
    }

    /// Scores scaled by `1 / √divisor` (Gemma 2's `query_pre_attn_scalar`),
    /// no capping.
    pub fn scaled_by(divisor: f32) -> Scores {
        Scores {
            scale: 1.0 / divisor.sqrt(),
            softcap: None,
        }
    }
}

/// Where an op runs: on the GPU of its first GPU operand (host operands
/// are uploaded for it, as an offloaded weight is streamed to the execution
/// device), on the CPU when every operand is there.
fn backend_of(tensors: &[&Tensor]) -> Backend {
    tensors
        .iter()
        .map(|t| t.backend())
        .find(|b| *b != Backend::Cpu)
        .unwrap_or(Backend::Cpu)
}

/// The GPU an op placed by [`backend_of`] on `Backend::Cuda` runs on.
fn gpu_for(tensors: &[&Tensor]) -> bm_device::Gpu {
    cuda::gpu_of(tensors).expect("backend_of found a GPU operand")
}

pub(crate) fn bad(op: &'static str, message: String) -> Error {
    Error::BadOperands { op, message }
}

/// The innermost dimension, and the number of rows before it.
pub(crate) fn rows_cols(t: &Tensor) -> (usize, usize) {
    let cols = t.shape().last().copied().unwrap_or(1);
    (t.numel() / cols.max(1), cols)
}

pub(crate) fn expect_vector(
    op: &'static str,
    t: &Tensor,
    len: usize,
    what: &str,
) -> Result<(), Error> {
    if t.shape() != [len] {
        return Err(bad(
            op,
            format!("{what} has shape {:?}, expected [{len}]", t.shape()),
        ));
    }
    Ok(())
}

/// The rounding of `dtype` applied to an f32 value (identity for F32).
pub(crate) fn rounding(dtype: DType) -> fn(f32) -> f32 {
    match dtype {
        DType::F16 => |v| f16::from_f32(v).to_f32(),
        DType::BF16 => |v| bf16::from_f32(v).to_f32(),
        _ => |v| v,
    }
}

/// The operands of [`linear`] checked: the input's rows `m` and width `k`,
/// and the output width `n`.
fn linear_dims(
    x: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
) -> Result<(usize, usize, usize), Error> {
    let (m, k) = rows_cols(x);
    if weight.shape().len() != 2 || weight.shape()[1] != k {
        return Err(bad(
            "linear",
            format!(
                "input of shape {:?} does not fit weight of shape {:?}",
                x.shape(),
                weight.shape()
            ),
        ));
    }
    let n = weight.shape()[0];
    if let Some(b) = bias {
        expect_vector("linear", b, n, "bias")?;
    }
    Ok((m, k, n))
}

/// `x`'s shape with its last dimension `n` (a product's result).
fn with_last(x: &Tensor, n: usize) -> Vec<usize> {
    let mut shape = x.shape().to_vec();
    *shape.last_mut().expect("input has a last dimension") = n;
    shape
}

/// The CPU product of `x` (its f32 values `xs`, rows of `k`) by a dense
/// `weight` read in place, with this CPU's kernels; a BF16 input is also
/// read as bf16, for the bf16 dot product.
fn dense_product<'a>(x: &'a Tensor, xs: &'a [f32], k: usize, weight: &'a Tensor) -> cpu::Dense<'a> {
    let x_bf16 = (x.dtype() == DType::BF16).then(|| x.host_bytes());
    cpu::Dense::new(
        (xs, x_bf16),
        k,
        (weight.host_bytes(), weight.dtype()),
        crate::Isa::active(),
    )
}

/// `x · weightᵀ + bias`: the matmul of `nn.Linear`, with `weight` stored
/// `[out_features, in_features]` as in every checkpoint. `x` is
/// `[..., in_features]`; the result `[..., out_features]`.
pub fn linear(x: &Tensor, weight: &Tensor, bias: Option<&Tensor>) -> Result<Tensor, Error> {
    let mut operands = vec![x, weight];
    operands.extend(bias);
    let backend = backend_of(&operands);
    let (m, k, n) = linear_dims(x, weight, bias)?;
    let shape = with_last(x, n);
    match backend {
        Backend::Cuda(_) => cuda::linear(
            &gpu_for(&operands),
            x,
            (weight, BLayout::OutIn),
            bias,
            (m, k, n),
            &shape,
        ),
        Backend::Cpu => {
            let xs = x.f32_values();
            let bs = bias.map(|b| b.f32_values());
            let product = dense_product(x, &xs, k, weight);
            Tensor::build(x.dtype(), &shape, |out| {
                cpu::linear((m, k), &product, n, bs.as_deref(), out)
            })
        }
    }
}

/// [`linear`] of one input `x` by several `(weight, bias)` layers (a
/// layer's separate q/k/v projections): each result is what [`linear`]
/// gives. On the CPU they share one pass over the threads, so a decode
/// step wakes and joins the threads once rather than once per layer.
pub fn linear_many(
    x: &Tensor,
    layers: &[(&Tensor, Option<&Tensor>)],
) -> Result<Vec<Tensor>, Error> {
    let mut operands = vec![x];
    for (w, b) in layers {
        operands.push(w);
        operands.extend(b);
    }
    if backend_of(&operands) != Backend::Cpu {
        return layers.iter().map(|(w, b)| linear(x, w, *b)).collect();
    }
    let checked = layers
        .iter()
        .map(|(w, b)| linear_dims(x, w, *b))
        .collect::<Result<Vec<_>, _>>()?;
    let biases: Vec<_> = layers
        .iter()
        .map(|(_, b)| b.map(|b| b.f32_values()))
        .collect();
    let (m, k) = rows_cols(x);
    let xs = x.f32_values();
    let products: Vec<_> = layers
        .iter()
        .map(|(weight, _)| dense_product(x, &xs, k, weight))
        .collect();
    let mut outs: Vec<Vec<f32>> = checked.iter().map(|(_, _, n)| vec![0f32; m * n]).collect();
    let mut parts: Vec<cpu::LinearPart<'_>> = products
        .iter()
        .zip(&checked)
        .zip(&biases)
        .zip(&mut outs)
        .map(|(((product, (_, _, n)), b), out)| cpu::LinearPart {
            product,
            n: *n,
            bias: b.as_deref(),
            out,
        })
        .collect();
    cpu::linear_many((m, k), &mut parts);
    outs.iter()
        .zip(&checked)
        .map(|(out, (_, _, n))| Tensor::from_f32(x.dtype(), &with_last(x, *n), out))
        .collect()
}

/// `act(x · gateᵀ + gate_bias) · (x · upᵀ + up_bias)`, elementwise: the
/// first half of a gated MLP (Llama's `act_fn(gate_proj(x)) * up_proj(x)`),
/// rounded to `x`'s dtype where the separate ops round (each product, the
/// activation, the result), so it equals [`linear`], [`activate`] and
/// [`mul`] in turn. On the CPU both products share one pass over the
/// threads and the activation and product one pass over the values.
pub fn gated_linear(
    x: &Tensor,
    gate: (&Tensor, Option<&Tensor>),
    up: (&Tensor, Option<&Tensor>),
    act: Activation,
) -> Result<Tensor, Error> {
    let [g, u]: [Tensor; 2] = linear_many(x, &[gate, up])?
        .try_into()
        .expect("two layers give two products");
    if g.shape() != u.shape() {
        return Err(bad(
            "gated_linear",
            format!(
                "gate output {:?} differs from up output {:?}",
                g.shape(),
                u.shape()
            ),
        ));
    }
    if g.backend() != Backend::Cpu {
        return mul(&activate(&g, act)?, &u);
    }
    let round = rounding(x.dtype());
    let (gs, us) = (g.f32_values(), u.f32_values());
    Tensor::build(x.dtype(), g.shape(), |out| {
        for ((o, g), u) in out.iter_mut().zip(gs.iter()).zip(us.iter()) {
            *o = round(cpu::activation(act, *g)) * u;
        }
    })
}

/// `x · weight + bias` with `weight` stored `[in_features, out_features]`:
/// the product of transformers' `Conv1D` (GPT-2's layers), read in place
/// rather than transposed. `x` is `[..., in_features]`; the result
/// `[..., out_features]`.
pub fn linear_t(x: &Tensor, weight: &Tensor, bias: Option<&Tensor>) -> Result<Tensor, Error> {
    let mut operands = vec![x, weight];
    operands.extend(bias);
    let (m, k) = rows_cols(x);
    if weight.shape().len() != 2 || weight.shape()[0] != k {
        return Err(bad(
            "linear_t",
            format!(
                "input of shape {:?} does not fit [in, out] weight of shape {:?}",
                x.shape(),
                weight.shape()
            ),
        ));
    }
    let n = weight.shape()[1];
    if let Some(b) = bias {
        expect_vector("linear_t", b, n, "bias")?;
    }
    let shape = with_last(x, n);
    match backend_of(&operands) {
        Backend::Cuda(_) => cuda::linear(
            &gpu_for(&operands),
            x,
            (weight, BLayout::InOut),
            bias,
            (m, k, n),
            &shape,
        ),
        Backend::Cpu => {
            let xs = x.f32_values();
            let bs = bias.map(|b| b.f32_values());
            Tensor::build(x.dtype(), &shape, |out| {
                cpu::linear_t(&xs, m, k, weight, bs.as_deref(), out)
            })
        }
    }
}

/// Rows of `table` picked by `ids`, as `[ids.len(), hidden]` in `dtype`.
pub fn embedding(ids: &[u32], table: &Tensor, dtype: DType) -> Result<Tensor, Error> {
    if table.shape().len() != 2 {
        return Err(bad(
            "embedding",
            format!("table has shape {:?}, expected 2-D", table.shape()),
        ));
    }
    let (vocab, hidden) = (table.shape()[0], table.shape()[1]);
    if let Some(&id) = ids.iter().find(|&&id| id as usize >= vocab) {
        return Err(Error::TokenOutOfVocab {
            id,
            vocab_size: vocab,
        });
    }
    match table.backend() {
        Backend::Cuda(_) => cuda::embedding(ids, table, dtype),
        Backend::Cpu => Tensor::build(dtype, &[ids.len(), hidden], |out| {
            for (row, &id) in out.chunks_exact_mut(hidden).zip(ids) {
                row.copy_from_slice(&table.f32_rows(id as usize, id as usize + 1));
            }
        }),
    }
}

/// Llama's RMSNorm over the last dimension.
pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f32) -> Result<Tensor, Error> {
    let backend = backend_of(&[x, weight]);
    let (_, cols) = rows_cols(x);
    expect_vector("rms_norm", weight, cols, "weight")?;
    match backend {
        Backend::Cuda(_) => cuda::rms_norm(&gpu_for(&[x, weight]), x, weight, eps),
        Backend::Cpu => {
            let (xs, ws) = (x.f32_values(), weight.f32_values());
            let round = rounding(x.dtype());
            Tensor::build(x.dtype(), x.shape(), |out| {
                cpu::rms_norm(&xs, cols, &ws, eps, round, out)
            })
        }
    }
}

/// Gemma's RMSNorm: `x / rms(x) · (1 + weight)` computed in f32 and
/// rounded to `x`'s dtype once (Llama's rounds before the weight). Built
/// from the other ops, so it runs wherever they do.
pub fn rms_norm_plus_one(x: &Tensor, weight: &Tensor, eps: f32) -> Result<Tensor, Error> {
    let ones = Tensor::from_f32(DType::F32, weight.shape(), &vec![1.0; weight.numel()])?;
    let scale = add(&ones, weight)?;
    let normed = rms_norm(&x.to_dtype(DType::F32)?, &scale, eps)?;
    if x.dtype() == DType::F32 {
        Ok(normed)
    } else {
        normed.to_dtype(x.dtype())
    }
}

/// LayerNorm over the last dimension, with weight and bias.
pub fn layer_norm(x: &Tensor, weight: &Tensor, bias: &Tensor, eps: f32) -> Result<Tensor, Error> {
    let backend = backend_of(&[x, weight, bias]);
    let (_, cols) = rows_cols(x);
    expect_vector("layer_norm", weight, cols, "weight")?;
    expect_vector("layer_norm", bias, cols, "bias")?;
    match backend {
        Backend::Cuda(_) => cuda::layer_norm(&gpu_for(&[x, weight, bias]), x, weight, bias, eps),
        Backend::Cpu => {
            let (xs, ws, bs) = (x.f32_values(), weight.f32_values(), bias.f32_values());
            Tensor::build(x.dtype(), x.shape(), |out| {
                cpu::layer_norm(&xs, cols, &ws, &bs, eps, out)
            })
        }
    }
}

/// Rotary position embedding with Llama's `rotate_half` convention: the
/// default frequencies `1 / theta^(2i / head_dim)` over the whole head, or
/// frequencies a model computed itself (scaled variants such as Phi-3's
/// LongRoPE), possibly over only the first dimensions of each head
/// (partial rotary), with cos/sin multiplied by an attention scaling.
#[derive(Clone, Debug)]
pub struct Rope {
    head_dim: usize,
    /// The base, when the frequencies are the default ones (the CUDA
    /// kernel computes those itself).
    theta: Option<f32>,
    inv_freq: Vec<f32>,
    scaling: f32,
}

impl Rope {
    /// Default frequencies for heads of `head_dim` (even) and base `theta`,
    /// computed in f32 as transformers does.
    pub fn new(head_dim: usize, theta: f32) -> Rope {
        let inv_freq = (0..head_dim / 2)
            .map(|i| 1.0 / theta.powf((2 * i) as f32 / head_dim as f32))
            .collect();
        Rope {
            head_dim,
            theta: Some(theta),
            inv_freq,
            scaling: 1.0,
        }
    }

    /// Given frequencies: dimension i of the first `2 * inv_freq.len()` of
    /// each head turns at `inv_freq[i % len]` radians per position, the
    /// rest pass through; cos and sin are multiplied by `scaling`.
    pub fn with_frequencies(
        head_dim: usize,
        inv_freq: Vec<f32>,
        scaling: f32,
    ) -> Result<Rope, Error> {
        if inv_freq.is_empty() || 2 * inv_freq.len() > head_dim {
            return Err(bad(
                "rotary",
                format!(
                    "{} frequencies do not fit heads of {head_dim} dimensions",
                    inv_freq.len()
                ),
            ));
        }
        Ok(Rope {
            head_dim,
            theta: None,
            inv_freq,
            scaling,
        })
    }

    /// Rotates every head of `x` (`[seq, heads * head_dim]`), row r being
    /// at position `start_pos + r`.
    pub fn apply(&self, x: &Tensor, start_pos: usize) -> Result<Tensor, Error> {
        let rows = rows_cols(x).0;
        let positions: Vec<usize> = (start_pos..start_pos + rows).collect();
        self.apply_at(x, &positions)
    }

    /// Rotates every head of `x` (`[rows, heads * head_dim]`), row r being
    /// at position `positions[r]`: the rows of a batch, each sequence at
    /// its own position.
    pub fn apply_at(&self, x: &Tensor, positions: &[usize]) -> Result<Tensor, Error> {
        let (rows, cols) = rows_cols(x);
        if x.shape().len() != 2 || cols % self.head_dim != 0 {
            return Err(bad(
                "rotary",
                format!(
                    "input of shape {:?} is not [seq, heads * {}]",
                    x.shape(),
                    self.head_dim
                ),
            ));
        }
        if positions.len() != rows {
            return Err(bad(
                "rotary",
                format!("{} positions for {rows} rows", positions.len()),
            ));
        }
        let rotary_dim = 2 * self.inv_freq.len();
        if let (Backend::Cuda(_), Some(theta)) = (x.backend(), self.theta) {
            // The default kernel computes its own angles, row r at `start + r`.
            let start = positions.first().copied().unwrap_or(0);
            let consecutive = positions.iter().enumerate().all(|(r, &p)| p == start + r);
            if rotary_dim == self.head_dim && consecutive {
                return cuda::rotary(x, self.head_dim, start, theta);
            }
        }
        // transformers multiplies cos/sin by the attention scaling in f32,
        // then casts them to the activation dtype.
        let round = rounding(x.dtype());
        let half = rotary_dim / 2;
        let (mut cos, mut sin) = (
            Vec::with_capacity(rows * half),
            Vec::with_capacity(rows * half),
        );
        for &p in positions {
            let pos = p as f32;
            for f in &self.inv_freq {
                let angle = pos * f;
                cos.push(round(angle.cos() * self.scaling));
                sin.push(round(angle.sin() * self.scaling));
            }
        }
        match x.backend() {
            Backend::Cuda(_) => cuda::rotary_table(x, (self.head_dim, rotary_dim), &cos, &sin),
            Backend::Cpu => {
                let xs = x.f32_values();
                Tensor::build(x.dtype(), x.shape(), |out| {
                    cpu::rotary(&xs, self.head_dim, rotary_dim, &cos, &sin, out)
                })
            }
        }
    }
}

/// One layer's key/value cache, on the backend of the tensors appended.
///
/// Values are kept widened to f32: they were rounded to the model's dtype
/// before being appended, so the widening is exact.
///
/// A cache may hold a batch of sequences ([`LayerCache::batched`]).
/// Positions are stored time-major: the `batch` rows of one position lie
/// together (row `t * batch + b` is sequence b at cache position t), so
/// one decoding step of every sequence appends contiguously, and queries
/// and keys are laid out the same way. The first `pads[b]` positions of
/// sequence b are left padding: no query of b attends to them.
///
/// A sliding-window layer may [`LayerCache::forget_outside_window`]: the
/// host cache then drops positions no future query can see, so it stays
/// within twice the window however long the sequence grows.
#[derive(Debug)]
pub struct LayerCache {
    width: usize,
    /// Left-padding positions of each sequence (its length is the batch).
    pads: Vec<usize>,
    keys: Vec<f32>,
    values: Vec<f32>,
    /// Positions dropped from the front (sliding-window layers).
    dropped: usize,
    /// The cache of a layer computed on a GPU (one sequence).
    device: Option<cuda::DeviceKv>,
}

impl Default for LayerCache {
    fn default() -> LayerCache {
        LayerCache::new()
    }
}

impl LayerCache {
    /// An empty cache for one sequence.
    pub fn new() -> LayerCache {
        LayerCache {
            width: 0,
            pads: vec![0],
            keys: Vec::new(),
            values: Vec::new(),
            dropped: 0,
            device: None,
        }
    }

    /// An empty cache for `pads.len()` sequences, sequence b starting with
    /// `pads[b]` positions of left padding.
    pub fn batched(pads: &[usize]) -> Result<LayerCache, Error> {
        if pads.is_empty() {
            return Err(Error::EmptyInput("batch of sequences"));
        }
        Ok(LayerCache {
            pads: pads.to_vec(),
            ..LayerCache::new()
        })
    }

    /// Sequences in the batch.
    pub fn batch(&self) -> usize {
        self.pads.len()
    }

    /// Positions seen so far (the next position's index), dropped ones
    /// included.
    pub fn len(&self) -> usize {
        self.dropped + self.rows()
    }

    /// Positions held.
    fn rows(&self) -> usize {
        match &self.device {
            Some(kv) => kv.rows,
            None => self
                .keys
                .len()
                .checked_div(self.width * self.batch())
                .unwrap_or(0),
        }
    }

    /// Lets a layer attending through `Mask::SlidingWindow(window)` drop
    /// positions that no later query can see: the newest `window - 1` are
    /// always kept. Drops happen in batches (when twice the window is held)
    /// so the cost per token stays constant. GPU caches keep every position.
    pub fn forget_outside_window(&mut self, window: usize) {
        let keep = window.saturating_sub(1);
        let rows = self.rows();
        if self.device.is_some() || rows < 2 * window.max(1) {
            return;
        }
        let drop = (rows - keep) * self.width * self.batch();
        self.keys.drain(..drop);
        self.values.drain(..drop);
        self.dropped += rows - keep;
    }

    /// True when nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Forgets every position from `len` on, so that the next one appended
    /// is position `len` (a conversation rewound to the prefix it shares
    /// with the cache). Positions a sliding window already dropped cannot
    /// be rewound to.
    pub fn truncate(&mut self, len: usize) -> Result<(), Error> {
        if len >= self.len() {
            return Ok(());
        }
        if len < self.dropped {
            return Err(bad(
                "kv cache truncate",
                format!(
                    "cannot rewind to position {len}: the sliding window dropped the first {}",
                    self.dropped
                ),
            ));
        }
        let held = len - self.dropped;
        match &mut self.device {
            Some(kv) => kv.rows = held,
            None => {
                let keep = held * self.width * self.pads.len();
                self.keys.truncate(keep);
                self.values.truncate(keep);
            }
        }
        Ok(())
    }

    /// Keeps only the sequences whose `keep` entry is true (finished ones
    /// leave the batch), in order.
    pub fn retain(&mut self, keep: &[bool]) -> Result<(), Error> {
        let batch = self.batch();
        if keep.len() != batch {
            return Err(bad(
                "kv cache retain",
                format!("{} flags for a batch of {batch}", keep.len()),
            ));
        }
        if keep.iter().all(|k| *k) {
            return Ok(());
        }
        if !keep.iter().any(|k| *k) {
            return Err(Error::EmptyInput("batch of sequences"));
        }
        if self.device.is_some() {
            return Err(Error::NotOnCuda {
                op: "batched KV cache (several sequences at once)",
            });
        }
        let w = self.width;
        let gather = |rows: &[f32]| -> Vec<f32> {
            rows.chunks_exact(w.max(1))
                .enumerate()
                .filter(|(r, _)| keep[r % batch])
                .flat_map(|(_, row)| row.iter().copied())
                .collect()
        };
        self.keys = gather(&self.keys);
        self.values = gather(&self.values);
        self.pads = self
            .pads
            .iter()
            .zip(keep)
            .filter(|(_, k)| **k)
            .map(|(p, _)| *p)
            .collect();
        Ok(())
    }

    /// Appends the keys and values of new positions: `[seq * batch, width]`,
    /// time-major (every sequence's row of one position together).
    pub fn append(&mut self, keys: &Tensor, values: &Tensor) -> Result<(), Error> {
        let backend = backend_of(&[keys, values]);
        let (rows, width) = rows_cols(keys);
        if keys.shape() != values.shape() || keys.shape().len() != 2 {
            return Err(bad(
                "kv cache append",
                format!(
                    "keys {:?} and values {:?} must both be [seq, width]",
                    keys.shape(),
                    values.shape()
                ),
            ));
        }
        if self.width != 0 && self.width != width {
            return Err(bad(
                "kv cache append",
                format!("width {width} differs from the cached {}", self.width),
            ));
        }
        if rows % self.batch() != 0 {
            return Err(bad(
                "kv cache append",
                format!("{rows} rows do not divide into a batch of {}", self.batch()),
            ));
        }
        let on_gpu = self.device.is_some();
        match backend {
            Backend::Cuda(_) if self.batch() > 1 => Err(Error::NotOnCuda {
                op: "batched KV cache (several sequences at once)",
            }),
            Backend::Cuda(_) if !self.keys.is_empty() => Err(bad(
                "kv cache append",
                "this layer's cache is in host memory; GPU keys cannot join it".into(),
            )),
            Backend::Cuda(_) => {
                let gpu = gpu_for(&[keys, values]);
                let keys = cuda::on_gpu(keys, &gpu, keys.dtype())?;
                cuda::DeviceKv::append(&mut self.device, width, &keys, values)?;
                self.width = width;
                Ok(())
            }
            Backend::Cpu if on_gpu => Err(bad(
                "kv cache append",
                "this layer's cache is on a GPU; host keys cannot join it".into(),
            )),
            Backend::Cpu => {
                self.width = width;
                self.keys.extend_from_slice(&keys.f32_values());
                self.values.extend_from_slice(&values.f32_values());
                Ok(())
            }
        }
    }

    /// Bytes the cache holds (keys and values, as f32).
    pub fn bytes(&self) -> usize {
        2 * self.rows() * self.width * self.batch() * 4
    }
}

/// Scaled dot-product attention (softmax in f32) of `q`
/// (`[seq * batch, heads * head_dim]`, the last `seq` positions of each
/// sequence of the cache's batch, time-major as the cache) against every
/// position in `cache`. The result has `q`'s shape.
pub fn attention(
    q: &Tensor,
    cache: &LayerCache,
    heads: Heads,
    mask: Mask,
) -> Result<Tensor, Error> {
    attention_with(q, cache, heads, mask, Scores::standard(heads.head_dim))
}

/// [`attention`] with the scores formed as `scores` says (another scale,
/// soft-capping).
pub fn attention_with(
    q: &Tensor,
    cache: &LayerCache,
    heads: Heads,
    mask: Mask,
    scores: Scores,
) -> Result<Tensor, Error> {
    attend(q, cache, heads, (mask, scores), None)
}

/// [`attention_with`] with a bias on each score that depends only on the
/// head and the relative position `key - query` (T5's relative position
/// bias), the same for each sequence of the batch: `bias` is
/// `[heads, keys + queries - 1]`, entry `r + keys - 1` for relative
/// position r, from `-(keys - 1)` to `queries - 1` (the queries are the
/// last positions, as the cache's). Memory grows with the sequence, not
/// its square. Runs where the cache is (host or GPU).
pub fn attention_biased(
    q: &Tensor,
    cache: &LayerCache,
    heads: Heads,
    (mask, scores): (Mask, Scores),
    bias: &Tensor,
) -> Result<Tensor, Error> {
    let queries = rows_cols(q).0 / cache.batch();
    if queries > cache.rows() {
        return Err(bad(
            "attention",
            format!(
                "a relative position bias needs a key per query: {queries} queries, {} keys",
                cache.rows()
            ),
        ));
    }
    let expected = [heads.heads, cache.rows() + queries - 1];
    if bias.shape() != expected {
        return Err(bad(
            "attention",
            format!(
                "position bias of shape {:?}, expected {expected:?}",
                bias.shape()
            ),
        ));
    }
    attend(q, cache, heads, (mask, scores), Some(bias))
}

fn attend(
    q: &Tensor,
    cache: &LayerCache,
    heads: Heads,
    (mask, scores): (Mask, Scores),
    bias: Option<&Tensor>,
) -> Result<Tensor, Error> {
    let (rows, width) = rows_cols(q);
    if heads.kv_heads == 0 || !heads.heads.is_multiple_of(heads.kv_heads) {
        return Err(bad(
            "attention",
            format!(
                "{} query heads cannot be grouped over {} key/value heads",
                heads.heads, heads.kv_heads
            ),
        ));
    }
    if width != heads.heads * heads.head_dim || cache.width != heads.kv_heads * heads.head_dim {
        return Err(bad(
            "attention",
            format!(
                "query width {width} / cache width {} do not fit {heads:?}",
                cache.width
            ),
        ));
    }
    let batch = cache.batch();
    if rows % batch != 0 {
        return Err(bad(
            "attention",
            format!("{rows} query rows do not divide into a batch of {batch}"),
        ));
    }
    let s = rows / batch;
    // Every query sees every key under a bidirectional mask (T5's
    // cross-attention has more decoder queries than encoder keys at times).
    if mask != Mask::Bidirectional && cache.rows() < s {
        return Err(bad(
            "attention",
            format!("{s} queries but only {} cached positions", cache.rows()),
        ));
    }
    if cache.dropped > 0 && !matches!(mask, Mask::SlidingWindow(_)) {
        return Err(bad(
            "attention",
            format!(
                "{mask:?} attention over a cache that dropped {} positions",
                cache.dropped
            ),
        ));
    }
    // The first held position each sequence may attend to.
    let first: Vec<usize> = cache
        .pads
        .iter()
        .map(|p| p.saturating_sub(cache.dropped))
        .collect();
    if let Some(kv) = &cache.device {
        return kv.attention(q, heads, mask, scores, bias);
    }
    let bias = match bias {
        Some(b) => Some(b.to_host()?.f32_values().into_owned()),
        None => None,
    };
    let on_host = |qs: &[f32]| {
        Tensor::build(q.dtype(), q.shape(), |out| {
            cpu::attention(
                qs,
                &cache.keys,
                &cache.values,
                heads,
                (mask, scores, bias.as_deref()),
                &first,
                out,
            )
        })
    };
    match q.backend() {
        Backend::Cpu => on_host(&q.f32_values()),
        Backend::Cuda(_) => on_host(&q.to_host()?.f32_values()),
    }
}

/// Softmax over the last dimension, computed in f32.
pub fn softmax(x: &Tensor) -> Result<Tensor, Error> {
    let (_, cols) = rows_cols(x);
    match x.backend() {
        Backend::Cuda(_) => cuda::softmax(x),
        Backend::Cpu => {
            let xs = x.f32_values();
            Tensor::build(x.dtype(), x.shape(), |out| {
                out.copy_from_slice(&xs);
                out.chunks_exact_mut(cols.max(1)).for_each(cpu::softmax_row);
            })
        }
    }
}

/// An elementwise function: `f` on the CPU, bm-device's activation kernel
/// `on_gpu` (`None`: no kernel, refused on a GPU as `op`).
fn unary(
    x: &Tensor,
    f: impl Fn(f32) -> f32,
    on_gpu: Result<Activation, &'static str>,
) -> Result<Tensor, Error> {
    match (x.backend(), on_gpu) {
        (Backend::Cuda(_), Ok(op)) => cuda::unary(x, op),
        (Backend::Cuda(_), Err(op)) => Err(Error::NotOnCuda { op }),
        (Backend::Cpu, _) => {
            let xs = x.f32_values();
            Tensor::build(x.dtype(), x.shape(), |out| {
                for (o, v) in out.iter_mut().zip(xs.iter()) {
                    *o = f(*v);
                }
            })
        }
    }
}

/// `op` elementwise.
pub fn activate(x: &Tensor, op: Activation) -> Result<Tensor, Error> {
    unary(x, |v| cpu::activation(op, v), Ok(op))
}

/// SiLU (`x · sigmoid(x)`), elementwise.
pub fn silu(x: &Tensor) -> Result<Tensor, Error> {
    activate(x, Activation::Silu)
}

/// GELU in its exact erf form (BERT's `gelu`), elementwise.
pub fn gelu(x: &Tensor) -> Result<Tensor, Error> {
    activate(x, Activation::Gelu)
}

/// GELU's tanh approximation (GPT-2's `gelu_new`, Gemma's
/// `gelu_pytorch_tanh`), elementwise.
pub fn gelu_tanh(x: &Tensor) -> Result<Tensor, Error> {
    activate(x, Activation::GeluTanh)
}

/// ReLU (`max(x, 0)`, NaN kept), elementwise.
pub fn relu(x: &Tensor) -> Result<Tensor, Error> {
    activate(x, Activation::Relu)
}

/// `cap · tanh(x / cap)` elementwise: soft-capping (Gemma 2's final logits).
pub fn softcap(x: &Tensor, cap: f32) -> Result<Tensor, Error> {
    activate(x, Activation::SoftCap(cap))
}

/// `x · factor` elementwise, rounded once to `x`'s dtype (the factor is
/// used as given: round it to the dtype first where the reference does).
pub fn scale(x: &Tensor, factor: f32) -> Result<Tensor, Error> {
    match x.backend() {
        // The GPU has an elementwise product, not a scalar one.
        Backend::Cuda(_) => {
            let factors = Tensor::from_f32(x.dtype(), x.shape(), &vec![factor; x.numel()])?;
            mul(x, &factors)
        }
        Backend::Cpu => unary(x, |v| v * factor, Err("scale")),
    }
}

/// Splits the last dimension of `x` (`[rows, sum(widths)]`) into
/// consecutive column groups of `widths`: the q/k/v parts of a fused
/// projection's output. Each part is a new tensor on `x`'s backend.
pub fn split_columns(x: &Tensor, widths: &[usize]) -> Result<Vec<Tensor>, Error> {
    let (rows, cols) = rows_cols(x);
    if x.shape().len() != 2 || widths.iter().sum::<usize>() != cols {
        return Err(bad(
            "split_columns",
            format!(
                "a tensor of shape {:?} cannot be split into columns {widths:?}",
                x.shape()
            ),
        ));
    }
    let host = (x.backend() == Backend::Cpu).then(|| x.f32_values());
    let mut start = 0;
    let mut parts = Vec::with_capacity(widths.len());
    for &w in widths {
        parts.push(match &host {
            None => cuda::columns(x, start, w)?,
            Some(xs) => Tensor::build(x.dtype(), &[rows, w], |out| {
                for (o, row) in out.chunks_exact_mut(w.max(1)).zip(xs.chunks_exact(cols)) {
                    o.copy_from_slice(&row[start..start + w]);
                }
            })?,
        });
        start += w;
    }
    Ok(parts)
}

fn binary(
    op: &'static str,
    a: &Tensor,
    b: &Tensor,
    f: fn(f32, f32) -> f32,
) -> Result<Tensor, Error> {
    let backend = backend_of(&[a, b]);
    if a.shape() != b.shape() {
        return Err(bad(
            op,
            format!("shapes {:?} and {:?} differ", a.shape(), b.shape()),
        ));
    }
    match backend {
        Backend::Cuda(_) => cuda::binary(&gpu_for(&[a, b]), a, b, op == "mul"),
        Backend::Cpu => {
            let (xs, ys) = (a.f32_values(), b.f32_values());
            Tensor::build(a.dtype(), a.shape(), |out| {
                for ((o, x), y) in out.iter_mut().zip(xs.iter()).zip(ys.iter()) {
                    *o = f(*x, *y);
                }
            })
        }
    }
}

/// Elementwise sum of two tensors of one shape.
pub fn add(a: &Tensor, b: &Tensor) -> Result<Tensor, Error> {
    binary("add", a, b, |x, y| x + y)
}

/// Elementwise product of two tensors of one shape.
pub fn mul(a: &Tensor, b: &Tensor) -> Result<Tensor, Error> {
    binary("mul", a, b, |x, y| x * y)
}

/// Mean over the rows of `x` (`[seq, hidden]`), then L2 normalisation:
/// sentence-transformers' mean pooling and `Normalize` (norm floor 1e-12).
pub fn mean_pool_normalize(x: &Tensor) -> Result<Vec<f32>, Error> {
    let (rows, cols) = rows_cols(x);
    if rows == 0 {
        return Err(Error::EmptyInput("sequence to pool"));
    }
    let host = x.to_host()?;
    let xs = host.f32_values();
    let mut mean = vec![0f32; cols];
    for row in xs.chunks_exact(cols) {
        for (m, v) in mean.iter_mut().zip(row) {
            *m += v;
        }
    }
    mean.iter_mut().for_each(|m| *m /= rows as f32);
    let norm = mean.iter().map(|v| v * v).sum::<f32>().sqrt().max(1e-12);
    mean.iter_mut().for_each(|m| *m /= norm);
    Ok(mean)
}

/// Checks that `dtype` is one the ops compute in; `what` names the user.
pub fn check_compute_dtype(what: &str, dtype: DType) -> Result<(), Error> {
    if is_compute_dtype(dtype) {
        Ok(())
    } else {
        Err(Error::UnsupportedDType {
            what: what.to_string(),
            dtype,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(shape: &[usize], v: &[f32]) -> Tensor {
        Tensor::from_f32(DType::F32, shape, v).unwrap()
    }

    fn naive_linear(x: &[f32], m: usize, k: usize, w: &[f32], n: usize) -> Vec<f32> {
        let mut y = vec![0f32; m * n];
        for i in 0..m {
            for j in 0..n {
                y[i * n + j] = (0..k).map(|l| x[i * k + l] * w[j * k + l]).sum();
            }
        }
        y
    }

    #[test]
    fn linear_matches_naive_product_in_every_dtype() {
        // One row (the matrix-vector path) and several (the GEMM path); odd
        // sizes so blocks do not divide evenly.
        for (m, k, n) in [(1, 37, 101), (3, 37, 101)] {
            let x: Vec<f32> = (0..m * k)
                .map(|i| ((i * 7) % 13) as f32 * 0.1 - 0.6)
                .collect();
            let w: Vec<f32> = (0..n * k)
                .map(|i| ((i * 5) % 11) as f32 * 0.05 - 0.25)
                .collect();
            let b: Vec<f32> = (0..n).map(|i| i as f32 * 0.01).collect();
            for dtype in [DType::F32, DType::F16, DType::BF16] {
                let wt = Tensor::from_f32(dtype, &[n, k], &w).unwrap();
                let xt = Tensor::from_f32(dtype, &[m, k], &x).unwrap();
                let want = naive_linear(&xt.to_f32_vec(), m, k, &wt.to_f32_vec(), n);
                let y = linear(&xt, &wt, None).unwrap();
                assert_eq!((y.shape(), y.dtype()), (&[m, n][..], dtype));
                // F32 is exact up to summation order; halves round the output.
                let tol = if dtype == DType::F32 { 1e-5 } else { 1e-2 };
                let y = y.to_f32_vec();
                for (a, e) in y.iter().zip(&want) {
                    assert!(
                        (a - e).abs() <= tol * (1.0 + e.abs()),
                        "{m} {dtype}: {a} vs {e}"
                    );
                }
                let bias = Tensor::from_f32(dtype, &[n], &b).unwrap();
                let yb = linear(&xt, &wt, Some(&bias)).unwrap().to_f32_vec();
                let last = m * n - 1;
                assert!(
                    (yb[last] - y[last] - 1.0).abs() <= tol * 10.0,
                    "{m} {dtype} bias"
                );
            }
        }
    }

    #[test]
    fn linear_many_and_gated_linear_equal_the_separate_ops() {
        // Layers of different widths sharing one input, with and without a
        // bias, one row (decode) and several (prefill), in every dtype: the
        // fused ops must give the separate ops' values exactly.
        let values = |len: usize, seed: usize| -> Vec<f32> {
            (0..len)
                .map(|i| ((i * seed + 3) % 17) as f32 * 0.07 - 0.55)
                .collect()
        };
        for m in [1, 5] {
            let k = 45;
            for dtype in [DType::F32, DType::F16, DType::BF16] {
                let x = Tensor::from_f32(dtype, &[m, k], &values(m * k, 7)).unwrap();
                let weight =
                    |n: usize, seed| Tensor::from_f32(dtype, &[n, k], &values(n * k, seed));
                let (wa, wb, wc) = (
                    weight(70, 5).unwrap(),
                    weight(19, 3).unwrap(),
                    weight(70, 11).unwrap(),
                );
                let bias = Tensor::from_f32(dtype, &[70], &values(70, 13)).unwrap();
                let layers = [(&wa, Some(&bias)), (&wb, None), (&wc, None)];
                let fused = linear_many(&x, &layers).unwrap();
                assert_eq!(fused.len(), 3);
                for (got, (w, b)) in fused.iter().zip(layers) {
                    let want = linear(&x, w, b).unwrap();
                    assert_eq!(got.shape(), want.shape());
                    assert_eq!(got.host_bytes(), want.host_bytes(), "{m} rows, {dtype}");
                }
                for act in [Activation::Silu, Activation::GeluTanh, Activation::Relu] {
                    let got = gated_linear(&x, (&wa, Some(&bias)), (&wc, None), act).unwrap();
                    let gate = activate(&linear(&x, &wa, Some(&bias)).unwrap(), act).unwrap();
                    let want = mul(&gate, &linear(&x, &wc, None).unwrap()).unwrap();
                    assert_eq!(got.dtype(), dtype);
                    assert_eq!(
                        got.host_bytes(),
                        want.host_bytes(),
                        "{m} rows, {dtype}, {act:?}"
                    );
                }
                let err = gated_linear(&x, (&wa, None), (&wb, None), Activation::Silu).unwrap_err();
                assert!(err.to_string().contains("differs from up output"), "{err}");
                let err =
                    linear_many(&x, &[(&wa, None), (&t(&[2, 3], &[0.; 6]), None)]).unwrap_err();
                assert!(err.to_string().contains("does not fit weight"), "{err}");
            }
        }
    }

    #[test]
    fn linear_rejects_mismatched_shapes() {
        let err = linear(&t(&[1, 3], &[0.; 3]), &t(&[2, 4], &[0.; 8]), None).unwrap_err();
        assert!(err.to_string().contains("does not fit weight"), "{err}");
        let err = linear(
            &t(&[1, 4], &[0.; 4]),
            &t(&[2, 4], &[0.; 8]),
            Some(&t(&[3], &[0.; 3])),
        )
        .unwrap_err();
        assert!(err.to_string().contains("bias has shape [3]"), "{err}");
    }

    #[test]
    fn embedding_picks_rows_and_rejects_out_of_vocab() {
        let table = t(&[3, 2], &[0., 1., 2., 3., 4., 5.]);
        let e = embedding(&[2, 0], &table, DType::F32).unwrap();
        assert_eq!(e.to_f32_vec(), [4., 5., 0., 1.]);
        let err = embedding(&[3], &table, DType::F32).unwrap_err();
        assert_eq!(
            err.to_string(),
            "token id 3 is out of the vocabulary (size 3)"
        );
    }

    #[test]
    fn norms_match_hand_computation() {
        let x = t(&[1, 4], &[1., 2., 3., 4.]);
        let w = t(&[4], &[1., 2., 1., 1.]);
        let y = rms_norm(&x, &w, 0.0).unwrap().to_f32_vec();
        let rms = (30.0f32 / 4.0).sqrt();
        assert!((y[1] - 4.0 / rms).abs() < 1e-6);
        let b = t(&[4], &[0., 0., 0., 1.]);
        let y = layer_norm(&x, &w, &b, 0.0).unwrap().to_f32_vec();
        let sd = 1.25f32.sqrt();
        assert!((y[0] + 1.5 / sd).abs() < 1e-6);
        assert!((y[3] - (1.5 / sd + 1.0)).abs() < 1e-6);
        assert!(rms_norm(&x, &t(&[3], &[1.; 3]), 1e-6).is_err());
    }

    #[test]
    fn rope_rotates_pairs_half_a_head_apart() {
        let rope = Rope::new(4, 10000.0);
        let x = t(&[1, 4], &[1., 0., 0., 0.]);
        assert_eq!(rope.apply(&x, 0).unwrap().to_f32_vec(), [1., 0., 0., 0.]);
        let y = rope.apply(&x, 1).unwrap().to_f32_vec();
        // Dimension 0 pairs with dimension 2 at frequency 1.
        assert!((y[0] - 1f32.cos()).abs() < 1e-6 && (y[2] - 1f32.sin()).abs() < 1e-6);
        assert_eq!(y[1], 0.0);
    }

    #[test]
    fn a_relative_position_bias_moves_each_heads_attention() {
        let heads = Heads {
            heads: 2,
            kv_heads: 2,
            head_dim: 1,
        };
        let mut cache = LayerCache::new();
        cache
            .append(
                &t(&[3, 2], &[0.; 6]),
                &t(&[3, 2], &[1., 10., 2., 20., 3., 30.]),
            )
            .unwrap();
        // Queries at positions 1 and 2 over keys 0..3: relative positions
        // -2..=1, entry r + 2. Head 0 favours its own position (r = 0);
        // head 1 the key two back (r = -2), which only position 2 has.
        let big = 30.0;
        let bias = t(&[2, 4], &[0., 0., big, 0., big, 0., 0., 0.]);
        let q = t(&[2, 2], &[0.; 4]);
        let scores = Scores::scaled_by(1.0);
        let out = attention_biased(&q, &cache, heads, (Mask::Bidirectional, scores), &bias)
            .unwrap()
            .to_f32_vec();
        let want = [2., 20., 3., 10.];
        for (o, w) in out.iter().zip(want) {
            assert!((o - w).abs() < 1e-4, "{out:?}");
        }
        let err = attention_biased(
            &q,
            &cache,
            heads,
            (Mask::Bidirectional, scores),
            &t(&[2, 3], &[0.; 6]),
        )
        .unwrap_err();
        assert!(err.to_string().contains("expected [2, 4]"), "{err}");
        let three = t(&[4, 2], &[0.; 8]);
        let err = attention_biased(&three, &cache, heads, (Mask::Bidirectional, scores), &bias)
            .unwrap_err();
        assert!(err.to_string().contains("4 queries, 3 keys"), "{err}");
        // Cross-attention (no bias) may have more queries than keys;
        // causal attention still needs a key per query.
        let full = attention_with(&three, &cache, heads, Mask::Bidirectional, scores).unwrap();
        assert_eq!(full.to_f32_vec(), [2., 20., 2., 20., 2., 20., 2., 20.]);
        assert!(attention(&three, &cache, heads, Mask::Causal).is_err());
    }

    #[test]
    fn relu_zeroes_negatives() {
        let y = relu(&t(&[3], &[-1., 0., 2.5])).unwrap().to_f32_vec();
        assert_eq!(y, [0., 0., 2.5]);
    }

    #[test]
    fn attention_respects_causality_and_groups() {
        let heads = Heads {
            heads: 2,
            kv_heads: 1,
            head_dim: 1,
        };
        let mut cache = LayerCache::new();
        cache
            .append(&t(&[3, 1], &[0., 0., 0.]), &t(&[3, 1], &[1., 2., 3.]))
            .unwrap();
        let q = t(&[3, 2], &[0.; 6]);
        // Equal scores: the output is the mean of the visible values.
        let causal = attention(&q, &cache, heads, Mask::Causal)
            .unwrap()
            .to_f32_vec();
        assert_eq!(causal, [1., 1., 1.5, 1.5, 2., 2.]);
        let full = attention(&q, &cache, heads, Mask::Bidirectional)
            .unwrap()
            .to_f32_vec();
        assert_eq!(full, [2.; 6]);
        let window = attention(&q, &cache, heads, Mask::SlidingWindow(2))
            .unwrap()
            .to_f32_vec();
        assert_eq!(window, [1., 1., 1.5, 1.5, 2.5, 2.5]);
        // One new query at position 3 sees all four.
        cache
            .append(&t(&[1, 1], &[0.]), &t(&[1, 1], &[6.]))
            .unwrap();
        let last = attention(&t(&[1, 2], &[0.; 2]), &cache, heads, Mask::Causal).unwrap();
        assert_eq!(last.to_f32_vec(), [3., 3.]);
        let bad = Heads {
            heads: 3,
            kv_heads: 2,
            head_dim: 1,
        };
        assert!(attention(&t(&[1, 3], &[0.; 3]), &cache, bad, Mask::Causal).is_err());
    }

    #[test]
    fn elementwise_ops() {
        let a = t(&[2], &[1., -2.]);
        let b = t(&[2], &[3., 4.]);
        assert_eq!(add(&a, &b).unwrap().to_f32_vec(), [4., 2.]);
        assert_eq!(mul(&a, &b).unwrap().to_f32_vec(), [3., -8.]);
        assert!(add(&a, &t(&[1], &[0.])).is_err());
        let s = silu(&a).unwrap().to_f32_vec();
        assert!((s[0] - 0.7310586).abs() < 1e-6);
        let g = gelu(&a).unwrap().to_f32_vec();
        assert!((g[0] - 0.8413447).abs() < 1e-6 && (g[1] + 0.04550026).abs() < 1e-6);
        let p = softmax(&t(&[1, 2], &[0., 0.])).unwrap().to_f32_vec();
        assert_eq!(p, [0.5, 0.5]);
    }

    #[test]
    fn linear_t_equals_linear_with_the_transposed_weight() {
        // One row (the column-streaming path) and several (the GEMM path);
        // sizes that do not divide into blocks evenly.
        for (m, k, n) in [(1, 37, 101), (3, 37, 101)] {
            let x: Vec<f32> = (0..m * k)
                .map(|i| ((i * 7) % 13) as f32 * 0.1 - 0.6)
                .collect();
            let w: Vec<f32> = (0..n * k)
                .map(|i| ((i * 5) % 11) as f32 * 0.05 - 0.25)
                .collect();
            let b: Vec<f32> = (0..n).map(|i| i as f32 * 0.01).collect();
            // w is [n, k]; wt[l, j] = w[j, l] is the same matrix stored [k, n].
            let wt: Vec<f32> = (0..k * n).map(|i| w[(i % n) * k + i / n]).collect();
            for dtype in [DType::F32, DType::F16, DType::BF16] {
                let xt = Tensor::from_f32(dtype, &[m, k], &x).unwrap();
                let bias = Tensor::from_f32(dtype, &[n], &b).unwrap();
                let want = linear(
                    &xt,
                    &Tensor::from_f32(dtype, &[n, k], &w).unwrap(),
                    Some(&bias),
                )
                .unwrap()
                .to_f32_vec();
                let got = linear_t(
                    &xt,
                    &Tensor::from_f32(dtype, &[k, n], &wt).unwrap(),
                    Some(&bias),
                )
                .unwrap();
                assert_eq!((got.shape(), got.dtype()), (&[m, n][..], dtype));
                let tol = if dtype == DType::F32 { 1e-5 } else { 1e-2 };
                for (a, e) in got.to_f32_vec().iter().zip(&want) {
                    assert!(
                        (a - e).abs() <= tol * (1.0 + e.abs()),
                        "{m} {dtype}: {a} vs {e}"
                    );
                }
            }
        }
        let err = linear_t(&t(&[1, 3], &[0.; 3]), &t(&[4, 2], &[0.; 8]), None).unwrap_err();
        assert!(
            err.to_string().contains("does not fit [in, out] weight"),
            "{err}"
        );
    }

    #[test]
    fn tanh_gelu_softcap_and_scale() {
        let x = t(&[3], &[1., -2., 0.5]);
        // torch.nn.functional.gelu(x, approximate="tanh")
        let g = gelu_tanh(&x).unwrap().to_f32_vec();
        for (a, e) in g.iter().zip([0.841_192, -0.045_402_3, 0.345_714]) {
            assert!((a - e).abs() < 1e-6, "{a} vs {e}");
        }
        let c = softcap(&t(&[2], &[100., -1.]), 30.0).unwrap().to_f32_vec();
        assert!((c[0] - 30.0 * (100f32 / 30.0).tanh()).abs() < 1e-5 && c[0] < 30.0);
        assert!((c[1] + 0.99963).abs() < 1e-4);
        let half = Tensor::from_f32(DType::BF16, &[1], &[3.0]).unwrap();
        // 3 · 1.7 = 5.1, rounded once to bf16.
        assert_eq!(scale(&half, 1.7).unwrap().to_f32_vec(), [5.09375]);
    }

    #[test]
    fn gemma_norm_multiplies_by_one_plus_the_weight_in_f32() {
        let x = t(&[1, 4], &[1., 2., 3., 4.]);
        let w = t(&[4], &[0., 1., -0.5, 0.]);
        let y = rms_norm_plus_one(&x, &w, 0.0).unwrap().to_f32_vec();
        let rms = (30.0f32 / 4.0).sqrt();
        for (i, (a, f)) in y.iter().zip([1., 2., 0.5, 1.]).enumerate() {
            assert!((a - (i + 1) as f32 / rms * f).abs() < 1e-6, "{i}: {a}");
        }
        let xb = x.to_dtype(DType::BF16).unwrap();
        let yb = rms_norm_plus_one(&xb, &w, 0.0).unwrap();
        assert_eq!(yb.dtype(), DType::BF16);
    }

    #[test]
    fn split_columns_cuts_fused_outputs() {
        let x = t(&[2, 5], &[0., 1., 2., 3., 4., 5., 6., 7., 8., 9.]);
        let parts = split_columns(&x, &[2, 0, 3]).unwrap();
        assert_eq!(parts[0].to_f32_vec(), [0., 1., 5., 6.]);
        assert_eq!(parts[1].shape(), [2, 0]);
        assert_eq!(parts[2].to_f32_vec(), [2., 3., 4., 7., 8., 9.]);
        assert!(split_columns(&x, &[2, 2]).is_err());
    }

    #[test]
    fn partial_and_scaled_rope() {
        // Head of 6, rotary over the first 4 (frequencies 1 and 0.5),
        // cos/sin scaled by 2; the last two dimensions pass through.
        let rope = Rope::with_frequencies(6, vec![1.0, 0.5], 2.0).unwrap();
        let x = t(&[1, 6], &[1., 0., 0., 0., 7., 8.]);
        let y = rope.apply(&x, 1).unwrap().to_f32_vec();
        assert!((y[0] - 2.0 * 1f32.cos()).abs() < 1e-6);
        assert!((y[2] - 2.0 * 1f32.sin()).abs() < 1e-6);
        assert_eq!((y[1], y[3], y[4], y[5]), (0., 0., 7., 8.));
        // Default frequencies given explicitly rotate as Rope::new does.
        let default = Rope::new(4, 100.0);
        let explicit = Rope::with_frequencies(4, vec![1.0, 0.1], 1.0).unwrap();
        let x = t(&[2, 8], &[0.3; 16]);
        assert_eq!(
            default.apply(&x, 5).unwrap().to_f32_vec(),
            explicit.apply(&x, 5).unwrap().to_f32_vec()
        );
        assert!(Rope::with_frequencies(2, vec![1.0, 2.0], 1.0).is_err());
        assert!(Rope::with_frequencies(2, vec![], 1.0).is_err());
    }

    #[test]
    fn attention_scale_and_softcap() {
        let heads = Heads {
            heads: 1,
            kv_heads: 1,
            head_dim: 1,
        };
        let mut cache = LayerCache::new();
        cache
            .append(&t(&[2, 1], &[1., 3.]), &t(&[2, 1], &[0., 1.]))
            .unwrap();
        let q = t(&[1, 1], &[2.]);
        let weight_of_second = |scores: Scores| {
            attention_with(&q, &cache, heads, Mask::Causal, scores)
                .unwrap()
                .to_f32_vec()[0]
        };
        // Scores 2 and 6 at scale 1: softmax weight of the second key.
        let plain = weight_of_second(Scores::standard(1));
        assert!((plain - 1.0 / (1.0 + (-4f32).exp())).abs() < 1e-6);
        let halved = weight_of_second(Scores::scaled_by(4.0));
        assert!((halved - 1.0 / (1.0 + (-2f32).exp())).abs() < 1e-6);
        let capped = weight_of_second(Scores {
            scale: 1.0,
            softcap: Some(2.0),
        });
        let gap = 2.0 * (3f32.tanh() - 1f32.tanh());
        assert!((capped - 1.0 / (1.0 + (-gap).exp())).abs() < 1e-6);
    }

    #[test]
    fn a_windowed_cache_forgets_old_positions_and_attends_the_same() {
        let heads = Heads {
            heads: 2,
            kv_heads: 1,
            head_dim: 2,
        };
        let window = 3;
        let (mut full, mut rolling) = (LayerCache::new(), LayerCache::new());
        for pos in 0..20 {
            let v = |seed: f32| {
                t(
                    &[1, 2],
                    &[(pos as f32 * seed).sin(), (pos as f32 + seed).cos()],
                )
            };
            for cache in [&mut full, &mut rolling] {
                cache.append(&v(0.7), &v(1.3)).unwrap();
            }
            let q = t(&[1, 4], &[0.5, -0.2, 0.1, 0.9]);
            let want = attention(&q, &full, heads, Mask::SlidingWindow(window)).unwrap();
            let got = attention(&q, &rolling, heads, Mask::SlidingWindow(window)).unwrap();
            assert_eq!(want.to_f32_vec(), got.to_f32_vec(), "position {pos}");
            rolling.forget_outside_window(window);
            assert_eq!(rolling.len(), pos + 1);
            assert!(rolling.rows() < 2 * window);
        }
        let err = attention(&t(&[1, 4], &[0.; 4]), &rolling, heads, Mask::Causal).unwrap_err();
        assert!(err.to_string().contains("dropped"), "{err}");
    }

    /// Rows `[seq, width]` of a deterministic sequence `seed`.
    fn rows_of(seed: f32, seq: usize, width: usize) -> Vec<f32> {
        (0..seq * width)
            .map(|i| ((i as f32 + 1.0) * seed).sin())
            .collect()
    }

    /// Interleaves per-sequence rows `[seq, width]` (left-padded with
    /// `pad` zero rows each) into time-major `[len * batch, width]`.
    fn time_major(seqs: &[(Vec<f32>, usize)], width: usize) -> Vec<f32> {
        let len = seqs[0].0.len() / width + seqs[0].1;
        let mut out = Vec::new();
        for step in 0..len {
            for (rows, pad) in seqs {
                match step.checked_sub(*pad) {
                    Some(i) => out.extend_from_slice(&rows[i * width..][..width]),
                    None => out.extend(std::iter::repeat_n(0.0, width)),
                }
            }
        }
        out
    }

    #[test]
    fn a_padded_batch_attends_as_each_sequence_alone() {
        let heads = Heads {
            heads: 2,
            kv_heads: 1,
            head_dim: 3,
        };
        let (qw, kw) = (6, 3);
        // Sequence 0 has 5 positions, sequence 1 has 3 (2 positions of left
        // padding in the batch); then one decoding step each.
        let lens = [5usize, 3];
        let pads = [0usize, 2];
        for mask in [Mask::Causal, Mask::SlidingWindow(2)] {
            let mut alone = Vec::new();
            for (b, &len) in lens.iter().enumerate() {
                let seed = b as f32 + 0.3;
                let mut cache = LayerCache::new();
                let (k, v) = (rows_of(seed, len + 1, kw), rows_of(seed + 7.0, len + 1, kw));
                cache
                    .append(
                        &t(&[len, kw], &k[..len * kw]),
                        &t(&[len, kw], &v[..len * kw]),
                    )
                    .unwrap();
                let q = rows_of(seed + 3.0, len + 1, qw);
                let prefill = attention(&t(&[len, qw], &q[..len * qw]), &cache, heads, mask)
                    .unwrap()
                    .to_f32_vec();
                cache
                    .append(&t(&[1, kw], &k[len * kw..]), &t(&[1, kw], &v[len * kw..]))
                    .unwrap();
                let step = attention(&t(&[1, qw], &q[len * qw..]), &cache, heads, mask)
                    .unwrap()
                    .to_f32_vec();
                alone.push((prefill, step));
            }
            let mut cache = LayerCache::batched(&pads).unwrap();
            // Every sequence's rows of `seed + offset`: the prompt positions
            // (left-padded) when `prompt`, else the decoding step's.
            let batch_rows = |offset: f32, width: usize, prompt: bool| {
                let seqs: Vec<(Vec<f32>, usize)> = lens
                    .iter()
                    .enumerate()
                    .map(|(b, &len)| {
                        let all = rows_of(b as f32 + 0.3 + offset, len + 1, width);
                        match prompt {
                            true => (all[..len * width].to_vec(), pads[b]),
                            false => (all[len * width..].to_vec(), 0),
                        }
                    })
                    .collect();
                time_major(&seqs, width)
            };
            let (k, v, q) = (
                batch_rows(0.0, kw, true),
                batch_rows(7.0, kw, true),
                batch_rows(3.0, qw, true),
            );
            cache.append(&t(&[10, kw], &k), &t(&[10, kw], &v)).unwrap();
            let prefill = attention(&t(&[10, qw], &q), &cache, heads, mask)
                .unwrap()
                .to_f32_vec();
            let (k, v, q) = (
                batch_rows(0.0, kw, false),
                batch_rows(7.0, kw, false),
                batch_rows(3.0, qw, false),
            );
            cache.append(&t(&[2, kw], &k), &t(&[2, kw], &v)).unwrap();
            let step = attention(&t(&[2, qw], &q), &cache, heads, mask)
                .unwrap()
                .to_f32_vec();
            for (b, (want_prefill, want_step)) in alone.iter().enumerate() {
                for i in 0..lens[b] {
                    let r = (i + pads[b]) * 2 + b;
                    assert_eq!(
                        &prefill[r * qw..][..qw],
                        &want_prefill[i * qw..][..qw],
                        "{mask:?} sequence {b} position {i}"
                    );
                }
                assert_eq!(&step[b * qw..][..qw], &want_step[..], "{mask:?} step {b}");
            }
            // Padding rows of sequence 1 see no key: zeros.
            assert_eq!(&prefill[qw..2 * qw], &[0.0; 6]);
            // Sequence 0 leaves; sequence 1 goes on alone, as before.
            cache.retain(&[false, true]).unwrap();
            assert_eq!((cache.batch(), cache.len()), (1, 6));
            let again = attention(&t(&[1, qw], &q[qw..]), &cache, heads, mask).unwrap();
            assert_eq!(again.to_f32_vec(), alone[1].1, "{mask:?} after retain");
        }
        let mut cache = LayerCache::batched(&[0, 0]).unwrap();
        let err = cache
            .append(&t(&[3, 1], &[0.; 3]), &t(&[3, 1], &[0.; 3]))
            .unwrap_err();
        assert!(err.to_string().contains("batch of 2"), "{err}");
        assert!(LayerCache::batched(&[]).is_err());
        assert!(cache.retain(&[false, false]).is_err());
        assert!(cache.retain(&[true]).is_err());
    }

    #[test]
    fn truncate_rewinds_the_cache_unless_the_window_dropped_it() {
        let heads = Heads {
            heads: 1,
            kv_heads: 1,
            head_dim: 2,
        };
        let k = rows_of(0.5, 6, 2);
        let v = rows_of(1.5, 6, 2);
        let mut full = LayerCache::new();
        full.append(&t(&[6, 2], &k), &t(&[6, 2], &v)).unwrap();
        let mut rewound = LayerCache::new();
        rewound
            .append(
                &t(&[6, 2], &rows_of(9.0, 6, 2)),
                &t(&[6, 2], &rows_of(8.0, 6, 2)),
            )
            .unwrap();
        rewound.truncate(0).unwrap();
        assert_eq!((rewound.len(), rewound.bytes()), (0, 0));
        rewound
            .append(&t(&[4, 2], &k[..8]), &t(&[4, 2], &v[..8]))
            .unwrap();
        rewound.truncate(9).unwrap();
        assert_eq!(rewound.len(), 4);
        rewound.truncate(3).unwrap();
        rewound
            .append(&t(&[3, 2], &k[6..]), &t(&[3, 2], &v[6..]))
            .unwrap();
        let q = t(&[1, 2], &[0.3, -0.7]);
        assert_eq!(
            attention(&q, &rewound, heads, Mask::Causal)
                .unwrap()
                .to_f32_vec(),
            attention(&q, &full, heads, Mask::Causal)
                .unwrap()
                .to_f32_vec()
        );
        let mut windowed = LayerCache::new();
        windowed.append(&t(&[6, 2], &k), &t(&[6, 2], &v)).unwrap();
        windowed.forget_outside_window(2);
        let err = windowed.truncate(2).unwrap_err();
        assert!(err.to_string().contains("dropped the first 5"), "{err}");
        windowed.truncate(5).unwrap();
        assert_eq!(windowed.len(), 5);
    }

    #[test]
    fn rope_at_positions_equals_rope_from_a_start() {
        let rope = Rope::new(4, 10000.0);
        let x = t(&[3, 8], &rows_of(0.7, 3, 8));
        let from_start = rope.apply(&x, 5).unwrap().to_f32_vec();
        let at = rope.apply_at(&x, &[5, 6, 7]).unwrap().to_f32_vec();
        assert_eq!(from_start, at);
        let row1 = rope.apply(&x.rows(1, 2).unwrap(), 2).unwrap().to_f32_vec();
        let mixed = rope.apply_at(&x, &[9, 2, 0]).unwrap().to_f32_vec();
        assert_eq!(&mixed[8..16], &row1[..]);
        let err = rope.apply_at(&x, &[1, 2]).unwrap_err();
        assert!(err.to_string().contains("2 positions for 3 rows"), "{err}");
    }

    #[test]
    fn mean_pool_normalize_gives_unit_vectors() {
        let x = t(&[2, 2], &[3., 0., 3., 8.]);
        let e = mean_pool_normalize(&x).unwrap();
        assert!((e[0] - 0.6).abs() < 1e-6 && (e[1] - 0.8).abs() < 1e-6);
    }
}
