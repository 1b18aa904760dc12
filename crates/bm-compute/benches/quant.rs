//! The dequantizing matmul (`ops::linear_quantized`: NF4, NF4 with double
//! quantization, FP4, LLM.int8()) next to the plain `ops::linear` on F32,
//! BF16 and F16 weights of the same shape, for one token (decode) and a
//! 64-token prompt (prefill); and quantizing a weight (load time). On a
//! machine with a CUDA GPU the same products run there too (weights and
//! inputs resident, the GPU synchronised inside each timed iteration);
//! elsewhere that group says it was skipped.
//!
//! `cargo bench -p bm-compute --bench quant` (`--features cuda` for the
//! GPU group; the GPU bundle's bench binaries have it)

use std::hint::black_box;

use bm_compute::quant::{FourBitType, QuantFormat, quantize};
use bm_compute::{Tensor, ops};
use bm_device::DeviceSet;
use bm_tensor::DType;
use criterion::{Criterion, criterion_group, criterion_main};

const K: usize = 2048;
const N: usize = 2048;

fn formats() -> [(&'static str, QuantFormat); 4] {
    let four = |kind, double_quant| QuantFormat::FourBit {
        kind,
        blocksize: 64,
        double_quant,
    };
    [
        ("nf4", four(FourBitType::Nf4, false)),
        ("nf4 double-quant", four(FourBitType::Nf4, true)),
        ("fp4", four(FourBitType::Fp4, false)),
        (
            "int8 (LLM.int8, threshold 6)",
            QuantFormat::Int8 { threshold: 6.0 },
        ),
    ]
}

fn linear(c: &mut Criterion) {
    // Roughly normal weights of a trained layer's scale.
    let w: Vec<f32> = (0..N * K)
        .map(|i| (((i * 31) % 97) as f32 / 97.0 - 0.5) * 0.05)
        .collect();
    for m in [1, 64] {
        let x: Vec<f32> = (0..m * K)
            .map(|i| ((i * 17) % 89) as f32 / 89.0 - 0.5)
            .collect();
        let mut group = c.benchmark_group(format!("linear {m}x{K} · {N}x{K}ᵀ"));
        group.sample_size(10);
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            let wt = Tensor::from_f32(dtype, &[N, K], &w).unwrap();
            let xt = Tensor::from_f32(dtype, &[m, K], &x).unwrap();
            group.bench_function(format!("ops::linear {dtype}"), |b| {
                b.iter(|| black_box(ops::linear(&xt, &wt, None).unwrap()))
            });
        }
        let dense = Tensor::from_f32(DType::BF16, &[N, K], &w).unwrap();
        for dtype in [DType::F32, DType::BF16] {
            let xt = Tensor::from_f32(dtype, &[m, K], &x).unwrap();
            for (name, format) in formats() {
                let mut q = quantize(&dense, format, "w").unwrap();
                // Compute in the activation dtype (4-bit); LLM.int8 has its own.
                q.set_compute_dtype(None).unwrap();
                group.bench_function(format!("linear_quantized {name}, x {dtype}"), |b| {
                    b.iter(|| black_box(ops::linear_quantized(&xt, &q, None).unwrap()))
                });
            }
        }
        group.finish();
    }
}

/// The products of [`linear`] on GPU 0, dense F16/BF16 next to every
/// quantized format (compute in the activation dtype).
fn linear_on_gpu(c: &mut Criterion) {
    let devices = DeviceSet::probe();
    let Ok(gpu) = devices.gpu(0) else {
        let why = devices.cuda_status().error.clone();
        println!(
            "quant: no CUDA GPU ({}): the GPU group is skipped",
            why.as_deref().unwrap_or("no CUDA device")
        );
        return;
    };
    let w: Vec<f32> = (0..N * K)
        .map(|i| (((i * 31) % 97) as f32 / 97.0 - 0.5) * 0.05)
        .collect();
    let dense = Tensor::from_f32(DType::BF16, &[N, K], &w).unwrap();
    for m in [1, 64] {
        let x: Vec<f32> = (0..m * K)
            .map(|i| ((i * 17) % 89) as f32 / 89.0 - 0.5)
            .collect();
        let mut group = c.benchmark_group(format!("cuda linear {m}x{K} · {N}x{K}ᵀ"));
        group.sample_size(20);
        for dtype in [DType::BF16, DType::F16] {
            let xt = Tensor::from_f32(dtype, &[m, K], &x)
                .unwrap()
                .to_gpu(gpu)
                .unwrap();
            let wt = Tensor::from_f32(dtype, &[N, K], &w)
                .unwrap()
                .to_gpu(gpu)
                .unwrap();
            group.bench_function(format!("ops::linear {dtype}"), |b| {
                b.iter(|| {
                    black_box(ops::linear(&xt, &wt, None).unwrap());
                    gpu.synchronize().unwrap();
                })
            });
            for (name, format) in formats() {
                let mut q = quantize(&dense, format, "w").unwrap();
                q.set_compute_dtype(None).unwrap();
                let on_gpu = q.to_gpu(gpu).unwrap();
                group.bench_function(format!("linear_quantized {name}, x {dtype}"), |b| {
                    b.iter(|| {
                        black_box(ops::linear_quantized_on_gpu(&xt, &on_gpu, None).unwrap());
                        gpu.synchronize().unwrap();
                    })
                });
            }
        }
        group.finish();
    }
}

fn quantizing(c: &mut Criterion) {
    let w: Vec<f32> = (0..N * K)
        .map(|i| (((i * 31) % 97) as f32 / 97.0 - 0.5) * 0.05)
        .collect();
    let dense = Tensor::from_f32(DType::BF16, &[N, K], &w).unwrap();
    let mut group = c.benchmark_group(format!("quantize {N}x{K} BF16"));
    group.sample_size(10);
    for (name, format) in formats() {
        group.bench_function(name, |b| {
            b.iter(|| black_box(quantize(&dense, format, "w").unwrap()))
        });
    }
    group.finish();
}

criterion_group!(benches, linear, linear_on_gpu, quantizing);
criterion_main!(benches);
