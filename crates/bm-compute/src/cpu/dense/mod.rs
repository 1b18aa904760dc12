//! The products of dense F32/F16/BF16 weights, read where they lie.
//!
//! A decode step multiplies one or a few rows of activations by every
//! weight of the model, so its speed is the speed of reading the weights:
//! the kernels here load each weight once, from wherever its bytes are (an
//! owned buffer, a mapped checkpoint, a streamed offload copy), widen it
//! inside registers and multiply it into every input row it meets. Nothing
//! is allocated, zero-filled or packed per call.
//!
//! The work is cut into tiles of up to [`TILE`] weight rows by [`TILE`]
//! input rows: each tile keeps its `TILE × TILE` partial dot products in
//! registers over the whole width `k`, so a weight is converted once per
//! four input rows and a tile's weight rows stay in L1 while every group
//! of input rows of a chunk passes over them. Input rows go by chunks of
//! [`X_CHUNK`], which keeps a chunk in L2 during a prompt.
//!
//! BF16 weights times BF16 activations use AVX-512 BF16's `vdpbf16ps`
//! where it is faster than FMA ([`Isa::bf16_dot_pays`]): products of two
//! bf16 values are exact in f32 and accumulate in f32, as PyTorch's oneDNN
//! kernels do, with no conversion at all. Other pairs widen the weight to f32 (a shift for bf16, F16C for
//! f16) and use FMA. Which kernel runs is [`Isa`]'s decision, made by the
//! caller, so tests can force each level.

use std::ops::Range;

use bm_tensor::DType;

use super::Isa;
use super::linear::{OutColumns, RowProduct};

#[cfg(target_arch = "aarch64")]
mod neon;
mod portable;
#[cfg(target_arch = "x86_64")]
mod x86;

/// Weight rows and input rows of one register tile.
pub(crate) const TILE: usize = 4;

/// Input rows a block of weight rows sees at a time (about 128 KiB of f32
/// activations at k = 1024: L2-resident while the block's tiles pass).
pub(crate) const X_CHUNK: usize = 32;

/// The partial sums of one tile: `[input row][weight row]`.
pub(crate) type TileSums = [[f32; TILE]; TILE];

/// How a tile reads its two operands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Pair {
    /// f32 input times F32 weights.
    F32,
    /// f32 input times F16 weights, widened in registers.
    F16,
    /// f32 input times BF16 weights, widened in registers.
    Bf16,
    /// BF16 input times BF16 weights, both read as bf16 (`vdpbf16ps`).
    Bf16Dot,
}

impl Pair {
    /// Bytes of one weight element.
    pub(crate) fn weight_size(self) -> usize {
        match self {
            Pair::F32 => 4,
            Pair::F16 | Pair::Bf16 | Pair::Bf16Dot => 2,
        }
    }

    /// Bytes of one input element: bf16 for [`Pair::Bf16Dot`], else f32.
    pub(crate) fn input_size(self) -> usize {
        if self == Pair::Bf16Dot { 2 } else { 4 }
    }
}

/// The operands of one tile, as raw pointers a kernel reads with
/// unaligned loads: `rows` weight rows from `w` (row stride `w_stride`
/// bytes) and `inputs` input rows from `x` (row stride `x_stride`
/// elements: f32, or bf16 for [`Pair::Bf16Dot`]), `k` elements each.
#[derive(Clone, Copy)]
pub(crate) struct Tile {
    pub(crate) w: *const u8,
    pub(crate) w_stride: usize,
    pub(crate) x: *const u8,
    pub(crate) x_stride: usize,
    pub(crate) k: usize,
    pub(crate) rows: usize,
    pub(crate) inputs: usize,
}

/// `x[m, k] · weight[n, k]ᵀ` for a dense weight read in place.
pub(crate) struct Dense<'a> {
    /// The input's f32 values, m × k.
    x: &'a [f32],
    /// The input's bf16 bytes (m × k), when both operands are BF16 and
    /// the CPU has the bf16 dot product.
    x_bf16: Option<&'a [u8]>,
    k: usize,
    /// The weight's bytes, n × k elements of `dtype`, at any alignment.
    weight: &'a [u8],
    pair: Pair,
    isa: Isa,
}

impl<'a> Dense<'a> {
    /// The product of `x` (f32 values, row-major `[m, k]`; `x_bf16` the
    /// same values as bf16 bytes when the input tensor is BF16) by
    /// `weight`, the bytes of `[n, k]` elements of `dtype` (F32, F16 or
    /// BF16), with the kernels of `isa`.
    pub(crate) fn new(
        (x, x_bf16): (&'a [f32], Option<&'a [u8]>),
        k: usize,
        (weight, dtype): (&'a [u8], DType),
        isa: Isa,
    ) -> Dense<'a> {
        assert!(
            k > 0 && x.len().is_multiple_of(k),
            "input of {} values in rows of {k}",
            x.len()
        );
        // The kernels' SAFETY rests on this: a level is only run where detected.
        assert!(isa.is_supported(), "{isa} kernels on a CPU without {isa}");
        let size = dtype.size_in_bytes();
        assert!(
            weight.len().is_multiple_of(k * size),
            "weight of {} bytes in rows of {k} {dtype}",
            weight.len()
        );
        let pair = match dtype {
            DType::F32 => Pair::F32,
            DType::F16 => Pair::F16,
            DType::BF16 if x_bf16.is_some() && isa.bf16_dot_pays() => Pair::Bf16Dot,
            DType::BF16 => Pair::Bf16,
            other => unreachable!("dense weight of non-compute dtype {other}"),
        };
        let x_bf16 = x_bf16.filter(|_| pair == Pair::Bf16Dot);
        if let Some(b) = x_bf16 {
            assert_eq!(b.len(), 2 * x.len(), "bf16 input bytes");
        }
        Dense {
            x,
            x_bf16,
            k,
            weight,
            pair,
            isa,
        }
    }

    /// The tile kernel of this product's instruction set.
    fn kernel(&self) -> unsafe fn(Pair, Tile) -> TileSums {
        match self.isa {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 | Isa::Avx512Bf16 => x86::tile_avx512,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => x86::tile_avx2,
            #[cfg(target_arch = "aarch64")]
            Isa::Neon => neon::tile,
            _ => portable::tile,
        }
    }
}

impl RowProduct for Dense<'_> {
    fn add_rows(&self, rows: Range<usize>, out: &mut OutColumns<'_>, _scratch: &mut Vec<f32>) {
        let (k, m) = (self.k, out.rows());
        assert!(m * k <= self.x.len(), "{m} input rows of {k}");
        let size = self.pair.weight_size();
        assert!(
            rows.end * k * size <= self.weight.len(),
            "weight rows {rows:?}"
        );
        let kernel = self.kernel();
        let x = match self.x_bf16 {
            Some(b) => b.as_ptr(),
            None => self.x.as_ptr().cast::<u8>(),
        };
        let x_size = self.pair.input_size();
        for chunk in (0..m).step_by(X_CHUNK) {
            let chunk_end = (chunk + X_CHUNK).min(m);
            let mut j = rows.start;
            while j < rows.end {
                let r = if rows.end - j >= TILE { TILE } else { 1 };
                let mut i = chunk;
                while i < chunk_end {
                    let inputs = (chunk_end - i).min(TILE);
                    let tile = Tile {
                        w: self.weight[j * k * size..].as_ptr(),
                        w_stride: k * size,
                        x: x.wrapping_add(i * k * x_size),
                        x_stride: k,
                        k,
                        rows: r,
                        inputs,
                    };
                    // SAFETY: the tile's `r` weight rows j..j + r lie inside
                    // `weight` (rows.end * k * size <= its length, checked
                    // above) and its input rows i..i + inputs inside the
                    // input (i + inputs <= m, m * k <= its length); the
                    // kernel reads exactly k elements of each. The kernel
                    // was chosen for an instruction set this CPU runs
                    // (`Isa` levels are only made from detected ones).
                    let sums = unsafe { kernel(self.pair, tile) };
                    for (a, sums) in sums.iter().enumerate().take(inputs) {
                        let row = &mut out.row(i + a)[j - rows.start..][..r];
                        for (o, s) in row.iter_mut().zip(sums) {
                            *o += s;
                        }
                    }
                    i += inputs;
                }
                j += r;
            }
        }
    }
}

#[cfg(test)]
mod tests;
