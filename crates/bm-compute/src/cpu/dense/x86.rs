//! The tile kernels for x86-64: AVX2 with FMA and F16C (8 lanes), and
//! AVX-512 (16 lanes, masked tails, and `vdpbf16ps` for bf16 × bf16).
//!
//! Each kernel is generic over the tile's shape (`R` weight rows by `M`
//! input rows, both constants, so the `R × M` accumulators live in
//! registers) and over how the weight is widened (`D`, a [`Pair`] as a
//! constant, so the choice folds away); [`tile_avx512`] and [`tile_avx2`]
//! pick the instance for a tile.

// The tiles index their accumulators by row and input, both constants:
// indexing is what keeps them in registers.
#![allow(clippy::needless_range_loop)]

use std::arch::x86_64::*;

use super::{Pair, TILE, Tile, TileSums};

const F32: u8 = 0;
const F16: u8 = 1;
const BF16: u8 = 2;

/// Instantiates `$kernel::<D, R, M>` for the tile's pair and shape.
macro_rules! dispatch {
    ($kernel:ident, $dot:ident, $pair:expr, $t:expr) => {{
        let t = $t;
        macro_rules! by_inputs {
            ($d:expr, $r:literal) => {
                match t.inputs {
                    1 => $kernel::<{ $d }, $r, 1>(t),
                    2 => $kernel::<{ $d }, $r, 2>(t),
                    3 => $kernel::<{ $d }, $r, 3>(t),
                    _ => $kernel::<{ $d }, $r, 4>(t),
                }
            };
        }
        macro_rules! by_rows {
            ($d:expr) => {
                if t.rows == TILE {
                    by_inputs!($d, 4)
                } else {
                    by_inputs!($d, 1)
                }
            };
        }
        match $pair {
            Pair::F32 => by_rows!(F32),
            Pair::F16 => by_rows!(F16),
            Pair::Bf16 => by_rows!(BF16),
            Pair::Bf16Dot => $dot(t),
        }
    }};
}

/// The tile's dot products with AVX-512 (and AVX-512 BF16 for
/// [`Pair::Bf16Dot`]).
///
/// # Safety
/// The CPU has AVX-512 F/BW/DQ/VL (and BF16 for `Bf16Dot`); `t` describes
/// readable rows.
pub(super) unsafe fn tile_avx512(pair: Pair, t: Tile) -> TileSums {
    /// The bf16 dot-product kernel for the tile's shape.
    ///
    /// # Safety
    /// As [`tile_avx512`], with AVX-512 BF16.
    unsafe fn dot(t: Tile) -> TileSums {
        // SAFETY: the caller's promises.
        unsafe {
            match (t.rows == TILE, t.inputs) {
                (true, 1) => dot_bf16_512::<4, 1>(t),
                (true, 2) => dot_bf16_512::<4, 2>(t),
                (true, 3) => dot_bf16_512::<4, 3>(t),
                (true, _) => dot_bf16_512::<4, 4>(t),
                (false, 1) => dot_bf16_512::<1, 1>(t),
                (false, 2) => dot_bf16_512::<1, 2>(t),
                (false, 3) => dot_bf16_512::<1, 3>(t),
                (false, _) => dot_bf16_512::<1, 4>(t),
            }
        }
    }
    // SAFETY: the caller's promises.
    unsafe { dispatch!(fma_512, dot, pair, t) }
}

/// The tile's dot products with AVX2 and FMA (bf16 inputs are not made
/// for this level, so `Bf16Dot` never reaches it).
///
/// # Safety
/// The CPU has AVX2, FMA and F16C; `t` describes readable rows.
pub(super) unsafe fn tile_avx2(pair: Pair, t: Tile) -> TileSums {
    /// `Bf16Dot` is only chosen with AVX-512 BF16.
    unsafe fn dot(_: Tile) -> TileSums {
        unreachable!("the bf16 dot product needs AVX-512 BF16")
    }
    // SAFETY: the caller's promises.
    unsafe { dispatch!(fma_256, dot, pair, t) }
}

/// 16 weights from `p` widened to f32.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,f16c")]
unsafe fn load_512<const D: u8>(p: *const u8) -> __m512 {
    // SAFETY: the caller reads 16 elements at `p`.
    unsafe {
        match D {
            F32 => _mm512_loadu_ps(p.cast()),
            F16 => _mm512_cvtph_ps(_mm256_loadu_si256(p.cast())),
            _ => _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(
                _mm256_loadu_si256(p.cast()),
            ))),
        }
    }
}

/// The first `mask`'s elements of 16 weights from `p` widened to f32, the
/// others zero (masked loads touch no byte past the mask).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,f16c")]
unsafe fn load_masked_512<const D: u8>(p: *const u8, mask: __mmask16) -> __m512 {
    // SAFETY: the caller's mask covers only readable elements.
    unsafe {
        match D {
            F32 => _mm512_maskz_loadu_ps(mask, p.cast()),
            F16 => _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, p.cast())),
            _ => _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(
                _mm256_maskz_loadu_epi16(mask, p.cast()),
            ))),
        }
    }
}

/// Bytes of a weight element of kind `D`.
const fn size<const D: u8>() -> usize {
    if D == F32 { 4 } else { 2 }
}

/// An `R × M` tile of f32 dot products over weights widened from `D`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,f16c,fma")]
unsafe fn fma_512<const D: u8, const R: usize, const M: usize>(t: Tile) -> TileSums {
    let (w, x) = (t.w, t.x.cast::<f32>());
    let mut acc = [[_mm512_setzero_ps(); R]; M];
    let mut i = 0;
    // SAFETY: for the whole body, rows b < R of the weight and a < M of the input
    // hold k elements; full loads stay below k, the tail is masked to it.
    unsafe {
        while i + 16 <= t.k {
            let mut xv = [_mm512_setzero_ps(); M];
            for (a, v) in xv.iter_mut().enumerate() {
                *v = _mm512_loadu_ps(x.add(a * t.x_stride + i));
            }
            for b in 0..R {
                let row = w.add(b * t.w_stride + i * size::<D>());
                // The next tile's weights, one line per line read here: a
                // tile's rows are a few KiB each, short streams for the
                // hardware prefetcher to ramp up on.
                _mm_prefetch::<_MM_HINT_T0>(row.wrapping_add(R * t.w_stride).cast());
                let wv = load_512::<D>(row);
                for a in 0..M {
                    acc[a][b] = _mm512_fmadd_ps(xv[a], wv, acc[a][b]);
                }
            }
            i += 16;
        }
        if i < t.k {
            let mask = ((1u32 << (t.k - i)) - 1) as __mmask16;
            let mut xv = [_mm512_setzero_ps(); M];
            for (a, v) in xv.iter_mut().enumerate() {
                *v = _mm512_maskz_loadu_ps(mask, x.add(a * t.x_stride + i));
            }
            for b in 0..R {
                let wv = load_masked_512::<D>(w.add(b * t.w_stride + i * size::<D>()), mask);
                for a in 0..M {
                    acc[a][b] = _mm512_fmadd_ps(xv[a], wv, acc[a][b]);
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

/// An `R × M` tile of bf16 × bf16 dot products accumulated in f32, 32
/// products per instruction, neither operand converted.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")]
unsafe fn dot_bf16_512<const R: usize, const M: usize>(t: Tile) -> TileSums {
    let (w, x) = (t.w, t.x.cast::<u16>());
    let mut acc = [[_mm512_setzero_ps(); R]; M];
    let mut i = 0;
    // SAFETY: for the whole body, rows of both operands hold k bf16 values; full
    // loads stay below k, the tail is masked to it. The transmutes
    // reinterpret 512 bits of bf16 pairs as the type `vdpbf16ps` takes.
    unsafe {
        let pairs = |v: __m512i| std::mem::transmute::<__m512i, __m512bh>(v);
        while i + 32 <= t.k {
            let mut xv = [_mm512_setzero_si512(); M];
            for (a, v) in xv.iter_mut().enumerate() {
                *v = _mm512_loadu_si512(x.add(a * t.x_stride + i).cast());
            }
            for b in 0..R {
                let row = w.add(b * t.w_stride + 2 * i);
                // The next tile's weights, as in `fma_512`.
                _mm_prefetch::<_MM_HINT_T0>(row.wrapping_add(R * t.w_stride).cast());
                let wv = pairs(_mm512_loadu_si512(row.cast()));
                for a in 0..M {
                    acc[a][b] = _mm512_dpbf16_ps(acc[a][b], pairs(xv[a]), wv);
                }
            }
            i += 32;
        }
        if i < t.k {
            let mask = ((1u64 << (t.k - i)) - 1) as __mmask32;
            let mut xv = [_mm512_setzero_si512(); M];
            for (a, v) in xv.iter_mut().enumerate() {
                *v = _mm512_maskz_loadu_epi16(mask, x.add(a * t.x_stride + i).cast());
            }
            for b in 0..R {
                let wv = pairs(_mm512_maskz_loadu_epi16(
                    mask,
                    w.add(b * t.w_stride + 2 * i).cast(),
                ));
                for a in 0..M {
                    acc[a][b] = _mm512_dpbf16_ps(acc[a][b], pairs(xv[a]), wv);
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

/// 8 weights from `p` widened to f32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn load_256<const D: u8>(p: *const u8) -> __m256 {
    // SAFETY: the caller reads 8 elements at `p`.
    unsafe {
        match D {
            F32 => _mm256_loadu_ps(p.cast()),
            F16 => _mm256_cvtph_ps(_mm_loadu_si128(p.cast())),
            _ => _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(
                _mm_loadu_si128(p.cast()),
            ))),
        }
    }
}

/// The sum of the 8 lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn sum_256(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
}

/// An `R × M` tile of f32 dot products with AVX2; the last `k % 8`
/// elements of each row are copied to zero-padded stack buffers first.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn fma_256<const D: u8, const R: usize, const M: usize>(t: Tile) -> TileSums {
    let (w, x) = (t.w, t.x.cast::<f32>());
    let mut acc = [[_mm256_setzero_ps(); R]; M];
    let mut i = 0;
    // SAFETY: for the whole body, rows b < R of the weight and a < M of the input
    // hold k elements; full loads stay below k, the tail is copied from
    // exactly the elements left.
    unsafe {
        while i + 8 <= t.k {
            let mut xv = [_mm256_setzero_ps(); M];
            for (a, v) in xv.iter_mut().enumerate() {
                *v = _mm256_loadu_ps(x.add(a * t.x_stride + i));
            }
            for b in 0..R {
                let wv = load_256::<D>(w.add(b * t.w_stride + i * size::<D>()));
                for a in 0..M {
                    acc[a][b] = _mm256_fmadd_ps(xv[a], wv, acc[a][b]);
                }
            }
            i += 8;
        }
        let left = t.k - i;
        if left > 0 {
            let mut xv = [_mm256_setzero_ps(); M];
            for (a, v) in xv.iter_mut().enumerate() {
                let mut buf = [0f32; 8];
                std::ptr::copy_nonoverlapping(x.add(a * t.x_stride + i), buf.as_mut_ptr(), left);
                *v = _mm256_loadu_ps(buf.as_ptr());
            }
            for b in 0..R {
                let mut buf = [0u8; 32];
                let bytes = left * size::<D>();
                std::ptr::copy_nonoverlapping(
                    w.add(b * t.w_stride + i * size::<D>()),
                    buf.as_mut_ptr(),
                    bytes,
                );
                let wv = load_256::<D>(buf.as_ptr());
                for a in 0..M {
                    acc[a][b] = _mm256_fmadd_ps(xv[a], wv, acc[a][b]);
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
