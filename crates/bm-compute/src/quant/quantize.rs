//! Quantizing a dense weight, bit for bit as bitsandbytes does on the CPU.
//!
//! * 4-bit (`quantize_4bit`, its default PyTorch backend): the flattened
//!   weight is cut into blocks; each block's absmax scales it into [-1, 1]
//!   (full blocks multiply by the f32 reciprocal, a trailing partial block
//!   divides, and stores its absmax clamped to 1e-38), each value takes the
//!   code of its bucket between midpoints of the sorted table (ties go
//!   down), two codes a byte, the first in the high nibble.
//! * Double quantization (`compress_statistics`): the absmax values minus
//!   their mean are quantized in blocks of 256 to the 8-bit dynamic map by
//!   bitsandbytes' CPU kernel, which looks codes up in a 65536-bin table.
//!   The mean is the one deviation: bitsandbytes takes it with PyTorch's
//!   float32 sum, whose rounding depends on the SIMD width and thread count
//!   of the machine; we sum in f64 (see docs/compat.md).
//! * 8-bit (`Int8Params`): the weight is rounded to float16, each row's
//!   absmax (`SCB`) scales it to ±127 (by `127 * (1 / absmax)`: PyTorch's
//!   `127.0 / t` is a reciprocal and a multiply), rounded half to even.

use std::sync::LazyLock;

use bm_tensor::{DType, HostBuffer};
use half::f16;
use rayon::prelude::*;

use super::format::{self, FourBitType, NESTED_BLOCK_SIZE};
use super::tensor::{Data, F32s, FourBit, Int8, QuantFormat, QuantizedTensor, Scales};
use crate::{Backend, Error, HostBytes, Tensor};

/// The smallest scale PyTorch's `clamp(min=1e-38)` leaves (a subnormal).
const MIN_ABSMAX: f32 = 1e-38;

/// Blocks one task quantizes.
const TASK_BLOCKS: usize = 64;

/// bitsandbytes' blockwise lookup table for the dynamic map, built once.
static DYNAMIC_LUT: LazyLock<Vec<u8>> =
    LazyLock::new(|| format::blockwise_lut(&format::dynamic_map()));

/// Quantizes a dense `[out_features, in_features]` host weight (F32, F16
/// or BF16) to `format`, as bitsandbytes would from a weight of that
/// dtype. `name` is used in errors. Non-finite values are refused
/// (bitsandbytes would store garbage scales).
pub fn quantize(
    weight: &Tensor,
    format: QuantFormat,
    name: &str,
) -> Result<QuantizedTensor, Error> {
    if weight.backend() != Backend::Cpu {
        return Err(Error::NotOnCuda { op: "quantize" });
    }
    let shape = match *weight.shape() {
        [rows, cols] if rows > 0 && cols > 0 => [rows, cols],
        ref other => {
            return Err(Error::Quantize {
                tensor: name.to_string(),
                message: format!("shape {other:?} is not a non-empty matrix"),
            });
        }
    };
    let data = match format {
        QuantFormat::FourBit {
            kind,
            blocksize,
            double_quant,
        } => {
            format::check_four_bit_block_size(blocksize)?;
            Data::FourBit(quantize_four_bit(
                weight,
                kind,
                blocksize,
                double_quant,
                name,
            )?)
        }
        QuantFormat::Int8 { threshold } => Data::Int8(quantize_int8(weight, threshold, name)?),
    };
    Ok(QuantizedTensor {
        shape,
        dtype: match format {
            QuantFormat::FourBit { .. } => weight.dtype(),
            QuantFormat::Int8 { .. } => DType::F16,
        },
        compute_dtype: None,
        data,
    })
}

fn non_finite(name: &str, index: usize, value: f32, why: &str) -> Error {
    Error::Quantize {
        tensor: name.to_string(),
        message: format!("element {index} is {value}{why}"),
    }
}

fn quantize_four_bit(
    weight: &Tensor,
    kind: FourBitType,
    blocksize: usize,
    double_quant: bool,
    name: &str,
) -> Result<FourBit, Error> {
    let n = weight.numel();
    let (bounds, order) = kind.quantize_table();
    let code_of = |scaled: f32| order[bounds.partition_point(|&b| b < scaled)];
    let mut packed = HostBuffer::zeroed(n.div_ceil(2))?;
    let mut absmax = vec![0f32; n.div_ceil(blocksize)];
    packed
        .as_mut_bytes()
        .par_chunks_mut(TASK_BLOCKS * blocksize / 2)
        .zip(absmax.par_chunks_mut(TASK_BLOCKS))
        .enumerate()
        .try_for_each(|(task, (packed, absmax))| {
            let first = task * TASK_BLOCKS * blocksize;
            let values = weight.f32_range(first, (first + TASK_BLOCKS * blocksize).min(n));
            if let Some(i) = values.iter().position(|v| !v.is_finite()) {
                return Err(non_finite(name, first + i, values[i], ""));
            }
            let mut codes = Vec::with_capacity(blocksize + 1);
            for ((block, packed), absmax) in values
                .chunks(blocksize)
                .zip(packed.chunks_mut(blocksize / 2))
                .zip(absmax.iter_mut())
            {
                let max = block.iter().fold(0f32, |m, v| m.max(v.abs()));
                codes.clear();
                if block.len() == blocksize {
                    *absmax = max;
                    let inv = 1.0 / max.max(MIN_ABSMAX);
                    codes.extend(block.iter().map(|v| code_of((v * inv).clamp(-1.0, 1.0))));
                } else {
                    *absmax = max.max(MIN_ABSMAX);
                    codes.extend(
                        block
                            .iter()
                            .map(|v| code_of((v / *absmax).clamp(-1.0, 1.0))),
                    );
                }
                if codes.len() % 2 == 1 {
                    // An odd count is padded with the code of 0.
                    codes.push(code_of(0.0));
                }
                for (byte, pair) in packed.iter_mut().zip(codes.chunks_exact(2)) {
                    *byte = (pair[0] << 4) | pair[1];
                }
            }
            Ok(())
        })?;
    let scales = if double_quant {
        let offset = scale_offset(&absmax);
        let (codes, nested) = quantize_scales(&absmax, offset);
        Scales::Nested {
            codes: HostBytes::Owned(HostBuffer::from_bytes(&codes)?),
            absmax: F32s::from_values(&nested)?,
            map: F32s::from_values(&format::dynamic_map())?,
            offset,
        }
    } else {
        Scales::Plain(F32s::from_values(&absmax)?)
    };
    Ok(FourBit {
        kind,
        blocksize,
        packed: HostBytes::Owned(packed),
        scales,
    })
}

/// The mean of the block scales, which double quantization subtracts
/// before quantizing them: summed in f64 and rounded once.
pub(crate) fn scale_offset(absmax: &[f32]) -> f32 {
    (absmax.iter().map(|&a| f64::from(a)).sum::<f64>() / absmax.len() as f64) as f32
}

/// Double quantization of the block scales around `offset`: their 8-bit
/// codes and the absmax of each block of 256, as bitsandbytes'
/// `quantize_blockwise(absmax - offset, blocksize=256)` on the CPU.
pub(crate) fn quantize_scales(absmax: &[f32], offset: f32) -> (Vec<u8>, Vec<f32>) {
    let lut = &*DYNAMIC_LUT;
    let mut codes = Vec::with_capacity(absmax.len());
    let mut nested = Vec::with_capacity(absmax.len().div_ceil(NESTED_BLOCK_SIZE));
    for block in absmax.chunks(NESTED_BLOCK_SIZE) {
        let centred: Vec<f32> = block.iter().map(|a| a - offset).collect();
        let max = centred.iter().fold(0f32, |m, v| m.max(v.abs()));
        nested.push(max);
        if max == 0.0 {
            codes.extend(std::iter::repeat_n(0, block.len()));
        } else {
            let inv = 1.0 / max;
            codes.extend(centred.iter().map(|v| lut[format::lut_bin(v * inv)]));
        }
    }
    (codes, nested)
}

fn quantize_int8(weight: &Tensor, threshold: f32, name: &str) -> Result<Int8, Error> {
    let [rows, cols] = [weight.shape()[0], weight.shape()[1]];
    let mut codes = HostBuffer::zeroed(rows * cols)?;
    let mut scb = vec![0f32; rows];
    codes
        .as_mut_bytes()
        .par_chunks_mut(cols)
        .zip(scb.par_iter_mut())
        .enumerate()
        .try_for_each(|(r, (codes, scb))| {
            // bitsandbytes quantizes the weight in float16.
            let row: Vec<f32> = weight
                .f32_rows(r, r + 1)
                .iter()
                .map(|&v| f16::from_f32(v).to_f32())
                .collect();
            if let Some(i) = row.iter().position(|v| !v.is_finite()) {
                let why = " in float16, which 8-bit quantization goes through";
                return Err(non_finite(name, r * cols + i, row[i], why));
            }
            *scb = row.iter().fold(0f32, |m, v| m.max(v.abs()));
            if *scb > 0.0 {
                // `127.0 / row_stats` in PyTorch is `reciprocal() * 127`.
                let scale = (1.0 / *scb) * 127.0;
                for (c, v) in codes.iter_mut().zip(&row) {
                    *c = (v * scale).round_ties_even() as i8 as u8;
                }
            }
            Ok(())
        })?;
    Ok(Int8 {
        codes: HostBytes::Owned(codes),
        scb: F32s::from_values(&scb)?,
        threshold,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn four_bit(kind: FourBitType, blocksize: usize, double_quant: bool) -> QuantFormat {
        QuantFormat::FourBit {
            kind,
            blocksize,
            double_quant,
        }
    }

    #[test]
    fn four_bit_round_trip_is_within_half_a_code_step() {
        // 3 × 50 = 150 values: two full blocks of 64 and a partial one of 22.
        let values: Vec<f32> = (0..150)
            .map(|i| ((i * 37) % 101) as f32 / 50.0 - 1.0)
            .collect();
        let w = Tensor::from_f32(DType::F32, &[3, 50], &values).unwrap();
        for kind in [FourBitType::Nf4, FourBitType::Fp4] {
            let q = quantize(&w, four_bit(kind, 64, false), "w").unwrap();
            assert_eq!(q.byte_len(), 75 + 3 * 4);
            let back = q.dequantize(DType::F32).unwrap().to_f32_vec();
            for (a, b) in values.iter().zip(&back) {
                // The widest gap between neighbouring codes is FP4's 1/3.
                assert!((a - b).abs() <= 1.0 / 6.0 + 1e-6, "{kind:?}: {a} -> {b}");
            }
        }
    }

    #[test]
    fn zero_blocks_and_odd_counts_follow_bitsandbytes() {
        // 65 zeros: a full zero block keeps absmax 0, the partial one 1e-38.
        let w = Tensor::from_f32(DType::F32, &[5, 13], &[0.0; 65]).unwrap();
        let q = quantize(&w, four_bit(FourBitType::Nf4, 64, false), "w").unwrap();
        let entries = q.to_entries("w");
        let absmax: &[f32] = bytemuck::cast_slice(&entries[1].bytes);
        assert_eq!(absmax, [0.0, MIN_ABSMAX]);
        // NF4's zero is code 7; the 66th nibble pads with it too.
        assert!(entries[0].bytes.iter().all(|&b| b == 0x77));
        assert_eq!(q.dequantize(DType::F32).unwrap().to_f32_vec(), [0.0; 65]);
    }

    #[test]
    fn double_quantization_recovers_the_scales_closely() {
        let values: Vec<f32> = (0..64 * 300)
            .map(|i| ((i * 7919) % 1013) as f32 / 1013.0 * (1.0 + (i / 64 % 5) as f32))
            .collect();
        let w = Tensor::from_f32(DType::BF16, &[300, 64], &values).unwrap();
        let plain = quantize(&w, four_bit(FourBitType::Nf4, 64, false), "w").unwrap();
        let nested = quantize(&w, four_bit(FourBitType::Nf4, 64, true), "w").unwrap();
        assert_eq!(nested.dtype(), DType::BF16);
        let (Data::FourBit(p), Data::FourBit(n)) = (&plain.data, &nested.data) else {
            unreachable!()
        };
        // Same codes; the scales differ by the dynamic map's rounding of
        // their distance from the mean: at most 0.7% of the largest
        // distance (the map's gap next to -1 is 0.007).
        assert_eq!(p.packed.as_bytes(), n.packed.as_bytes());
        let scales: Vec<f32> = (0..300).map(|b| p.scale(b)).collect();
        let offset = scale_offset(&scales);
        let spread = scales.iter().fold(0f32, |m, s| m.max((s - offset).abs()));
        for (b, a) in scales.iter().enumerate() {
            let c = n.scale(b);
            assert!((a - c).abs() <= 0.0071 * spread, "block {b}: {a} vs {c}");
        }
        assert_eq!(
            nested.byte_len(),
            nested.format().byte_len(300, 64),
            "byte_len and QuantFormat::byte_len agree"
        );
    }

    #[test]
    fn int8_rows_scale_to_127() {
        let w = Tensor::from_f32(
            DType::F32,
            &[2, 4],
            &[0.0, 0.0, 0.0, 0.0, 1.0, -2.0, 0.5, 0.25],
        )
        .unwrap();
        let q = quantize(&w, QuantFormat::Int8 { threshold: 6.0 }, "w").unwrap();
        let Data::Int8(i) = &q.data else {
            unreachable!()
        };
        assert_eq!(i.codes(), [0, 0, 0, 0, 64, -127, 32, 16]);
        assert_eq!(i.scb.get(), [0.0, 2.0]);
    }

    #[test]
    fn bad_weights_are_named() {
        let w = Tensor::from_f32(DType::F32, &[1, 3], &[1.0, f32::NAN, 0.0]).unwrap();
        let err = quantize(&w, four_bit(FourBitType::Fp4, 64, false), "x.weight").unwrap_err();
        assert_eq!(
            err.to_string(),
            "cannot quantize x.weight: element 1 is NaN"
        );
        let w = Tensor::from_f32(DType::F32, &[1, 2], &[1e6, 0.0]).unwrap();
        let err = quantize(&w, QuantFormat::Int8 { threshold: 0.0 }, "y").unwrap_err();
        assert!(
            err.to_string().contains("element 0 is inf in float16"),
            "{err}"
        );
        let v = Tensor::from_f32(DType::F32, &[3], &[1.0; 3]).unwrap();
        let err = quantize(&v, four_bit(FourBitType::Nf4, 64, false), "b").unwrap_err();
        assert!(
            err.to_string().contains("[3] is not a non-empty matrix"),
            "{err}"
        );
        let err = quantize(&w, four_bit(FourBitType::Nf4, 100, false), "b").unwrap_err();
        assert!(err.to_string().contains("block size 100"), "{err}");
    }
}
