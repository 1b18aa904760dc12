//! The tile kernel for aarch64 Advanced SIMD: 4 lanes, FMA, bf16 widened
//! by a shift and f16 by `fcvtl` (through `asm!`: the f16 vector types of
//! the intrinsics are not stable Rust).

// The tiles index their accumulators by row and input, both constants:
// indexing is what keeps them in registers.
#![allow(clippy::needless_range_loop)]

use std::arch::aarch64::*;

use super::{Pair, TILE, Tile, TileSums};

/// 4 weights of `pair` from `p` widened to f32.
#[inline]
#[target_feature(enable = "neon")]
unsafe fn load(pair: Pair, p: *const u8) -> float32x4_t {
    // SAFETY: the caller reads 4 elements at `p`.
    unsafe {
        match pair {
            Pair::F32 => vld1q_f32(p.cast()),
            Pair::F16 => {
                let h = vld1_u16(p.cast());
                let f: float32x4_t;
                std::arch::asm!("fcvtl {0:v}.4s, {1:v}.4h", out(vreg) f, in(vreg) h,
                    options(pure, nomem, nostack));
                f
            }
            Pair::Bf16 | Pair::Bf16Dot => {
                vreinterpretq_f32_u32(vshlq_n_u32::<16>(vmovl_u16(vld1_u16(p.cast()))))
            }
        }
    }
}

/// An `R × M` tile of f32 dot products.
#[target_feature(enable = "neon")]
unsafe fn fma<const R: usize, const M: usize>(pair: Pair, t: Tile) -> TileSums {
    let size = pair.weight_size();
    let (w, x) = (t.w, t.x.cast::<f32>());
    let mut acc = [[vdupq_n_f32(0.0); R]; M];
    let mut i = 0;
    // SAFETY: for the whole body, rows b < R of the weight and a < M of the input
    // hold k elements; full loads stay below k, the tail is copied from
    // exactly the elements left.
    unsafe {
        while i + 4 <= t.k {
            let mut xv = [vdupq_n_f32(0.0); M];
            for (a, v) in xv.iter_mut().enumerate() {
                *v = vld1q_f32(x.add(a * t.x_stride + i));
            }
            for b in 0..R {
                let wv = load(pair, w.add(b * t.w_stride + i * size));
                for a in 0..M {
                    acc[a][b] = vfmaq_f32(acc[a][b], xv[a], wv);
                }
            }
            i += 4;
        }
        let left = t.k - i;
        if left > 0 {
            let mut xv = [vdupq_n_f32(0.0); M];
            for (a, v) in xv.iter_mut().enumerate() {
                let mut buf = [0f32; 4];
                std::ptr::copy_nonoverlapping(x.add(a * t.x_stride + i), buf.as_mut_ptr(), left);
                *v = vld1q_f32(buf.as_ptr());
            }
            for b in 0..R {
                let mut buf = [0u8; 16];
                std::ptr::copy_nonoverlapping(
                    w.add(b * t.w_stride + i * size),
                    buf.as_mut_ptr(),
                    left * size,
                );
                let wv = load(pair, buf.as_ptr());
                for a in 0..M {
                    acc[a][b] = vfmaq_f32(acc[a][b], xv[a], wv);
                }
            }
        }
    }
    let mut sums = [[0f32; TILE]; TILE];
    for a in 0..M {
        for b in 0..R {
            sums[a][b] = vaddvq_f32(acc[a][b]);
        }
    }
    sums
}

/// The tile's dot products (bf16 inputs are not made for this level).
///
/// # Safety
/// `t` describes readable rows.
pub(super) unsafe fn tile(pair: Pair, t: Tile) -> TileSums {
    debug_assert!(pair != Pair::Bf16Dot);
    // SAFETY: the caller's promise; NEON is always present on aarch64.
    unsafe {
        match (t.rows == TILE, t.inputs) {
            (true, 1) => fma::<4, 1>(pair, t),
            (true, 2) => fma::<4, 2>(pair, t),
            (true, 3) => fma::<4, 3>(pair, t),
            (true, _) => fma::<4, 4>(pair, t),
            (false, 1) => fma::<1, 1>(pair, t),
            (false, 2) => fma::<1, 2>(pair, t),
            (false, 3) => fma::<1, 3>(pair, t),
            (false, _) => fma::<1, 4>(pair, t),
        }
    }
}
