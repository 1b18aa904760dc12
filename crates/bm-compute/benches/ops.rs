//! The matmul behind every linear layer, at the shapes of one decoder step
//! (one token) and of a prompt (64 tokens), against a plain single-threaded
//! dot-product loop in the same run: the ratio is what to read. The same
//! product with the weight stored `[in, out]` (GPT-2's `Conv1D`,
//! `ops::linear_t`) stands beside it.
//!
//! `cargo bench -p bm-compute --bench ops`

use std::hint::black_box;

use bm_compute::{Tensor, ops};
use bm_tensor::DType;
use criterion::{Criterion, criterion_group, criterion_main};

const K: usize = 2048;
const N: usize = 2048;

fn naive_linear(x: &[f32], m: usize, w: &[f32]) -> Vec<f32> {
    let mut y = vec![0f32; m * N];
    for i in 0..m {
        for j in 0..N {
            y[i * N + j] = x[i * K..][..K]
                .iter()
                .zip(&w[j * K..][..K])
                .map(|(a, b)| a * b)
                .sum();
        }
    }
    y
}

fn linear(c: &mut Criterion) {
    let w: Vec<f32> = (0..N * K)
        .map(|i| ((i * 31) % 97) as f32 / 97.0 - 0.5)
        .collect();
    for m in [1, 64] {
        let x: Vec<f32> = (0..m * K)
            .map(|i| ((i * 17) % 89) as f32 / 89.0 - 0.5)
            .collect();
        let mut group = c.benchmark_group(format!("linear {m}x{K} · {N}x{K}ᵀ"));
        group.sample_size(10);
        group.bench_function("naive f32, one thread", |b| {
            b.iter(|| black_box(naive_linear(&x, m, &w)))
        });
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            let wt = Tensor::from_f32(dtype, &[N, K], &w).unwrap();
            let xt = Tensor::from_f32(dtype, &[m, K], &x).unwrap();
            group.bench_function(format!("ops::linear {dtype}"), |b| {
                b.iter(|| black_box(ops::linear(&xt, &wt, None).unwrap()))
            });
            // The same values stored transposed (as Conv1D keeps them).
            let transposed = Tensor::from_f32(dtype, &[K, N], &w).unwrap();
            group.bench_function(format!("ops::linear_t {dtype}"), |b| {
                b.iter(|| black_box(ops::linear_t(&xt, &transposed, None).unwrap()))
            });
        }
        group.finish();
    }
}

criterion_group!(benches, linear);
criterion_main!(benches);
