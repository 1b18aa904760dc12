//! The quantized tile kernels for x86-64.
//!
//! 4-bit: AVX-512 keeps a block's 16 values in one register and turns 16
//! bytes into 32 weights with two `vpermps`; AVX2 holds them in two and
//! picks between them by the index's fourth bit (`vpermps` there uses
//! three). int8: sign-extended codes times int16 inputs, pairs summed into
//! 32-bit lanes by `vpmaddwd` (`vpdpwssd` with VNNI).
//!
//! Every kernel is generic over the tile's shape (`R` weight rows by `M`
//! input rows, constants, so the accumulators live in registers) and, for
//! 4-bit, over the rounding (`C`), so the choices fold away.

#![allow(clippy::needless_range_loop)]

use std::arch::x86_64::*;

use super::{FourBitTile, Int8Tile, IntSums, RUN, Rounding, TILE, TileSums};

const F32: u8 = 0;
const F16: u8 = 1;
const BF16: u8 = 2;

/// Instantiates `$kernel::<C, R, M>` (or `<R, M>` without `$c`) for the
/// tile's shape.
macro_rules! by_shape {
    ($kernel:ident, $t:expr $(, $c:expr)?) => {{
        let t = $t;
        match (t.rows == TILE, t.inputs) {
            (true, 1) => $kernel::<$($c,)? 4, 1>(t),
            (true, 2) => $kernel::<$($c,)? 4, 2>(t),
            (true, 3) => $kernel::<$($c,)? 4, 3>(t),
            (true, _) => $kernel::<$($c,)? 4, 4>(t),
            (false, 1) => $kernel::<$($c,)? 1, 1>(t),
            (false, 2) => $kernel::<$($c,)? 1, 2>(t),
            (false, 3) => $kernel::<$($c,)? 1, 3>(t),
            (false, _) => $kernel::<$($c,)? 1, 4>(t),
        }
    }};
}

/// A 4-bit tile with AVX-512.
///
/// # Safety
/// The CPU has AVX-512 F/BW/DQ/VL; `t` describes readable rows.
pub(super) unsafe fn four_bit_avx512(t: FourBitTile) -> TileSums {
    // SAFETY: the caller's promises.
    unsafe {
        match t.rounding {
            Rounding::F32 => by_shape!(four_bit_512, t, F32),
            Rounding::F16 => by_shape!(four_bit_512, t, F16),
            Rounding::Bf16 => by_shape!(four_bit_512, t, BF16),
        }
    }
}

/// A 4-bit tile with AVX2.
///
/// # Safety
/// The CPU has AVX2, FMA and F16C; `t` describes readable rows.
pub(super) unsafe fn four_bit_avx2(t: FourBitTile) -> TileSums {
    // SAFETY: the caller's promises.
    unsafe {
        match t.rounding {
            Rounding::F32 => by_shape!(four_bit_256, t, F32),
            Rounding::F16 => by_shape!(four_bit_256, t, F16),
            Rounding::Bf16 => by_shape!(four_bit_256, t, BF16),
        }
    }
}

/// An int8 tile with AVX-512 VNNI.
///
/// # Safety
/// The CPU has AVX-512 F/BW/DQ/VL and VNNI; `t` describes readable rows.
pub(super) unsafe fn int8_vnni(t: Int8Tile) -> IntSums {
    // SAFETY: the caller's promises.
    unsafe { by_shape!(int8_512_vnni, t) }
}

/// An int8 tile with AVX-512.
///
/// # Safety
/// The CPU has AVX-512 F/BW/DQ/VL; `t` describes readable rows.
pub(super) unsafe fn int8_avx512(t: Int8Tile) -> IntSums {
    // SAFETY: the caller's promises.
    unsafe { by_shape!(int8_512, t) }
}

/// An int8 tile with AVX2.
///
/// # Safety
/// The CPU has AVX2; `t` describes readable rows.
pub(super) unsafe fn int8_avx2(t: Int8Tile) -> IntSums {
    // SAFETY: the caller's promises.
    unsafe { by_shape!(int8_256, t) }
}

/// `v` rounded to the compute dtype `C`, as `round_to` rounds (nearest
/// even; NaN kept).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,f16c")]
fn round_512<const C: u8>(v: __m512) -> __m512 {
    match C {
        F32 => v,
        F16 => _mm512_cvtph_ps(_mm512_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v)),
        _ => {
            let bits = _mm512_castps_si512(v);
            let odd = _mm512_and_si512(_mm512_srli_epi32::<16>(bits), _mm512_set1_epi32(1));
            let up = _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)), odd);
            let rounded = _mm512_and_si512(up, _mm512_set1_epi32(0xFFFF_0000_u32 as i32));
            let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(v, v);
            _mm512_mask_blend_ps(nan, _mm512_castsi512_ps(rounded), v)
        }
    }
}

/// An `R × M` tile of 4-bit weights against prepared inputs, 32 weights
/// (16 bytes) per step.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,f16c,fma")]
unsafe fn four_bit_512<const C: u8, const R: usize, const M: usize>(t: FourBitTile) -> TileSums {
    let mut acc = [[_mm512_setzero_ps(); R]; M];
    // SAFETY: for the whole body, rows b < R hold k / 2 bytes and k /
    // blocksize scales, input rows a < M hold k values; every run read
    // (e + 32 <= k) lies inside them.
    unsafe {
        let code = _mm512_loadu_ps(t.code.cast());
        for block in 0..t.k / t.blocksize {
            let mut table = [_mm512_setzero_ps(); R];
            for b in 0..R {
                let scale = *t.scales.add(b * t.scales_stride + block);
                table[b] = round_512::<C>(_mm512_mul_ps(code, _mm512_set1_ps(scale)));
            }
            for run in 0..t.blocksize / RUN {
                let e = block * t.blocksize + run * RUN;
                let mut high = [_mm512_setzero_ps(); M];
                let mut low = [_mm512_setzero_ps(); M];
                for a in 0..M {
                    high[a] = _mm512_loadu_ps(t.x.add(a * t.x_stride + e));
                    low[a] = _mm512_loadu_ps(t.x.add(a * t.x_stride + e + RUN / 2));
                }
                for b in 0..R {
                    let row = t.w.add(b * t.w_stride + e / 2);
                    // Rows of packed 4-bit codes are short (2 KiB at k =
                    // 4096): too short for the hardware prefetcher to ramp
                    // up on each, so the next tile's bytes are asked for
                    // while this tile's are used.
                    _mm_prefetch::<_MM_HINT_T0>(row.wrapping_add(R * t.w_stride).cast());
                    let bytes = _mm_loadu_si128(row.cast());
                    let idx = _mm512_cvtepu8_epi32(bytes);
                    // vpermps reads the low 4 bits of each index: the low
                    // nibble as it is, the high one shifted down.
                    let wh = _mm512_permutexvar_ps(_mm512_srli_epi32::<4>(idx), table[b]);
                    let wl = _mm512_permutexvar_ps(idx, table[b]);
                    for a in 0..M {
                        acc[a][b] = _mm512_fmadd_ps(high[a], wh, acc[a][b]);
                        acc[a][b] = _mm512_fmadd_ps(low[a], wl, acc[a][b]);
                    }
                }
            }
        }
    }
    let mut sums = [[0f32; TILE]; TILE];
    for a in 0..M {
        for b in 0..R {
            sums[a][b] = _mm512_reduce_add_ps(acc[a][b]);
        }
    }
    sums
}

/// `v` rounded to the compute dtype `C` with AVX2 (see [`round_512`]).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn round_256<const C: u8>(v: __m256) -> __m256 {
    match C {
        F32 => v,
        F16 => _mm256_cvtph_ps(_mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v)),
        _ => {
            let bits = _mm256_castps_si256(v);
            let odd = _mm256_and_si256(_mm256_srli_epi32::<16>(bits), _mm256_set1_epi32(1));
            let up = _mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7FFF)), odd);
            let rounded = _mm256_and_si256(up, _mm256_set1_epi32(0xFFFF_0000_u32 as i32));
            let nan = _mm256_cmp_ps::<_CMP_UNORD_Q>(v, v);
            _mm256_blendv_ps(_mm256_castsi256_ps(rounded), v, nan)
        }
    }
}

/// Entry `idx & 15` of the 16 values held as `lo` (0..8) and `hi` (8..16):
/// `vpermps` picks by the low three bits, the fourth (moved to the sign)
/// picks the half.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn lookup_256(lo: __m256, hi: __m256, idx: __m256i) -> __m256 {
    let from_lo = _mm256_permutevar8x32_ps(lo, idx);
    let from_hi = _mm256_permutevar8x32_ps(hi, idx);
    _mm256_blendv_ps(
        from_lo,
        from_hi,
        _mm256_castsi256_ps(_mm256_slli_epi32::<28>(idx)),
    )
}

/// An `R × M` tile of 4-bit weights with AVX2: each 16-byte run as two
/// halves of 8 bytes.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn four_bit_256<const C: u8, const R: usize, const M: usize>(t: FourBitTile) -> TileSums {
    let mut acc = [[_mm256_setzero_ps(); R]; M];
    // SAFETY: as in `four_bit_512`.
    unsafe {
        let code_lo = _mm256_loadu_ps(t.code.cast());
        let code_hi = _mm256_loadu_ps(t.code.cast::<f32>().add(8));
        for block in 0..t.k / t.blocksize {
            let mut lo = [_mm256_setzero_ps(); R];
            let mut hi = [_mm256_setzero_ps(); R];
            for b in 0..R {
                let scale = _mm256_set1_ps(*t.scales.add(b * t.scales_stride + block));
                lo[b] = round_256::<C>(_mm256_mul_ps(code_lo, scale));
                hi[b] = round_256::<C>(_mm256_mul_ps(code_hi, scale));
            }
            for run in 0..t.blocksize / RUN {
                for part in 0..2 {
                    let e = block * t.blocksize + run * RUN;
                    let mut high = [_mm256_setzero_ps(); M];
                    let mut low = [_mm256_setzero_ps(); M];
                    for a in 0..M {
                        let x = t.x.add(a * t.x_stride + e + 8 * part);
                        high[a] = _mm256_loadu_ps(x);
                        low[a] = _mm256_loadu_ps(x.add(RUN / 2));
                    }
                    for b in 0..R {
                        let bytes =
                            _mm_loadl_epi64(t.w.add(b * t.w_stride + e / 2 + 8 * part).cast());
                        let idx = _mm256_cvtepu8_epi32(bytes);
                        let wh = lookup_256(lo[b], hi[b], _mm256_srli_epi32::<4>(idx));
                        let wl = lookup_256(lo[b], hi[b], idx);
                        for a in 0..M {
                            acc[a][b] = _mm256_fmadd_ps(high[a], wh, acc[a][b]);
                            acc[a][b] = _mm256_fmadd_ps(low[a], wl, acc[a][b]);
                        }
                    }
                }
            }
        }
    }
    let mut sums = [[0f32; TILE]; TILE];
    for a in 0..M {
        for b in 0..R {
            sums[a][b] = sum_256(acc[a][b]);
        }
    }
    sums
}

/// The sum of 8 f32 lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn sum_256(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
}

/// `acc + Σ pairs of x · w` in 32-bit lanes, fused (VNNI).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")]
fn madd_vnni(acc: __m512i, x: __m512i, w: __m512i) -> __m512i {
    _mm512_dpwssd_epi32(acc, x, w)
}

/// `acc + Σ pairs of x · w` in 32-bit lanes.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq")]
fn madd_512(acc: __m512i, x: __m512i, w: __m512i) -> __m512i {
    _mm512_add_epi32(acc, _mm512_madd_epi16(x, w))
}

/// Defines an `R × M` tile of int8 × int16 products in 32-bit lanes, 32
/// per step, for a target-feature set and its multiply-add (two
/// functions, so code for a CPU without VNNI never contains it).
macro_rules! int8_512_kernel {
    ($name:ident, $features:literal, $madd:ident) => {
        #[target_feature(enable = $features)]
        unsafe fn $name<const R: usize, const M: usize>(t: Int8Tile) -> IntSums {
            let mut acc = [[_mm512_setzero_si512(); R]; M];
            let mut i = 0;
            // SAFETY: rows b < R of the weight and a < M of the input
            // hold k elements; full loads stay below k, the tail is
            // masked to it.
            unsafe {
                while i < t.k {
                    let left = t.k - i;
                    let mask = if left >= 32 {
                        !0
                    } else {
                        ((1u64 << left) - 1) as __mmask32
                    };
                    let mut x = [_mm512_setzero_si512(); M];
                    for a in 0..M {
                        x[a] = _mm512_maskz_loadu_epi16(mask, t.x.add(a * t.x_stride + i));
                    }
                    for b in 0..R {
                        let row = t.w.add(b * t.w_stride + i);
                        // The next tile's codes, as in `four_bit_512`.
                        _mm_prefetch::<_MM_HINT_T0>(row.wrapping_add(R * t.w_stride).cast());
                        let w = _mm512_cvtepi8_epi16(_mm256_maskz_loadu_epi8(mask, row));
                        for a in 0..M {
                            acc[a][b] = $madd(acc[a][b], x[a], w);
                        }
                    }
                    i += 32;
                }
            }
            let mut sums = [[0i32; TILE]; TILE];
            for a in 0..M {
                for b in 0..R {
                    sums[a][b] = _mm512_reduce_add_epi32(acc[a][b]);
                }
            }
            sums
        }
    };
}

int8_512_kernel!(
    int8_512_vnni,
    "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni",
    madd_vnni
);
int8_512_kernel!(int8_512, "avx512f,avx512bw,avx512vl,avx512dq", madd_512);

/// An `R × M` tile of int8 × int16 products with AVX2, 16 per step; the
/// last `k % 16` are summed as scalars.
#[target_feature(enable = "avx2")]
unsafe fn int8_256<const R: usize, const M: usize>(t: Int8Tile) -> IntSums {
    let mut acc = [[_mm256_setzero_si256(); R]; M];
    let mut sums = [[0i32; TILE]; TILE];
    let mut i = 0;
    // SAFETY: rows b < R of the weight and a < M of the input hold k
    // elements; vector loads stay below k, the tail reads single elements.
    unsafe {
        while i + 16 <= t.k {
            let mut x = [_mm256_setzero_si256(); M];
            for a in 0..M {
                x[a] = _mm256_loadu_si256(t.x.add(a * t.x_stride + i).cast());
            }
            for b in 0..R {
                let w = _mm256_cvtepi8_epi16(_mm_loadu_si128(t.w.add(b * t.w_stride + i).cast()));
                for a in 0..M {
                    acc[a][b] = _mm256_add_epi32(acc[a][b], _mm256_madd_epi16(x[a], w));
                }
            }
            i += 16;
        }
        for l in i..t.k {
            for a in 0..M {
                for b in 0..R {
                    sums[a][b] += i32::from(*t.w.add(b * t.w_stride + l))
                        * i32::from(*t.x.add(a * t.x_stride + l));
                }
            }
        }
    }
    for a in 0..M {
        for b in 0..R {
            let v = acc[a][b];
            let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
            let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b01_00_11_10>(s));
            let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b10_11_00_01>(s));
            sums[a][b] += _mm_cvtsi128_si32(s);
        }
    }
    sums
}
