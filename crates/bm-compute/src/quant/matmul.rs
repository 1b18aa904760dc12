//! The matmul of a linear layer whose weight is quantized, on the CPU.
//!
//! Both formats run on [`cpu::linear`]'s tiling (threads over blocks of
//! weight rows) with kernels that read the packed weight in place and
//! dequantize in registers (`cpu::quant`), so no dequantized copy of a
//! weight ever exists.
//!
//! * 4-bit computes as bitsandbytes' `Linear4bit` does on the CPU: the
//!   input is cast to the compute dtype, the weight dequantized to it
//!   (`code * absmax` in f32, then rounded), the product accumulated in
//!   f32 and rounded to the compute dtype, then cast back to the input's.
//! * 8-bit is LLM.int8() as `Linear8bitLt` runs it (`MatMul8bitLt`): the
//!   input goes to float16; activation columns holding a value at or above
//!   the threshold are outliers, kept out of the int8 product and
//!   multiplied in the input's dtype against the dequantized weight
//!   columns; the rest is quantized row-wise to int8, multiplied exactly
//!   (in integers; bitsandbytes' own CPU fallback sums them in f32, which
//!   is exact until a partial sum passes 2²⁴) and scaled by
//!   `row_absmax * SCB / 127²`.

use std::borrow::Cow;

use bm_tensor::DType;
use half::f16;

use super::tensor::{Data, INV_127, INV_127_SQUARED, Int8, QuantizedTensor};
use crate::Isa;
use crate::cpu::{self, round_to};
use crate::ops::{bad, expect_vector, rounding, rows_cols};
use crate::{Backend, Error, Tensor};

/// `x · weightᵀ + bias` with a quantized `weight` (`[out_features,
/// in_features]`), as bitsandbytes' `Linear4bit` / `Linear8bitLt` compute
/// it. `x` is `[..., in_features]` in F32, F16 or BF16; the result has its
/// shape (last dimension `out_features`) and dtype. An `x` on a GPU runs
/// there ([`linear_quantized_on_gpu`](super::linear_quantized_on_gpu)) with
/// the weight uploaded packed; a GPU bias with a host `x` is
/// [`Error::NotOnCuda`].
pub fn linear_quantized(
    x: &Tensor,
    weight: &QuantizedTensor,
    bias: Option<&Tensor>,
) -> Result<Tensor, Error> {
    const OP: &str = "linear_quantized";
    if let Some(gpu) = x.device_buffer().map(|b| b.gpu().clone()) {
        return super::linear_quantized_on_gpu(x, &weight.to_gpu(&gpu)?, bias);
    }
    if bias.is_some_and(|b| b.backend() != Backend::Cpu) {
        return Err(Error::NotOnCuda { op: OP });
    }
    let ((m, k, n), shape) = product_shape(x, weight.shape, bias)?;
    match &weight.data {
        Data::FourBit(_) => four_bit(x, weight, bias, (m, k, n), &shape),
        Data::Int8(int8) => llm_int8(x, int8, bias, (m, k, n), &shape),
    }
}

/// `values` cast to `dtype` (a copy only when that rounds anything).
fn cast(values: Cow<'_, [f32]>, from: DType, to: DType) -> Cow<'_, [f32]> {
    if to == DType::F32 || to == from {
        return values;
    }
    let mut v = values.into_owned();
    round_to(to, &mut v);
    Cow::Owned(v)
}

fn four_bit(
    x: &Tensor,
    weight: &QuantizedTensor,
    bias: Option<&Tensor>,
    mkn: (usize, usize, usize),
    shape: &[usize],
) -> Result<Tensor, Error> {
    let compute = weight.compute_dtype.unwrap_or(x.dtype());
    let xs = cast(x.f32_values(), x.dtype(), compute);
    let bs = bias.map(|b| cast(b.f32_values(), b.dtype(), compute));
    let Data::FourBit(four_bit) = &weight.data else {
        unreachable!("four_bit is called for 4-bit weights")
    };
    let (m, k, n) = mkn;
    let product = cpu::FourBitProduct::new(&xs, k, four_bit.kernel_view(), compute, Isa::active());
    Tensor::build(x.dtype(), shape, |out| {
        cpu::linear((m, k), &product, n, bs.as_deref(), out);
        // The product is in the compute dtype before it is cast back.
        if compute != DType::F32 && compute != x.dtype() {
            round_to(compute, out);
        }
    })
}

fn llm_int8(
    x: &Tensor,
    int8: &Int8,
    bias: Option<&Tensor>,
    (m, k, n): (usize, usize, usize),
    shape: &[usize],
) -> Result<Tensor, Error> {
    let dtype = x.dtype();
    let round = rounding(dtype);
    let xs = x.f32_values();
    // MatMul8bitLt quantizes the input from float16.
    let mut half = xs.to_vec();
    round_to(DType::F16, &mut half);
    let mut outliers = Vec::new();
    if int8.threshold > 0.0 {
        // The comparison happens in float16 too.
        let threshold = f16::from_f32(int8.threshold).to_f32();
        let mut is_outlier = vec![false; k];
        for row in half.chunks_exact_mut(k) {
            for (v, flag) in row.iter_mut().zip(is_outlier.iter_mut()) {
                if v.abs() >= threshold {
                    *flag = true;
                    *v = 0.0;
                }
            }
        }
        outliers = (0..k).filter(|&c| is_outlier[c]).collect();
    }
    // int8_vectorwise_quant: each row scaled by its absmax to ±127; a zero
    // row stays zero; outlier columns are zero in every row.
    let mut row_absmax = vec![0f32; m];
    for (row, absmax) in half.chunks_exact_mut(k).zip(row_absmax.iter_mut()) {
        *absmax = row.iter().fold(0f32, |a, v| a.max(v.abs()));
        let scale = (1.0 / *absmax) * 127.0;
        for v in row.iter_mut() {
            *v = if *absmax > 0.0 {
                round_small_ties_even(*v * scale)
            } else {
                0.0
            };
        }
        for &c in &outliers {
            row[c] = 0.0;
        }
    }
    let scb = int8.scb.get();
    let bias = bias.map(|b| b.f32_values());
    Tensor::build(dtype, shape, |out| {
        let product = cpu::Int8Product::new(&half, k, int8.codes(), Isa::active());
        cpu::linear((m, k), &product, n, None, out);
        for (row, &absmax) in out.chunks_exact_mut(n).zip(&row_absmax) {
            for (j, v) in row.iter_mut().enumerate() {
                let scaled = *v * (absmax * scb[j]) * INV_127_SQUARED;
                *v = round(scaled + bias.as_ref().map_or(0.0, |b| b[j]));
            }
        }
        if outliers.is_empty() {
            return;
        }
        // The outlier columns in the input's dtype, against the weight's
        // columns dequantized to it (`dequantize_rows`' formula, for those
        // columns only).
        let codes = int8.codes();
        let mut w = vec![0f32; outliers.len()];
        for j in 0..n {
            for (w, &c) in w.iter_mut().zip(&outliers) {
                *w = round(f32::from(codes[j * k + c]) * scb[j] * INV_127);
            }
            for (i, row) in out.chunks_exact_mut(n).enumerate() {
                let extra: f32 = outliers
                    .iter()
                    .zip(&w)
                    .map(|(&c, w)| xs[i * k + c] * w)
                    .sum();
                row[j] = round(row[j] + extra);
            }
        }
    })
}

/// `v.round_ties_even()` for |v| < 2²² (here |v| <= 127), in two adds:
/// adding 1.5 · 2²³ leaves no fraction bits, so the add rounds to the
/// nearest integer, ties to even, as the FPU's default mode does. The
/// baseline x86-64 build has no rounding instruction, and the libm call behind
/// `round_ties_even` costs more than the product on a small layer.
fn round_small_ties_even(v: f32) -> f32 {
    const SHIFT: f32 = 12_582_912.0;
    (v + SHIFT) - SHIFT
}

/// A product's (rows, k, n) and its output shape.
pub(super) type ProductShape = ((usize, usize, usize), Vec<usize>);

/// `x` ([.., k]) times a quantized weight of `weight_shape` ([n, k]) plus
/// `bias` ([n]): the product's shape, or why they do not fit.
pub(super) fn product_shape(
    x: &Tensor,
    weight_shape: [usize; 2],
    bias: Option<&Tensor>,
) -> Result<ProductShape, Error> {
    const OP: &str = "linear_quantized";
    let (m, k) = rows_cols(x);
    let [n, cols] = weight_shape;
    if cols != k || x.shape().is_empty() {
        return Err(bad(
            OP,
            format!(
                "input of shape {:?} does not fit weight of shape {weight_shape:?}",
                x.shape(),
            ),
        ));
    }
    if let Some(b) = bias {
        expect_vector(OP, b, n, "bias")?;
    }
    let mut shape = x.shape().to_vec();
    *shape.last_mut().expect("input has a last dimension") = n;
    Ok(((m, k, n), shape))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::{FourBitType, QuantFormat, quantize};

    fn values(len: usize, seed: usize) -> Vec<f32> {
        (0..len)
            .map(|i| (((i + seed) * 7919) % 1009) as f32 / 1009.0 - 0.5)
            .collect()
    }

    fn naive(x: &[f32], w: &[f32], m: usize, k: usize, n: usize) -> Vec<f32> {
        let mut y = vec![0f32; m * n];
        for i in 0..m {
            for j in 0..n {
                y[i * n + j] = (0..k).map(|l| x[i * k + l] * w[j * k + l]).sum();
            }
        }
        y
    }

    #[test]
    fn four_bit_matmul_equals_the_dequantized_product() {
        // k = 75 puts block boundaries inside rows and odd rows at a
        // half byte; one row (decode) and several (prefill).
        let (k, n) = (75, 37);
        let w = Tensor::from_f32(DType::F32, &[n, k], &values(n * k, 1)).unwrap();
        for (kind, double_quant) in [(FourBitType::Nf4, true), (FourBitType::Fp4, false)] {
            let format = QuantFormat::FourBit {
                kind,
                blocksize: 64,
                double_quant,
            };
            let q = quantize(&w, format, "w").unwrap();
            let dense = q.dequantize(DType::F32).unwrap().to_f32_vec();
            for m in [1, 5] {
                let x = Tensor::from_f32(DType::F32, &[m, k], &values(m * k, 2)).unwrap();
                let bias = Tensor::from_f32(DType::F32, &[n], &values(n, 3)).unwrap();
                let y = linear_quantized(&x, &q, Some(&bias)).unwrap().to_f32_vec();
                let want = naive(&x.to_f32_vec(), &dense, m, k, n);
                let b = bias.to_f32_vec();
                for (i, (a, e)) in y.iter().zip(&want).enumerate() {
                    let e = e + b[i % n];
                    assert!((a - e).abs() < 1e-5, "{kind:?} m={m} [{i}]: {a} vs {e}");
                }
            }
        }
    }

    #[test]
    fn four_bit_compute_dtype_rounds_input_weight_and_output() {
        let (k, n) = (64, 8);
        let w = Tensor::from_f32(DType::F32, &[n, k], &values(n * k, 4)).unwrap();
        let format = QuantFormat::FourBit {
            kind: FourBitType::Nf4,
            blocksize: 64,
            double_quant: false,
        };
        let mut q = quantize(&w, format, "w").unwrap();
        q.set_compute_dtype(Some(DType::BF16)).unwrap();
        let x = Tensor::from_f32(DType::F32, &[1, k], &values(k, 5)).unwrap();
        let y = linear_quantized(&x, &q, None).unwrap();
        assert_eq!(y.dtype(), DType::F32);
        let xb = x.to_dtype(DType::BF16).unwrap().to_f32_vec();
        let wb = q.dequantize(DType::BF16).unwrap().to_f32_vec();
        let want = Tensor::from_f32(DType::BF16, &[n], &naive(&xb, &wb, 1, k, n)).unwrap();
        for (a, e) in y.to_f32_vec().iter().zip(want.to_f32_vec()) {
            // Both are bf16 values; summation order may move one ulp.
            assert!((a - e).abs() <= e.abs() / 128.0 + 1e-6, "{a} vs {e}");
            assert_eq!(half::bf16::from_f32(*a).to_f32(), *a);
        }
    }

    #[test]
    fn llm_int8_keeps_outlier_columns_in_full_precision() {
        let (m, k, n) = (3, 16, 5);
        let wv = values(n * k, 6);
        let w = Tensor::from_f32(DType::F32, &[n, k], &wv).unwrap();
        let mut xv = values(m * k, 7);
        xv[k + 3] = 9.0; // row 1, column 3: an outlier column
        let x = Tensor::from_f32(DType::F32, &[m, k], &xv).unwrap();
        let exact = naive(&xv, &wv, m, k, n);
        let plain = quantize(&w, QuantFormat::Int8 { threshold: 0.0 }, "w").unwrap();
        let mixed = quantize(&w, QuantFormat::Int8 { threshold: 6.0 }, "w").unwrap();
        let err = |q: &QuantizedTensor| {
            let y = linear_quantized(&x, q, None).unwrap().to_f32_vec();
            y.iter()
                .zip(&exact)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0, f32::max)
        };
        // With the outlier quantized, row 1's other activations lose most
        // of their precision; decomposed, only int8 rounding remains.
        let (e_plain, e_mixed) = (err(&plain), err(&mixed));
        assert!(e_mixed < 0.02, "{e_mixed}");
        assert!(e_plain > 2.0 * e_mixed, "{e_plain} vs {e_mixed}");
    }

    #[test]
    fn small_values_round_half_to_even() {
        for i in -2540..=2540 {
            let v = i as f32 / 20.0;
            assert_eq!(round_small_ties_even(v), v.round_ties_even(), "{v}");
        }
        for v in [
            0.5f32, 1.5, 2.5, -0.5, -2.5, 126.5, -126.5, 127.0, 126.99999,
        ] {
            assert_eq!(round_small_ties_even(v), v.round_ties_even(), "{v}");
        }
    }

    #[test]
    fn mismatched_shapes_are_errors() {
        let w = Tensor::from_f32(DType::F32, &[4, 8], &values(32, 0)).unwrap();
        let q = quantize(&w, QuantFormat::Int8 { threshold: 6.0 }, "w").unwrap();
        let x = Tensor::from_f32(DType::F32, &[1, 7], &values(7, 0)).unwrap();
        let err = linear_quantized(&x, &q, None).unwrap_err();
        assert!(
            err.to_string()
                .contains("does not fit weight of shape [4, 8]"),
            "{err}"
        );
        let x = Tensor::from_f32(DType::F32, &[1, 8], &values(8, 0)).unwrap();
        let b = Tensor::from_f32(DType::F32, &[3], &[0.0; 3]).unwrap();
        let err = linear_quantized(&x, &q, Some(&b)).unwrap_err();
        assert!(err.to_string().contains("bias has shape [3]"), "{err}");
    }
}
