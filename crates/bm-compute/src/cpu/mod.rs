//! CPU kernels. Every kernel writes f32 and accumulates in f32 (the
//! integer products in integers), as PyTorch's CPU kernels do: the callers
//! round outputs back to the model's dtype. Weights are read in place in
//! their own format, dense (`dense`) or bitsandbytes-quantized (`quant`);
//! other inputs are widened to f32 by the callers.

mod attention;
mod dense;
mod isa;
mod linear;
#[cfg(test)]
mod mapped_test_file;
mod quant;

use bm_tensor::DType;
use rayon::prelude::*;

use crate::ops::Activation;

pub(crate) use attention::attention;
pub(crate) use dense::Dense;
pub use isa::Isa;
pub(crate) use linear::{LinearPart, linear, linear_many, linear_t};
pub(crate) use quant::{BlockScales, FourBitProduct, FourBitWeight, Int8Product};

/// Rounds f32 values to `dtype` in place (PyTorch's rounding; no-op for F32).
pub(crate) fn round_to(dtype: DType, values: &mut [f32]) {
    use half::slice::HalfFloatSliceExt;
    match dtype {
        // Through a stack buffer, in chunks: half's slice conversions use
        // the CPU's F16C instructions, and nothing is allocated per call.
        DType::F16 => {
            const CHUNK: usize = 256;
            let mut tmp = [half::f16::ZERO; CHUNK];
            for c in values.chunks_mut(CHUNK) {
                let t = &mut tmp[..c.len()];
                t.convert_from_f32_slice(c);
                t.convert_to_f32_slice(c);
            }
        }
        // Round to nearest even on the bits (what `bf16::from_f32` does),
        // written so it vectorises; NaN stays NaN.
        DType::BF16 => values.iter_mut().for_each(|v| {
            let b = v.to_bits();
            let rounded = f32::from_bits((b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF_0000);
            *v = if v.is_nan() { *v } else { rounded };
        }),
        _ => {}
    }
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
    fn rounding_matches_half() {
        let mut v: Vec<f32> = (0..4000u32)
            .map(|i| f32::from_bits(0x3F80_0000 + i * 0x1_1111))
            .chain([f32::MAX, -0.0, f32::INFINITY, 1e-40, 3.0e38])
            .collect();
        for dtype in [DType::BF16, DType::F16] {
            let want: Vec<f32> = v
                .iter()
                .map(|&x| match dtype {
                    DType::BF16 => half::bf16::from_f32(x).to_f32(),
                    _ => half::f16::from_f32(x).to_f32(),
                })
                .collect();
            let mut got = v.clone();
            round_to(dtype, &mut got);
            assert!(
                got.iter()
                    .zip(&want)
                    .all(|(a, b)| a.to_bits() == b.to_bits())
            );
        }
        v[0] = f32::NAN;
        round_to(DType::BF16, &mut v[..1]);
        assert!(v[0].is_nan());
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
