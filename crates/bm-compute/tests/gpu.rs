//! CUDA compute of bm-compute: every op on a GPU against the CPU op, in
//! F32, F16 and BF16. Run for real on a GPU machine through `cargo xtask
//! gpu-bundle`; without a GPU each test prints "skipped: no CUDA device"
//! and returns, unless `BM_GPU_TESTS=1`, which makes that a failure.

use bm_compute::ops::{self, Heads, LayerCache, Mask, Rope, Scores};
use bm_compute::{Backend, Tensor};
use bm_device::DeviceSet;
use bm_tensor::DType;

fn values(n: usize, seed: u32) -> Vec<f32> {
    (0..n as u32)
        .map(|i| {
            let h = i
                .wrapping_mul(2_654_435_761)
                .wrapping_add(seed.wrapping_mul(97));
            ((h >> 8) % 2000) as f32 / 1000.0 - 1.0
        })
        .collect()
}

fn host(dtype: DType, shape: &[usize], seed: u32) -> Tensor {
    Tensor::from_f32(dtype, shape, &values(shape.iter().product(), seed)).unwrap()
}

/// Compares a GPU result with the CPU op's, in units of the dtype's precision.
fn assert_matches(what: &str, gpu: &Tensor, cpu: &Tensor) {
    assert!(
        matches!(gpu.backend(), Backend::Cuda(0)),
        "{what} ran on {:?}",
        gpu.backend()
    );
    assert_eq!(
        (gpu.shape(), gpu.dtype()),
        (cpu.shape(), cpu.dtype()),
        "{what}"
    );
    let tol = match cpu.dtype() {
        DType::F32 => 1e-5,
        DType::F16 => 2e-3,
        _ => 1.6e-2,
    };
    let (g, c) = (gpu.to_host().unwrap().to_f32_vec(), cpu.to_f32_vec());
    for (i, (a, b)) in g.iter().zip(&c).enumerate() {
        assert!(
            (a - b).abs() <= tol * (1.0 + b.abs()),
            "{what} {}[{i}]: GPU {a}, CPU {b}",
            cpu.dtype()
        );
    }
}

#[test]
fn every_op_on_a_gpu_matches_the_cpu_op() {
    let Some(set) = DeviceSet::cuda_for_gpu_tests() else {
        return;
    };
    let gpu = set.gpu(0).unwrap();
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        let (s, hidden, out) = (5, 64, 48);
        let x = host(dtype, &[s, hidden], 1);
        let w = host(dtype, &[out, hidden], 2);
        let bias = host(dtype, &[out], 3);
        let norm_w = host(dtype, &[hidden], 4);
        let norm_b = host(dtype, &[hidden], 5);
        let (gx, gw) = (x.to_gpu(gpu).unwrap(), w.to_gpu(gpu).unwrap());
        let gbias = bias.to_gpu(gpu).unwrap();

        assert_matches(
            "linear",
            &ops::linear(&gx, &gw, Some(&gbias)).unwrap(),
            &ops::linear(&x, &w, Some(&bias)).unwrap(),
        );
        // A host weight with a GPU activation: uploaded for the op.
        assert_matches(
            "linear with a host weight",
            &ops::linear(&gx, &w, None).unwrap(),
            &ops::linear(&x, &w, None).unwrap(),
        );
        let gnw = norm_w.to_gpu(gpu).unwrap();
        assert_matches(
            "rms_norm",
            &ops::rms_norm(&gx, &gnw, 1e-6).unwrap(),
            &ops::rms_norm(&x, &norm_w, 1e-6).unwrap(),
        );
        assert_matches(
            "layer_norm",
            &ops::layer_norm(&gx, &gnw, &norm_b.to_gpu(gpu).unwrap(), 1e-12).unwrap(),
            &ops::layer_norm(&x, &norm_w, &norm_b, 1e-12).unwrap(),
        );
        let rope = Rope::new(16, 10000.0);
        assert_matches(
            "rotary",
            &rope.apply(&gx, 7).unwrap(),
            &rope.apply(&x, 7).unwrap(),
        );
        assert_matches(
            "softmax",
            &ops::softmax(&gx).unwrap(),
            &ops::softmax(&x).unwrap(),
        );
        assert_matches("silu", &ops::silu(&gx).unwrap(), &ops::silu(&x).unwrap());
        assert_matches("gelu", &ops::gelu(&gx).unwrap(), &ops::gelu(&x).unwrap());
        assert_matches(
            "gelu_tanh",
            &ops::gelu_tanh(&gx).unwrap(),
            &ops::gelu_tanh(&x).unwrap(),
        );
        assert_matches("relu", &ops::relu(&gx).unwrap(), &ops::relu(&x).unwrap());
        let y = host(dtype, &[s, hidden], 6);
        let gy = y.to_gpu(gpu).unwrap();
        assert_matches(
            "add",
            &ops::add(&gx, &gy).unwrap(),
            &ops::add(&x, &y).unwrap(),
        );
        assert_matches(
            "mul",
            &ops::mul(&gx, &gy).unwrap(),
            &ops::mul(&x, &y).unwrap(),
        );
        let table = host(dtype, &[11, hidden], 7);
        let gtable = table.to_gpu(gpu).unwrap();
        for out_dtype in [DType::F32, dtype] {
            assert_matches(
                "embedding",
                &ops::embedding(&[3, 10, 0, 3], &gtable, out_dtype).unwrap(),
                &ops::embedding(&[3, 10, 0, 3], &table, out_dtype).unwrap(),
            );
        }
        assert_matches(
            "to_dtype",
            &gx.to_dtype(DType::F32).unwrap(),
            &x.to_dtype(DType::F32).unwrap(),
        );
        assert_matches("rows", &gx.rows(1, 3).unwrap(), &x.rows(1, 3).unwrap());
        for (i, (g, c)) in ops::split_columns(&gx, &[16, 40, 8])
            .unwrap()
            .iter()
            .zip(ops::split_columns(&x, &[16, 40, 8]).unwrap())
            .enumerate()
        {
            assert_matches(&format!("split_columns part {i}"), g, &c);
        }
        assert_matches(
            "scale",
            &ops::scale(&gx, 1.7).unwrap(),
            &ops::scale(&x, 1.7).unwrap(),
        );
        assert_matches(
            "rms_norm_plus_one",
            &ops::rms_norm_plus_one(&gx, &gnw, 1e-6).unwrap(),
            &ops::rms_norm_plus_one(&x, &norm_w, 1e-6).unwrap(),
        );
        let head_w = host(dtype, &[16], 8);
        assert_matches(
            "per-head rms_norm",
            &ops::rms_norm(
                &gx.to_dtype(dtype).unwrap().reshape(&[s * 4, 16]).unwrap(),
                &head_w.to_gpu(gpu).unwrap(),
                1e-6,
            )
            .unwrap(),
            &ops::rms_norm(
                &x.to_dtype(dtype).unwrap().reshape(&[s * 4, 16]).unwrap(),
                &head_w,
                1e-6,
            )
            .unwrap(),
        );
        // Conv1D's [in, out] weight, on the GPU and streamed from the host.
        let wt = host(dtype, &[hidden, out], 9);
        assert_matches(
            "linear_t",
            &ops::linear_t(&gx, &wt.to_gpu(gpu).unwrap(), Some(&gbias)).unwrap(),
            &ops::linear_t(&x, &wt, Some(&bias)).unwrap(),
        );
        assert_matches(
            "linear_t with a host F32 weight",
            &ops::linear_t(&gx, &wt.to_dtype(DType::F32).unwrap(), None).unwrap(),
            &ops::linear_t(&x, &wt.to_dtype(DType::F32).unwrap(), None).unwrap(),
        );
        // Rotary from host tables: rows at their own positions, given
        // frequencies over part of each head, a cos/sin scaling.
        let positions = [3, 0, 9, 4, 4];
        assert_matches(
            "rotary at given positions",
            &rope.apply_at(&gx, &positions).unwrap(),
            &rope.apply_at(&x, &positions).unwrap(),
        );
        let partial = Rope::with_frequencies(16, vec![1.0, 0.3, 0.05], 1.2).unwrap();
        for (what, start) in [("partial rotary", 0), ("partial rotary from 6", 6)] {
            assert_matches(
                what,
                &partial.apply(&gx, start).unwrap(),
                &partial.apply(&x, start).unwrap(),
            );
        }
        // Soft-capping, with values well past the cap.
        let wide = Tensor::from_f32(dtype, &[4], &[100.0, -100.0, 0.5, -3.0]).unwrap();
        assert_matches(
            "softcap",
            &ops::softcap(&wide.to_gpu(gpu).unwrap(), 30.0).unwrap(),
            &ops::softcap(&wide, 30.0).unwrap(),
        );
        assert_matches(
            "softcap",
            &ops::softcap(&gx, 0.5).unwrap(),
            &ops::softcap(&x, 0.5).unwrap(),
        );

        // Attention over a cache filled in two appends (prefill, one step).
        let heads = Heads {
            heads: 4,
            kv_heads: 2,
            head_dim: 16,
        };
        for mask in [Mask::Bidirectional, Mask::Causal, Mask::SlidingWindow(3)] {
            let (mut cpu_cache, mut gpu_cache) = (LayerCache::new(), LayerCache::new());
            for (step, rows) in [(0u32, 4usize), (1, 1)] {
                let k = host(dtype, &[rows, 32], 10 + step);
                let v = host(dtype, &[rows, 32], 20 + step);
                let q = host(dtype, &[rows, 64], 30 + step);
                cpu_cache.append(&k, &v).unwrap();
                gpu_cache
                    .append(&k.to_gpu(gpu).unwrap(), &v.to_gpu(gpu).unwrap())
                    .unwrap();
                assert_eq!(gpu_cache.len(), cpu_cache.len());
                assert_matches(
                    &format!("attention {mask:?} step {step}"),
                    &ops::attention(&q.to_gpu(gpu).unwrap(), &gpu_cache, heads, mask).unwrap(),
                    &ops::attention(&q, &cpu_cache, heads, mask).unwrap(),
                );
                // T5's scores: unscaled, plus a bias by head and relative
                // position ([heads, keys + queries - 1]).
                let unscaled = Scores {
                    scale: 1.0,
                    softcap: None,
                };
                let gq = q.to_gpu(gpu).unwrap();
                assert_matches(
                    &format!("unscaled attention {mask:?} step {step}"),
                    &ops::attention_with(&gq, &gpu_cache, heads, mask, unscaled).unwrap(),
                    &ops::attention_with(&q, &cpu_cache, heads, mask, unscaled).unwrap(),
                );
                let bias = host(dtype, &[4, cpu_cache.len() + rows - 1], 40 + step);
                for b in [&bias, &bias.to_gpu(gpu).unwrap()] {
                    assert_matches(
                        &format!("biased attention {mask:?} step {step}"),
                        &ops::attention_biased(&gq, &gpu_cache, heads, (mask, unscaled), b)
                            .unwrap(),
                        &ops::attention_biased(&q, &cpu_cache, heads, (mask, unscaled), &bias)
                            .unwrap(),
                    );
                }
                let capped = Scores {
                    scale: 0.1,
                    softcap: Some(5.0),
                };
                assert_matches(
                    &format!("soft-capped attention {mask:?} step {step}"),
                    &ops::attention_with(&q.to_gpu(gpu).unwrap(), &gpu_cache, heads, mask, capped)
                        .unwrap(),
                    &ops::attention_with(&q, &cpu_cache, heads, mask, capped).unwrap(),
                );
            }
            // More queries than keys, every key seen (T5's cross-attention).
            if mask == Mask::Bidirectional {
                let q = host(dtype, &[7, 64], 50);
                let unscaled = Scores {
                    scale: 1.0,
                    softcap: None,
                };
                assert_matches(
                    "cross-attention, 7 queries over 5 keys",
                    &ops::attention_with(
                        &q.to_gpu(gpu).unwrap(),
                        &gpu_cache,
                        heads,
                        mask,
                        unscaled,
                    )
                    .unwrap(),
                    &ops::attention_with(&q, &cpu_cache, heads, mask, unscaled).unwrap(),
                );
            }
        }
    }
}

#[test]
fn mixed_caches_are_refused_with_a_clear_error() {
    let Some(set) = DeviceSet::cuda_for_gpu_tests() else {
        return;
    };
    let gpu = set.gpu(0).unwrap();
    let k = host(DType::F32, &[2, 8], 1);
    let mut cache = LayerCache::new();
    cache.append(&k, &k).unwrap();
    let gk = k.to_gpu(gpu).unwrap();
    let err = cache.append(&gk, &gk).unwrap_err();
    assert!(err.to_string().contains("cache is in host memory"), "{err}");
}

#[test]
fn dequantizing_on_a_gpu_is_the_cpu_dequantization_bit_for_bit() {
    use bm_compute::quant::{FourBitType, QuantFormat, quantize};
    let Some(set) = DeviceSet::cuda_for_gpu_tests() else {
        return;
    };
    let gpu = set.gpu(0).unwrap();
    let four = |kind, double_quant| QuantFormat::FourBit {
        kind,
        blocksize: 64,
        double_quant,
    };
    let formats = [
        four(FourBitType::Nf4, false),
        four(FourBitType::Nf4, true),
        four(FourBitType::Fp4, false),
        four(FourBitType::Fp4, true),
        QuantFormat::Int8 { threshold: 6.0 },
    ];
    // Odd widths start rows mid-byte; 300 x 257 needs two nested scales.
    for shape in [[3, 5], [48, 71], [300, 257]] {
        for (seed, format) in formats.into_iter().enumerate() {
            let weight = host(DType::BF16, &shape, seed as u32);
            let q = quantize(&weight, format, "w").unwrap();
            for dtype in [DType::F32, DType::F16, DType::BF16] {
                let cpu = q.dequantize(dtype).unwrap();
                let on_gpu = q.dequantize_on(gpu, dtype).unwrap();
                assert!(matches!(on_gpu.backend(), Backend::Cuda(0)));
                assert_eq!(on_gpu.shape(), cpu.shape());
                assert!(
                    on_gpu.to_host().unwrap().host_bytes() == cpu.host_bytes(),
                    "{format:?} {shape:?} {dtype}: GPU and CPU dequantization differ"
                );
            }
        }
    }
}

#[test]
fn quantized_matmul_on_a_gpu_matches_the_cpu_kernel() {
    use bm_compute::quant::{FourBitType, QuantFormat, quantize};
    let Some(set) = DeviceSet::cuda_for_gpu_tests() else {
        return;
    };
    let gpu = set.gpu(0).unwrap();
    let four = |kind, blocksize, double_quant| QuantFormat::FourBit {
        kind,
        blocksize,
        double_quant,
    };
    let formats = [
        four(FourBitType::Nf4, 64, false),
        four(FourBitType::Nf4, 64, true),
        four(FourBitType::Fp4, 64, false),
        four(FourBitType::Fp4, 128, true),
        QuantFormat::Int8 { threshold: 0.0 },
        QuantFormat::Int8 { threshold: 6.0 },
    ];
    // The coarser of two dtypes' precisions: a sum taken in another order
    // may round once more to the compute dtype.
    let tolerance = |a: DType, b: DType| {
        let tol = |d: DType| match d {
            DType::F32 => 1e-5,
            DType::F16 => 2e-3,
            _ => 1.6e-2,
        };
        f32::max(tol(a), tol(b))
    };
    // k = 75 puts block boundaries and odd nibbles inside rows; 300 x 257
    // needs two nested scales. m = 1 and 3 read the weight packed, 17
    // dequantizes it for a GEMM.
    for [n, k] in [[37, 75], [300, 257]] {
        for (seed, format) in formats.into_iter().enumerate() {
            let weight = host(DType::BF16, &[n, k], seed as u32);
            let mut q = quantize(&weight, format, "w").unwrap();
            let computes: &[Option<DType>] = match format {
                QuantFormat::FourBit { .. } => &[None, Some(DType::F32), Some(DType::BF16)],
                QuantFormat::Int8 { .. } => &[None],
            };
            for &compute in computes {
                q.set_compute_dtype(compute).unwrap();
                let on_gpu = q.to_gpu(gpu).unwrap();
                for dtype in [DType::F32, DType::F16, DType::BF16] {
                    for m in [1, 3, 17] {
                        let mut xv = values(m * k, 7 + m as u32);
                        // Outlier columns for LLM.int8(): 3 (one row) and 40.
                        xv[(m / 2) * k + 3] = 9.0;
                        xv[40] = -7.5;
                        let x = Tensor::from_f32(dtype, &[m, k], &xv).unwrap();
                        let bias = host(dtype, &[n], 11);
                        let cpu = ops::linear_quantized(&x, &q, Some(&bias)).unwrap();
                        let xg = x.to_gpu(gpu).unwrap();
                        let bg = bias.to_gpu(gpu).unwrap();
                        let got = ops::linear_quantized_on_gpu(&xg, &on_gpu, Some(&bg)).unwrap();
                        assert!(matches!(got.backend(), Backend::Cuda(0)));
                        assert_eq!((got.shape(), got.dtype()), (cpu.shape(), cpu.dtype()));
                        let tol = tolerance(dtype, compute.unwrap_or(dtype));
                        let (g, c) = (got.to_host().unwrap().to_f32_vec(), cpu.to_f32_vec());
                        for (i, (a, b)) in g.iter().zip(&c).enumerate() {
                            assert!(
                                (a - b).abs() <= tol * (1.0 + b.abs()),
                                "{format:?} compute {compute:?} x {dtype} m={m} [{n}, {k}] \
                                 [{i}]: GPU {a}, CPU {b}"
                            );
                        }
                        // A GPU input with a host weight uploads it packed.
                        let uploaded = ops::linear_quantized(&xg, &q, None).unwrap();
                        assert!(matches!(uploaded.backend(), Backend::Cuda(0)));
                    }
                }
            }
        }
    }
}
