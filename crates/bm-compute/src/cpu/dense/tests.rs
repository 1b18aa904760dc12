//! Every tile kernel against a scalar f64 reference, with each level of
//! the instruction set this CPU runs forced on in turn, on odd shapes and
//! misaligned weights, owned and mapped.

use super::*;
use crate::cpu::linear::linear;
use crate::cpu::mapped_test_file::mapped_at_end;

/// Deterministic values in [-1, 1), exactly representable in bf16 and f16.
fn values(n: usize, seed: u32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(2_654_435_761).wrapping_add(1);
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            ((s >> 24) as f32 - 128.0) / 128.0
        })
        .collect()
}

/// The weight's bytes in `dtype`, starting `offset` bytes into the buffer.
fn weight_bytes(w: &[f32], dtype: DType, offset: usize) -> Vec<u8> {
    let mut bytes = vec![0u8; offset];
    for &v in w {
        match dtype {
            DType::F32 => bytes.extend(v.to_le_bytes()),
            DType::F16 => bytes.extend(half::f16::from_f32(v).to_le_bytes()),
            _ => bytes.extend(half::bf16::from_f32(v).to_le_bytes()),
        }
    }
    bytes
}

#[test]
fn every_level_matches_the_reference_on_odd_shapes() {
    for isa in Isa::supported() {
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            for (m, n, k) in [
                (1, 1, 1),
                (1, 5, 7),
                (1, 17, 33),
                (2, 4, 16),
                (3, 9, 31),
                (4, 8, 64),
                (5, 13, 100),
                (8, 16, 65),
                (17, 7, 129),
                (40, 6, 48),
            ] {
                for offset in [0, 1, 2] {
                    let x = values(m * k, (m * 31 + k) as u32);
                    let w = values(n * k, (n * 17 + k) as u32);
                    let bytes = weight_bytes(&w, dtype, offset);
                    let xb = weight_bytes(&x, DType::BF16, 0);
                    // Owned, and at the end of a mapped file's last page.
                    let mapped = mapped_at_end(&bytes[offset..]);
                    for (weight, dot) in [
                        (&bytes[offset..], false),
                        (mapped.as_bytes(), false),
                        (&bytes[offset..], true),
                    ] {
                        let mut product = Dense::new((&x, Some(&xb)), k, (weight, dtype), isa);
                        // The bf16 dot product wherever the CPU has it,
                        // whether or not it is the one chosen here.
                        if dot {
                            if dtype != DType::BF16 || isa < Isa::Avx512Bf16 {
                                continue;
                            }
                            product.pair = Pair::Bf16Dot;
                            product.x_bf16 = Some(&xb);
                        }
                        let mut out = vec![0.5f32; m * n];
                        linear((m, k), &product, n, Some(&vec![0.5; n]), &mut out);
                        for i in 0..m {
                            for j in 0..n {
                                let want: f64 = (0..k)
                                    .map(|l| f64::from(x[i * k + l]) * f64::from(w[j * k + l]))
                                    .sum::<f64>()
                                    + 0.5;
                                let got = f64::from(out[i * n + j]);
                                assert!(
                                    (got - want).abs() <= 1e-5 * (k as f64 + 1.0),
                                    "{isa} {dtype} dot={dot} m={m} n={n} k={k} offset={offset} [{i},{j}]: {got} vs {want}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn the_bf16_dot_product_is_only_chosen_for_bf16_inputs_where_it_pays() {
    let (x, w) = (vec![1f32; 4], vec![0u8; 8]);
    let xb = vec![0u8; 8];
    for isa in Isa::supported() {
        let with = Dense::new((&x, Some(&xb)), 4, (&w, DType::BF16), isa);
        assert_eq!(with.pair == Pair::Bf16Dot, isa.bf16_dot_pays());
        assert!(!isa.bf16_dot_pays() || isa >= Isa::Avx512Bf16);
        let without = Dense::new((&x, None), 4, (&w, DType::BF16), isa);
        assert_eq!(without.pair, Pair::Bf16);
    }
}
