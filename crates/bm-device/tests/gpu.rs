//! CUDA paths of bm-device, run for real on a GPU machine through
//! `cargo xtask gpu-bundle` / `gpu-test`. Without a GPU (or without the
//! `cuda` feature) each test prints "skipped: no CUDA device" and returns,
//! unless `BM_GPU_TESTS=1` is set, which turns a missing GPU into a failure.
//! The bundle runs them with `--test-threads=1`: some compare the driver's
//! free memory before and after an allocation.

use std::time::Duration;

use bm_device::{Device, DeviceSet, Error, GpuKind};

const MIB: usize = 1 << 20;

fn pattern(len: usize, seed: u32) -> Vec<u8> {
    (0..len as u32)
        .map(|i| (i.wrapping_mul(2_654_435_761).wrapping_add(seed) >> 13) as u8)
        .collect()
}

#[test]
fn probe_reports_driver_memory_and_names() {
    let Some(set) = DeviceSet::cuda_for_gpu_tests() else {
        return;
    };
    let status = set.cuda_status();
    assert!(status.compiled && status.driver_found, "{status:?}");
    assert!(
        status.driver_version.is_some_and(|(major, _)| major >= 12),
        "{status:?}"
    );
    let probed = DeviceSet::probe();
    assert_eq!(probed.gpu_count(), set.gpu_count());
    let info = set.memory_info().unwrap();
    for (g, m) in set.gpus().iter().zip(&info.gpus) {
        assert_eq!(g.kind(), GpuKind::Cuda);
        assert!(!g.name().is_empty());
        assert!(m.free > 0 && m.free < m.total, "{m:?}");
        assert_eq!(m.total, g.total_bytes());
        // The default budget starts at what was free after context creation.
        assert!(g.budget() <= m.total);
    }
    let budgets = set.default_budgets().unwrap();
    for (b, m) in budgets.gpus.iter().zip(&info.gpus) {
        assert!(*b + bm_device::gpu_safety_margin(m.total) <= m.free + (64 * MIB) as u64);
    }
}

#[test]
fn allocation_budget_and_accounting() {
    let Some(set) = DeviceSet::cuda_for_gpu_tests() else {
        return;
    };
    let g = set.gpu(0).unwrap();
    let original = g.budget();
    g.set_budget((64 * MIB) as u64).unwrap();
    let before = g.memory().unwrap().free;
    let a = g.alloc(48 * MIB).unwrap();
    let after = g.memory().unwrap().free;
    assert!(
        before - after >= (48 * MIB) as u64,
        "the driver saw the allocation"
    );
    let err = g.alloc(32 * MIB).unwrap_err();
    assert!(
        matches!(err, Error::BudgetExceeded { live, .. } if live == (48 * MIB) as u64),
        "{err}"
    );
    let b = g.alloc_zeroed(16 * MIB).unwrap();
    let mut back = vec![1u8; 16 * MIB];
    b.copy_to_host(0, &mut back).unwrap();
    assert!(back.iter().all(|&x| x == 0), "alloc_zeroed zeroes");
    assert_eq!(g.live_bytes(), (64 * MIB) as u64);
    drop(a);
    drop(b);
    assert_eq!(g.live_bytes(), 0);
    assert_eq!(g.peak_bytes(), (64 * MIB) as u64);
    assert!(matches!(g.alloc(0), Err(Error::ZeroSizedAllocation { .. })));
    let err = g.set_budget(g.total_bytes() + 1).unwrap_err();
    assert!(matches!(err, Error::BudgetLargerThanDevice { .. }), "{err}");
    g.set_budget(original).unwrap();
    assert!(matches!(
        set.gpu(set.gpu_count()),
        Err(Error::OrdinalOutOfRange { .. })
    ));
}

#[test]
fn driver_out_of_memory_is_typed() {
    let Some(set) = DeviceSet::cuda_for_gpu_tests() else {
        return;
    };
    let g = set.gpu(0).unwrap();
    let original = g.budget();
    // Let the request through the budget so the driver itself refuses it:
    // the whole card is never free once a context exists.
    g.set_budget(g.total_bytes()).unwrap();
    let err = g.alloc(g.total_bytes() as usize).unwrap_err();
    g.set_budget(original).unwrap();
    match err {
        Error::OutOfMemory {
            device,
            requested,
            free,
        } => {
            assert_eq!(device, Device::Gpu(0));
            assert_eq!(requested, g.total_bytes());
            assert!(free > 0 && free < requested);
        }
        other => panic!("expected OutOfMemory, got {other}"),
    }
    assert_eq!(g.live_bytes(), 0, "a failed allocation holds nothing");
}

#[test]
fn copies_each_way() {
    let Some(set) = DeviceSet::cuda_for_gpu_tests() else {
        return;
    };
    let g = set.gpu(0).unwrap();
    let copy = g.copy_stream();
    let data = pattern(10 * MIB + 3, 11);

    // Synchronous, pageable.
    let mut a = g.alloc(data.len() + 5).unwrap();
    a.copy_from_host(5, &data).unwrap();
    let mut back = vec![0u8; data.len()];
    a.copy_to_host(5, &mut back).unwrap();
    assert_eq!(back, data);

    // Through the pinned staging ring (more data than the ring holds).
    let pool = set.pinned_pool(MIB, 2).unwrap();
    assert!(pool.is_pinned(), "{:?}", pool.fallback_reason());
    let mut b = g.alloc(data.len()).unwrap();
    let done = b.upload(0, &data, &pool, copy).unwrap();
    g.compute_stream().wait(&done).unwrap();
    let mut back = vec![0u8; data.len()];
    b.download(0, &mut back, &pool, copy).unwrap();
    assert_eq!(back, data);

    // Asynchronous pinned H2D and D2H.
    let mut pinned = set.alloc_pinned(data.len()).unwrap();
    assert!(pinned.is_pinned());
    pinned.as_mut_slice().unwrap().copy_from_slice(&data);
    let mut c = g.alloc(data.len()).unwrap();
    c.copy_from_pinned(0, &pinned, 0..data.len(), copy).unwrap();
    let mut out = set.alloc_pinned(MIB).unwrap();
    c.copy_to_pinned(4 * MIB, &mut out, 0, MIB, copy).unwrap();
    assert_eq!(out.as_slice().unwrap(), &data[4 * MIB..5 * MIB]);

    // Registered host memory, a sub-range.
    let reg = set.register_host(&data);
    assert!(reg.is_registered(), "{:?}", reg.fallback_reason());
    let mut d = g.alloc(MIB).unwrap();
    d.copy_from_registered(0, &reg, 3 * MIB..4 * MIB, copy)
        .unwrap();
    let mut back = vec![0u8; MIB];
    d.copy_to_host(0, &mut back).unwrap();
    assert_eq!(back, &data[3 * MIB..4 * MIB]);
    drop(reg);

    // Device to device on the same GPU, and to every other GPU.
    let mut e = g.alloc_zeroed(2 * MIB).unwrap();
    e.copy_from_device(MIB, &c, 0..MIB, g.compute_stream())
        .unwrap();
    let mut back = vec![0u8; 2 * MIB];
    e.copy_to_host(0, &mut back).unwrap();
    assert!(back[..MIB].iter().all(|&x| x == 0));
    assert_eq!(&back[MIB..], &data[..MIB]);
    let peers = set.enable_peer_access().unwrap();
    for other in set.gpus().iter().skip(1) {
        let mut f = other.alloc(MIB).unwrap();
        f.copy_from_device(0, &c, 2 * MIB..3 * MIB, other.copy_stream())
            .unwrap();
        let mut back = vec![0u8; MIB];
        f.copy_to_host(0, &mut back).unwrap();
        assert_eq!(
            back,
            &data[2 * MIB..3 * MIB],
            "peer copy to {} (peers {peers:?})",
            other.ordinal()
        );
    }
    drop((a, b, c, d, e));
    for g in set.gpus() {
        assert_eq!(g.live_bytes(), 0);
    }
}

#[test]
fn events_order_copies_after_compute() {
    let Some(set) = DeviceSet::cuda_for_gpu_tests() else {
        return;
    };
    let g = set.gpu(0).unwrap();
    let (compute, copy) = (g.compute_stream(), g.copy_stream());
    let data = pattern(4 * MIB, 5);
    let mut pinned = set.alloc_pinned(data.len()).unwrap();
    pinned.as_mut_slice().unwrap().copy_from_slice(&data);
    let mut buf = g.alloc_zeroed(data.len()).unwrap();

    let start = compute.record_timed().unwrap();
    compute.busy_wait(Duration::from_millis(300)).unwrap();
    let busy = compute.record_timed().unwrap();
    // The copy waits for the busy kernel, so it cannot have finished yet.
    copy.wait(&busy).unwrap();
    let copied = buf
        .copy_from_pinned(0, &pinned, 0..data.len(), copy)
        .unwrap();
    assert!(!busy.is_complete().unwrap(), "the kernel runs for 300 ms");
    assert!(
        !copied.is_complete().unwrap(),
        "the copy waits for the kernel"
    );
    copied.synchronize().unwrap();
    assert!(busy.is_complete().unwrap());
    let elapsed = busy.elapsed_since(&start).unwrap();
    assert!(elapsed >= Duration::from_millis(250), "{elapsed:?}");
    let mut back = vec![0u8; data.len()];
    buf.copy_to_host(0, &mut back).unwrap();
    assert_eq!(back, data);
}

#[test]
fn staging_slots_are_reused_only_after_their_copy() {
    let Some(set) = DeviceSet::cuda_for_gpu_tests() else {
        return;
    };
    let g = set.gpu(0).unwrap();
    // One slot: every chunk must wait for the previous DMA out of it, and
    // a copy stream stalled behind a kernel makes a premature reuse visible.
    let pool = set.pinned_pool(256 * 1024, 1).unwrap();
    let data = pattern(3 * MIB + 1, 9);
    let mut buf = g.alloc(data.len()).unwrap();
    g.compute_stream()
        .busy_wait(Duration::from_millis(100))
        .unwrap();
    let stalled = g.compute_stream().record().unwrap();
    g.copy_stream().wait(&stalled).unwrap();
    let done = buf.upload(0, &data, &pool, g.copy_stream()).unwrap();
    done.synchronize().unwrap();
    let mut back = vec![0u8; data.len()];
    buf.copy_to_host(0, &mut back).unwrap();
    assert_eq!(back, data);
}

#[test]
fn cuda_buffers_refuse_foreign_streams() {
    let Some(set) = DeviceSet::cuda_for_gpu_tests() else {
        return;
    };
    let emulated = DeviceSet::emulated(&[MIB as u64]);
    let mut buf = set.gpu(0).unwrap().alloc(MIB).unwrap();
    let pool = set.pinned_pool(MIB, 2).unwrap();
    let err = buf
        .upload(0, &[1, 2, 3], &pool, emulated.gpu(0).unwrap().copy_stream())
        .unwrap_err();
    assert!(matches!(err, Error::WrongDevice { .. }), "{err}");
    let other = emulated.gpu(0).unwrap().alloc(16).unwrap();
    let stream = set.gpu(0).unwrap().copy_stream();
    assert!(matches!(
        buf.copy_from_device(0, &other, 0..16, stream),
        Err(Error::WrongDevice { .. })
    ));
}

#[test]
fn every_cuda_library_is_found_and_reported() {
    let Some(set) = DeviceSet::cuda_for_gpu_tests() else {
        return;
    };
    let libraries = set.cuda_libraries();
    for l in &libraries {
        println!(
            "{}: {} {}",
            l.library,
            l.version.as_deref().unwrap_or("-"),
            l.path.as_ref().map_or_else(
                || l.error.clone().unwrap_or_default(),
                |p| p.display().to_string()
            )
        );
    }
    assert_eq!(libraries.len(), bm_device::CudaLibrary::ALL.len());
    for l in &libraries {
        assert!(l.path.is_some() && l.error.is_none(), "{l:?}");
    }
}

#[test]
fn dropping_a_buffer_in_use_does_not_wait_for_the_gpu() {
    let Some(set) = DeviceSet::cuda_for_gpu_tests() else {
        return;
    };
    let g = set.gpu(0).unwrap();
    let data = pattern(8 * MIB, 12);
    let mut pinned = set.alloc_pinned(data.len()).unwrap();
    pinned.as_mut_slice().unwrap().copy_from_slice(&data);
    // A copy stuck behind a 500 ms kernel.
    g.compute_stream()
        .busy_wait(Duration::from_millis(500))
        .unwrap();
    let busy = g.compute_stream().record().unwrap();
    g.copy_stream().wait(&busy).unwrap();
    let mut buf = g.alloc_on(data.len(), g.copy_stream()).unwrap();
    let copied = buf
        .copy_from_pinned(0, &pinned, 0..data.len(), g.copy_stream())
        .unwrap();
    let before = std::time::Instant::now();
    drop(buf);
    let took = before.elapsed();
    assert!(!copied.is_complete().unwrap(), "the copy is still queued");
    assert!(
        took < Duration::from_millis(250),
        "drop blocked for {took:?}"
    );
    assert_eq!(g.live_bytes(), 0);
    g.synchronize().unwrap();
}

#[test]
fn a_steady_state_of_allocations_takes_nothing_from_the_driver() {
    let Some(set) = DeviceSet::cuda_for_gpu_tests() else {
        return;
    };
    let g = set.gpu(0).unwrap();
    let sizes = [3 * MIB, 17 * 1024, 64 * MIB, 1000, 5 * MIB];
    let round = || {
        let bufs: Vec<_> = sizes.iter().map(|&n| g.alloc_zeroed(n).unwrap()).collect();
        drop(bufs);
    };
    round();
    round();
    let after_two = g.driver_allocations();
    for _ in 0..20 {
        round();
    }
    assert_eq!(g.driver_allocations(), after_two);
    assert_eq!(g.live_bytes(), 0);
    // What the pool keeps counts as free, and can be handed back.
    let before = g.memory().unwrap().free;
    g.release_cached_memory().unwrap();
    let after = g.memory().unwrap().free;
    assert!(after + 8 * MIB as u64 >= before, "{before} -> {after}");
}

#[test]
fn memsets_and_host_copies_are_ordered_on_the_buffers_stream() {
    let Some(set) = DeviceSet::cuda_for_gpu_tests() else {
        return;
    };
    let g = set.gpu(0).unwrap();
    // The copy stream is held up by a kernel: a zeroed buffer allocated
    // there, then written from the host and read back, must still come out
    // in order.
    g.compute_stream()
        .busy_wait(Duration::from_millis(100))
        .unwrap();
    let busy = g.compute_stream().record().unwrap();
    g.copy_stream().wait(&busy).unwrap();
    let mut buf = g.alloc_zeroed_on(4 * MIB, g.copy_stream()).unwrap();
    let data = pattern(MIB, 13);
    buf.copy_from_host(MIB, &data).unwrap();
    let mut back = vec![1u8; 4 * MIB];
    buf.copy_to_host(0, &mut back).unwrap();
    assert!(back[..MIB].iter().all(|&b| b == 0));
    assert_eq!(&back[MIB..2 * MIB], &data[..]);
    assert!(back[2 * MIB..].iter().all(|&b| b == 0));
}

#[test]
fn the_reader_pool_uploads_a_file_through_pinned_slots() {
    let Some(set) = DeviceSet::cuda_for_gpu_tests() else {
        return;
    };
    let g = set.gpu(0).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("weights.bin");
    let data = pattern(40 * MIB + 777, 14);
    std::fs::write(&path, &data).unwrap();
    let pool = set
        .reader_pool(bm_device::ReaderOptions {
            slot_bytes: 4 * MIB,
            ..Default::default()
        })
        .unwrap();
    assert!(pool.is_pinned());
    for direct in [false, true] {
        let file = bm_device::SourceFile::open(&path, direct).unwrap();
        let range = 4099..data.len() as u64;
        let n = (range.end - range.start) as usize;
        let mut buf = g.alloc_on(n, g.copy_stream()).unwrap();
        pool.upload_from_file(&file, range.clone(), &mut buf, 0, g.copy_stream())
            .unwrap()
            .synchronize()
            .unwrap();
        let mut back = vec![0u8; n];
        buf.copy_to_host(0, &mut back).unwrap();
        assert!(
            back == data[range.start as usize..],
            "direct: {}",
            file.is_direct()
        );
    }
}
