//! CPU kernels. Every kernel reads f32 and writes f32: the callers widen
//! F16/BF16 inputs and round outputs back, so half-precision models
//! accumulate in f32 as PyTorch's CPU kernels do.

use rayon::prelude::*;

use crate::Tensor;
use crate::ops::{Activation, Heads, Mask, Scores};

/// A raw output pointer shared by threads that write disjoint parts.
#[derive(Clone, Copy)]
struct SharedOut(*mut f32);
// SAFETY: only used by `linear_many` and `linear_t`, whose blocks write
// disjoint columns.
unsafe impl Send for SharedOut {}
// SAFETY: as above.
unsafe impl Sync for SharedOut {}

impl SharedOut {
    // A method, so closures capture the Send wrapper and not the raw field.
    fn at(self, offset: usize) -> *mut f32 {
        self.0.wrapping_add(offset)
    }
}

/// Weight rows one task widens and multiplies at a time: enough work per
/// task to amortise the GEMM set-up, small enough to spread over threads
/// and keep a half-precision block's f32 copy in cache.
fn block_rows(n: usize, k: usize) -> usize {
    let threads = rayon::current_num_threads().max(1);
    let by_threads = n.div_ceil(threads * 4);
    let by_cache = (256 * 1024 / 4 / k.max(1)).max(16);
    by_threads.clamp(16, by_cache.max(16)).next_multiple_of(16)
}

/// Where [`linear`] gets the weight's rows: a dense tensor widens them to
/// f32 (no copy for F32), a quantized one dequantizes them.
pub(crate) trait WeightRows: Sync {
    /// Rows `start..end` as f32, row-major: borrowed when stored that way,
    /// else written into `scratch` (a per-thread buffer reused across calls).
    fn rows<'a>(&'a self, start: usize, end: usize, scratch: &'a mut Vec<f32>) -> &'a [f32];
}

impl WeightRows for Tensor {
    fn rows<'a>(&'a self, start: usize, end: usize, scratch: &'a mut Vec<f32>) -> &'a [f32] {
        match self.f32_rows(start, end) {
            std::borrow::Cow::Borrowed(rows) => rows,
            std::borrow::Cow::Owned(rows) => {
                *scratch = rows;
                scratch
            }
        }
    }
}

/// `out[m, n] = x[m, k] · weight[n, k]ᵀ (+ bias[n])`, the product of
/// `nn.Linear`: [`linear_many`] with one weight.
pub(crate) fn linear(
    x: &[f32],
    (m, k, n): (usize, usize, usize),
    weight: &dyn WeightRows,
    bias: Option<&[f32]>,
    out: &mut [f32],
) {
    linear_many(
        x,
        (m, k),
        &mut [LinearPart {
            weight,
            n,
            bias,
            out,
        }],
    );
}

/// One product of [`linear_many`]: `out[m, n] = x · weight[n, k]ᵀ (+ bias)`.
pub(crate) struct LinearPart<'a> {
    pub(crate) weight: &'a dyn WeightRows,
    pub(crate) n: usize,
    pub(crate) bias: Option<&'a [f32]>,
    pub(crate) out: &'a mut [f32],
}

/// Several `nn.Linear` products of one input `x[m, k]` (a layer's separate
/// q/k/v projections, a gated MLP's gate and up) in one pass over the
/// threads: a decode step makes many small products, and each parallel
/// pass costs a wake-up and a join, which dominate on a loaded machine.
/// Threads split the weights' rows; each block is widened (or
/// dequantized) to f32 on the fly into a per-thread buffer, so a
/// half-precision or quantized weight is never converted whole. Each
/// output is what the product alone gives (the same blocks and sums).
pub(crate) fn linear_many(x: &[f32], (m, k): (usize, usize), parts: &mut [LinearPart<'_>]) {
    // What each task reads of its part: the weight, its rows, the bias, and
    // where the output is (tasks write disjoint elements of it).
    let mut reads = Vec::with_capacity(parts.len());
    let mut tasks = Vec::new();
    for (p, part) in parts.iter_mut().enumerate() {
        let n = part.n;
        debug_assert_eq!(part.out.len(), m * n);
        if let Some(b) = part.bias {
            for row in part.out.chunks_exact_mut(n) {
                row.copy_from_slice(b);
            }
        }
        reads.push((
            part.weight,
            n,
            part.bias.is_some(),
            SharedOut(part.out.as_mut_ptr()),
        ));
        let block = block_rows(n, k);
        tasks.extend((0..n.div_ceil(block)).map(|b| (p, b * block, ((b + 1) * block).min(n))));
    }
    tasks
        .into_par_iter()
        .for_each_init(Vec::new, |scratch, (p, j0, j1)| {
            let (weight, n, has_bias, dst) = reads[p];
            let w = weight.rows(j0, j1, scratch);
            if m == 1 {
                // One token (every decode step): a matrix-vector product is
                // bound by reading the weight, so stream rows through a dot
                // product instead of packing them for a GEMM kernel.
                for (j, row) in (j0..j1).zip(w.chunks_exact(k)) {
                    // SAFETY: `dst` points to this part's output (1 × n);
                    // this task alone writes its elements j0..j1, and j < n.
                    unsafe { *dst.at(j) += dot(x, row) };
                }
                return;
            }
            // SAFETY: `dst` points to this part's output (m × n, row stride
            // n); this task writes only columns j0..j1, which no other task
            // touches. `x` is m × k with row stride k; `w` holds rows j0..j1
            // of the weight, read transposed (k × (j1 - j0), column stride k).
            unsafe {
                gemm::gemm(
                    m,
                    j1 - j0,
                    k,
                    dst.at(j0),
                    1,
                    n as isize,
                    has_bias,
                    x.as_ptr(),
                    1,
                    k as isize,
                    w.as_ptr(),
                    k as isize,
                    1,
                    1.0,
                    1.0,
                    false,
                    false,
                    false,
                    gemm::Parallelism::None,
                )
            }
        });
}

/// `out[m, n] = x[m, k] · weight[k, n] (+ bias[n])`: the product of
/// transformers' `Conv1D` (GPT-2), whose weight is stored `[in, out]`.
/// Threads split the weight's columns; a half-precision block is widened
/// to f32 on the fly, an F32 one is read in place.
pub(crate) fn linear_t(
    x: &[f32],
    m: usize,
    k: usize,
    weight: &Tensor,
    bias: Option<&[f32]>,
    out: &mut [f32],
) {
    let n = weight.shape()[1];
    debug_assert_eq!(out.len(), m * n);
    if let Some(b) = bias {
        for row in out.chunks_exact_mut(n) {
            row.copy_from_slice(b);
        }
    }
    if m == 1 {
        // One token: the weight is read once, front to back. Each task sums
        // x[l] · w[l, :] over a fixed run of rows into its own vector, and
        // the vectors are added in order, so the result does not depend on
        // the number of threads.
        const ROWS: usize = 32;
        let partials: Vec<Vec<f32>> = (0..k.div_ceil(ROWS))
            .into_par_iter()
            .map(|b| {
                let (l0, l1) = (b * ROWS, ((b + 1) * ROWS).min(k));
                let w = weight.f32_rows(l0, l1);
                let mut acc = vec![0f32; n];
                for (xl, row) in x[l0..l1].iter().zip(w.chunks_exact(n)) {
                    for (a, v) in acc.iter_mut().zip(row) {
                        *a += xl * v;
                    }
                }
                acc
            })
            .collect();
        for partial in partials {
            for (o, v) in out.iter_mut().zip(&partial) {
                *o += v;
            }
        }
        return;
    }
    let block = block_rows(n, k);
    let dst = SharedOut(out.as_mut_ptr());
    let f32_weight = (weight.dtype() == bm_tensor::DType::F32).then(|| weight.f32_values());
    (0..n.div_ceil(block)).into_par_iter().for_each(|b| {
        let (j0, j1) = (b * block, ((b + 1) * block).min(n));
        let width = j1 - j0;
        // The k × width block: in place for F32 (row stride n), else widened
        // into a dense copy (row stride width).
        let widened;
        let (rhs, row_stride) = match &f32_weight {
            Some(w) => (&w[j0..], n),
            None => {
                let mut dense = vec![0f32; k * width];
                for (l, row) in dense.chunks_exact_mut(width).enumerate() {
                    weight.widen_range_into(l * n + j0, row);
                }
                widened = dense;
                (&widened[..], width)
            }
        };
        // SAFETY: `dst` points to `out` (m × n, row stride n); this task
        // writes only columns j0..j1, which no other task touches. `x` is
        // m × k with row stride k; `rhs` holds the k × width block with the
        // given row stride and column stride 1, and the last element read,
        // (k - 1) * row_stride + width - 1, is inside it.
        unsafe {
            gemm::gemm(
                m,
                width,
                k,
                dst.at(j0),
                1,
                n as isize,
                bias.is_some(),
                x.as_ptr(),
                1,
                k as isize,
                rhs.as_ptr(),
                1,
                row_stride as isize,
                1.0,
                1.0,
                false,
                false,
                false,
                gemm::Parallelism::None,
            )
        }
    });
}

/// Dot product with eight independent partial sums, so it vectorises.
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x * y)
        .sum();
    let mut acc = [0f32; 8];
    for (x, y) in ca.zip(cb) {
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// Llama's RMSNorm over rows of `cols`: `w * round(x / rms(x))`, where
/// `round` is the activation dtype's rounding (PyTorch normalises in f32,
/// casts back, then multiplies by the weight).
pub(crate) fn rms_norm(
    x: &[f32],
    cols: usize,
    weight: &[f32],
    eps: f32,
    round: fn(f32) -> f32,
    out: &mut [f32],
) {
    out.par_chunks_mut(cols)
        .zip(x.par_chunks(cols))
        .for_each(|(o, r)| {
            let mean_sq = r.iter().map(|v| v * v).sum::<f32>() / cols as f32;
            let inv = 1.0 / (mean_sq + eps).sqrt();
            for ((o, v), w) in o.iter_mut().zip(r).zip(weight) {
                *o = w * round(v * inv);
            }
        });
}

/// LayerNorm over rows of `cols` (biased variance, as PyTorch).
pub(crate) fn layer_norm(
    x: &[f32],
    cols: usize,
    weight: &[f32],
    bias: &[f32],
    eps: f32,
    out: &mut [f32],
) {
    out.par_chunks_mut(cols)
        .zip(x.par_chunks(cols))
        .for_each(|(o, r)| {
            let mean = r.iter().sum::<f32>() / cols as f32;
            let var = r.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / cols as f32;
            let inv = 1.0 / (var + eps).sqrt();
            for (((o, v), w), b) in o.iter_mut().zip(r).zip(weight).zip(bias) {
                *o = (v - mean) * inv * w + b;
            }
        });
}

/// Softmax of one row, in place, with the max subtracted first.
pub(crate) fn softmax_row(row: &mut [f32]) {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0;
    for v in row.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    for v in row.iter_mut() {
        *v /= sum;
    }
}

/// Llama's rotary embedding on `x` ([seq, heads * head_dim]), rows at
/// positions `start_pos..`: the `rotate_half` convention over the first
/// `rotary_dim` dimensions of each head, where dimension i pairs with
/// i + rotary_dim / 2; the other dimensions pass through (partial rotary).
/// `cos`/`sin` give row-major [seq, rotary_dim / 2].
pub(crate) fn rotary(
    x: &[f32],
    head_dim: usize,
    rotary_dim: usize,
    cos: &[f32],
    sin: &[f32],
    out: &mut [f32],
) {
    let half = rotary_dim / 2;
    let width = x.len() / (cos.len() / half);
    out.par_chunks_mut(width)
        .zip(x.par_chunks(width))
        .enumerate()
        .for_each(|(row, (o, r))| {
            let (c, s) = (&cos[row * half..][..half], &sin[row * half..][..half]);
            for (oh, xh) in o.chunks_exact_mut(head_dim).zip(r.chunks_exact(head_dim)) {
                for i in 0..half {
                    let (a, b) = (xh[i], xh[i + half]);
                    oh[i] = a * c[i] - b * s[i];
                    oh[i + half] = b * c[i] + a * s[i];
                }
                oh[rotary_dim..].copy_from_slice(&xh[rotary_dim..]);
            }
        });
}

/// Multiply-adds of attention's scores (queries × keys × head width ×
/// heads) below which its heads run on the calling thread.
const SERIAL_ATTENTION_WORK: usize = 1 << 20;

/// Scaled dot-product attention for `s` queries of each of `batch`
/// sequences against `t` cached keys/values of each; the queries are the
/// last `s` positions. Rows are time-major (row `i * batch + b` is
/// sequence b at position i), and sequence b attends to no position before
/// `first[b]` (its left padding). Grouped-query attention: query head h
/// reads kv head h / (heads / kv_heads). Scores are `q · k` times
/// `scores.scale`, soft-capped when asked, plus, when a bias is given, its
/// value for head h and the relative position `key - query`, at
/// `bias[h * (t + s - 1) + key - query + t - 1]`. A query that sees no key
/// (a padding row) gets zeros.
pub(crate) fn attention(
    q: &[f32],
    keys: &[f32],
    values: &[f32],
    heads: Heads,
    (mask, scores, bias): (Mask, Scores, Option<&[f32]>),
    first: &[usize],
    out: &mut [f32],
) {
    let Heads {
        heads: nh,
        kv_heads: nkv,
        head_dim: hd,
    } = heads;
    let batch = first.len();
    let (q_width, kv_width) = (nh * hd, nkv * hd);
    let rows = q.len() / q_width;
    let s = rows / batch;
    let t = keys.len() / (kv_width * batch);
    // Only causal masks look at positions, and they have s <= t.
    let past = t.saturating_sub(s);
    let group = nh / nkv;
    let Scores { scale, softcap } = scores;
    let head = |h: usize| {
        let g = h / group;
        let mut o = vec![0f32; rows * hd];
        let mut row = Vec::with_capacity(t);
        for r in 0..rows {
            let (i, b) = (r / batch, r % batch);
            let pos = past + i;
            let (lo, hi) = match mask {
                Mask::Bidirectional => (0, t),
                Mask::Causal => (0, pos + 1),
                Mask::SlidingWindow(w) => ((pos + 1).saturating_sub(w), pos + 1),
            };
            let lo = lo.max(first[b]);
            if lo >= hi {
                continue;
            }
            let key = |j: usize| (j * batch + b) * kv_width + g * hd;
            let qi = &q[r * q_width + h * hd..][..hd];
            row.clear();
            row.extend((lo..hi).map(|j| {
                let kj = &keys[key(j)..][..hd];
                let score = qi.iter().zip(kj).map(|(a, b)| a * b).sum::<f32>() * scale;
                let score = match softcap {
                    Some(cap) => soft_cap(score, cap),
                    None => score,
                };
                // key - query + t - 1 = j - (past + i) + t - 1.
                match bias {
                    Some(bias) => score + bias[h * (t + s - 1) + j + s - 1 - i],
                    None => score,
                }
            }));
            softmax_row(&mut row);
            let oi = &mut o[r * hd..][..hd];
            for (p, j) in row.iter().zip(lo..hi) {
                let vj = &values[key(j)..][..hd];
                for (acc, v) in oi.iter_mut().zip(vj) {
                    *acc += p * v;
                }
            }
        }
        o
    };
    // A decode step over a short cache is a few microseconds of work per
    // layer: less than waking and joining the threads costs.
    let per_head: Vec<Vec<f32>> = if rows * t * hd * nh < SERIAL_ATTENTION_WORK {
        (0..nh).map(head).collect()
    } else {
        (0..nh).into_par_iter().map(head).collect()
    };
    for (h, o) in per_head.iter().enumerate() {
        for r in 0..rows {
            out[r * q_width + h * hd..][..hd].copy_from_slice(&o[r * hd..][..hd]);
        }
    }
}

/// `op` on one value.
pub(crate) fn activation(op: Activation, x: f32) -> f32 {
    match op {
        Activation::Silu => silu(x),
        Activation::Gelu => gelu(x),
        Activation::GeluTanh => gelu_tanh(x),
        // NaN is kept (`NaN < 0` is false).
        Activation::Relu => {
            if x < 0.0 {
                0.0
            } else {
                x
            }
        }
        Activation::SoftCap(cap) => soft_cap(x, cap),
    }
}

/// `x * sigmoid(x)`.
fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// `cap · tanh(x / cap)`: Gemma 2's soft-capping of attention scores and
/// final logits, which squashes values into (-cap, cap).
fn soft_cap(x: f32, cap: f32) -> f32 {
    (x / cap).tanh() * cap
}

/// GELU's tanh approximation, `0.5 x (1 + tanh(√(2/π) (x + 0.044715 x³)))`:
/// GPT-2's `gelu_new` and PyTorch's `gelu(approximate="tanh")`, in f32 as
/// PyTorch's CPU kernel computes it.
fn gelu_tanh(x: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    0.5 * x * (1.0 + (SQRT_2_OVER_PI * (x + 0.044715 * x * x * x)).tanh())
}

/// BERT's exact GELU, `0.5 x (1 + erf(x / √2))`.
fn gelu(x: f32) -> f32 {
    let x = x as f64;
    (0.5 * x * (1.0 + erf(x / std::f64::consts::SQRT_2))) as f32
}

/// erf from the Chebyshev fit of Numerical Recipes' `erfc` (fractional
/// error below 1.2e-7, far under f32 rounding of GELU's output).
fn erf(x: f64) -> f64 {
    let z = x.abs();
    let t = 1.0 / (1.0 + 0.5 * z);
    let poly = -z * z - 1.26551223
        + t * (1.00002368
            + t * (0.37409196
                + t * (0.09678418
                    + t * (-0.18628806
                        + t * (0.27886807
                            + t * (-1.13520398
                                + t * (1.48851587 + t * (-0.82215223 + t * 0.17087277))))))));
    let erfc = t * poly.exp();
    if x >= 0.0 { 1.0 - erfc } else { erfc - 1.0 }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn erf_matches_known_values() {
        // Values from scipy.special.erf.
        for (x, want) in [
            (0.0, 0.0),
            (0.5, 0.5204998778130465),
            (1.0, 0.8427007929497149),
            (-2.0, -0.9953222650189527),
            (3.5, 0.9999992569016276),
        ] {
            assert!((erf(x) - want).abs() < 2e-7, "erf({x}) = {}", erf(x));
        }
    }

    #[test]
    fn softmax_is_shift_invariant_and_sums_to_one() {
        let mut a = [1.0f32, 2.0, 3.0];
        let mut b = [1001.0f32, 1002.0, 1003.0];
        softmax_row(&mut a);
        softmax_row(&mut b);
        assert!((a.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        assert_eq!(a, b);
        assert!((a[2] - 0.66524096).abs() < 1e-6);
    }
}
