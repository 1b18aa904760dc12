//! CPU dtype conversion, bit for bit as PyTorch's CPU `Tensor.to(dtype)`.
//!
//! Every finite value rounds to nearest even and infinities are kept, as in
//! PyTorch. NaNs stay NaN, and their bits follow the vectorised kernels that
//! convert the bulk of a tensor (checked against torch 2.15 by the fixture
//! written by `tools/make_cast_fixture.py`):
//!
//! * F32 and F64 to BF16 write every NaN as `0xFFFF`; F16 to BF16 writes
//!   `0x7FC0`.
//! * F32, F64 and BF16 to F16 quiet the NaN and keep its top payload bits
//!   (the F16C instruction).
//! * Widening (F16/BF16 to F32/F64) is exact; F16 NaNs are quieted.
//!
//! PyTorch converts the last few elements of a tensor (fewer than one SIMD
//! vector) with scalar code that writes NaN differently (`0x7FC0`, or
//! `0x7E00` with the sign); we do not reproduce that position-dependent
//! artifact, so only NaN payload bits in a tensor's tail can differ.
//!
//! F64 narrows to F16/BF16 through F32, as `c10::Half(double)` does. The
//! loops read and write little-endian bytes element by element, so neither
//! side needs to be aligned.

use crate::{DType, Error, HostBuffer};

/// Converts `src`, a buffer of `from` elements, into a new buffer of `to`
/// elements. Same dtype is a plain copy.
pub fn cast(src: &[u8], from: DType, to: DType) -> Result<HostBuffer, Error> {
    let n = element_count(src, from)?;
    let mut out = HostBuffer::zeroed(n * to.size_in_bytes())?;
    cast_into(src, from, out.as_mut_bytes(), to)?;
    Ok(out)
}

/// Converts `src` (`from` elements) into `dst` (`to` elements); `dst` must
/// hold exactly as many elements as `src`.
pub fn cast_into(src: &[u8], from: DType, dst: &mut [u8], to: DType) -> Result<(), Error> {
    let n = element_count(src, from)?;
    if dst.len() != n * to.size_in_bytes() {
        return Err(Error::LengthMismatch {
            what: format!("cast destination for {n} {to} elements"),
            expected: n * to.size_in_bytes(),
            found: dst.len(),
        });
    }
    use DType::{BF16, F16, F32, F64};
    match (from, to) {
        _ if from == to => dst.copy_from_slice(src),
        (F32, BF16) => map(src, dst, |b| {
            bf16_vectorised(f32::from_le_bytes(b)).to_le_bytes()
        }),
        (F16, BF16) => map(src, dst, |b| {
            bf16_from_f16_kernel(f16_to_f32(b)).to_le_bytes()
        }),
        (F64, BF16) => map(src, dst, |b| {
            bf16_vectorised(f64::from_le_bytes(b) as f32).to_le_bytes()
        }),
        (F32, F16) => map(src, dst, |b| {
            f16_hardware(f32::from_le_bytes(b)).to_le_bytes()
        }),
        (BF16, F16) => map(src, dst, |b| f16_hardware(bf16_to_f32(b)).to_le_bytes()),
        (F64, F16) => map(src, dst, |b| {
            f16_hardware(f64::from_le_bytes(b) as f32).to_le_bytes()
        }),
        (F16, F32) => map(src, dst, |b| f16_to_f32(b).to_le_bytes()),
        (BF16, F32) => map(src, dst, |b| bf16_to_f32(b).to_le_bytes()),
        (F64, F32) => map(src, dst, |b| (f64::from_le_bytes(b) as f32).to_le_bytes()),
        (F16, F64) => map(src, dst, |b| (f16_to_f32(b) as f64).to_le_bytes()),
        (BF16, F64) => map(src, dst, |b| (bf16_to_f32(b) as f64).to_le_bytes()),
        (F32, F64) => map(src, dst, |b| (f32::from_le_bytes(b) as f64).to_le_bytes()),
        _ => return Err(Error::UnsupportedCast { from, to }),
    }
    Ok(())
}

fn element_count(src: &[u8], dtype: DType) -> Result<usize, Error> {
    let size = dtype.size_in_bytes();
    if !src.len().is_multiple_of(size) {
        return Err(Error::LengthMismatch {
            what: format!("buffer of {dtype} elements"),
            expected: src.len() / size * size,
            found: src.len(),
        });
    }
    Ok(src.len() / size)
}

fn map<const S: usize, const D: usize>(src: &[u8], dst: &mut [u8], f: impl Fn([u8; S]) -> [u8; D]) {
    for (s, d) in src.chunks_exact(S).zip(dst.chunks_exact_mut(D)) {
        d.copy_from_slice(&f(s.try_into().expect("chunk of S bytes")));
    }
}

fn f16_to_f32(b: [u8; 2]) -> f32 {
    half::f16::from_bits(u16::from_le_bytes(b)).to_f32()
}

fn bf16_to_f32(b: [u8; 2]) -> f32 {
    f32::from_bits((u16::from_le_bytes(b) as u32) << 16)
}

fn bf16_round_to_nearest_even(v: f32) -> u16 {
    let u = v.to_bits();
    let rounding_bias = ((u >> 16) & 1) + 0x7FFF;
    (u.wrapping_add(rounding_bias) >> 16) as u16
}

/// ATen's vectorised F32/F64 to BF16: NaN becomes `0xFFFF`.
fn bf16_vectorised(v: f32) -> u16 {
    if v.is_nan() {
        0xFFFF
    } else {
        bf16_round_to_nearest_even(v)
    }
}

/// ATen's F16 to BF16 (through c10's `round_to_nearest_even`): NaN becomes `0x7FC0`.
fn bf16_from_f16_kernel(v: f32) -> u16 {
    if v.is_nan() {
        0x7FC0
    } else {
        bf16_round_to_nearest_even(v)
    }
}

/// F16C `vcvtps2ph`: a NaN is quieted and keeps its top payload bits.
fn f16_hardware(v: f32) -> u16 {
    half::f16::from_f32(v).to_bits()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f32_bytes(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    fn u16s(b: &[u8]) -> Vec<u16> {
        b.chunks_exact(2)
            .map(|c| u16::from_le_bytes([c[0], c[1]]))
            .collect()
    }

    // Expected bits computed with torch 2.15: torch.tensor(v).to(dtype).view(torch.int16).
    #[test]
    fn f32_to_bf16_matches_pytorch() {
        let v = [
            0.0,
            -0.0,
            1.0,
            1.0 + 1.0 / 256.0, // exactly halfway between two bf16: ties to even (down)
            1.0 + 3.0 / 256.0, // halfway, ties to even (up)
            3.4028235e38,      // f32::MAX rounds to +inf
            f32::INFINITY,
            f32::NEG_INFINITY,
            1e-40, // subnormal
            f32::NAN,
            -f32::NAN,
        ];
        let out = cast(&f32_bytes(&v), DType::F32, DType::BF16).unwrap();
        assert_eq!(
            u16s(out.as_bytes()),
            [
                0x0000, 0x8000, 0x3F80, 0x3F80, 0x3F82, 0x7F80, 0x7F80, 0xFF80, 0x0001, 0xFFFF,
                0xFFFF
            ]
        );
    }

    #[test]
    fn f32_to_f16_matches_pytorch() {
        let v = [
            0.0,
            -0.0,
            1.0,
            1.0 + 1.0 / 2048.0, // halfway between 1 and next f16: ties to even (down)
            65504.0,
            65520.0, // rounds to +inf
            6e-8,    // subnormal
            f32::INFINITY,
            f32::NAN,
            -f32::NAN,
        ];
        let out = cast(&f32_bytes(&v), DType::F32, DType::F16).unwrap();
        assert_eq!(
            u16s(out.as_bytes()),
            [
                0x0000, 0x8000, 0x3C00, 0x3C00, 0x7BFF, 0x7C00, 0x0001, 0x7C00, 0x7E00, 0xFE00
            ]
        );
    }

    #[test]
    fn half_types_widen_exactly_and_round_trip() {
        let v: Vec<f32> = (0..2000).map(|i| (i as f32 - 1000.0) * 0.37).collect();
        for dt in [DType::F16, DType::BF16] {
            let narrow = cast(&f32_bytes(&v), DType::F32, dt).unwrap();
            let wide = cast(narrow.as_bytes(), dt, DType::F32).unwrap();
            let again = cast(wide.as_bytes(), DType::F32, dt).unwrap();
            assert_eq!(narrow.as_bytes(), again.as_bytes(), "{dt}");
            let through_f64 = cast(
                cast(narrow.as_bytes(), dt, DType::F64).unwrap().as_bytes(),
                DType::F64,
                dt,
            )
            .unwrap();
            assert_eq!(narrow.as_bytes(), through_f64.as_bytes(), "{dt} via F64");
        }
    }

    #[test]
    fn f16_to_bf16_goes_through_f32() {
        let src = 0x3C01u16.to_le_bytes(); // 1 + 2^-10
        let out = cast(&src, DType::F16, DType::BF16).unwrap();
        assert_eq!(u16s(out.as_bytes()), [0x3F80]);
    }

    #[test]
    fn unaligned_source_is_fine() {
        let mut b = [0u8; 9];
        b[1..].copy_from_slice(&f32_bytes(&[1.5, -2.0]));
        let out = cast(&b[1..], DType::F32, DType::F64).unwrap();
        assert_eq!(&out.as_bytes()[..8], &1.5f64.to_le_bytes());
    }

    #[test]
    fn integer_and_fp8_casts_are_refused() {
        let err = cast(&[0; 8], DType::I64, DType::F32).unwrap_err();
        assert!(err.to_string().contains("cannot cast I64 to F32"), "{err}");
        assert!(cast(&[0; 2], DType::F8E4M3, DType::F16).is_err());
        assert!(cast(&[0; 3], DType::F32, DType::F16).is_err());
    }

    #[test]
    fn same_dtype_copies() {
        let out = cast(&[1, 2, 3, 4], DType::I32, DType::I32).unwrap();
        assert_eq!(out.as_bytes(), &[1, 2, 3, 4]);
    }
}
