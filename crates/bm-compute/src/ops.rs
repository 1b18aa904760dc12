//! The operations the reference models are made of.
//!
//! Each op checks its operands (shapes, dtypes), then runs on the backend
//! its inputs live on. Inputs may be F32, F16 or BF16 (weights and
//! activations need not agree); the result has the dtype of the activation
//! operand. Half-precision inputs are widened to f32 and results rounded
//! once, PyTorch's rule for CPU kernels that accumulate in f32.

use bm_tensor::DType;
use half::{bf16, f16};

use crate::tensor::is_compute_dtype;
use crate::{Backend, Error, Tensor, cpu, cuda};

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

fn bad(op: &'static str, message: String) -> Error {
    Error::BadOperands { op, message }
}

/// The innermost dimension, and the number of rows before it.
fn rows_cols(t: &Tensor) -> (usize, usize) {
    let cols = t.shape().last().copied().unwrap_or(1);
    (t.numel() / cols.max(1), cols)
}

fn expect_vector(op: &'static str, t: &Tensor, len: usize, what: &str) -> Result<(), Error> {
    if t.shape() != [len] {
        return Err(bad(
            op,
            format!("{what} has shape {:?}, expected [{len}]", t.shape()),
        ));
    }
    Ok(())
}

/// The rounding of `dtype` applied to an f32 value (identity for F32).
fn rounding(dtype: DType) -> fn(f32) -> f32 {
    match dtype {
        DType::F16 => |v| f16::from_f32(v).to_f32(),
        DType::BF16 => |v| bf16::from_f32(v).to_f32(),
        _ => |v| v,
    }
}

/// `x · weightᵀ + bias`: the matmul of `nn.Linear`, with `weight` stored
/// `[out_features, in_features]` as in every checkpoint. `x` is
/// `[..., in_features]`; the result `[..., out_features]`.
pub fn linear(x: &Tensor, weight: &Tensor, bias: Option<&Tensor>) -> Result<Tensor, Error> {
    let mut operands = vec![x, weight];
    operands.extend(bias);
    let backend = backend_of(&operands);
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
    let mut shape = x.shape().to_vec();
    *shape.last_mut().expect("input has a last dimension") = n;
    match backend {
        Backend::Cuda(_) => cuda::linear(&gpu_for(&operands), x, weight, bias, (m, k, n), &shape),
        Backend::Cpu => {
            let xs = x.f32_values();
            let bs = bias.map(|b| b.f32_values());
            Tensor::build(x.dtype(), &shape, |out| {
                cpu::linear(&xs, m, k, weight, bs.as_deref(), out)
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

/// Rotary position embedding with Llama's `rotate_half` convention and
/// default (unscaled) frequencies `1 / theta^(2i / head_dim)`.
#[derive(Clone, Debug)]
pub struct Rope {
    head_dim: usize,
    theta: f32,
    inv_freq: Vec<f32>,
}

impl Rope {
    /// Frequencies for heads of `head_dim` (even) and base `theta`,
    /// computed in f32 as transformers does.
    pub fn new(head_dim: usize, theta: f32) -> Rope {
        let inv_freq = (0..head_dim / 2)
            .map(|i| 1.0 / theta.powf((2 * i) as f32 / head_dim as f32))
            .collect();
        Rope {
            head_dim,
            theta,
            inv_freq,
        }
    }

    /// Rotates every head of `x` (`[seq, heads * head_dim]`), row r being
    /// at position `start_pos + r`.
    pub fn apply(&self, x: &Tensor, start_pos: usize) -> Result<Tensor, Error> {
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
        if let Backend::Cuda(_) = x.backend() {
            return cuda::rotary(x, self.head_dim, start_pos, self.theta);
        }
        // transformers casts cos/sin to the activation dtype before use.
        let round = rounding(x.dtype());
        let half = self.head_dim / 2;
        let (mut cos, mut sin) = (
            Vec::with_capacity(rows * half),
            Vec::with_capacity(rows * half),
        );
        for r in 0..rows {
            let pos = (start_pos + r) as f32;
            for f in &self.inv_freq {
                let angle = pos * f;
                cos.push(round(angle.cos()));
                sin.push(round(angle.sin()));
            }
        }
        let xs = x.f32_values();
        Tensor::build(x.dtype(), x.shape(), |out| {
            cpu::rotary(&xs, self.head_dim, &cos, &sin, out)
        })
    }
}

/// One layer's key/value cache, on the backend of the tensors appended.
///
/// Values are kept widened to f32: they were rounded to the model's dtype
/// before being appended, so the widening is exact.
#[derive(Debug, Default)]
pub struct LayerCache {
    width: usize,
    keys: Vec<f32>,
    values: Vec<f32>,
    /// The cache of a layer computed on a GPU.
    device: Option<cuda::DeviceKv>,
}

impl LayerCache {
    /// An empty cache.
    pub fn new() -> LayerCache {
        LayerCache::default()
    }

    /// Positions cached so far.
    pub fn len(&self) -> usize {
        match &self.device {
            Some(kv) => kv.rows,
            None => self.keys.len().checked_div(self.width).unwrap_or(0),
        }
    }

    /// True when nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Appends the keys and values (`[seq, kv_heads * head_dim]`) of new positions.
    pub fn append(&mut self, keys: &Tensor, values: &Tensor) -> Result<(), Error> {
        let backend = backend_of(&[keys, values]);
        let (_, width) = rows_cols(keys);
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
        let on_gpu = self.device.is_some();
        match backend {
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
}

/// Scaled dot-product attention (softmax in f32) of `q`
/// (`[seq, heads * head_dim]`, the last `seq` positions) against every
/// position in `cache`. The result is `[seq, heads * head_dim]`.
pub fn attention(
    q: &Tensor,
    cache: &LayerCache,
    heads: Heads,
    mask: Mask,
) -> Result<Tensor, Error> {
    let (s, width) = rows_cols(q);
    if heads.kv_heads == 0 || heads.heads % heads.kv_heads != 0 {
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
    if cache.len() < s {
        return Err(bad(
            "attention",
            format!("{s} queries but only {} cached positions", cache.len()),
        ));
    }
    match (&cache.device, q.backend()) {
        (Some(kv), _) => kv.attention(q, heads, mask),
        (None, Backend::Cpu) => {
            let qs = q.f32_values();
            Tensor::build(q.dtype(), q.shape(), |out| {
                cpu::attention(&qs, &cache.keys, &cache.values, heads, mask, out)
            })
        }
        (None, Backend::Cuda(_)) => {
            let host = q.to_host()?;
            let qs = host.f32_values();
            Tensor::build(q.dtype(), q.shape(), |out| {
                cpu::attention(&qs, &cache.keys, &cache.values, heads, mask, out)
            })
        }
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

/// An elementwise function; `gelu` picks the GPU kernel (SiLU otherwise).
fn unary(x: &Tensor, f: fn(f32) -> f32, gelu: bool) -> Result<Tensor, Error> {
    match x.backend() {
        Backend::Cuda(_) => cuda::unary(x, gelu),
        Backend::Cpu => {
            let xs = x.f32_values();
            Tensor::build(x.dtype(), x.shape(), |out| {
                for (o, v) in out.iter_mut().zip(xs.iter()) {
                    *o = f(*v);
                }
            })
        }
    }
}

/// SiLU (`x · sigmoid(x)`), elementwise.
pub fn silu(x: &Tensor) -> Result<Tensor, Error> {
    unary(x, cpu::silu, false)
}

/// GELU in its exact erf form (BERT's `gelu`), elementwise.
pub fn gelu(x: &Tensor) -> Result<Tensor, Error> {
    unary(x, cpu::gelu, true)
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
    fn mean_pool_normalize_gives_unit_vectors() {
        let x = t(&[2, 2], &[3., 0., 3., 8.]);
        let e = mean_pool_normalize(&x).unwrap();
        assert!((e[0] - 0.6).abs() < 1e-6 && (e[1] - 0.8).abs() < 1e-6);
    }
}
