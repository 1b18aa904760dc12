//! The quantized tile kernels in plain Rust: the reference the SIMD
//! kernels are tested against, and what runs where they were not written
//! (aarch64 among them; the integer loop vectorises there).

// The lanes index several arrays at once.
#![allow(clippy::needless_range_loop)]

use super::{FourBitTile, Int8Tile, IntSums, RUN, TILE, TileSums, value_table};

/// A 4-bit tile: each block's value table built once per weight row, each
/// byte's two codes looked up in it.
///
/// # Safety
/// `t` describes readable rows, scales and inputs (see [`FourBitTile`]).
pub(super) unsafe fn four_bit(t: FourBitTile) -> TileSums {
    let half = RUN / 2;
    let mut acc = [[[0f32; RUN / 2]; TILE]; TILE];
    // SAFETY: the caller's promise.
    let code = unsafe { &*t.code };
    for block in 0..t.k / t.blocksize {
        let mut tables = [[0f32; 16]; TILE];
        for (b, table) in tables.iter_mut().enumerate().take(t.rows) {
            // SAFETY: row b has k / blocksize scales.
            let scale = unsafe { *t.scales.add(b * t.scales_stride + block) };
            *table = value_table(code, scale, t.rounding);
        }
        for run in 0..t.blocksize / RUN {
            let e = block * t.blocksize + run * RUN;
            for b in 0..t.rows {
                // SAFETY: bytes e / 2 .. e / 2 + 16 of row b (e + 32 <= k).
                let bytes =
                    unsafe { std::slice::from_raw_parts(t.w.add(b * t.w_stride + e / 2), half) };
                let mut high = [0f32; RUN / 2];
                let mut low = [0f32; RUN / 2];
                for ((h, l), &byte) in high.iter_mut().zip(&mut low).zip(bytes) {
                    *h = tables[b][usize::from(byte >> 4)];
                    *l = tables[b][usize::from(byte & 0xF)];
                }
                for (a, acc) in acc.iter_mut().enumerate().take(t.inputs) {
                    // SAFETY: prepared values e..e + 32 of input row a.
                    let x = unsafe { std::slice::from_raw_parts(t.x.add(a * t.x_stride + e), RUN) };
                    let (xh, xl) = x.split_at(half);
                    for l in 0..half {
                        acc[b][l] += xh[l] * high[l] + xl[l] * low[l];
                    }
                }
            }
        }
    }
    let mut sums = [[0f32; TILE]; TILE];
    for (s, acc) in sums.iter_mut().zip(&acc) {
        for (s, lanes) in s.iter_mut().zip(acc) {
            *s = lanes.iter().sum();
        }
    }
    sums
}

/// An int8 tile, in 32-bit integer lanes the compiler vectorises.
///
/// # Safety
/// `t` describes readable rows (see [`Int8Tile`]).
pub(super) unsafe fn int8(t: Int8Tile) -> IntSums {
    const LANES: usize = 16;
    let mut sums = [[0i32; TILE]; TILE];
    for b in 0..t.rows {
        // SAFETY: row b of the weight holds k codes.
        let w = unsafe { std::slice::from_raw_parts(t.w.add(b * t.w_stride), t.k) };
        for a in 0..t.inputs {
            // SAFETY: row a of the input holds k values.
            let x = unsafe { std::slice::from_raw_parts(t.x.add(a * t.x_stride), t.k) };
            let mut lanes = [0i32; LANES];
            let (wc, xc) = (w.chunks_exact(LANES), x.chunks_exact(LANES));
            let tail: i32 = wc
                .remainder()
                .iter()
                .zip(xc.remainder())
                .map(|(&w, &x)| i32::from(w) * i32::from(x))
                .sum();
            for (w, x) in wc.zip(xc) {
                for l in 0..LANES {
                    lanes[l] += i32::from(w[l]) * i32::from(x[l]);
                }
            }
            sums[a][b] = lanes.iter().sum::<i32>() + tail;
        }
    }
    sums
}
