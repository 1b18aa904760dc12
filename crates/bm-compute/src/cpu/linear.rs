//! The products of linear layers on the CPU: `nn.Linear` (`linear`,
//! `linear_many`) and transformers' `Conv1D` (`linear_t`).

use std::ops::Range;

use rayon::prelude::*;

use crate::Tensor;

/// A raw output pointer shared by threads that write disjoint parts.
#[derive(Clone, Copy)]
struct SharedOut(*mut f32);
// SAFETY: only used by `linear_many` and `linear_t`, whose blocks write
// disjoint columns.
unsafe impl Send for SharedOut {}
// SAFETY: as above.
unsafe impl Sync for SharedOut {}

impl SharedOut {
    // A method, so closures capture the Send wrapper and not the raw field.
    fn at(self, offset: usize) -> *mut f32 {
        self.0.wrapping_add(offset)
    }
}

/// Weight rows one task multiplies at a time: enough work per task to
/// amortise its set-up, small enough to spread over threads and keep a
/// block's working set in cache. A multiple of 16, so kernels that take
/// rows in groups (interleaved layouts) see whole groups but in the last
/// block.
fn block_rows(n: usize, k: usize) -> usize {
    let threads = rayon::current_num_threads().max(1);
    let by_threads = n.div_ceil(threads * 4);
    let by_cache = (256 * 1024 / 4 / k.max(1)).max(16);
    by_threads.clamp(16, by_cache.max(16)).next_multiple_of(16)
}

/// Columns `j0..j1` of every row of one product's output (`m` rows of `n`
/// values): the part of the output one task of [`linear_many`] owns. No
/// other task writes these elements, so the task may hold them mutably.
pub(crate) struct OutColumns<'a> {
    /// Element `[0, j0]` of the output.
    first: *mut f32,
    /// The output's row stride (`n`).
    stride: usize,
    rows: usize,
    width: usize,
    _borrow: std::marker::PhantomData<&'a mut [f32]>,
}

impl OutColumns<'_> {
    /// Output rows (the input's rows, `m`).
    pub(crate) fn rows(&self) -> usize {
        self.rows
    }

    /// Row `i`'s columns `j0..j1`.
    pub(crate) fn row(&mut self, i: usize) -> &mut [f32] {
        assert!(i < self.rows, "row {i} of an output of {} rows", self.rows);
        // SAFETY: `first + i * stride .. + width` lies inside the output
        // (row i < m, columns j0..j1 <= n) and is this block's alone (see
        // the type's doc); `&mut self` keeps the slice unique here.
        unsafe { std::slice::from_raw_parts_mut(self.first.add(i * self.stride), self.width) }
    }
}

/// A weight matrix `[n, k]` and the input `x[m, k]` it multiplies, in the
/// forms its kernel reads: each weight format (dense F32/F16/BF16,
/// bitsandbytes 4- and 8-bit) implements this, and [`linear_many`] spreads
/// the rows over the threads. The input is prepared once per product when
/// the value is made (converted, quantized or re-laid out as the kernel
/// wants), not once per task.
pub(crate) trait RowProduct: Sync {
    /// Adds `x · weight[rows]ᵀ` to `out` (`out.rows()` = m rows,
    /// `rows.len()` columns). `scratch` is a buffer of this thread's, kept
    /// across calls, for kernels that need room.
    fn add_rows(&self, rows: Range<usize>, out: &mut OutColumns<'_>, scratch: &mut Vec<f32>);
}

/// `out[m, n] = x · weight[n, k]ᵀ (+ bias[n])`, the product of
/// `nn.Linear`: [`linear_many`] with one weight.
pub(crate) fn linear(
    (m, k): (usize, usize),
    product: &dyn RowProduct,
    n: usize,
    bias: Option<&[f32]>,
    out: &mut [f32],
) {
    linear_many(
        (m, k),
        &mut [LinearPart {
            product,
            n,
            bias,
            out,
        }],
    );
}

/// One product of [`linear_many`]: `out[m, n] = x · weight[n, k]ᵀ (+ bias)`.
pub(crate) struct LinearPart<'a> {
    pub(crate) product: &'a dyn RowProduct,
    pub(crate) n: usize,
    pub(crate) bias: Option<&'a [f32]>,
    pub(crate) out: &'a mut [f32],
}

/// Several `nn.Linear` products of one input `[m, k]` (a layer's
/// separate q/k/v projections, a gated MLP's gate and up) in one pass over
/// the threads: a decode step makes many small products, and each parallel
/// pass costs a wake-up and a join, which dominate on a loaded machine.
/// Threads split the weights' rows; each output is what the product alone
/// gives (the same blocks and sums).
pub(crate) fn linear_many((m, k): (usize, usize), parts: &mut [LinearPart<'_>]) {
    // What each task reads of its part: the product, its width, and where
    // the output is (tasks write disjoint columns of it).
    let mut reads = Vec::with_capacity(parts.len());
    let mut tasks = Vec::new();
    for (p, part) in parts.iter_mut().enumerate() {
        let n = part.n;
        assert_eq!(part.out.len(), m * n, "output of {m} rows of {n}");
        match part.bias {
            Some(b) => part
                .out
                .chunks_exact_mut(n)
                .for_each(|row| row.copy_from_slice(b)),
            None => part.out.fill(0.0),
        }
        reads.push((part.product, n, SharedOut(part.out.as_mut_ptr())));
        let block = block_rows(n, k);
        tasks.extend((0..n.div_ceil(block)).map(|b| (p, b * block, ((b + 1) * block).min(n))));
    }
    tasks
        .into_par_iter()
        .for_each_init(Vec::new, |scratch, (p, j0, j1)| {
            let (product, n, dst) = reads[p];
            let mut out = OutColumns {
                first: dst.at(j0),
                stride: n,
                rows: m,
                width: j1 - j0,
                _borrow: std::marker::PhantomData,
            };
            product.add_rows(j0..j1, &mut out, scratch);
        });
}

/// `out[m, n] = x[m, k] · weight[k, n] (+ bias[n])`: the product of
/// transformers' `Conv1D` (GPT-2), whose weight is stored `[in, out]`.
/// Threads split the weight's columns; a half-precision block is widened
/// to f32 on the fly, an F32 one is read in place.
pub(crate) fn linear_t(
    x: &[f32],
    m: usize,
    k: usize,
    weight: &Tensor,
    bias: Option<&[f32]>,
    out: &mut [f32],
) {
    let n = weight.shape()[1];
    debug_assert_eq!(out.len(), m * n);
    if let Some(b) = bias {
        for row in out.chunks_exact_mut(n) {
            row.copy_from_slice(b);
        }
    }
    if m == 1 {
        // One token: the weight is read once, front to back. Each task sums
        // x[l] · w[l, :] over a fixed run of rows into its own vector, and
        // the vectors are added in order, so the result does not depend on
        // the number of threads.
        const ROWS: usize = 32;
        let partials: Vec<Vec<f32>> = (0..k.div_ceil(ROWS))
            .into_par_iter()
            .map(|b| {
                let (l0, l1) = (b * ROWS, ((b + 1) * ROWS).min(k));
                let w = weight.f32_rows(l0, l1);
                let mut acc = vec![0f32; n];
                for (xl, row) in x[l0..l1].iter().zip(w.chunks_exact(n)) {
                    for (a, v) in acc.iter_mut().zip(row) {
                        *a += xl * v;
                    }
                }
                acc
            })
            .collect();
        for partial in partials {
            for (o, v) in out.iter_mut().zip(&partial) {
                *o += v;
            }
        }
        return;
    }
    let block = block_rows(n, k);
    let dst = SharedOut(out.as_mut_ptr());
    let f32_weight = (weight.dtype() == bm_tensor::DType::F32).then(|| weight.f32_values());
    (0..n.div_ceil(block)).into_par_iter().for_each(|b| {
        let (j0, j1) = (b * block, ((b + 1) * block).min(n));
        let width = j1 - j0;
        // The k × width block: in place for F32 (row stride n), else widened
        // into a dense copy (row stride width).
        let widened;
        let (rhs, row_stride) = match &f32_weight {
            Some(w) => (&w[j0..], n),
            None => {
                let mut dense = vec![0f32; k * width];
                for (l, row) in dense.chunks_exact_mut(width).enumerate() {
                    weight.widen_range_into(l * n + j0, row);
                }
                widened = dense;
                (&widened[..], width)
            }
        };
        // SAFETY: `dst` points to `out` (m × n, row stride n); this task
        // writes only columns j0..j1, which no other task touches. `x` is
        // m × k with row stride k; `rhs` holds the k × width block with the
        // given row stride and column stride 1, and the last element read,
        // (k - 1) * row_stride + width - 1, is inside it.
        unsafe {
            gemm::gemm(
                m,
                width,
                k,
                dst.at(j0),
                1,
                n as isize,
                bias.is_some(),
                x.as_ptr(),
                1,
                k as isize,
                rhs.as_ptr(),
                1,
                row_stride as isize,
                1.0,
                1.0,
                false,
                false,
                false,
                gemm::Parallelism::None,
            )
        }
    });
}
