//! The CUDA backend of the ops: tensors in `DeviceBuffer`s, computed by
//! bm-device's compute API (cuBLAS GEMMs, NVRTC kernels) on the GPU's
//! compute stream.
//!
//! Placement rule: an op runs on the GPU of its first GPU operand, and host
//! operands are uploaded for it (a CPU-offloaded weight is streamed to the
//! execution device, as Accelerate's hooks do). Weights in another dtype
//! than the activations are cast on the GPU to the activation dtype, except
//! for matmuls with one F32 side, which run in F32 so no weight is rounded.
//! Built without the `cuda` feature the variant exists but no GPU can hold
//! a compute tensor, so none of this runs.

use bm_device::{
    Activation, AttentionMask, AttentionScores, AttentionShape, BLayout, DeviceBuffer, DeviceSlice,
    FourBitParts, GemmShape, Gpu, GpuKind, Int8Parts,
};
use bm_tensor::DType;

use crate::ops::{Heads, Mask, Scores};
use crate::quant::tensor::{
    Data, INV_127, INV_127_SQUARED, PackedLayout, QuantFormat, Scales, packed_layout,
};
use crate::quant::{QuantizedOnGpu, QuantizedTensor};
use crate::{Error, Tensor};

/// The GPU of the first operand that lives on one.
pub(crate) fn gpu_of(tensors: &[&Tensor]) -> Option<Gpu> {
    tensors
        .iter()
        .find_map(|t| t.device_buffer().map(|b| b.gpu().clone()))
}

fn buffer(t: &Tensor) -> &DeviceBuffer {
    t.device_buffer()
        .expect("operands are brought onto the GPU before use")
}

/// An uninitialised GPU tensor (the kernel writing it fills every element).
fn empty(gpu: &Gpu, dtype: DType, shape: &[usize]) -> Result<Tensor, Error> {
    let numel: usize = shape.iter().product();
    let buf = gpu.alloc((numel * dtype.size_in_bytes()).max(1))?;
    Ok(Tensor::from_device(dtype, shape, buf))
}

pub(crate) fn to_gpu(t: &Tensor, gpu: &Gpu) -> Result<Tensor, Error> {
    // Emulated GPUs hold bytes but run no kernels: their blocks compute on
    // host copies, so a compute tensor never lives on one.
    if gpu.kind() == GpuKind::Emulated {
        return Err(bm_device::Error::ComputeUnsupported {
            device: gpu.device(),
        }
        .into());
    }
    let upload = |bytes: &[u8]| -> Result<Tensor, Error> {
        let mut buf = gpu.alloc(bytes.len().max(1))?;
        gpu.write_for_compute(&mut buf, 0, bytes)?;
        Ok(Tensor::from_device(t.dtype(), t.shape(), buf))
    };
    match t.device_buffer() {
        None => upload(t.host_bytes()),
        // Between GPUs through the host: simple, and rare (a block's
        // activations crossing to the next GPU of a map).
        Some(_) => upload(t.to_host()?.host_bytes()),
    }
}

/// An operand brought onto the op's GPU: the caller's tensor when it
/// already was there in the right dtype, a copy otherwise.
pub(crate) enum Operand<'a> {
    Borrowed(&'a Tensor),
    Owned(Tensor),
}

impl std::ops::Deref for Operand<'_> {
    type Target = Tensor;
    fn deref(&self) -> &Tensor {
        match self {
            Operand::Borrowed(t) => t,
            Operand::Owned(t) => t,
        }
    }
}

/// `t` on `gpu` in `dtype`: borrowed when it already is, else copied
/// and/or cast.
pub(crate) fn on_gpu<'a>(t: &'a Tensor, gpu: &Gpu, dtype: DType) -> Result<Operand<'a>, Error> {
    let here = t
        .device_buffer()
        .is_some_and(|b| b.device() == gpu.device() && b.gpu().kind() == gpu.kind());
    let moved = if here {
        Operand::Borrowed(t)
    } else {
        Operand::Owned(to_gpu(t, gpu)?)
    };
    if moved.dtype() == dtype {
        Ok(moved)
    } else {
        Ok(Operand::Owned(cast(&moved, gpu, dtype)?))
    }
}

pub(crate) fn cast(t: &Tensor, gpu: &Gpu, dtype: DType) -> Result<Tensor, Error> {
    let mut out = empty(gpu, dtype, t.shape())?;
    gpu.cast(
        buffer(t),
        t.dtype(),
        out_buffer(&mut out),
        dtype,
        t.numel(),
        0,
    )?;
    Ok(out)
}

fn out_buffer(t: &mut Tensor) -> &mut DeviceBuffer {
    t.device_buffer_mut()
        .expect("outputs are allocated on the GPU")
}

pub(crate) fn rows(
    src: &DeviceBuffer,
    dtype: DType,
    cols: usize,
    start: usize,
    end: usize,
) -> Result<Tensor, Error> {
    let gpu = src.gpu().clone();
    let row_bytes = cols * dtype.size_in_bytes();
    let mut out = empty(&gpu, dtype, &[end - start, cols])?;
    if end > start {
        out_buffer(&mut out).copy_from_device(
            0,
            src,
            start * row_bytes..end * row_bytes,
            gpu.compute_stream(),
        )?;
    }
    Ok(out)
}

/// Columns `start..start + width` of the 2-D GPU tensor `x`, one
/// device-to-device copy per row.
pub(crate) fn columns(x: &Tensor, start: usize, width: usize) -> Result<Tensor, Error> {
    let src = buffer(x);
    let gpu = src.gpu().clone();
    let (rows, cols) = (x.shape()[0], x.shape()[1]);
    let size = x.dtype().size_in_bytes();
    let mut out = empty(&gpu, x.dtype(), &[rows, width])?;
    if width > 0 {
        let dst = out_buffer(&mut out);
        for r in 0..rows {
            let from = (r * cols + start) * size;
            dst.copy_from_device(
                r * width * size,
                src,
                from..from + width * size,
                gpu.compute_stream(),
            )?;
        }
    }
    Ok(out)
}

/// `x · wᵀ + bias` with x `[m, k]` (any leading shape flattened), w `[n, k]`
/// (`BLayout::OutIn`), or `x · w + bias` with w `[k, n]` (`BLayout::InOut`).
pub(crate) fn linear(
    gpu: &Gpu,
    x: &Tensor,
    (weight, layout): (&Tensor, BLayout),
    bias: Option<&Tensor>,
    (m, k, n): (usize, usize, usize),
    out_shape: &[usize],
) -> Result<Tensor, Error> {
    let dtype = x.dtype();
    let compute = if weight.dtype() == dtype {
        dtype
    } else {
        DType::F32
    };
    let xs = on_gpu(x, gpu, compute)?;
    let ws = on_gpu(weight, gpu, compute)?;
    let bs = bias.map(|b| on_gpu(b, gpu, dtype)).transpose()?;
    let mut acc = gpu.alloc(m * n * 4)?;
    let shape = match layout {
        BLayout::OutIn => GemmShape::new(m, n, k),
        BLayout::InOut => GemmShape::new(m, n, k).b_in_out(),
    };
    gpu.gemm(
        buffer(&xs),
        buffer(&ws),
        &mut acc,
        compute,
        DType::F32,
        shape,
    )?;
    let mut out = empty(gpu, dtype, out_shape)?;
    gpu.bias_epilogue(
        &acc,
        bs.as_deref().map(buffer),
        out_buffer(&mut out),
        dtype,
        m,
        n,
    )?;
    Ok(out)
}

pub(crate) fn embedding(ids: &[u32], table: &Tensor, dtype: DType) -> Result<Tensor, Error> {
    let b = buffer(table);
    let gpu = b.gpu().clone();
    let (vocab, hidden) = (table.shape()[0], table.shape()[1]);
    let mut out = empty(&gpu, dtype, &[ids.len(), hidden])?;
    gpu.embedding(
        b,
        table.dtype(),
        vocab,
        hidden,
        ids,
        out_buffer(&mut out),
        dtype,
    )?;
    Ok(out)
}

pub(crate) fn rms_norm(gpu: &Gpu, x: &Tensor, w: &Tensor, eps: f32) -> Result<Tensor, Error> {
    let dtype = x.dtype();
    let (xs, ws) = (on_gpu(x, gpu, dtype)?, on_gpu(w, gpu, dtype)?);
    let cols = x.shape().last().copied().unwrap_or(1);
    let mut out = empty(gpu, dtype, x.shape())?;
    gpu.rms_norm(
        buffer(&xs),
        buffer(&ws),
        out_buffer(&mut out),
        dtype,
        x.numel() / cols.max(1),
        cols,
        eps,
    )?;
    Ok(out)
}

pub(crate) fn layer_norm(
    gpu: &Gpu,
    x: &Tensor,
    w: &Tensor,
    b: &Tensor,
    eps: f32,
) -> Result<Tensor, Error> {
    let dtype = x.dtype();
    let xs = on_gpu(x, gpu, dtype)?;
    let (ws, bs) = (on_gpu(w, gpu, dtype)?, on_gpu(b, gpu, dtype)?);
    let cols = x.shape().last().copied().unwrap_or(1);
    let mut out = empty(gpu, dtype, x.shape())?;
    gpu.layer_norm(
        buffer(&xs),
        buffer(&ws),
        buffer(&bs),
        out_buffer(&mut out),
        dtype,
        x.numel() / cols.max(1),
        cols,
        eps,
    )?;
    Ok(out)
}

pub(crate) fn rotary(
    x: &Tensor,
    head_dim: usize,
    start_pos: usize,
    theta: f32,
) -> Result<Tensor, Error> {
    let b = buffer(x);
    let gpu = b.gpu().clone();
    let (rows, width) = (x.shape()[0], x.shape()[1]);
    let mut out = empty(&gpu, x.dtype(), x.shape())?;
    gpu.rotary(
        b,
        out_buffer(&mut out),
        x.dtype(),
        rows,
        width,
        head_dim,
        start_pos,
        theta,
    )?;
    Ok(out)
}

/// Rotary embedding of `x` (`[rows, heads * head_dim]`) from the host's
/// cos/sin tables (`rows × rotary_dim / 2`), uploaded for the kernel.
pub(crate) fn rotary_table(
    x: &Tensor,
    (head_dim, rotary_dim): (usize, usize),
    cos: &[f32],
    sin: &[f32],
) -> Result<Tensor, Error> {
    let b = buffer(x);
    let gpu = b.gpu().clone();
    let bytes = |v: &[f32]| -> Vec<u8> { v.iter().flat_map(|f| f.to_le_bytes()).collect() };
    let (c, s) = (upload(&gpu, &bytes(cos))?, upload(&gpu, &bytes(sin))?);
    let (rows, width) = (x.shape()[0], x.shape()[1]);
    let mut out = empty(&gpu, x.dtype(), x.shape())?;
    gpu.rotary_table(
        b,
        (&c, &s),
        out_buffer(&mut out),
        x.dtype(),
        rows,
        width,
        (head_dim, rotary_dim),
    )?;
    Ok(out)
}

pub(crate) fn softmax(x: &Tensor) -> Result<Tensor, Error> {
    let b = buffer(x);
    let gpu = b.gpu().clone();
    let cols = x.shape().last().copied().unwrap_or(1);
    let mut out = empty(&gpu, x.dtype(), x.shape())?;
    gpu.softmax(
        b,
        out_buffer(&mut out),
        x.dtype(),
        x.numel() / cols.max(1),
        cols,
    )?;
    Ok(out)
}

/// An elementwise activation.
pub(crate) fn unary(x: &Tensor, op: Activation) -> Result<Tensor, Error> {
    let b = buffer(x);
    let gpu = b.gpu().clone();
    let mut out = empty(&gpu, x.dtype(), x.shape())?;
    gpu.unary(op, b, out_buffer(&mut out), x.dtype(), x.numel())?;
    Ok(out)
}

/// Add or mul.
pub(crate) fn binary(gpu: &Gpu, a: &Tensor, b: &Tensor, mul: bool) -> Result<Tensor, Error> {
    let dtype = a.dtype();
    let (xa, xb) = (on_gpu(a, gpu, dtype)?, on_gpu(b, gpu, dtype)?);
    let mut out = empty(gpu, dtype, a.shape())?;
    let n = a.numel();
    if mul {
        gpu.mul(buffer(&xa), buffer(&xb), out_buffer(&mut out), dtype, n)?;
    } else {
        gpu.add(buffer(&xa), buffer(&xb), out_buffer(&mut out), dtype, n)?;
    }
    Ok(out)
}

/// One layer's keys and values on a GPU, widened to f32 as the host cache
/// keeps them, in buffers that double when full.
#[derive(Debug)]
pub(crate) struct DeviceKv {
    keys: DeviceBuffer,
    values: DeviceBuffer,
    /// Rows the buffers have room for.
    capacity: usize,
    /// Rows filled.
    pub(crate) rows: usize,
}

impl DeviceKv {
    /// Appends `keys`/`values` (GPU tensors `[seq, width]`) to `kv`,
    /// creating or growing it.
    pub(crate) fn append(
        kv: &mut Option<DeviceKv>,
        width: usize,
        keys: &Tensor,
        values: &Tensor,
    ) -> Result<(), Error> {
        let gpu = buffer(keys).gpu().clone();
        let seq = keys.shape()[0];
        let rows = kv.as_ref().map_or(0, |c| c.rows);
        let needed = rows + seq;
        if kv.as_ref().is_none_or(|c| c.capacity < needed) {
            let capacity = needed
                .max(kv.as_ref().map_or(0, |c| 2 * c.capacity))
                .max(64);
            let bytes = capacity * width * 4;
            let (mut k, mut v) = (gpu.alloc(bytes)?, gpu.alloc(bytes)?);
            if let Some(old) = kv.as_ref().filter(|c| c.rows > 0) {
                let used = old.rows * width * 4;
                k.copy_from_device(0, &old.keys, 0..used, gpu.compute_stream())?;
                v.copy_from_device(0, &old.values, 0..used, gpu.compute_stream())?;
            }
            *kv = Some(DeviceKv {
                keys: k,
                values: v,
                capacity,
                rows,
            });
        }
        let c = kv.as_mut().expect("created above");
        let dtype = keys.dtype();
        let vs = on_gpu(values, &gpu, keys.dtype())?;
        let count = seq * width;
        gpu.cast(
            buffer(keys),
            dtype,
            &mut c.keys,
            DType::F32,
            count,
            rows * width,
        )?;
        gpu.cast(
            buffer(&vs),
            dtype,
            &mut c.values,
            DType::F32,
            count,
            rows * width,
        )?;
        c.rows = needed;
        Ok(())
    }

    /// Attention of `q` over this cache, scores `q · k · scale` plus the
    /// position bias if any (`[heads, keys + queries - 1]`, uploaded and
    /// widened to F32 for the kernel).
    pub(crate) fn attention(
        &self,
        q: &Tensor,
        heads: Heads,
        mask: Mask,
        scores: Scores,
        bias: Option<&Tensor>,
    ) -> Result<Tensor, Error> {
        let gpu = self.keys.gpu().clone();
        let qs = on_gpu(q, &gpu, q.dtype())?;
        let bs = bias.map(|b| on_gpu(b, &gpu, DType::F32)).transpose()?;
        let mut out = empty(&gpu, q.dtype(), q.shape())?;
        let shape = AttentionShape {
            queries: q.shape()[0],
            keys: self.rows,
            heads: heads.heads,
            kv_heads: heads.kv_heads,
            head_dim: heads.head_dim,
            mask: match mask {
                Mask::Bidirectional => AttentionMask::Bidirectional,
                Mask::Causal => AttentionMask::Causal,
                Mask::SlidingWindow(w) => AttentionMask::SlidingWindow(w),
            },
        };
        let scores = AttentionScores {
            scale: scores.scale,
            softcap: scores.softcap,
            bias: bs.as_deref().map(buffer),
        };
        gpu.attention_with(
            buffer(&qs),
            &self.keys,
            &self.values,
            out_buffer(&mut out),
            q.dtype(),
            shape,
            scores,
        )?;
        Ok(out)
    }
}

/// Host bytes uploaded to `gpu` for a kernel to read.
fn upload(gpu: &Gpu, bytes: &[u8]) -> Result<DeviceBuffer, Error> {
    let mut buf = gpu.alloc(bytes.len().max(1))?;
    gpu.write_for_compute(&mut buf, 0, bytes)?;
    Ok(buf)
}

/// `q` dequantized on `gpu` into a `dtype` tensor of its shape: its packed
/// parts uploaded, then bitsandbytes' dequantization kernels, bit for bit
/// what [`QuantizedTensor::dequantize`] computes on the CPU.
pub(crate) fn dequantize(q: &QuantizedTensor, gpu: &Gpu, dtype: DType) -> Result<Tensor, Error> {
    crate::ops::check_compute_dtype("dequantized dtype", dtype)?;
    if gpu.kind() == GpuKind::Emulated {
        return Err(bm_device::Error::ComputeUnsupported {
            device: gpu.device(),
        }
        .into());
    }
    let mut out = empty(gpu, dtype, q.shape())?;
    let [rows, cols] = q.shape;
    match &q.data {
        Data::FourBit(fb) => {
            let n = rows * cols;
            let blocks = n.div_ceil(fb.blocksize);
            let absmax = match &fb.scales {
                Scales::Plain(a) => upload(gpu, a.bytes())?,
                Scales::Nested {
                    codes,
                    absmax,
                    map,
                    offset,
                } => {
                    let mut scales = gpu.alloc(4 * blocks)?;
                    gpu.dequantize_nested_absmax(
                        (&upload(gpu, codes.as_bytes())?).into(),
                        (&upload(gpu, absmax.bytes())?).into(),
                        (&upload(gpu, map.bytes())?).into(),
                        (&upload(gpu, &offset.to_le_bytes())?).into(),
                        &mut scales,
                        blocks,
                    )?;
                    scales
                }
            };
            let codes = upload(gpu, fb.packed.as_bytes())?;
            let parts = FourBitParts {
                codes: (&codes).into(),
                absmax: (&absmax).into(),
                table: fb.kind.code(),
                blocksize: fb.blocksize,
            };
            gpu.dequantize_4bit(parts, out_buffer(&mut out), dtype, n)?;
        }
        Data::Int8(i) => gpu.dequantize_int8(
            (&upload(gpu, i.codes.as_bytes())?).into(),
            (&upload(gpu, i.scb.bytes())?).into(),
            INV_127,
            out_buffer(&mut out),
            dtype,
            rows,
            cols,
        )?,
    }
    Ok(out)
}

/// A part of `buffer` from byte `offset`.
fn part(buffer: &DeviceBuffer, offset: usize) -> DeviceSlice<'_> {
    DeviceSlice { buffer, offset }
}

/// Rows up to which a 4-bit matmul reads the weight packed (one output a
/// block); beyond, it dequantizes the weight once for a cuBLAS GEMM.
const FOUR_BIT_DIRECT_ROWS: usize = 8;

/// `x · wᵀ + bias` for a quantized weight on its GPU (see
/// [`crate::quant::linear_quantized_on_gpu`]); x `[m, k]`, w `[n, k]`.
pub(crate) fn linear_quantized(
    x: &Tensor,
    w: &QuantizedOnGpu,
    bias: Option<&Tensor>,
    (m, k, n): (usize, usize, usize),
    out_shape: &[usize],
) -> Result<Tensor, Error> {
    let packed: &DeviceBuffer = w.bytes.as_ref().as_ref();
    let gpu = packed.gpu().clone();
    let dtype = x.dtype();
    let xs = on_gpu(x, &gpu, dtype)?;
    let bs = bias.map(|b| on_gpu(b, &gpu, dtype)).transpose()?;
    let mut out = empty(&gpu, dtype, out_shape)?;
    let bias_buffer = bs.as_deref().map(buffer);
    let (kind, blocksize) = match w.format {
        QuantFormat::Int8 { threshold } => {
            let PackedLayout::Int8 { scb, codes } = packed_layout(w.format, w.shape) else {
                unreachable!("an 8-bit format has the 8-bit layout")
            };
            let parts = Int8Parts {
                codes: part(packed, codes.start),
                scb: part(packed, scb.start),
                // MatMul8bitLt compares in float16.
                threshold: (threshold > 0.0).then(|| half::f16::from_f32(threshold).to_f32()),
                inv_127: INV_127,
                inv_127_squared: INV_127_SQUARED,
            };
            gpu.linear_int8(
                buffer(&xs),
                parts,
                bias_buffer,
                out_buffer(&mut out),
                dtype,
                (m, k, n),
            )?;
            return Ok(out);
        }
        QuantFormat::FourBit {
            kind, blocksize, ..
        } => (kind, blocksize),
    };
    let compute = w.compute_dtype.unwrap_or(dtype);
    let blocks = (n * k).div_ceil(blocksize);
    // Double quantization: the block scales first, into a temporary.
    let scales;
    let (codes, absmax) = match packed_layout(w.format, w.shape) {
        PackedLayout::FourBit { absmax, codes } => (codes, part(packed, absmax.start)),
        PackedLayout::Nested {
            offset,
            nested,
            map,
            absmax_codes,
            codes,
        } => {
            let mut s = gpu.alloc(4 * blocks)?;
            gpu.dequantize_nested_absmax(
                part(packed, absmax_codes.start),
                part(packed, nested.start),
                part(packed, map.start),
                part(packed, offset.start),
                &mut s,
                blocks,
            )?;
            scales = s;
            (codes, DeviceSlice::from(&scales))
        }
        PackedLayout::Int8 { .. } => unreachable!("a 4-bit format has a 4-bit layout"),
    };
    let parts = FourBitParts {
        codes: part(packed, codes.start),
        absmax,
        table: kind.code(),
        blocksize,
    };
    if m <= FOUR_BIT_DIRECT_ROWS {
        gpu.linear_4bit(
            buffer(&xs),
            parts,
            bias_buffer,
            out_buffer(&mut out),
            dtype,
            compute,
            (m, k, n),
        )?;
        return Ok(out);
    }
    // Dropped (its free enqueued after the GEMM) before this returns.
    let mut dense = gpu.alloc(n * k * compute.size_in_bytes())?;
    gpu.dequantize_4bit(parts, &mut dense, compute, n * k)?;
    let xc = on_gpu(&xs, &gpu, compute)?;
    let mut acc = gpu.alloc(m * n * 4)?;
    gpu.gemm(
        buffer(&xc),
        &dense,
        &mut acc,
        compute,
        DType::F32,
        GemmShape::new(m, n, k),
    )?;
    gpu.linear_epilogue(
        &acc,
        bias_buffer,
        out_buffer(&mut out),
        dtype,
        compute,
        m,
        n,
    )?;
    Ok(out)
}
