//! The tile kernel in plain Rust: the reference the SIMD kernels are
//! tested against, and what runs on CPUs they were not written for. The
//! weights are widened a short run at a time into a stack buffer, and the
//! sums kept in eight lanes the compiler vectorises.

use super::{Pair, TILE, Tile, TileSums};

/// Elements widened at a time.
const RUN: usize = 64;

/// Lanes of the partial sums.
const LANES: usize = 8;

/// Element `i` of a row of `pair`'s weights starting at `w`.
///
/// # Safety
/// `w` must be readable for `(i + 1) * pair.weight_size()` bytes.
unsafe fn weight_at(pair: Pair, w: *const u8, i: usize) -> f32 {
    // SAFETY: the caller's promise; unaligned reads of the element's bytes.
    unsafe {
        match pair {
            Pair::F32 => w.cast::<f32>().add(i).read_unaligned(),
            Pair::F16 => half::f16::from_bits(w.cast::<u16>().add(i).read_unaligned()).to_f32(),
            Pair::Bf16 | Pair::Bf16Dot => {
                f32::from_bits(u32::from(w.cast::<u16>().add(i).read_unaligned()) << 16)
            }
        }
    }
}

/// Element `i` of an input row starting at `x` (f32, or bf16 for
/// [`Pair::Bf16Dot`]).
///
/// # Safety
/// `x` must be readable for element `i`.
unsafe fn input_at(pair: Pair, x: *const u8, i: usize) -> f32 {
    // SAFETY: the caller's promise.
    unsafe {
        match pair {
            Pair::Bf16Dot => {
                f32::from_bits(u32::from(x.cast::<u16>().add(i).read_unaligned()) << 16)
            }
            _ => x.cast::<f32>().add(i).read_unaligned(),
        }
    }
}

/// The tile's dot products.
///
/// # Safety
/// `t` describes readable rows (see [`Tile`]).
pub(super) unsafe fn tile(pair: Pair, t: Tile) -> TileSums {
    let mut acc = [[[0f32; LANES]; TILE]; TILE];
    let mut w = [[0f32; RUN]; TILE];
    let mut x = [[0f32; RUN]; TILE];
    let x_size = pair.input_size();
    let mut start = 0;
    while start < t.k {
        let len = RUN.min(t.k - start);
        for (b, w) in w.iter_mut().enumerate().take(t.rows) {
            let row = t.w.wrapping_add(b * t.w_stride);
            for (i, v) in w[..len].iter_mut().enumerate() {
                // SAFETY: element start + i < k of weight row b.
                *v = unsafe { weight_at(pair, row, start + i) };
            }
            w[len..].fill(0.0);
        }
        for (a, x) in x.iter_mut().enumerate().take(t.inputs) {
            let row = t.x.wrapping_add(a * t.x_stride * x_size);
            for (i, v) in x[..len].iter_mut().enumerate() {
                // SAFETY: element start + i < k of input row a.
                *v = unsafe { input_at(pair, row, start + i) };
            }
            x[len..].fill(0.0);
        }
        for (acc, x) in acc.iter_mut().zip(&x).take(t.inputs) {
            for (acc, w) in acc.iter_mut().zip(&w).take(t.rows) {
                for (xc, wc) in x.chunks_exact(LANES).zip(w.chunks_exact(LANES)) {
                    for l in 0..LANES {
                        acc[l] += xc[l] * wc[l];
                    }
                }
            }
        }
        start += len;
    }
    let mut sums = [[0f32; TILE]; TILE];
    for (s, acc) in sums.iter_mut().zip(&acc) {
        for (s, lanes) in s.iter_mut().zip(acc) {
            *s = lanes.iter().sum();
        }
    }
    sums
}
