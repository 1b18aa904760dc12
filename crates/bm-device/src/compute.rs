//! Compute on a GPU: the few kernels a transformer needs, on
//! [`DeviceBuffer`]s, enqueued on the GPU's compute stream.
//!
//! * [`Gpu::gemm`]: `C = A · Bᵀ` in row-major order (the product of
//!   `nn.Linear`, whose weight is stored `[out, in]`), or `C = A · B` for
//!   B stored `[in, out]` (`Conv1D`, GPT-2), optionally strided
//!   batched, through cuBLAS with f32 accumulation. A and B share one type;
//!   C is that type or F32.
//! * Kernels compiled at run time with NVRTC (no toolkit at build time) and
//!   loaded once per GPU: cast, add, mul, activations (SiLU, exact and
//!   tanh GELU, ReLU), the bias epilogue of a linear layer, embedding
//!   gather, RMSNorm, LayerNorm,
//!   rotary embedding (`rotate_half`; default frequencies computed on the
//!   GPU, or any frequencies and positions from host tables), softmax, a
//!   fused attention with
//!   bidirectional, causal or sliding-window masks, grouped-query heads and
//!   an optional relative position bias (T5),
//!   bitsandbytes' dequantization (4-bit NF4/FP4 with plain or nested
//!   scales, LLM.int8() rows) and quantized linear layers reading the
//!   packed weight in place (4-bit, LLM.int8()), whose parts may be
//!   [`DeviceSlice`]s of one buffer.
//!   Every kernel computes in f32 and rounds once when storing, the rule
//!   PyTorch's kernels follow.
//!
//! Element types are [`DType`]s (F32, F16 or BF16: the others have no
//! kernels and are refused); sizes are element counts and every
//! buffer is checked to hold what the kernel touches before anything is
//! enqueued ([`Error::OutOfBounds`] otherwise).
//!
//! # Ordering
//!
//! Every operation first makes the compute stream wait for the last copy
//! or kernel using each of its buffers, then records one event after the
//! launch as every operand's last use. So a weight uploaded on the copy
//! stream is read only once its copy finished, a buffer is freed (or
//! overwritten by a later copy) only after the kernels reading it, and
//! reading a result back ([`DeviceBuffer::copy_to_host`]) waits for the
//! kernel that wrote it.
//!
//! # Emulated GPUs
//!
//! Emulated GPUs hold bytes but do not compute: every operation here fails
//! on them with [`Error::ComputeUnsupported`] (after the same argument
//! checks, so those are tested without a GPU). A model whose weights sit on
//! an emulated GPU computes on the host, as its CPU kernels are the
//! reference the CUDA ones are tested against.

use bm_tensor::DType;

use crate::gpu::Backend;
use crate::{DeviceBuffer, Error, Gpu, Result};

/// What a GPU's compute kernels were loaded from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KernelModuleInfo {
    /// The NVRTC target: `sm_XY` (machine code for the GPU) or, as the
    /// fallback, `compute_XY` (PTX the driver compiles).
    pub target: String,
    /// Whether the image came from the disk cache rather than NVRTC.
    pub from_cache: bool,
}

/// How the B operand of a [`GemmShape`] is stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BLayout {
    /// `[n, k]` row-major, `C = A · Bᵀ`: `nn.Linear`'s weight `[out, in]`.
    OutIn,
    /// `[k, n]` row-major, `C = A · B`: transformers' `Conv1D` weight
    /// `[in, out]` (GPT-2), read in place rather than transposed.
    InOut,
}

/// Sizes of a row-major `C[m, n] = A[m, k] · B[n, k]ᵀ` (or `A · B[k, n]`,
/// per [`BLayout`]), repeated `batch` times with the given element strides
/// between consecutive matrices.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GemmShape {
    /// Rows of A and C.
    pub m: usize,
    /// Rows of B, columns of C.
    pub n: usize,
    /// Columns of A and B.
    pub k: usize,
    /// Number of products.
    pub batch: usize,
    /// Elements from one A to the next.
    pub stride_a: usize,
    /// Elements from one B to the next (0 shares one B).
    pub stride_b: usize,
    /// Elements from one C to the next.
    pub stride_c: usize,
    /// How B is stored.
    pub b_layout: BLayout,
}

impl GemmShape {
    /// One product of dense matrices.
    pub fn new(m: usize, n: usize, k: usize) -> GemmShape {
        GemmShape {
            m,
            n,
            k,
            batch: 1,
            stride_a: m * k,
            stride_b: n * k,
            stride_c: m * n,
            b_layout: BLayout::OutIn,
        }
    }

    /// The same product with B stored `[k, n]`: `C = A · B`.
    pub fn b_in_out(self) -> Self {
        GemmShape {
            b_layout: BLayout::InOut,
            ..self
        }
    }

    /// `batch` products with the given element strides.
    pub fn batched(self, batch: usize, stride_a: usize, stride_b: usize, stride_c: usize) -> Self {
        GemmShape {
            batch,
            stride_a,
            stride_b,
            stride_c,
            ..self
        }
    }
}

/// Which keys each query attends to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttentionMask {
    /// Every key.
    Bidirectional,
    /// Keys at or before the query's position.
    Causal,
    /// Causal, within the last `n` positions including the query's own.
    SlidingWindow(usize),
}

/// Geometry of one attention call: `queries` new positions (the last ones)
/// against `keys` positions, grouped-query heads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttentionShape {
    /// Query rows (the last `queries` of the `keys` positions).
    pub queries: usize,
    /// Cached positions, the queries' own included.
    pub keys: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads; divides `heads`.
    pub kv_heads: usize,
    /// Width of one head.
    pub head_dim: usize,
    /// The mask.
    pub mask: AttentionMask,
}

/// An elementwise activation of [`Gpu::unary`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Activation {
    /// SiLU, `x · sigmoid(x)`.
    Silu,
    /// Exact GELU, `0.5 x (1 + erf(x / √2))` (BERT's `gelu`).
    Gelu,
    /// GELU's tanh approximation, `0.5 x (1 + tanh(√(2/π) (x + 0.044715 x³)))`
    /// (GPT-2's `gelu_new`, Gemma's `gelu_pytorch_tanh`).
    GeluTanh,
    /// ReLU, `max(x, 0)`, NaN kept.
    Relu,
    /// Soft-capping, `cap · tanh(x / cap)` (Gemma 2's final logits); the
    /// cap is positive.
    SoftCap(f32),
}

impl Activation {
    fn name(self) -> &'static str {
        match self {
            Activation::Silu => "silu",
            Activation::Gelu => "gelu",
            Activation::GeluTanh => "gelu_tanh",
            Activation::Relu => "relu",
            Activation::SoftCap(_) => "softcap",
        }
    }

    /// The kernel's op code (kernels.cu, `unary`).
    fn code(self) -> u32 {
        match self {
            Activation::Silu => 0,
            Activation::Gelu => 1,
            Activation::GeluTanh => 2,
            Activation::Relu => 3,
            Activation::SoftCap(_) => 4,
        }
    }

    /// The kernel's argument: the cap, else unused.
    fn arg(self) -> f32 {
        match self {
            Activation::SoftCap(cap) => cap,
            _ => 0.0,
        }
    }
}

/// How [`Gpu::attention_with`] forms scores: `q · k · scale`, soft-capped
/// when there is a cap, plus the bias when there is one.
#[derive(Clone, Copy, Debug)]
pub struct AttentionScores<'a> {
    /// Factor on `q · k`.
    pub scale: f32,
    /// Gemma 2's soft-capping, `cap · tanh(score / cap)` (positive).
    pub softcap: Option<f32>,
    /// F32 `[heads, keys + queries - 1]`: per head, one value per relative
    /// position `key - query` (entry `key - query + keys - 1`), as T5's
    /// relative position bias.
    pub bias: Option<&'a DeviceBuffer>,
}

/// Most keys one query may see: the fused attention kernel keeps a query's
/// scores in shared memory, within the 48 KiB a block gets by default.
pub const MAX_ATTENTION_KEYS: usize = 12_000;

/// Bytes of the workspace each GPU's cuBLAS handle is given when it is
/// created (`cublasSetWorkspace`), for the life of the process: NVIDIA's
/// recommended size for Hopper and newer, and more than the 4 MiB it
/// recommends for older GPUs, so one size serves all. The planner charges
/// it as the ledger's `gemm_workspace` on every GPU with a budget.
pub const GEMM_WORKSPACE_BYTES: usize = 32 << 20;

/// Threads per block of the elementwise, row and attention kernels.
const THREADS: u32 = 256;
const ATTENTION_THREADS: u32 = 128;

/// A kernel argument before it is turned into a device address.
#[derive(Clone, Copy)]
enum Arg<'a> {
    /// `count` elements of `ty` in a buffer from byte `offset`: every
    /// element the kernel may touch there, checked before anything is
    /// enqueued ([`check_args`]).
    Buf {
        buffer: &'a DeviceBuffer,
        offset: usize,
        ty: DType,
        count: usize,
    },
    /// A null pointer (an absent optional operand).
    Null,
    U32(u32),
    U64(u64),
    F32(f32),
}

/// A kernel argument as the kernel receives it.
#[derive(Clone, Copy, Debug)]
#[allow(
    dead_code,
    reason = "read by the CUDA backend; without it every launch is refused"
)]
pub(crate) enum RawArg {
    /// A device pointer (0 for a null pointer).
    Ptr(u64),
    /// `u32`.
    U32(u32),
    /// `u64`.
    U64(u64),
    /// `float`.
    F32(f32),
}

/// Grid, block and dynamic shared memory of a launch.
#[derive(Clone, Copy, Debug)]
#[allow(
    dead_code,
    reason = "read by the CUDA backend; without it every launch is refused"
)]
pub(crate) struct LaunchShape {
    pub grid: (u32, u32, u32),
    pub block: u32,
    pub shared_bytes: u32,
}

fn bad(operation: &'static str, message: String) -> Error {
    Error::BadComputeArgs { operation, message }
}

/// The kernel-name suffix of element type `ty`; only F32, F16 and BF16
/// have kernels.
fn suffix(operation: &'static str, ty: DType) -> Result<&'static str> {
    match ty {
        DType::F32 => Ok("f32"),
        DType::F16 => Ok("f16"),
        DType::BF16 => Ok("bf16"),
        other => Err(bad(
            operation,
            format!("{other} has no kernels (only F32, F16 and BF16 compute)"),
        )),
    }
}

/// `count` elements of `ty` from the start of `buffer`.
fn buf(buffer: &DeviceBuffer, ty: DType, count: usize) -> Arg<'_> {
    Arg::Buf {
        buffer,
        offset: 0,
        ty,
        count,
    }
}

/// `count` elements of `ty` of `buffer` from element `start`.
fn buf_from(buffer: &DeviceBuffer, start: usize, ty: DType, count: usize) -> Arg<'_> {
    Arg::Buf {
        buffer,
        offset: start.saturating_mul(ty.size_in_bytes()),
        ty,
        count,
    }
}

/// [`buf`] for an optional operand: a null pointer when absent.
fn opt_buf(buffer: Option<&DeviceBuffer>, ty: DType, count: usize) -> Arg<'_> {
    buffer.map_or(Arg::Null, |b| buf(b, ty, count))
}

/// The one argument check of every kernel launch: each buffer argument
/// holds the elements it declares, aligned for their type, and lives on
/// `gpu`.
fn check_args(gpu: &Gpu, operation: &'static str, args: &[Arg<'_>]) -> Result<()> {
    for arg in args {
        if let Arg::Buf {
            buffer,
            offset,
            ty,
            count,
        } = *arg
        {
            let size = ty.size_in_bytes();
            if offset % size != 0 {
                return Err(bad(
                    operation,
                    format!("a {ty} operand at byte offset {offset} is not aligned"),
                ));
            }
            let len = count.saturating_mul(size);
            crate::buffer::check_range(operation, offset, len, buffer.len())?;
            gpu.check_owned(operation, buffer)?;
        }
    }
    Ok(())
}

fn product(operation: &'static str, dims: &[usize]) -> Result<usize> {
    dims.iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| bad(operation, format!("sizes {dims:?} overflow")))
}

fn to_u32(operation: &'static str, what: &str, v: usize) -> Result<u32> {
    u32::try_from(v).map_err(|_| bad(operation, format!("{what} {v} exceeds 2^32 - 1")))
}

/// Blocks for a grid-stride loop over `n` elements.
fn grid_for(n: usize) -> (u32, u32, u32) {
    let blocks = n.div_ceil(THREADS as usize).clamp(1, 1 << 20);
    (blocks as u32, 1, 1)
}

impl Gpu {
    /// What this GPU's compute kernels were loaded from, once the first
    /// kernel ran; `None` before that and on emulated GPUs.
    pub fn kernel_module(&self) -> Option<KernelModuleInfo> {
        match &self.inner.backend {
            Backend::Emulated => None,
            Backend::Cuda(g) => g.kernel_info(),
        }
    }

    fn check_owned(&self, operation: &'static str, buffer: &DeviceBuffer) -> Result<()> {
        if buffer.gpu().id() == self.id() {
            Ok(())
        } else {
            Err(Error::WrongDevice {
                operation,
                expected: self.device(),
                found: buffer.device(),
            })
        }
    }

    /// Enqueues kernel `name` on the compute stream after every buffer's
    /// last use, and records the launch as their new last use.
    fn launch(
        &self,
        operation: &'static str,
        name: String,
        grid: (u32, u32, u32),
        block: u32,
        shared_bytes: u32,
        args: &[Arg<'_>],
    ) -> Result<()> {
        check_args(self, operation, args)?;
        let buffers = || {
            args.iter().filter_map(|a| match a {
                Arg::Buf { buffer, .. } => Some(*buffer),
                _ => None,
            })
        };
        match &self.inner.backend {
            Backend::Emulated => Err(Error::ComputeUnsupported {
                device: self.device(),
            }),
            Backend::Cuda(g) => {
                let stream = self.compute_stream();
                for b in buffers() {
                    b.order_before(stream)?;
                }
                let ptr = |b: &DeviceBuffer, offset: usize| {
                    RawArg::Ptr(b.cuda_ptr().unwrap_or(0) + offset as u64)
                };
                let raw: Vec<RawArg> = args
                    .iter()
                    .map(|a| match a {
                        Arg::Buf { buffer, offset, .. } => ptr(buffer, *offset),
                        Arg::Null => RawArg::Ptr(0),
                        Arg::U32(v) => RawArg::U32(*v),
                        Arg::U64(v) => RawArg::U64(*v),
                        Arg::F32(v) => RawArg::F32(*v),
                    })
                    .collect();
                let shape = LaunchShape {
                    grid,
                    block,
                    shared_bytes,
                };
                // SAFETY: `check_args` checked every buffer argument against
                // the elements its kernel touches, and every operation below
                // passes the arguments in the kernel's order and types
                // (kernels.cu).
                unsafe { g.launch(crate::buffer::stream_cuda(stream)?, &name, shape, &raw)? };
                let done = stream.record()?;
                for b in buffers() {
                    b.note_use(stream, &done);
                }
                Ok(())
            }
        }
    }

    /// Enqueues a copy of `src` into `dst` at byte `offset` on the compute
    /// stream, so the kernels enqueued after it see the bytes. `src` may be
    /// pageable: it has been read when this returns. Emulated GPUs copy
    /// at once.
    pub fn write_for_compute(
        &self,
        dst: &mut DeviceBuffer,
        offset: usize,
        src: &[u8],
    ) -> Result<()> {
        const OP: &str = "write for compute";
        self.check_owned(OP, dst)?;
        crate::buffer::check_range(OP, offset, src.len(), dst.len())?;
        match &self.inner.backend {
            Backend::Emulated => dst.copy_from_host(offset, src),
            Backend::Cuda(g) => {
                if src.is_empty() {
                    return Ok(());
                }
                let stream = self.compute_stream();
                dst.order_before(stream)?;
                let ptr = dst.cuda_ptr().unwrap_or(0) + offset as u64;
                // SAFETY: the range was checked against the allocation; a
                // pageable source is consumed before the call returns.
                unsafe {
                    g.htod_async(
                        ptr,
                        src.as_ptr(),
                        src.len(),
                        crate::buffer::stream_cuda(stream)?,
                    )?
                };
                dst.note_use(stream, &stream.record()?);
                Ok(())
            }
        }
    }

    /// `c = a · bᵀ` per [`GemmShape`] (row-major), through cuBLAS with f32
    /// accumulation. `a` and `b` hold `input` elements; `c` holds `output`
    /// elements, which must be `input` or F32.
    pub fn gemm(
        &self,
        a: &DeviceBuffer,
        b: &DeviceBuffer,
        c: &mut DeviceBuffer,
        input: DType,
        output: DType,
        shape: GemmShape,
    ) -> Result<()> {
        const OP: &str = "gemm";
        if output != input && output != DType::F32 {
            return Err(bad(
                OP,
                format!(
                    "a {input:?} product cannot be written as {output:?} (only as {input:?} or F32)"
                ),
            ));
        }
        suffix(OP, input)?;
        let GemmShape { m, n, k, batch, .. } = shape;
        if m == 0 || n == 0 || k == 0 || batch == 0 {
            return Err(bad(OP, format!("empty product {shape:?}")));
        }
        // The last matrix of each operand must fit: (batch - 1) strides past
        // the first, plus one matrix.
        let span = |stride: usize, rows: usize, cols: usize| -> Result<usize> {
            let last = product(OP, &[batch - 1, stride])?;
            last.checked_add(product(OP, &[rows, cols])?)
                .ok_or_else(|| bad(OP, format!("sizes of {shape:?} overflow")))
        };
        check_args(
            self,
            OP,
            &[
                buf(a, input, span(shape.stride_a, m, k)?),
                buf(b, input, span(shape.stride_b, n, k)?),
                buf(c, output, span(shape.stride_c, m, n)?),
            ],
        )?;
        match &self.inner.backend {
            Backend::Emulated => Err(Error::ComputeUnsupported {
                device: self.device(),
            }),
            Backend::Cuda(g) => {
                let stream = self.compute_stream();
                let crate::stream::StreamImpl::Cuda { stream: cuda, .. } = &stream.imp else {
                    return Err(Error::ComputeUnsupported {
                        device: self.device(),
                    });
                };
                for buffer in [a, b, &*c] {
                    buffer.order_before(stream)?;
                }
                let ptrs = (
                    a.cuda_ptr().unwrap_or(0),
                    b.cuda_ptr().unwrap_or(0),
                    c.cuda_ptr().unwrap_or(0),
                );
                // SAFETY: all three buffers were checked to hold every
                // matrix of the batch in their types.
                unsafe { g.gemm(cuda, &shape, input, output, ptrs)? };
                let done = stream.record()?;
                for buffer in [a, b, &*c] {
                    buffer.note_use(stream, &done);
                }
                Ok(())
            }
        }
    }

    /// Converts `count` elements of `src` (from its start) into `dst` from
    /// element `dst_start`, rounding to nearest even.
    pub fn cast(
        &self,
        src: &DeviceBuffer,
        src_type: DType,
        dst: &mut DeviceBuffer,
        dst_type: DType,
        count: usize,
        dst_start: usize,
    ) -> Result<()> {
        const OP: &str = "cast";
        let name = format!(
            "bm_cast_{}_{}",
            suffix(OP, src_type)?,
            suffix(OP, dst_type)?
        );
        self.launch(
            OP,
            name,
            grid_for(count),
            THREADS,
            0,
            &[
                buf(src, src_type, count),
                buf_from(dst, dst_start, dst_type, count),
                Arg::U64(count as u64),
            ],
        )
    }

    /// Like [`Gpu::cast`], but bit for bit what `bm_tensor::cast` does on
    /// the host (PyTorch's CPU `Tensor.to`), NaN payloads included, so a
    /// checkpoint cast on the GPU while loading equals one cast on the
    /// host. [`Gpu::cast`] follows the `half` crate instead, as the CPU
    /// kernels the compute ops are tested against do; the two differ only
    /// in NaN bits. `src_type` and `dst_type` must differ.
    pub fn cast_exact(
        &self,
        src: &DeviceBuffer,
        src_type: DType,
        dst: &mut DeviceBuffer,
        dst_type: DType,
        count: usize,
        dst_start: usize,
    ) -> Result<()> {
        const OP: &str = "exact cast";
        if src_type == dst_type {
            return Err(bad(
                OP,
                format!("{src_type} to itself is a copy, not a cast"),
            ));
        }
        let name = format!(
            "bm_exact_cast_{}_{}",
            suffix(OP, src_type)?,
            suffix(OP, dst_type)?
        );
        self.launch(
            OP,
            name,
            grid_for(count),
            THREADS,
            0,
            &[
                buf(src, src_type, count),
                buf_from(dst, dst_start, dst_type, count),
                Arg::U64(count as u64),
            ],
        )
    }

    fn binary(
        &self,
        op: &'static str,
        a: &DeviceBuffer,
        b: &DeviceBuffer,
        out: &mut DeviceBuffer,
        ty: DType,
        count: usize,
    ) -> Result<()> {
        self.launch(
            op,
            format!("bm_{op}_{}", suffix(op, ty)?),
            grid_for(count),
            THREADS,
            0,
            &[
                buf(a, ty, count),
                buf(b, ty, count),
                buf(out, ty, count),
                Arg::U64(count as u64),
            ],
        )
    }

    /// `out = a + b` elementwise over `count` elements.
    pub fn add(
        &self,
        a: &DeviceBuffer,
        b: &DeviceBuffer,
        out: &mut DeviceBuffer,
        ty: DType,
        count: usize,
    ) -> Result<()> {
        self.binary("add", a, b, out, ty, count)
    }

    /// `out = a * b` elementwise over `count` elements.
    pub fn mul(
        &self,
        a: &DeviceBuffer,
        b: &DeviceBuffer,
        out: &mut DeviceBuffer,
        ty: DType,
        count: usize,
    ) -> Result<()> {
        self.binary("mul", a, b, out, ty, count)
    }

    /// `out = f(x)` elementwise over `count` elements, `f` the activation
    /// `op` names (one kernel, `bm_unary`, for them all).
    pub fn unary(
        &self,
        op: Activation,
        x: &DeviceBuffer,
        out: &mut DeviceBuffer,
        ty: DType,
        count: usize,
    ) -> Result<()> {
        let name = op.name();
        if let Activation::SoftCap(cap) = op
            && !(cap > 0.0 && cap.is_finite())
        {
            return Err(bad(name, format!("a cap of {cap}: it must be positive")));
        }
        self.launch(
            name,
            format!("bm_unary_{}", suffix(name, ty)?),
            grid_for(count),
            THREADS,
            0,
            &[
                buf(x, ty, count),
                buf(out, ty, count),
                Arg::U64(count as u64),
                Arg::U32(op.code()),
                Arg::F32(op.arg()),
            ],
        )
    }

    /// SiLU, `x · sigmoid(x)`, elementwise.
    pub fn silu(
        &self,
        x: &DeviceBuffer,
        out: &mut DeviceBuffer,
        ty: DType,
        count: usize,
    ) -> Result<()> {
        self.unary(Activation::Silu, x, out, ty, count)
    }

    /// Exact GELU, `0.5 x (1 + erf(x / √2))`, elementwise.
    pub fn gelu(
        &self,
        x: &DeviceBuffer,
        out: &mut DeviceBuffer,
        ty: DType,
        count: usize,
    ) -> Result<()> {
        self.unary(Activation::Gelu, x, out, ty, count)
    }

    /// The end of a linear layer: `out[r, c] = acc[r, c] + bias[c]` where
    /// `acc` is the F32 product (`rows × cols`) and `bias`, if any, holds
    /// `cols` elements of `ty`; the sum is rounded once to `ty`.
    pub fn bias_epilogue(
        &self,
        acc: &DeviceBuffer,
        bias: Option<&DeviceBuffer>,
        out: &mut DeviceBuffer,
        ty: DType,
        rows: usize,
        cols: usize,
    ) -> Result<()> {
        const OP: &str = "linear bias";
        let count = product(OP, &[rows, cols])?;
        self.launch(
            OP,
            format!("bm_bias_epilogue_{}", suffix(OP, ty)?),
            grid_for(count),
            THREADS,
            0,
            &[
                buf(acc, DType::F32, count),
                opt_buf(bias, ty, cols),
                buf(out, ty, count),
                Arg::U64(rows as u64),
                Arg::U64(cols as u64),
            ],
        )
    }

    /// Rows of `table` (`vocab × hidden`, `table_type`) picked by `ids`,
    /// written to `out` (`ids.len() × hidden`, `out_type`). Ids are checked
    /// against `vocab` on the host.
    #[allow(clippy::too_many_arguments)]
    pub fn embedding(
        &self,
        table: &DeviceBuffer,
        table_type: DType,
        vocab: usize,
        hidden: usize,
        ids: &[u32],
        out: &mut DeviceBuffer,
        out_type: DType,
    ) -> Result<()> {
        const OP: &str = "embedding";
        if let Some(&id) = ids.iter().find(|&&id| id as usize >= vocab) {
            return Err(bad(
                OP,
                format!("token id {id} is out of the vocabulary (size {vocab})"),
            ));
        }
        if ids.is_empty() || hidden == 0 {
            return Err(bad(OP, "no ids or an empty hidden size".into()));
        }
        let table = buf(table, table_type, product(OP, &[vocab, hidden])?);
        let count = product(OP, &[ids.len(), hidden])?;
        // Checked before the ids are staged.
        check_args(self, OP, &[table, buf(out, out_type, count)])?;
        if matches!(self.inner.backend, Backend::Emulated) {
            return Err(Error::ComputeUnsupported {
                device: self.device(),
            });
        }
        let id_bytes: Vec<u8> = ids.iter().flat_map(|id| id.to_le_bytes()).collect();
        let mut staged = self.alloc(id_bytes.len())?;
        self.write_for_compute(&mut staged, 0, &id_bytes)?;
        self.launch(
            OP,
            format!(
                "bm_embedding_{}_{}",
                suffix(OP, table_type)?,
                suffix(OP, out_type)?
            ),
            grid_for(count),
            THREADS,
            0,
            &[
                table,
                // u32 ids: I32 is their size.
                buf(&staged, DType::I32, ids.len()),
                buf(out, out_type, count),
                Arg::U64(ids.len() as u64),
                Arg::U64(hidden as u64),
            ],
        )
    }

    fn check_rows(op: &'static str, rows: usize, cols: usize) -> Result<u32> {
        if rows == 0 || cols == 0 {
            return Err(bad(op, format!("empty input of {rows} × {cols}")));
        }
        to_u32(op, "row count", rows)
    }

    /// Llama's RMSNorm of `rows` rows of `cols`: `w · round(x / rms(x))`,
    /// with the normalised value rounded to `ty` before the weight
    /// multiplies it (as transformers does).
    #[allow(clippy::too_many_arguments)]
    pub fn rms_norm(
        &self,
        x: &DeviceBuffer,
        weight: &DeviceBuffer,
        out: &mut DeviceBuffer,
        ty: DType,
        rows: usize,
        cols: usize,
        eps: f32,
    ) -> Result<()> {
        const OP: &str = "rms_norm";
        let grid_rows = Self::check_rows(OP, rows, cols)?;
        let count = product(OP, &[rows, cols])?;
        self.launch(
            OP,
            format!("bm_rms_norm_{}", suffix(OP, ty)?),
            (grid_rows, 1, 1),
            THREADS,
            0,
            &[
                buf(x, ty, count),
                buf(weight, ty, cols),
                buf(out, ty, count),
                Arg::U64(cols as u64),
                Arg::F32(eps),
            ],
        )
    }

    /// LayerNorm (biased variance) of `rows` rows of `cols`, with weight and bias.
    #[allow(clippy::too_many_arguments)]
    pub fn layer_norm(
        &self,
        x: &DeviceBuffer,
        weight: &DeviceBuffer,
        bias: &DeviceBuffer,
        out: &mut DeviceBuffer,
        ty: DType,
        rows: usize,
        cols: usize,
        eps: f32,
    ) -> Result<()> {
        const OP: &str = "layer_norm";
        let grid_rows = Self::check_rows(OP, rows, cols)?;
        let count = product(OP, &[rows, cols])?;
        self.launch(
            OP,
            format!("bm_layer_norm_{}", suffix(OP, ty)?),
            (grid_rows, 1, 1),
            THREADS,
            0,
            &[
                buf(x, ty, count),
                buf(weight, ty, cols),
                buf(bias, ty, cols),
                buf(out, ty, count),
                Arg::U64(cols as u64),
                Arg::F32(eps),
            ],
        )
    }

    /// Softmax over each of `rows` rows of `cols`, computed in f32.
    pub fn softmax(
        &self,
        x: &DeviceBuffer,
        out: &mut DeviceBuffer,
        ty: DType,
        rows: usize,
        cols: usize,
    ) -> Result<()> {
        const OP: &str = "softmax";
        let grid_rows = Self::check_rows(OP, rows, cols)?;
        let count = product(OP, &[rows, cols])?;
        self.launch(
            OP,
            format!("bm_softmax_{}", suffix(OP, ty)?),
            (grid_rows, 1, 1),
            THREADS,
            0,
            &[
                buf(x, ty, count),
                buf(out, ty, count),
                Arg::U64(cols as u64),
            ],
        )
    }

    /// Llama's rotary embedding (`rotate_half`, unscaled frequencies
    /// `1 / theta^(2i / head_dim)`) of `rows` rows of `width` (whole heads
    /// of `head_dim`), row r at position `start_pos + r`. cos and sin are
    /// rounded to `ty` before use, as transformers does.
    #[allow(clippy::too_many_arguments)]
    pub fn rotary(
        &self,
        x: &DeviceBuffer,
        out: &mut DeviceBuffer,
        ty: DType,
        rows: usize,
        width: usize,
        head_dim: usize,
        start_pos: usize,
        theta: f32,
    ) -> Result<()> {
        const OP: &str = "rotary";
        if head_dim == 0
            || !head_dim.is_multiple_of(2)
            || width == 0
            || !width.is_multiple_of(head_dim)
        {
            return Err(bad(
                OP,
                format!("width {width} is not a whole number of heads of even size {head_dim}"),
            ));
        }
        let count = product(OP, &[rows, width])?;
        self.launch(
            OP,
            format!("bm_rotary_{}", suffix(OP, ty)?),
            grid_for(count / 2),
            THREADS,
            0,
            &[
                buf(x, ty, count),
                buf(out, ty, count),
                Arg::U64(rows as u64),
                Arg::U64(width as u64),
                Arg::U64(head_dim as u64),
                Arg::U64(start_pos as u64),
                Arg::F32(theta),
            ],
        )
    }

    /// Rotary embedding (`rotate_half`) of `rows` rows of `width` (whole
    /// heads of `head_dim`) from F32 tables `cos` and `sin` (`rows ×
    /// rotary_dim / 2`, as the host computed them: any frequencies and
    /// positions): pair i of each head of row r turns by `cos[r, i]`,
    /// `sin[r, i]`; dimensions from `rotary_dim` on are copied.
    #[allow(clippy::too_many_arguments)]
    pub fn rotary_table(
        &self,
        x: &DeviceBuffer,
        (cos, sin): (&DeviceBuffer, &DeviceBuffer),
        out: &mut DeviceBuffer,
        ty: DType,
        rows: usize,
        width: usize,
        (head_dim, rotary_dim): (usize, usize),
    ) -> Result<()> {
        const OP: &str = "rotary";
        if head_dim == 0 || width == 0 || !width.is_multiple_of(head_dim) {
            return Err(bad(
                OP,
                format!("width {width} is not a whole number of heads of size {head_dim}"),
            ));
        }
        if rotary_dim == 0 || rotary_dim % 2 != 0 || rotary_dim > head_dim {
            return Err(bad(
                OP,
                format!("{rotary_dim} rotated dimensions of heads of {head_dim}"),
            ));
        }
        let count = product(OP, &[rows, width])?;
        let table = product(OP, &[rows, rotary_dim / 2])?;
        self.launch(
            OP,
            format!("bm_rotary_table_{}", suffix(OP, ty)?),
            grid_for(count),
            THREADS,
            0,
            &[
                buf(x, ty, count),
                buf(cos, DType::F32, table),
                buf(sin, DType::F32, table),
                buf(out, ty, count),
                Arg::U64(rows as u64),
                Arg::U64(width as u64),
                Arg::U64(head_dim as u64),
                Arg::U64(rotary_dim as u64),
            ],
        )
    }

    /// Scaled dot-product attention (scale `1/√head_dim`, softmax in f32)
    /// of `q` (`queries × heads·head_dim`, `ty`) against F32 `keys` and
    /// `values` (`keys × kv_heads·head_dim`); query head h reads key/value
    /// head `h / (heads / kv_heads)`. Writes `out` like `q`.
    pub fn attention(
        &self,
        q: &DeviceBuffer,
        keys: &DeviceBuffer,
        values: &DeviceBuffer,
        out: &mut DeviceBuffer,
        ty: DType,
        shape: AttentionShape,
    ) -> Result<()> {
        let scores = AttentionScores {
            scale: 1.0 / (shape.head_dim as f32).sqrt(),
            softcap: None,
            bias: None,
        };
        self.attention_with(q, keys, values, out, ty, shape, scores)
    }

    /// [`Gpu::attention`] with the scores formed as `scores` says: another
    /// scale, soft-capping (Gemma 2), and a position bias (T5). Under a bidirectional mask without
    /// a bias there may be more queries than keys (T5's cross-attention).
    #[allow(clippy::too_many_arguments)]
    pub fn attention_with(
        &self,
        q: &DeviceBuffer,
        keys: &DeviceBuffer,
        values: &DeviceBuffer,
        out: &mut DeviceBuffer,
        ty: DType,
        shape: AttentionShape,
        scores: AttentionScores<'_>,
    ) -> Result<()> {
        const OP: &str = "attention";
        let AttentionShape {
            queries,
            keys: t,
            heads,
            kv_heads,
            head_dim,
            mask,
        } = shape;
        if queries == 0
            || t == 0
            || heads == 0
            || head_dim == 0
            || kv_heads == 0
            || heads % kv_heads != 0
        {
            return Err(bad(OP, format!("unusable geometry {shape:?}")));
        }
        // Masks and the bias place the queries at the last positions.
        let positional = mask != AttentionMask::Bidirectional || scores.bias.is_some();
        if positional && queries > t {
            return Err(bad(
                OP,
                format!("{queries} queries but only {t} cached positions"),
            ));
        }
        if let Some(cap) = scores.softcap
            && !(cap > 0.0 && cap.is_finite())
        {
            return Err(bad(OP, format!("a soft-cap of {cap}: it must be positive")));
        }
        let (mask_kind, window) = match mask {
            AttentionMask::Bidirectional => (0u32, 0usize),
            AttentionMask::Causal => (1, 0),
            AttentionMask::SlidingWindow(0) => {
                return Err(bad(OP, "a sliding window of 0 positions".into()));
            }
            AttentionMask::SlidingWindow(w) => (2, w),
        };
        let visible = if mask_kind == 2 { t.min(window) } else { t };
        if visible > MAX_ATTENTION_KEYS {
            return Err(bad(
                OP,
                format!("{visible} visible positions exceed the kernel's {MAX_ATTENTION_KEYS}"),
            ));
        }
        let q_count = product(OP, &[queries, heads, head_dim])?;
        let kv_count = product(OP, &[t, kv_heads, head_dim])?;
        // The bias covers every relative position key - query.
        let bias_count = match scores.bias {
            Some(_) => product(OP, &[heads, t + queries - 1])?,
            None => 0,
        };
        let u = |what, v| to_u32(OP, what, v);
        self.launch(
            OP,
            format!("bm_attention_{}", suffix(OP, ty)?),
            (u("query count", queries)?, u("head count", heads)?, 1),
            ATTENTION_THREADS,
            (visible * 4) as u32,
            &[
                buf(q, ty, q_count),
                buf(keys, DType::F32, kv_count),
                buf(values, DType::F32, kv_count),
                opt_buf(scores.bias, DType::F32, bias_count),
                buf(out, ty, q_count),
                Arg::U32(u("query count", queries)?),
                Arg::U32(u("key count", t)?),
                Arg::U32(u("head count", heads)?),
                Arg::U32(u("key/value head count", kv_heads)?),
                Arg::U32(u("head size", head_dim)?),
                Arg::U32(mask_kind),
                Arg::U32(u("window", window)?),
                Arg::F32(scores.scale),
                Arg::F32(scores.softcap.unwrap_or(0.0)),
            ],
        )
    }
}

/// The values a nested (double-quantized) absmax scale covers, as in
/// bitsandbytes.
const NESTED_BLOCK: usize = 256;

/// Threads per block of the quantized linear kernels (one output a block).
const QUANT_THREADS: u32 = 128;

/// Most rows of a quantized linear kernel's grid (CUDA's limit on a grid's
/// second dimension).
pub const MAX_QUANTIZED_ROWS: usize = 65_535;

/// Part of a device buffer from a byte offset: one of the parts a buffer
/// holds together (a quantized weight's packed form).
#[derive(Clone, Copy, Debug)]
pub struct DeviceSlice<'a> {
    /// The buffer.
    pub buffer: &'a DeviceBuffer,
    /// Where the part starts, in bytes.
    pub offset: usize,
}

impl<'a> From<&'a DeviceBuffer> for DeviceSlice<'a> {
    fn from(buffer: &'a DeviceBuffer) -> Self {
        DeviceSlice { buffer, offset: 0 }
    }
}

impl<'a> DeviceSlice<'a> {
    /// The kernel argument: `count` elements of `ty` from the offset.
    fn arg(self, ty: DType, count: usize) -> Arg<'a> {
        Arg::Buf {
            buffer: self.buffer,
            offset: self.offset,
            ty,
            count,
        }
    }
}

/// A 4-bit (NF4/FP4) weight's parts on a GPU, as bitsandbytes stores them.
#[derive(Clone, Copy, Debug)]
pub struct FourBitParts<'a> {
    /// Two codes a byte over the flattened weight, the first in the high
    /// nibble: `ceil(n / 2)` bytes.
    pub codes: DeviceSlice<'a>,
    /// One f32 scale per block: `ceil(n / blocksize)`.
    pub absmax: DeviceSlice<'a>,
    /// The code table: the value of each 4-bit code.
    pub table: [f32; 16],
    /// Values per scale.
    pub blocksize: usize,
}

impl<'a> FourBitParts<'a> {
    /// The codes and scales of `n` values as kernel arguments.
    fn args(&self, operation: &'static str, n: usize) -> Result<[Arg<'a>; 2]> {
        if self.blocksize == 0 {
            return Err(bad(operation, "block size 0".into()));
        }
        Ok([
            self.codes.arg(DType::U8, n.div_ceil(2)),
            self.absmax.arg(DType::F32, n.div_ceil(self.blocksize)),
        ])
    }
}

/// An LLM.int8() weight's parts on a GPU and how its matmul runs.
#[derive(Clone, Copy, Debug)]
pub struct Int8Parts<'a> {
    /// `[out, in]` int8 values.
    pub codes: DeviceSlice<'a>,
    /// One f32 absmax per output row (`SCB`).
    pub scb: DeviceSlice<'a>,
    /// The outlier threshold as float16 rounds it; `None` quantizes every
    /// activation column.
    pub threshold: Option<f32>,
    /// What a weight value times its `SCB` is multiplied by (1/127 as
    /// bitsandbytes rounds it).
    pub inv_127: f32,
    /// What the integer product times `row_absmax * SCB` is multiplied by
    /// (1/127² as bitsandbytes writes it).
    pub inv_127_squared: f32,
}

/// Sizes of a linear layer: `m` input rows of `k`, `n` outputs.
fn linear_dims(operation: &'static str, (m, k, n): (usize, usize, usize)) -> Result<(u32, u32)> {
    if m == 0 || k == 0 || n == 0 {
        return Err(bad(
            operation,
            format!("empty linear layer: {m} rows, {k} → {n}"),
        ));
    }
    if m > MAX_QUANTIZED_ROWS {
        return Err(bad(
            operation,
            format!("{m} rows exceed the {MAX_QUANTIZED_ROWS} one launch takes"),
        ));
    }
    product(operation, &[m, k])?;
    product(operation, &[n, k])?;
    Ok((to_u32(operation, "output count", n)?, m as u32))
}

/// bitsandbytes' dequantization and quantized linear layers, the GPU side
/// of bm-compute's `quant` (whose CPU code is the reference: a dequantized
/// value is one f32 multiply, never fused, so dequantization is the CPU's
/// bit for bit; sums may be taken in another order).
impl Gpu {
    /// 4-bit NF4/FP4: `out[i] = table[nibble i] · absmax[i / blocksize]`
    /// for `n` values, written to `out` as `out_type`.
    pub fn dequantize_4bit(
        &self,
        w: FourBitParts<'_>,
        out: &mut DeviceBuffer,
        out_type: DType,
        n: usize,
    ) -> Result<()> {
        const OP: &str = "dequantize 4-bit";
        let mut args = w.args(OP, n)?.to_vec();
        args.extend([
            buf(out, out_type, n),
            Arg::U64(n as u64),
            Arg::U64(w.blocksize as u64),
        ]);
        // The code table travels as 16 float arguments.
        args.extend(w.table.iter().map(|&v| Arg::F32(v)));
        self.launch(
            OP,
            format!("bm_dequant_4bit_{}", suffix(OP, out_type)?),
            grid_for(n),
            THREADS,
            0,
            &args,
        )
    }

    /// Double quantization's block scales: `absmax[b] = map[codes[b]] ·
    /// nested[b / 256] + offset` for `blocks` blocks (`codes`: one byte a
    /// block; `nested`: one f32 per 256 blocks; `map`: 256 f32; `offset`:
    /// one f32).
    pub fn dequantize_nested_absmax(
        &self,
        codes: DeviceSlice<'_>,
        nested: DeviceSlice<'_>,
        map: DeviceSlice<'_>,
        offset: DeviceSlice<'_>,
        absmax: &mut DeviceBuffer,
        blocks: usize,
    ) -> Result<()> {
        const OP: &str = "dequantize nested absmax";
        self.launch(
            OP,
            "bm_dequant_nested_absmax".into(),
            grid_for(blocks),
            THREADS,
            0,
            &[
                codes.arg(DType::U8, blocks),
                nested.arg(DType::F32, blocks.div_ceil(NESTED_BLOCK)),
                map.arg(DType::F32, 256),
                offset.arg(DType::F32, 1),
                buf(absmax, DType::F32, blocks),
                Arg::U64(blocks as u64),
            ],
        )
    }

    /// LLM.int8() weights: `out[r, c] = codes[r, c] · scb[r] · scale` over
    /// a `rows × cols` int8 matrix with one f32 `scb` per row, written to
    /// `out` as `out_type`.
    #[allow(clippy::too_many_arguments)]
    pub fn dequantize_int8(
        &self,
        codes: DeviceSlice<'_>,
        scb: DeviceSlice<'_>,
        scale: f32,
        out: &mut DeviceBuffer,
        out_type: DType,
        rows: usize,
        cols: usize,
    ) -> Result<()> {
        const OP: &str = "dequantize int8";
        let n = product(OP, &[rows, cols])?;
        self.launch(
            OP,
            format!("bm_dequant_int8_{}", suffix(OP, out_type)?),
            grid_for(n),
            THREADS,
            0,
            &[
                codes.arg(DType::I8, n),
                scb.arg(DType::F32, rows),
                buf(out, out_type, n),
                Arg::U64(rows as u64),
                Arg::U64(cols as u64),
                Arg::F32(scale),
            ],
        )
    }

    /// `out = x · Wᵀ + bias` for a 4-bit weight `W` (`[n, k]`, read packed:
    /// nothing is dequantized to memory) and `m` rows of `x` (`[m, k]`),
    /// one output a block, as `Linear4bit` computes: `x`, each weight value
    /// and the bias rounded to `compute`, the sum taken in f32 and rounded
    /// to `compute`, stored as `x_type` (`out`: `[m, n]`; `bias`: `n`
    /// values of `x_type`). Meant for a few rows (decode); for many,
    /// dequantize into a temporary and use [`Gpu::gemm`] and
    /// [`Gpu::linear_epilogue`].
    #[allow(clippy::too_many_arguments)]
    pub fn linear_4bit(
        &self,
        x: &DeviceBuffer,
        w: FourBitParts<'_>,
        bias: Option<&DeviceBuffer>,
        out: &mut DeviceBuffer,
        x_type: DType,
        compute: DType,
        (m, k, n): (usize, usize, usize),
    ) -> Result<()> {
        const OP: &str = "linear 4-bit";
        let (blocks, rows) = linear_dims(OP, (m, k, n))?;
        let [codes, absmax] = w.args(OP, n * k)?;
        let mut args = vec![
            buf(x, x_type, m * k),
            codes,
            absmax,
            opt_buf(bias, x_type, n),
            buf(out, x_type, m * n),
            Arg::U64(k as u64),
            Arg::U64(n as u64),
            Arg::U64(w.blocksize as u64),
        ];
        // The code table travels as 16 float arguments.
        args.extend(w.table.iter().map(|&v| Arg::F32(v)));
        self.launch(
            OP,
            format!(
                "bm_linear_4bit_{}_{}",
                suffix(OP, x_type)?,
                suffix(OP, compute)?
            ),
            (blocks, rows, 1),
            QUANT_THREADS,
            0,
            &args,
        )
    }

    /// The end of a quantized linear layer whose product cuBLAS left in
    /// f32 (`acc`, `rows × cols`): `out = round_compute(acc +
    /// round_compute(bias))`, stored as `x_type` (`bias`: `cols` values of
    /// `x_type`).
    #[allow(clippy::too_many_arguments)]
    pub fn linear_epilogue(
        &self,
        acc: &DeviceBuffer,
        bias: Option<&DeviceBuffer>,
        out: &mut DeviceBuffer,
        x_type: DType,
        compute: DType,
        rows: usize,
        cols: usize,
    ) -> Result<()> {
        const OP: &str = "linear epilogue";
        let count = product(OP, &[rows, cols])?;
        self.launch(
            OP,
            format!(
                "bm_linear_epilogue_{}_{}",
                suffix(OP, x_type)?,
                suffix(OP, compute)?
            ),
            grid_for(count),
            THREADS,
            0,
            &[
                buf(acc, DType::F32, count),
                opt_buf(bias, x_type, cols),
                buf(out, x_type, count),
                Arg::U64(rows as u64),
                Arg::U64(cols as u64),
            ],
        )
    }

    /// `out = x · Wᵀ + bias` for an LLM.int8() weight `W` (`[n, k]`, read
    /// packed), as `Linear8bitLt` computes (bm-compute's CPU kernel is the
    /// reference): `x` (`[m, k]`) goes to float16; with a threshold, the
    /// columns holding a value at or above it are outliers, multiplied in
    /// `x_type` against the dequantized weight; the rest is quantized
    /// row-wise to int8, multiplied exactly in integers and scaled by
    /// `row_absmax · SCB / 127²`. Three kernels (outlier columns, row
    /// quantization, the product, one output a block) over stream-ordered
    /// temporaries of `4k + m(k + 4)` bytes.
    #[allow(clippy::too_many_arguments)]
    pub fn linear_int8(
        &self,
        x: &DeviceBuffer,
        w: Int8Parts<'_>,
        bias: Option<&DeviceBuffer>,
        out: &mut DeviceBuffer,
        x_type: DType,
        (m, k, n): (usize, usize, usize),
    ) -> Result<()> {
        const OP: &str = "linear int8";
        let (blocks, rows) = linear_dims(OP, (m, k, n))?;
        let (x_arg, codes, scb) = (
            buf(x, x_type, m * k),
            w.codes.arg(DType::I8, n * k),
            w.scb.arg(DType::F32, n),
        );
        let (bias, out) = (opt_buf(bias, x_type, n), buf(out, x_type, m * n));
        // Checked before the temporaries are allocated.
        check_args(self, OP, &[x_arg, codes, scb, bias, out])?;
        let name = suffix(OP, x_type)?;
        let (outliers, threshold) = match w.threshold {
            Some(t) if t > 0.0 => (1, t),
            _ => (0, 0.0),
        };
        // One u32 flag a column (sized as I32 in the argument checks).
        let flags = self.alloc(4 * k)?;
        let q = self.alloc(m * k)?;
        let row_absmax = self.alloc(4 * m)?;
        if outliers == 1 {
            self.launch(
                OP,
                format!("bm_int8_outliers_{name}"),
                grid_for(k),
                THREADS,
                0,
                &[
                    x_arg,
                    buf(&flags, DType::I32, k),
                    Arg::U64(m as u64),
                    Arg::U64(k as u64),
                    Arg::F32(threshold),
                ],
            )?;
        }
        self.launch(
            OP,
            format!("bm_int8_quantize_rows_{name}"),
            (rows, 1, 1),
            QUANT_THREADS,
            0,
            &[
                x_arg,
                buf(&flags, DType::I32, k),
                buf(&q, DType::I8, m * k),
                buf(&row_absmax, DType::F32, m),
                Arg::U64(k as u64),
                Arg::F32(threshold),
                Arg::U32(outliers),
            ],
        )?;
        self.launch(
            OP,
            format!("bm_int8_linear_{name}"),
            (blocks, rows, 1),
            QUANT_THREADS,
            0,
            &[
                x_arg,
                buf(&q, DType::I8, m * k),
                buf(&row_absmax, DType::F32, m),
                codes,
                scb,
                buf(&flags, DType::I32, k),
                bias,
                out,
                Arg::U64(k as u64),
                Arg::U64(n as u64),
                Arg::U32(outliers),
                Arg::F32(w.inv_127),
                Arg::F32(w.inv_127_squared),
            ],
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::DeviceSet;

    fn emulated() -> DeviceSet {
        DeviceSet::emulated(&[1 << 20, 1 << 20])
    }

    #[test]
    fn emulated_gpus_refuse_compute_after_checking_arguments() {
        let set = emulated();
        let g = set.gpu(0).unwrap();
        let a = g.alloc(64).unwrap();
        let mut out = g.alloc(64).unwrap();
        let err = g.silu(&a, &mut out, DType::F32, 16).unwrap_err();
        assert!(matches!(err, Error::ComputeUnsupported { .. }), "{err}");
        assert!(err.to_string().contains("emulated device 0"), "{err}");
        // 17 f32 do not fit 64 bytes: the size check comes first.
        let err = g.silu(&a, &mut out, DType::F32, 17).unwrap_err();
        assert!(matches!(err, Error::OutOfBounds { .. }), "{err}");
        // 32 bf16 do fit.
        let err = g.add(&a, &a, &mut out, DType::BF16, 32).unwrap_err();
        assert!(matches!(err, Error::ComputeUnsupported { .. }), "{err}");
    }

    #[test]
    fn dequantize_checks_sizes_before_refusing_on_emulated_gpus() {
        let set = emulated();
        let g = set.gpu(0).unwrap();
        let (packed, absmax) = (g.alloc(32).unwrap(), g.alloc(4).unwrap());
        let mut out = g.alloc(256).unwrap();
        let parts = FourBitParts {
            codes: (&packed).into(),
            absmax: (&absmax).into(),
            table: [0.5; 16],
            blocksize: 64,
        };
        let four = |g: &Gpu, out: &mut DeviceBuffer, n| {
            g.dequantize_4bit(parts, out, DType::F32, n).unwrap_err()
        };
        assert!(matches!(
            four(g, &mut out, 64),
            Error::ComputeUnsupported { .. }
        ));
        // 65 values need 33 packed bytes and two scales.
        assert!(matches!(four(g, &mut out, 65), Error::OutOfBounds { .. }));
        let err = g
            .dequantize_int8(
                (&packed).into(),
                (&absmax).into(),
                0.5,
                &mut out,
                DType::BF16,
                1,
                32,
            )
            .unwrap_err();
        assert!(matches!(err, Error::ComputeUnsupported { .. }), "{err}");
        // Two rows need two scales.
        let err = g
            .dequantize_int8(
                (&packed).into(),
                (&absmax).into(),
                0.5,
                &mut out,
                DType::BF16,
                2,
                16,
            )
            .unwrap_err();
        assert!(matches!(err, Error::OutOfBounds { .. }), "{err}");
        let map = g.alloc(1028).unwrap();
        let mut scales = g.alloc(128).unwrap();
        let nested = |g: &Gpu, scales: &mut DeviceBuffer, offset, blocks| {
            let at = |offset| DeviceSlice {
                buffer: &map,
                offset,
            };
            g.dequantize_nested_absmax(
                (&packed).into(),
                (&absmax).into(),
                at(4),
                at(offset),
                scales,
                blocks,
            )
            .unwrap_err()
        };
        let err = nested(g, &mut scales, 0, 32);
        assert!(matches!(err, Error::ComputeUnsupported { .. }), "{err}");
        let err = nested(g, &mut scales, 0, 33);
        assert!(matches!(err, Error::OutOfBounds { .. }), "{err}");
        // An f32 part must be 4-byte aligned.
        let err = nested(g, &mut scales, 2, 32);
        assert!(err.to_string().contains("not aligned"), "{err}");
    }

    #[test]
    fn quantized_linear_checks_parts_and_shapes_before_refusing_on_emulated_gpus() {
        let set = emulated();
        let g = set.gpu(0).unwrap();
        // A [4, 64] weight: 128 code bytes, 4 scales; x [2, 64] f32.
        let (codes, absmax) = (g.alloc(128).unwrap(), g.alloc(16).unwrap());
        let x = g.alloc(2 * 64 * 4).unwrap();
        let mut out = g.alloc(2 * 4 * 4).unwrap();
        let parts = |blocksize| FourBitParts {
            codes: (&codes).into(),
            absmax: (&absmax).into(),
            table: [1.0; 16],
            blocksize,
        };
        let four = |g: &Gpu, out: &mut DeviceBuffer, blocksize, dims| {
            g.linear_4bit(
                &x,
                parts(blocksize),
                None,
                out,
                DType::F32,
                DType::BF16,
                dims,
            )
            .unwrap_err()
        };
        let err = four(g, &mut out, 64, (2, 64, 4));
        assert!(matches!(err, Error::ComputeUnsupported { .. }), "{err}");
        // Five outputs need more codes, scales and output than there are.
        assert!(matches!(
            four(g, &mut out, 64, (2, 64, 5)),
            Error::OutOfBounds { .. }
        ));
        // Block size 32 needs 8 scales.
        assert!(matches!(
            four(g, &mut out, 32, (2, 64, 4)),
            Error::OutOfBounds { .. }
        ));
        let err = four(g, &mut out, 0, (2, 64, 4));
        assert!(err.to_string().contains("block size 0"), "{err}");
        let err = four(g, &mut out, 64, (0, 64, 4));
        assert!(err.to_string().contains("empty linear layer"), "{err}");
        let err = four(g, &mut out, 64, (MAX_QUANTIZED_ROWS + 1, 64, 4));
        assert!(err.to_string().contains("rows exceed"), "{err}");
        // 8-bit: [4, 64] int8 codes (256 bytes) and 4 row scales.
        let int8_codes = g.alloc(256).unwrap();
        let int8 = |g: &Gpu, out: &mut DeviceBuffer, scb_offset, dims| {
            let parts = Int8Parts {
                codes: (&int8_codes).into(),
                scb: DeviceSlice {
                    buffer: &absmax,
                    offset: scb_offset,
                },
                threshold: Some(6.0),
                inv_127: 1.0 / 127.0,
                inv_127_squared: 1.0 / 16129.0,
            };
            g.linear_int8(&x, parts, None, out, DType::F32, dims)
                .unwrap_err()
        };
        let err = int8(g, &mut out, 0, (2, 64, 4));
        assert!(matches!(err, Error::ComputeUnsupported { .. }), "{err}");
        // Four scales from byte 4 run past the buffer.
        assert!(matches!(
            int8(g, &mut out, 4, (2, 64, 4)),
            Error::OutOfBounds { .. }
        ));
        let err = g
            .linear_epilogue(&x, None, &mut out, DType::F32, DType::F16, 2, 5)
            .unwrap_err();
        assert!(matches!(err, Error::OutOfBounds { .. }), "{err}");
    }

    #[test]
    fn buffers_of_another_gpu_are_refused() {
        let set = emulated();
        let (g0, g1) = (set.gpu(0).unwrap(), set.gpu(1).unwrap());
        let a = g1.alloc(64).unwrap();
        let mut out = g0.alloc(64).unwrap();
        let err = g0.silu(&a, &mut out, DType::F32, 16).unwrap_err();
        assert!(matches!(err, Error::WrongDevice { .. }), "{err}");
    }

    #[test]
    fn gemm_checks_every_matrix_of_the_batch() {
        let set = emulated();
        let g = set.gpu(0).unwrap();
        let a = g.alloc(2 * 3 * 4 * 2).unwrap();
        let b = g.alloc(5 * 3 * 4 * 2).unwrap();
        let mut c = g.alloc(2 * 5 * 4 * 2).unwrap();
        let one = GemmShape::new(2, 5, 3);
        let err = g
            .gemm(
                &a,
                &b,
                &mut c,
                DType::F32,
                DType::F32,
                one.batched(2, 6, 15, 10),
            )
            .unwrap_err();
        assert!(matches!(err, Error::ComputeUnsupported { .. }), "{err}");
        let err = g
            .gemm(
                &a,
                &b,
                &mut c,
                DType::F32,
                DType::F32,
                one.batched(3, 6, 15, 10),
            )
            .unwrap_err();
        assert!(matches!(err, Error::OutOfBounds { .. }), "{err}");
        let err = g
            .gemm(&a, &b, &mut c, DType::F32, DType::BF16, one)
            .unwrap_err();
        assert!(
            err.to_string().contains("cannot be written as BF16"),
            "{err}"
        );
    }

    #[test]
    fn attention_and_embedding_reject_bad_geometry() {
        let set = emulated();
        let g = set.gpu(0).unwrap();
        let q = g.alloc(1024).unwrap();
        let kv = g.alloc(1024).unwrap();
        let mut out = g.alloc(1024).unwrap();
        let shape = AttentionShape {
            queries: 2,
            keys: 1,
            heads: 2,
            kv_heads: 1,
            head_dim: 4,
            mask: AttentionMask::Causal,
        };
        let err = g
            .attention(&q, &kv, &kv, &mut out, DType::F32, shape)
            .unwrap_err();
        assert!(err.to_string().contains("2 queries but only 1"), "{err}");
        let grouped = AttentionShape {
            kv_heads: 3,
            keys: 2,
            ..shape
        };
        assert!(
            g.attention(&q, &kv, &kv, &mut out, DType::F32, grouped)
                .is_err()
        );
        let long = AttentionShape {
            keys: MAX_ATTENTION_KEYS + 1,
            queries: 1,
            ..shape
        };
        let err = g
            .attention(&q, &kv, &kv, &mut out, DType::F32, long)
            .unwrap_err();
        assert!(err.to_string().contains("visible positions"), "{err}");
        let err = g
            .embedding(&q, DType::F32, 4, 8, &[1, 4], &mut out, DType::F32)
            .unwrap_err();
        assert!(err.to_string().contains("token id 4"), "{err}");
    }
}
