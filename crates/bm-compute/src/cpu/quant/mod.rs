//! The products of bitsandbytes-quantized weights, read where they lie.
//!
//! A quantized decode step is worth its name only if it reads fewer bytes
//! and does no more work per byte than the dense one: nothing may be
//! dequantized into memory on the way. So the kernels here read the packed
//! weight in place and dequantize inside registers.
//!
//! * **4-bit** (NF4/FP4, bitsandbytes' blockwise layout: two codes a byte,
//!   the first in the high nibble, one absmax per `blocksize` codes). Per
//!   block and weight row, the kernel builds the block's 16 possible values
//!   in one register, `round(code[i] · absmax)` in the compute dtype —
//!   exactly the values bitsandbytes dequantizes to — and every byte then
//!   becomes two weights by a shuffle (`vpermps`) indexed by its nibbles.
//!   The input is prepared once per product: rounded to the compute dtype
//!   and, inside each run of 32 values, split into the 16 that meet high
//!   nibbles and the 16 that meet low ones, so both shuffles multiply
//!   whole registers. This needs rows that start on a block (`k` a multiple
//!   of the block size, as every real layer is); otherwise a block of rows
//!   is dequantized into the thread's scratch and multiplied by the dense
//!   F32 kernels. A prompt's input rows go by chunks that stay in L2 while
//!   a block of weight rows passes over them, as in `dense`.
//! * **8-bit** (LLM.int8()): the input arrives quantized to integers by the
//!   caller; the product of int8 weights and int16 inputs is summed exactly
//!   in integers (`vpmaddwd`, or VNNI's `vpdpwssd`), in spans short enough
//!   that no 32-bit lane can overflow, the spans added in 64 bits.
//!
//! As in `dense`, which kernel runs is [`Isa`]'s decision, taken by the
//! caller so tests can force each level; aarch64 runs the portable
//! kernels (the compiler vectorises the integer one with NEON; the 4-bit
//! shuffle is scalar there).

use std::ops::Range;

use bm_tensor::DType;

use super::dense::{Dense, TILE, TileSums, X_CHUNK};
use super::linear::{OutColumns, RowProduct};
use super::{Isa, round_to};

mod portable;
#[cfg(target_arch = "x86_64")]
mod x86;

/// Values of one 4-bit run: 16 bytes, 32 codes.
pub(crate) const RUN: usize = 32;

/// Elements of one integer span: 65536 products of at most 128 · 128 sum
/// to under 2³¹, so no lane or lane total of a span overflows `i32`.
const INT8_SPAN: usize = 1 << 16;

/// The per-block absmax of a 4-bit weight, however it is stored (plain or
/// double-quantized).
pub(crate) trait BlockScales: Sync {
    /// The scale of each block of `blocks`, into `out` (one per block).
    fn scales_into(&self, blocks: Range<usize>, out: &mut [f32]);
}

/// A 4-bit weight `[n, k]` in bitsandbytes' layout.
#[derive(Clone, Copy)]
pub(crate) struct FourBitWeight<'a> {
    /// Two codes a byte over the flattened weight, the first in the high
    /// nibble.
    pub(crate) packed: &'a [u8],
    /// The value each code stands for.
    pub(crate) code: [f32; 16],
    pub(crate) blocksize: usize,
    pub(crate) scales: &'a dyn BlockScales,
}

/// How a 4-bit kernel rounds the dequantized values: the compute dtype.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Rounding {
    F32,
    F16,
    Bf16,
}

impl Rounding {
    fn of(dtype: DType) -> Rounding {
        match dtype {
            DType::F16 => Rounding::F16,
            DType::BF16 => Rounding::Bf16,
            _ => Rounding::F32,
        }
    }
}

/// The operands of one 4-bit tile, as raw pointers: `rows` weight rows of
/// `k / 2` packed bytes from `w` (row stride `w_stride` bytes) with their
/// block scales from `scales` (row stride `scales_stride`), and `inputs`
/// prepared input rows from `x` (row stride `x_stride` f32 values).
#[derive(Clone, Copy)]
pub(crate) struct FourBitTile {
    pub(crate) w: *const u8,
    pub(crate) w_stride: usize,
    pub(crate) scales: *const f32,
    pub(crate) scales_stride: usize,
    pub(crate) x: *const f32,
    pub(crate) x_stride: usize,
    pub(crate) k: usize,
    pub(crate) blocksize: usize,
    pub(crate) code: *const [f32; 16],
    pub(crate) rounding: Rounding,
    pub(crate) rows: usize,
    pub(crate) inputs: usize,
}

/// `x[m, k] · weight[n, k]ᵀ` for a 4-bit weight: the input rounded to the
/// compute dtype, the weight dequantized to it (`round(code · absmax)`),
/// the sums in f32.
pub(crate) struct FourBitProduct<'a> {
    weight: FourBitWeight<'a>,
    k: usize,
    /// The input's rows: split into high- and low-nibble halves per run
    /// for the register kernels, as given for the dequantizing path.
    x: Vec<f32>,
    rounding: Rounding,
    in_registers: bool,
    isa: Isa,
}

impl<'a> FourBitProduct<'a> {
    /// The product of `x` (row-major `[m, k]`, already rounded to
    /// `compute`) by `weight`, with the kernels of `isa`.
    pub(crate) fn new(
        x: &[f32],
        k: usize,
        weight: FourBitWeight<'a>,
        compute: DType,
        isa: Isa,
    ) -> FourBitProduct<'a> {
        assert!(
            k > 0 && x.len().is_multiple_of(k),
            "input of {} values in rows of {k}",
            x.len()
        );
        // The kernels' SAFETY rests on this: a level is only run where detected.
        assert!(isa.is_supported(), "{isa} kernels on a CPU without {isa}");
        assert!(weight.blocksize.is_multiple_of(RUN), "4-bit block size");
        let in_registers = k.is_multiple_of(weight.blocksize);
        let x = if in_registers {
            split_nibble_halves(x)
        } else {
            x.to_vec()
        };
        FourBitProduct {
            weight,
            k,
            x,
            rounding: Rounding::of(compute),
            in_registers,
            isa,
        }
    }

    fn kernel(&self) -> unsafe fn(FourBitTile) -> TileSums {
        match self.isa {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 | Isa::Avx512Bf16 => x86::four_bit_avx512,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => x86::four_bit_avx2,
            _ => portable::four_bit,
        }
    }

    /// Rows `rows` dequantized into `out` (f32, rounded to the compute
    /// dtype), as bitsandbytes dequantizes them, at any alignment.
    fn dequantize_rows(&self, rows: Range<usize>, out: &mut [f32]) {
        let (k, bs) = (self.k, self.weight.blocksize);
        let (start, end) = (rows.start * k, rows.end * k);
        let packed = self.weight.packed;
        let mut at = start;
        while at < end {
            let block = at / bs;
            let stop = ((block + 1) * bs).min(end);
            let mut scale = [0f32];
            self.weight.scales.scales_into(block..block + 1, &mut scale);
            let table = value_table(&self.weight.code, scale[0], self.rounding);
            for (e, o) in (at..stop).zip(&mut out[at - start..stop - start]) {
                let byte = packed[e / 2];
                *o = table[usize::from(if e % 2 == 0 { byte >> 4 } else { byte & 0xF })];
            }
            at = stop;
        }
    }
}

/// The 16 values a block's codes stand for: `round(code[i] · scale)`.
pub(crate) fn value_table(code: &[f32; 16], scale: f32, rounding: Rounding) -> [f32; 16] {
    let mut table = code.map(|c| c * scale);
    match rounding {
        Rounding::F32 => {}
        Rounding::F16 => round_to(DType::F16, &mut table),
        Rounding::Bf16 => round_to(DType::BF16, &mut table),
    }
    table
}

/// Each run of 32 values of each row as the 16 at even positions (they
/// meet high nibbles) then the 16 at odd ones.
fn split_nibble_halves(x: &[f32]) -> Vec<f32> {
    let mut out = Vec::with_capacity(x.len());
    for run in x.chunks_exact(RUN) {
        out.extend(run.iter().step_by(2));
        out.extend(run.iter().skip(1).step_by(2));
    }
    out
}

impl RowProduct for FourBitProduct<'_> {
    fn add_rows(&self, rows: Range<usize>, out: &mut OutColumns<'_>, scratch: &mut Vec<f32>) {
        let (k, m) = (self.k, out.rows());
        assert!(m * k <= self.x.len(), "{m} input rows of {k}");
        assert!(
            (rows.end * k).div_ceil(2) <= self.weight.packed.len(),
            "weight rows {rows:?}"
        );
        if !self.in_registers {
            scratch.resize(rows.len() * k, 0.0);
            self.dequantize_rows(rows.clone(), scratch);
            let bytes: &[u8] = bytemuck::cast_slice(scratch.as_slice());
            let dense = Dense::new((&self.x, None), k, (bytes, DType::F32), self.isa);
            dense.add_rows(0..rows.len(), out, &mut Vec::new());
            return;
        }
        let blocks = k / self.weight.blocksize;
        scratch.resize(rows.len() * blocks, 0.0);
        self.weight
            .scales
            .scales_into(rows.start * blocks..rows.end * blocks, scratch);
        let kernel = self.kernel();
        for chunk in (0..m).step_by(X_CHUNK) {
            let chunk_end = (chunk + X_CHUNK).min(m);
            self.add_chunk(kernel, (rows.clone(), chunk..chunk_end), out, scratch);
        }
    }
}

impl FourBitProduct<'_> {
    /// Input rows `inputs` times weight rows `rows` with the register
    /// kernel, the rows' block scales in `scales`.
    fn add_chunk(
        &self,
        kernel: unsafe fn(FourBitTile) -> TileSums,
        (rows, inputs): (Range<usize>, Range<usize>),
        out: &mut OutColumns<'_>,
        scales: &[f32],
    ) {
        let k = self.k;
        let blocks = k / self.weight.blocksize;
        assert!(inputs.end * k <= self.x.len(), "input rows {inputs:?}");
        assert!(
            scales.len() >= rows.len() * blocks,
            "scales of rows {rows:?}"
        );
        let mut j = rows.start;
        while j < rows.end {
            let r = if rows.end - j >= TILE { TILE } else { 1 };
            let mut i = inputs.start;
            while i < inputs.end {
                let n_in = (inputs.end - i).min(TILE);
                let tile = FourBitTile {
                    w: self.weight.packed[j * k / 2..].as_ptr(),
                    w_stride: k / 2,
                    scales: scales[(j - rows.start) * blocks..].as_ptr(),
                    scales_stride: blocks,
                    x: self.x[i * k..].as_ptr(),
                    x_stride: k,
                    k,
                    blocksize: self.weight.blocksize,
                    code: &self.weight.code,
                    rounding: self.rounding,
                    rows: r,
                    inputs: n_in,
                };
                // SAFETY: weight rows j..j + r hold k / 2 bytes each inside
                // `packed` (rows.end * k / 2 <= its length, checked by
                // `add_rows`; k is even, a multiple of the block size);
                // their scales, `blocks` each, lie in `scales` (checked
                // above); input rows i..i + n_in lie inside `x` (checked
                // above). The kernel reads exactly those. It was chosen for
                // a level this CPU runs (checked in `new`).
                let sums = unsafe { kernel(tile) };
                for (a, sums) in sums.iter().enumerate().take(n_in) {
                    let row = &mut out.row(i + a)[j - rows.start..][..r];
                    for (o, s) in row.iter_mut().zip(sums) {
                        *o += s;
                    }
                }
                i += n_in;
            }
            j += r;
        }
    }
}

/// The operands of one int8 tile: `rows` weight rows of int8 codes from
/// `w` and `inputs` rows of integer inputs from `x`, `k` elements each
/// (row strides in elements).
#[derive(Clone, Copy)]
pub(crate) struct Int8Tile {
    pub(crate) w: *const i8,
    pub(crate) w_stride: usize,
    pub(crate) x: *const i16,
    pub(crate) x_stride: usize,
    pub(crate) k: usize,
    pub(crate) rows: usize,
    pub(crate) inputs: usize,
}

/// The exact integer sums of one int8 tile: `[input row][weight row]`.
pub(crate) type IntSums = [[i32; TILE]; TILE];

/// `x[m, k] · codes[n, k]ᵀ` for integer inputs in [-127, 127] and int8
/// weight codes, summed exactly (then rounded to f32 once).
pub(crate) struct Int8Product<'a> {
    x: Vec<i16>,
    k: usize,
    codes: &'a [i8],
    isa: Isa,
}

impl<'a> Int8Product<'a> {
    /// The product of `x` (integers as f32, row-major `[m, k]`, each in
    /// [-127, 127]) by `codes` (`[n, k]`), with the kernels of `isa`.
    pub(crate) fn new(x: &[f32], k: usize, codes: &'a [i8], isa: Isa) -> Int8Product<'a> {
        assert!(
            k > 0 && x.len().is_multiple_of(k) && codes.len().is_multiple_of(k),
            "int8 product of rows of {k}"
        );
        // The kernels' SAFETY rests on this: a level is only run where detected.
        assert!(isa.is_supported(), "{isa} kernels on a CPU without {isa}");
        let x = x
            .iter()
            .map(|&v| {
                debug_assert!(v.abs() <= 127.0 && v.fract() == 0.0, "int8 input {v}");
                v as i16
            })
            .collect();
        Int8Product { x, k, codes, isa }
    }

    fn kernel(&self) -> unsafe fn(Int8Tile) -> IntSums {
        match self.isa {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512Bf16 => x86::int8_vnni,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => x86::int8_avx512,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => x86::int8_avx2,
            _ => portable::int8,
        }
    }
}

impl RowProduct for Int8Product<'_> {
    fn add_rows(&self, rows: Range<usize>, out: &mut OutColumns<'_>, _scratch: &mut Vec<f32>) {
        let (k, m) = (self.k, out.rows());
        assert!(m * k <= self.x.len(), "{m} input rows of {k}");
        assert!(rows.end * k <= self.codes.len(), "weight rows {rows:?}");
        let kernel = self.kernel();
        let mut j = rows.start;
        while j < rows.end {
            let r = if rows.end - j >= TILE { TILE } else { 1 };
            let mut i = 0;
            while i < m {
                let inputs = (m - i).min(TILE);
                let mut sums = [[0i64; TILE]; TILE];
                for span in (0..k).step_by(INT8_SPAN) {
                    let tile = Int8Tile {
                        w: self.codes[j * k + span..].as_ptr(),
                        w_stride: k,
                        x: self.x[i * k + span..].as_ptr(),
                        x_stride: k,
                        k: INT8_SPAN.min(k - span),
                        rows: r,
                        inputs,
                    };
                    // SAFETY: weight rows j..j + r and input rows i..i +
                    // inputs lie inside `codes` and `x` (checked above);
                    // the kernel reads elements span..span + tile.k < k of
                    // each. It was chosen for a level this CPU runs.
                    let part = unsafe { kernel(tile) };
                    for (s, p) in sums.iter_mut().zip(&part) {
                        for (s, &p) in s.iter_mut().zip(p) {
                            *s += i64::from(p);
                        }
                    }
                }
                for (a, sums) in sums.iter().enumerate().take(inputs) {
                    let row = &mut out.row(i + a)[j - rows.start..][..r];
                    for (o, &s) in row.iter_mut().zip(sums) {
                        *o += s as f32;
                    }
                }
                i += inputs;
            }
            j += r;
        }
    }
}

#[cfg(test)]
mod tests;
