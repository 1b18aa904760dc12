//! Checkpoint reading speed.
//!
//! * `inspect/open_sparse_64GiB`: `Checkpoint::open` of a sparse 64 GiB file
//!   with 2048 tensors: the cost of reading headers only.
//! * `inspect/open_{100k,1M}_tensors`: `Checkpoint::open` of headers of
//!   100,000 and 1,000,000 one-byte tensors (issue 10's quadratic case);
//!   the throughput (tensors/s) should not fall with size.
//! * `read_to_host/*`: every tensor of a checkpoint (1 GiB by default, warm
//!   page cache) read into fresh aligned host buffers, next to a plain memcpy
//!   of the same bytes from memory into buffers of the same sizes. Compare
//!   the two GB/s figures of one run; the `_reused` pair does the same into
//!   buffers allocated once (the copy alone). Set `BM_BENCH_CKPT_MIB` to change the
//!   size (e.g. 128 for a quick run).

use std::io::Write;
use std::path::Path;

use bigmodel::shard::Checkpoint;
use bigmodel::tensor::{DType, HostBuffer};
use bigmodel_benches::many_tensors::{Names, write_many_tensors};
use bigmodel_benches::safetensors_f32::{self, layers};
use criterion::{Criterion, Throughput, criterion_group, criterion_main};

const GIB: u64 = 1 << 30;

/// Writes a safetensors file of `count` F32 tensors of `bytes_each` bytes
/// filled with a byte pattern.
fn write_filled(path: &Path, count: usize, bytes_each: u64) {
    let tensors = layers(count, bytes_each);
    let mut f = std::io::BufWriter::new(std::fs::File::create(path).unwrap());
    f.write_all(&safetensors_f32::header(&tensors, &[]))
        .unwrap();
    let chunk: Vec<u8> = (0..1 << 20).map(|i| (i % 251) as u8).collect();
    let mut left = safetensors_f32::data_len(&tensors);
    while left > 0 {
        let n = left.min(chunk.len() as u64) as usize;
        f.write_all(&chunk[..n]).unwrap();
        left -= n as u64;
    }
    f.flush().unwrap();
}

fn inspect(c: &mut Criterion) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("sparse.safetensors");
    safetensors_f32::write_sparse(&path, &layers(2048, 32 * GIB / 1024)).unwrap();
    c.bench_function("inspect/open_sparse_64GiB_2048_tensors", |b| {
        b.iter(|| {
            let ckpt = Checkpoint::open(&path).unwrap();
            assert_eq!(ckpt.len(), 2048);
            ckpt
        })
    });
}

/// Opening a header of a million tensors (~85 MB): what issue 10 found
/// quadratic. Linear-ish now: the time per tensor should stay flat between
/// the two sizes.
fn many_tensors(c: &mut Criterion) {
    let dir = tempfile::tempdir().unwrap();
    let mut group = c.benchmark_group("inspect");
    group.sample_size(10);
    for (count, label) in [(100_000, "100k"), (1_000_000, "1M")] {
        let path = dir.path().join(format!("{label}.safetensors"));
        write_many_tensors(&path, count, Names::Layers).unwrap();
        group.throughput(Throughput::Elements(count as u64));
        group.bench_function(format!("open_{label}_tensors"), |b| {
            b.iter(|| {
                let ckpt = Checkpoint::open(&path).unwrap();
                assert_eq!(ckpt.len(), count);
                ckpt
            })
        });
    }
    group.finish();
}

fn read_to_host(c: &mut Criterion) {
    let mib: u64 = std::env::var("BM_BENCH_CKPT_MIB")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1024);
    let count = 64;
    let bytes_each = (mib << 20) / count / 4 * 4;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.safetensors");
    write_filled(&path, count as usize, bytes_each);
    let ckpt = Checkpoint::open(&path).unwrap();
    let names: Vec<String> = ckpt.tensors().map(|(n, _)| n.to_string()).collect();
    // The same bytes already in memory, for the memcpy baseline.
    let source: Vec<u8> = std::fs::read(&path).unwrap();
    let data_start = source.len() - (count * bytes_each) as usize;

    let mut group = c.benchmark_group("read_to_host");
    group.sample_size(10);
    group.throughput(Throughput::Bytes(count * bytes_each));
    group.bench_function(format!("checkpoint_read_as_{mib}MiB"), |b| {
        b.iter(|| {
            names
                .iter()
                .map(|n| ckpt.read_as(n, DType::F32).unwrap())
                .collect::<Vec<HostBuffer>>()
        })
    });
    group.bench_function(format!("memcpy_{mib}MiB"), |b| {
        b.iter(|| {
            source[data_start..]
                .chunks(bytes_each as usize)
                .map(|chunk| HostBuffer::from_bytes(chunk).unwrap())
                .collect::<Vec<HostBuffer>>()
        })
    });
    // Into buffers allocated once: the copy alone, without page faults of
    // fresh allocations.
    let mut reused: Vec<HostBuffer> = names
        .iter()
        .map(|_| HostBuffer::zeroed(bytes_each as usize).unwrap())
        .collect();
    group.bench_function(format!("checkpoint_read_into_reused_{mib}MiB"), |b| {
        b.iter(|| {
            for (n, buf) in names.iter().zip(&mut reused) {
                ckpt.read_into(n, buf.as_mut_bytes()).unwrap();
            }
        })
    });
    group.bench_function(format!("memcpy_reused_{mib}MiB"), |b| {
        b.iter(|| {
            let chunks = source[data_start..].chunks(bytes_each as usize);
            for (chunk, buf) in chunks.zip(&mut reused) {
                buf.as_mut_bytes().copy_from_slice(chunk);
            }
        })
    });
    group.finish();
}

criterion_group!(benches, inspect, many_tensors, read_to_host);
criterion_main!(benches);
