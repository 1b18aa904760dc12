//! Every quantized kernel against a scalar f64 reference, with each level
//! of the instruction set this CPU runs forced on in turn, on odd shapes,
//! every rounding and misaligned weights, owned and mapped.

use super::*;
use crate::cpu::linear::linear;
use crate::cpu::mapped_test_file::mapped_at_end;
use crate::quant::FourBitType;

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

/// Plain per-block scales.
struct Plain(Vec<f32>);

impl BlockScales for Plain {
    fn scales_into(&self, blocks: Range<usize>, out: &mut [f32]) {
        out.copy_from_slice(&self.0[blocks]);
    }
}

#[test]
fn four_bit_kernels_match_the_dequantized_reference() {
    for isa in Isa::supported() {
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            for blocksize in [32, 64, 128] {
                let bs = blocksize;
                for (m, n, k) in [
                    (1, 1, bs),
                    (1, 5, 2 * bs),
                    (2, 7, 3 * bs),
                    (3, 9, 4 * bs),
                    (4, 8, bs),
                    (5, 6, 2 * bs),
                    (8, 13, bs),
                    (9, 5, 2 * bs),
                    (17, 3, bs),
                    (40, 6, bs),
                    // Rows that do not start on a block, and odd widths.
                    (1, 5, bs + 32),
                    (2, 3, 75),
                    (1, 4, 33),
                ] {
                    for (kind, offset) in [
                        (FourBitType::Nf4, 0),
                        (FourBitType::Fp4, 1),
                        (FourBitType::Nf4, 3),
                    ] {
                        check_four_bit(isa, dtype, kind.code(), bs, (m, n, k), offset);
                    }
                }
            }
        }
    }
}

fn check_four_bit(
    isa: Isa,
    dtype: DType,
    code: [f32; 16],
    bs: usize,
    (m, n, k): (usize, usize, usize),
    offset: usize,
) {
    let codes: Vec<u8> = (0..n * k).map(|i| ((i * 7 + i / 5) % 16) as u8).collect();
    let mut bytes = vec![0u8; offset];
    bytes.extend(
        codes
            .chunks(2)
            .map(|p| (p[0] << 4) | p.get(1).copied().unwrap_or(0)),
    );
    let blocks = (n * k).div_ceil(bs);
    let scales = Plain((0..blocks).map(|b| 0.37 + 0.013 * b as f32).collect());
    let mut x = values(m * k, (m * 31 + k) as u32);
    round_to(dtype, &mut x);
    // Owned, and at the end of a mapped file's last page.
    let mapped = mapped_at_end(&bytes[offset..]);
    for packed in [&bytes[offset..], mapped.as_bytes()] {
        let weight = FourBitWeight {
            packed,
            code,
            blocksize: bs,
            scales: &scales,
        };
        let product = FourBitProduct::new(&x, k, weight, dtype, isa);
        let mut out = vec![0f32; m * n];
        linear((m, k), &product, n, Some(&vec![0.25; n]), &mut out);
        for i in 0..m {
            for j in 0..n {
                let want: f64 = (0..k)
                    .map(|l| {
                        let e = j * k + l;
                        let mut w = [code[codes[e] as usize] * scales.0[e / bs]];
                        round_to(dtype, &mut w);
                        f64::from(x[i * k + l]) * f64::from(w[0])
                    })
                    .sum::<f64>()
                    + 0.25;
                let got = f64::from(out[i * n + j]);
                assert!(
                    (got - want).abs() <= 1e-5 * (k as f64 + 1.0),
                    "{isa} {dtype} {code:?} bs={bs} m={m} n={n} k={k} offset={offset} [{i},{j}]: {got} vs {want}"
                );
            }
        }
    }
}

#[test]
fn the_register_path_is_taken_for_rows_that_start_on_a_block() {
    let scales = Plain(vec![1.0; 64]);
    let packed = vec![0u8; 64 * 64];
    let weight = FourBitWeight {
        packed: &packed,
        code: FourBitType::Nf4.code(),
        blocksize: 64,
        scales: &scales,
    };
    let isa = Isa::Portable;
    let decode = FourBitProduct::new(&[0.0; 128], 128, weight, DType::F32, isa);
    assert!(decode.in_registers);
    let prompt = FourBitProduct::new(&[0.0; 128 * 40], 128, weight, DType::F32, isa);
    assert!(prompt.in_registers);
    let unaligned = FourBitProduct::new(&[0.0; 96], 96, weight, DType::F32, isa);
    assert!(!unaligned.in_registers);
}

#[test]
fn int8_kernels_sum_exactly() {
    for isa in Isa::supported() {
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
        ] {
            for offset in [0, 1, 3] {
                let x: Vec<f32> = values(m * k, k as u32)
                    .iter()
                    .map(|v| (v * 127.0).round())
                    .collect();
                let mut codes = vec![0i8; offset];
                codes.extend(values(n * k, n as u32).iter().map(|v| (v * 128.0) as i8));
                let w = &codes[offset..];
                // Owned, and at the end of a mapped file's last page.
                let mapped = mapped_at_end(bytemuck::cast_slice(w));
                for w in [w, bytemuck::cast_slice(mapped.as_bytes())] {
                    let product = Int8Product::new(&x, k, w, isa);
                    let mut out = vec![0f32; m * n];
                    linear((m, k), &product, n, None, &mut out);
                    for i in 0..m {
                        for j in 0..n {
                            let want: i64 = (0..k)
                                .map(|l| x[i * k + l] as i64 * i64::from(w[j * k + l]))
                                .sum();
                            assert_eq!(
                                out[i * n + j],
                                want as f32,
                                "{isa} m={m} n={n} k={k} offset={offset} [{i},{j}]"
                            );
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn int8_sums_past_a_span_do_not_overflow() {
    // Every product at its largest: 127 · -128 over more than one span.
    let k = INT8_SPAN + 4099;
    let x = vec![127f32; 2 * k];
    let codes = vec![-128i8; 5 * k];
    for isa in Isa::supported() {
        let product = Int8Product::new(&x, k, &codes, isa);
        let mut out = vec![0f32; 2 * 5];
        linear((2, k), &product, 5, None, &mut out);
        let want = (-127i64 * 128 * k as i64) as f32;
        assert!(out.iter().all(|&v| v == want), "{isa}: {out:?} vs {want}");
    }
}
