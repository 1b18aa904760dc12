//! GPU compute of bm-device against host references, run for real on a GPU
//! machine through `cargo xtask gpu-bundle`. Without a GPU each test prints
//! "skipped: no CUDA device" and returns, unless `BM_GPU_TESTS=1`, which
//! turns a missing GPU into a failure.

use bm_device::{
    Activation, AttentionMask, AttentionShape, DeviceBuffer, DeviceSet, GemmShape, Gpu,
};
use bm_tensor::DType;

/// Deterministic values in about [-1, 1).
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

fn upload(g: &Gpu, v: &[f32]) -> DeviceBuffer {
    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    let mut b = g.alloc(bytes.len()).unwrap();
    g.write_for_compute(&mut b, 0, &bytes).unwrap();
    b
}

fn download(b: &DeviceBuffer, n: usize) -> Vec<f32> {
    let mut bytes = vec![0u8; n * 4];
    b.copy_to_host(0, &mut bytes).unwrap();
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

fn assert_close(what: &str, got: &[f32], want: &[f32], tol: f32) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= tol * (1.0 + w.abs()),
            "{what}[{i}]: got {g}, want {w}"
        );
    }
}

#[test]
fn gemm_matches_host_product_single_and_batched() {
    let Some(set) = DeviceSet::cuda_for_gpu_tests() else {
        return;
    };
    let g = set.gpu(0).unwrap();
    let (m, n, k, batch) = (5, 7, 33, 3);
    let a = values(batch * m * k, 1);
    let b = values(batch * n * k, 2);
    let mut want = vec![0f32; batch * m * n];
    for p in 0..batch {
        for i in 0..m {
            for j in 0..n {
                want[p * m * n + i * n + j] = (0..k)
                    .map(|l| a[p * m * k + i * k + l] * b[p * n * k + j * k + l])
                    .sum();
            }
        }
    }
    let (da, db) = (upload(g, &a), upload(g, &b));
    let mut dc = g.alloc(batch * m * n * 4).unwrap();
    let shape = GemmShape::new(m, n, k);
    g.gemm(&da, &db, &mut dc, DType::F32, DType::F32, shape)
        .unwrap();
    assert_close("gemm", &download(&dc, m * n), &want[..m * n], 1e-5);
    let batched = shape.batched(batch, m * k, n * k, m * n);
    g.gemm(&da, &db, &mut dc, DType::F32, DType::F32, batched)
        .unwrap();
    assert_close("batched gemm", &download(&dc, batch * m * n), &want, 1e-5);

    // B stored [k, n] (Conv1D): C = A · B, the same values read in place.
    let mut want_in_out = vec![0f32; batch * m * n];
    for p in 0..batch {
        for i in 0..m {
            for j in 0..n {
                want_in_out[p * m * n + i * n + j] = (0..k)
                    .map(|l| a[p * m * k + i * k + l] * b[p * n * k + l * n + j])
                    .sum();
            }
        }
    }
    g.gemm(&da, &db, &mut dc, DType::F32, DType::F32, shape.b_in_out())
        .unwrap();
    assert_close(
        "gemm, B [k, n]",
        &download(&dc, m * n),
        &want_in_out[..m * n],
        1e-5,
    );
    g.gemm(
        &da,
        &db,
        &mut dc,
        DType::F32,
        DType::F32,
        batched.b_in_out(),
    )
    .unwrap();
    assert_close(
        "batched gemm, B [k, n]",
        &download(&dc, batch * m * n),
        &want_in_out,
        1e-5,
    );

    // Half inputs, F32 output: the product of the rounded inputs,
    // accumulated in f32.
    for (half, round) in [
        (
            DType::BF16,
            (|x: f32| half::bf16::from_f32(x).to_f32()) as fn(f32) -> f32,
        ),
        (DType::F16, |x: f32| half::f16::from_f32(x).to_f32()),
    ] {
        let mut ha = g.alloc(m * k * 2).unwrap();
        let mut hb = g.alloc(n * k * 2).unwrap();
        g.cast(&da, DType::F32, &mut ha, half, m * k, 0).unwrap();
        g.cast(&db, DType::F32, &mut hb, half, n * k, 0).unwrap();
        g.gemm(&ha, &hb, &mut dc, half, DType::F32, shape).unwrap();
        let mut want = vec![0f32; m * n];
        for i in 0..m {
            for j in 0..n {
                want[i * n + j] = (0..k)
                    .map(|l| round(a[i * k + l]) * round(b[j * k + l]))
                    .sum();
            }
        }
        assert_close(
            &format!("{half:?} gemm"),
            &download(&dc, m * n),
            &want,
            1e-5,
        );
    }
}

#[test]
fn casts_round_to_nearest_even_and_widen_exactly() {
    let Some(set) = DeviceSet::cuda_for_gpu_tests() else {
        return;
    };
    let g = set.gpu(0).unwrap();
    let v = [
        1.0 + 1.0 / 256.0,
        1.0 + 3.0 / 256.0,
        -2.5,
        0.1,
        65504.0,
        1e-3,
    ];
    let dv = upload(g, &v);
    for (half, round) in [
        (
            DType::BF16,
            (|x: f32| half::bf16::from_f32(x).to_f32()) as fn(f32) -> f32,
        ),
        (DType::F16, |x: f32| half::f16::from_f32(x).to_f32()),
    ] {
        let mut h = g.alloc(v.len() * 2).unwrap();
        g.cast(&dv, DType::F32, &mut h, half, v.len(), 0).unwrap();
        let mut back = g.alloc(v.len() * 4 * 2).unwrap();
        // Written from element 6: the second half of `back`.
        g.cast(&h, half, &mut back, DType::F32, v.len(), v.len())
            .unwrap();
        let all = download(&back, 2 * v.len());
        let want: Vec<f32> = v.iter().map(|&x| round(x)).collect();
        assert_eq!(&all[v.len()..], &want[..], "{half:?}");
    }
}

#[test]
fn elementwise_ops_match_host() {
    let Some(set) = DeviceSet::cuda_for_gpu_tests() else {
        return;
    };
    let g = set.gpu(0).unwrap();
    let n = 1000;
    let (a, b) = (values(n, 3), values(n, 4));
    let (da, db) = (upload(g, &a), upload(g, &b));
    let mut out = g.alloc(n * 4).unwrap();
    let ty = DType::F32;
    g.add(&da, &db, &mut out, ty, n).unwrap();
    let want: Vec<f32> = a.iter().zip(&b).map(|(x, y)| x + y).collect();
    assert_close("add", &download(&out, n), &want, 0.0);
    g.mul(&da, &db, &mut out, ty, n).unwrap();
    let want: Vec<f32> = a.iter().zip(&b).map(|(x, y)| x * y).collect();
    assert_close("mul", &download(&out, n), &want, 0.0);
    g.silu(&da, &mut out, ty, n).unwrap();
    let want: Vec<f32> = a.iter().map(|x| x / (1.0 + (-x).exp())).collect();
    assert_close("silu", &download(&out, n), &want, 1e-6);
    g.gelu(&da, &mut out, ty, n).unwrap();
    let probe = upload(g, &[0.5, -1.0]);
    let mut probe_out = g.alloc(8).unwrap();
    g.gelu(&probe, &mut probe_out, ty, 2).unwrap();
    // gelu(0.5) = 0.25 (1 + erf(0.3535534)), gelu(-1) = -0.5 (1 - erf(0.7071068)).
    let want = [0.25 * (1.0 + 0.382_924_9), -0.5 * (1.0 - 0.682_689_5)];
    assert_close("gelu", &download(&probe_out, 2), &want, 1e-6);
    g.unary(Activation::GeluTanh, &da, &mut out, ty, n).unwrap();
    let want: Vec<f32> = a
        .iter()
        .map(|&x| 0.5 * x * (1.0 + (0.797_884_6 * (x + 0.044715 * x * x * x)).tanh()))
        .collect();
    assert_close("gelu_tanh", &download(&out, n), &want, 1e-6);
    g.unary(Activation::Relu, &da, &mut out, ty, n).unwrap();
    let want: Vec<f32> = a.iter().map(|&x| x.max(0.0)).collect();
    assert_close("relu", &download(&out, n), &want, 0.0);

    let (rows, cols) = (4, 250);
    let bias = values(cols, 5);
    let dbias = upload(g, &bias);
    g.bias_epilogue(&da, Some(&dbias), &mut out, ty, rows, cols)
        .unwrap();
    let want: Vec<f32> = a
        .iter()
        .enumerate()
        .map(|(i, x)| x + bias[i % cols])
        .collect();
    assert_close("bias", &download(&out, n), &want, 0.0);
}

#[test]
fn row_kernels_match_host() {
    let Some(set) = DeviceSet::cuda_for_gpu_tests() else {
        return;
    };
    let g = set.gpu(0).unwrap();
    let (rows, cols) = (3, 1031);
    let x = values(rows * cols, 6);
    let w = values(cols, 7);
    let b = values(cols, 8);
    let (dx, dw, db) = (upload(g, &x), upload(g, &w), upload(g, &b));
    let mut out = g.alloc(rows * cols * 4).unwrap();
    let ty = DType::F32;

    g.rms_norm(&dx, &dw, &mut out, ty, rows, cols, 1e-6)
        .unwrap();
    let mut want = Vec::new();
    for r in x.chunks_exact(cols) {
        let inv = 1.0 / (r.iter().map(|v| v * v).sum::<f32>() / cols as f32 + 1e-6).sqrt();
        want.extend(r.iter().zip(&w).map(|(v, w)| w * (v * inv)));
    }
    assert_close("rms_norm", &download(&out, rows * cols), &want, 1e-5);

    g.layer_norm(&dx, &dw, &db, &mut out, ty, rows, cols, 1e-5)
        .unwrap();
    let mut want = Vec::new();
    for r in x.chunks_exact(cols) {
        let mean = r.iter().sum::<f32>() / cols as f32;
        let var = r.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / cols as f32;
        let inv = 1.0 / (var + 1e-5).sqrt();
        want.extend(
            r.iter()
                .zip(&w)
                .zip(&b)
                .map(|((v, w), b)| (v - mean) * inv * w + b),
        );
    }
    assert_close("layer_norm", &download(&out, rows * cols), &want, 1e-5);

    g.softmax(&dx, &mut out, ty, rows, cols).unwrap();
    let mut want = Vec::new();
    for r in x.chunks_exact(cols) {
        let max = r.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let sum: f32 = r.iter().map(|v| (v - max).exp()).sum();
        want.extend(r.iter().map(|v| (v - max).exp() / sum));
    }
    assert_close("softmax", &download(&out, rows * cols), &want, 1e-5);
}

#[test]
fn rotary_and_embedding_match_host() {
    let Some(set) = DeviceSet::cuda_for_gpu_tests() else {
        return;
    };
    let g = set.gpu(0).unwrap();
    let (rows, heads, hd, start, theta) = (3, 2, 8, 5, 10000.0f32);
    let width = heads * hd;
    let x = values(rows * width, 9);
    let dx = upload(g, &x);
    let mut out = g.alloc(rows * width * 4).unwrap();
    g.rotary(&dx, &mut out, DType::F32, rows, width, hd, start, theta)
        .unwrap();
    let half = hd / 2;
    let mut want = x.clone();
    for r in 0..rows {
        for h in 0..heads {
            for i in 0..half {
                let f = 1.0 / theta.powf((2 * i) as f32 / hd as f32);
                let angle = (start + r) as f32 * f;
                let at = r * width + h * hd + i;
                let (a, b) = (x[at], x[at + half]);
                want[at] = a * angle.cos() - b * angle.sin();
                want[at + half] = b * angle.cos() + a * angle.sin();
            }
        }
    }
    assert_close("rotary", &download(&out, rows * width), &want, 1e-5);

    let (vocab, hidden) = (10, 6);
    let table = values(vocab * hidden, 10);
    let dt = upload(g, &table);
    let ids = [7u32, 0, 9, 7];
    let mut emb = g.alloc(ids.len() * hidden * 4).unwrap();
    g.embedding(&dt, DType::F32, vocab, hidden, &ids, &mut emb, DType::F32)
        .unwrap();
    let want: Vec<f32> = ids
        .iter()
        .flat_map(|&id| table[id as usize * hidden..][..hidden].to_vec())
        .collect();
    assert_close("embedding", &download(&emb, ids.len() * hidden), &want, 0.0);
}

#[test]
fn attention_matches_host_for_every_mask() {
    let Some(set) = DeviceSet::cuda_for_gpu_tests() else {
        return;
    };
    let g = set.gpu(0).unwrap();
    let (s, t, heads, kv_heads, hd) = (3, 7, 4, 2, 16);
    let q = values(s * heads * hd, 11);
    let k = values(t * kv_heads * hd, 12);
    let v = values(t * kv_heads * hd, 13);
    let (dq, dk, dv) = (upload(g, &q), upload(g, &k), upload(g, &v));
    let mut out = g.alloc(s * heads * hd * 4).unwrap();
    for mask in [
        AttentionMask::Bidirectional,
        AttentionMask::Causal,
        AttentionMask::SlidingWindow(3),
    ] {
        let shape = AttentionShape {
            queries: s,
            keys: t,
            heads,
            kv_heads,
            head_dim: hd,
            mask,
        };
        g.attention(&dq, &dk, &dv, &mut out, DType::F32, shape)
            .unwrap();
        let mut want = vec![0f32; s * heads * hd];
        let scale = 1.0 / (hd as f32).sqrt();
        for i in 0..s {
            let pos = t - s + i;
            let (lo, hi) = match mask {
                AttentionMask::Bidirectional => (0, t),
                AttentionMask::Causal => (0, pos + 1),
                AttentionMask::SlidingWindow(w) => ((pos + 1).saturating_sub(w), pos + 1),
            };
            for h in 0..heads {
                let gi = h / (heads / kv_heads);
                let qi = &q[i * heads * hd + h * hd..][..hd];
                let scores: Vec<f32> = (lo..hi)
                    .map(|j| {
                        let kj = &k[j * kv_heads * hd + gi * hd..][..hd];
                        qi.iter().zip(kj).map(|(a, b)| a * b).sum::<f32>() * scale
                    })
                    .collect();
                let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let sum: f32 = scores.iter().map(|x| (x - max).exp()).sum();
                for (p, j) in scores.iter().zip(lo..hi) {
                    let p = (p - max).exp() / sum;
                    for d in 0..hd {
                        want[i * heads * hd + h * hd + d] += p * v[j * kv_heads * hd + gi * hd + d];
                    }
                }
            }
        }
        assert_close(
            &format!("attention {mask:?}"),
            &download(&out, s * heads * hd),
            &want,
            1e-5,
        );
    }
}

/// Set in the child processes of the kernel cache test.
const CACHE_CHILD: &str = "BM_KERNEL_CACHE_CHILD";

#[test]
fn kernels_are_cubin_compiled_once_then_read_from_the_disk_cache() {
    if std::env::var_os(CACHE_CHILD).is_some() {
        // A child: run one kernel and say what its module came from.
        let set = DeviceSet::cuda().unwrap();
        let g = set.gpu(0).unwrap();
        assert_eq!(g.kernel_module(), None, "no kernel has run yet");
        let x = upload(g, &values(1000, 3));
        let mut y = g.alloc(1000 * 4).unwrap();
        g.silu(&x, &mut y, DType::F32, 1000).unwrap();
        download(&y, 1000);
        let info = g.kernel_module().unwrap();
        println!(
            "kernel module: {} from_cache={}",
            info.target, info.from_cache
        );
        return;
    }
    if DeviceSet::cuda_for_gpu_tests().is_none() {
        return;
    }
    let cache = tempfile::tempdir().unwrap();
    // Two processes, as two starts of a program: the first compiles, the
    // second loads what the first wrote.
    let start = || {
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "kernels_are_cubin_compiled_once_then_read_from_the_disk_cache",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CACHE_CHILD, "1")
            .env("BIGMODEL_CACHE", cache.path())
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success(),
            "{text}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        text.lines()
            .find_map(|l| l.strip_prefix("kernel module: ").map(str::to_string))
            .unwrap_or_else(|| panic!("the child printed no module: {text}"))
    };
    let first = start();
    let second = start();
    println!("first start: {first}; second start: {second}");
    assert!(first.starts_with("sm_"), "CUBIN for the GPU: {first}");
    assert!(first.ends_with("from_cache=false"), "{first}");
    assert_eq!(second, first.replace("from_cache=false", "from_cache=true"));
    let entries: Vec<_> = std::fs::read_dir(cache.path().join("kernels"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(entries.len(), 1, "{entries:?}");
    assert!(entries[0].ends_with(".cubin"), "{entries:?}");
}
