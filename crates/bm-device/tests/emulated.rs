//! The device API on host-emulated GPUs: what CI runs without a GPU.

use std::time::Duration;

use bm_device::{CudaLibrary, Device, DeviceSet, Error, GpuKind, PinnedPool};

const MIB: usize = 1 << 20;

/// Deterministic, position-dependent bytes, so misplaced chunks show.
fn pattern(len: usize, seed: u32) -> Vec<u8> {
    (0..len as u32)
        .map(|i| (i.wrapping_mul(2_654_435_761).wrapping_add(seed) >> 13) as u8)
        .collect()
}

#[test]
fn probe_never_panics_and_tells_the_truth() {
    let set = DeviceSet::probe();
    let status = set.cuda_status();
    assert_eq!(status.compiled, bm_device::CUDA_COMPILED);
    if !status.compiled {
        assert_eq!(set.gpu_count(), 0);
        assert_eq!(status.error.as_deref(), Some("built without CUDA support"));
        assert!(matches!(DeviceSet::cuda(), Err(Error::NotCompiledWithCuda)));
    } else if !status.driver_found {
        assert_eq!(set.gpu_count(), 0);
        let error = status.error.as_deref().unwrap();
        // The message lists where the driver was looked for.
        assert!(
            error.starts_with("no CUDA driver found: looked for libcuda.so.1, libcuda.so"),
            "{error}"
        );
        assert!(error.contains("/usr/local/nvidia/lib64"), "{error}");
        assert!(matches!(
            DeviceSet::cuda(),
            Err(Error::LibraryNotFound {
                library: CudaLibrary::Driver,
                ..
            })
        ));
        // NVRTC and cuBLAS are then never loaded, and say why.
        let libraries = set.cuda_libraries();
        assert_eq!(libraries.len(), CudaLibrary::ALL.len());
        assert!(
            libraries
                .iter()
                .all(|l| l.path.is_none() && l.error.is_some())
        );
    } else {
        // A driver is present: every GPU it shows is CUDA-backed.
        assert!(set.gpus().iter().all(|g| g.kind() == GpuKind::Cuda));
    }
    assert!(!set.is_emulated());
    assert!(set.memory_info().unwrap().host.available > 0);
}

#[test]
fn error_messages_are_exact() {
    let searched = bm_device::Searched {
        names: vec!["libnvrtc.so.13".into(), "libnvrtc.so".into()],
        dirs: vec!["/usr/local/cuda/lib64".into()],
        refused: vec![("/x/libnvrtc.so.13".into(), "invalid ELF header".into())],
    };
    let driver = Error::LibraryNotFound {
        library: CudaLibrary::Driver,
        searched: searched.clone(),
    };
    assert!(driver.to_string().starts_with("no CUDA driver found: "));
    assert_eq!(
        Error::LibraryNotFound {
            library: CudaLibrary::Nvrtc,
            searched
        }
        .to_string(),
        "NVRTC (libnvrtc), which compiles the GPU compute kernels, was not found: looked for \
         libnvrtc.so.13, libnvrtc.so through the dynamic loader (LD_LIBRARY_PATH, ld.so.cache) \
         and in /usr/local/cuda/lib64; /x/libnvrtc.so.13 did not load: invalid ELF header"
    );
    assert_eq!(
        Error::NotCompiledWithCuda.to_string(),
        "built without CUDA support"
    );
}

#[test]
fn emulated_devices_are_addressed_like_gpus() {
    let set = DeviceSet::emulated(&[1000, 2000]);
    assert!(set.is_emulated());
    assert_eq!(set.gpu_count(), 2);
    assert_eq!(set.gpu_kind(), Some(GpuKind::Emulated));
    let g1 = set.gpu(1).unwrap();
    assert_eq!(g1.device(), Device::Gpu(1));
    assert_eq!(g1.device().to_string(), "1");
    assert_eq!((g1.total_bytes(), g1.budget()), (2000, 2000));
    let m = set.memory_info().unwrap();
    assert_eq!(m.gpus.len(), 2);
    assert_eq!((m.gpus[0].free, m.gpus[0].total), (1000, 1000));
    assert_eq!(set.default_budgets().unwrap().gpus, vec![1000, 2000]);
    assert!(set.enable_peer_access().unwrap().is_empty());
}

#[test]
fn ordinal_out_of_range_is_a_typed_error() {
    let set = DeviceSet::emulated(&[1000]);
    let err = set.gpu(3).unwrap_err();
    assert!(
        matches!(
            err,
            Error::OrdinalOutOfRange {
                ordinal: 3,
                count: 1
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("ordinal 3"), "{err}");
    assert!(DeviceSet::cpu_only().gpu(0).is_err());
}

#[test]
fn budget_larger_than_device_is_refused() {
    let set = DeviceSet::emulated(&[4096]);
    let g = set.gpu(0).unwrap();
    let err = g.set_budget(4097).unwrap_err();
    assert!(
        matches!(
            err,
            Error::BudgetLargerThanDevice {
                budget: 4097,
                total: 4096,
                ..
            }
        ),
        "{err}"
    );
    assert_eq!(g.budget(), 4096, "a refused budget changes nothing");
    g.set_budget(100).unwrap();
    assert_eq!(g.budget(), 100);
}

#[test]
fn bad_allocations_are_typed_errors_and_leak_nothing() {
    let set = DeviceSet::emulated(&[u64::MAX, 10 * MIB as u64]);
    let big = set.gpu(0).unwrap();
    let small = set.gpu(1).unwrap();

    let err = small.alloc(0).unwrap_err();
    assert!(
        matches!(
            err,
            Error::ZeroSizedAllocation {
                device: Device::Gpu(1)
            }
        ),
        "{err}"
    );

    let err = small.alloc(usize::MAX).unwrap_err();
    assert!(matches!(err, Error::BudgetExceeded { .. }), "{err}");
    assert!(err.to_string().contains("device 1"), "{err}");

    // Within an unlimited budget but beyond what the host can address.
    let err = big.alloc(usize::MAX / 2 + 1).unwrap_err();
    assert!(
        matches!(
            err,
            Error::OutOfMemory {
                device: Device::Gpu(0),
                ..
            }
        ),
        "{err}"
    );

    let a = small.alloc(6 * MIB).unwrap();
    let err = small.alloc(5 * MIB).unwrap_err();
    match &err {
        Error::BudgetExceeded {
            requested,
            live,
            budget,
            ..
        } => {
            assert_eq!(
                (*requested, *live, *budget),
                (5 * MIB as u64, 6 * MIB as u64, 10 * MIB as u64)
            )
        }
        other => panic!("expected BudgetExceeded, got {other}"),
    }
    let b = small.alloc(4 * MIB).unwrap();
    assert_eq!(small.live_bytes(), 10 * MIB as u64);
    assert_eq!(small.memory().unwrap().free, 0);
    drop(a);
    drop(b);
    assert_eq!((small.live_bytes(), big.live_bytes()), (0, 0));
    assert_eq!(small.peak_bytes(), 10 * MIB as u64);
    small.reset_peak();
    assert_eq!(small.peak_bytes(), 0);
}

#[test]
fn buffers_on_the_wrong_device_are_refused() {
    let set = DeviceSet::emulated(&[MIB as u64, MIB as u64]);
    let other_set = DeviceSet::emulated(&[MIB as u64]);
    let mut a = set.gpu(0).unwrap().alloc(1024).unwrap();
    let pool = set.pinned_pool(4096, 2).unwrap();
    let wrong = set.gpu(1).unwrap().copy_stream();
    let err = a.upload(0, &[1, 2, 3], &pool, wrong).unwrap_err();
    assert!(
        matches!(
            err,
            Error::WrongDevice {
                expected: Device::Gpu(0),
                found: Device::Gpu(1),
                ..
            }
        ),
        "{err}"
    );
    // Same ordinal, different set: still another device.
    let foreign = other_set.gpu(0).unwrap().copy_stream();
    assert!(matches!(
        a.upload(0, &[1], &pool, foreign),
        Err(Error::WrongDevice { .. })
    ));
    let b = set.gpu(1).unwrap().alloc(1024).unwrap();
    assert!(matches!(
        a.copy_from_device(0, &b, 0..10, wrong),
        Err(Error::WrongDevice { .. })
    ));
}

#[test]
fn out_of_bounds_copies_are_refused() {
    let set = DeviceSet::emulated(&[MIB as u64]);
    let g = set.gpu(0).unwrap();
    let mut a = g.alloc(100).unwrap();
    let err = a.copy_from_host(90, &[0; 20]).unwrap_err();
    assert!(
        matches!(
            err,
            Error::OutOfBounds {
                offset: 90,
                len: 20,
                size: 100,
                ..
            }
        ),
        "{err}"
    );
    assert!(a.copy_to_host(usize::MAX, &mut [0; 2]).is_err());
    let b = g.alloc(10).unwrap();
    assert!(a.copy_from_device(0, &b, 5..20, g.copy_stream()).is_err());
    let pool = set.pinned_pool(64, 2).unwrap();
    assert!(
        a.download(50, &mut [0; 51], &pool, g.copy_stream())
            .is_err()
    );
}

#[test]
fn host_round_trip_with_offsets() {
    let set = DeviceSet::emulated(&[MIB as u64]);
    let g = set.gpu(0).unwrap();
    let mut buf = g.alloc_zeroed(1000).unwrap();
    let data = pattern(300, 7);
    buf.copy_from_host(123, &data).unwrap();
    let mut back = vec![0u8; 1000];
    buf.copy_to_host(0, &mut back).unwrap();
    assert!(back[..123].iter().all(|&b| b == 0));
    assert_eq!(&back[123..423], &data[..]);
    assert!(back[423..].iter().all(|&b| b == 0));
}

#[test]
fn upload_and_download_through_the_staging_ring() {
    let set = DeviceSet::emulated(&[16 * MIB as u64]);
    let g = set.gpu(0).unwrap();
    // Slots much smaller than the data, and a length that is not a multiple.
    let pool = set.pinned_pool(4096, 3).unwrap();
    assert!(!pool.is_pinned());
    assert!(pool.fallback_reason().unwrap().contains("emulated"));
    let data = pattern(5 * 4096 + 17, 1);
    let mut buf = g.alloc(data.len() + 10).unwrap();
    let done = buf.upload(10, &data, &pool, g.copy_stream()).unwrap();
    g.compute_stream().wait(&done).unwrap();
    assert!(done.is_complete().unwrap());
    let mut back = vec![0u8; data.len()];
    buf.download(10, &mut back, &pool, g.copy_stream()).unwrap();
    assert_eq!(back, data);
}

#[test]
fn pinned_registered_and_device_copies() {
    let set = DeviceSet::emulated(&[MIB as u64, MIB as u64]);
    let (g0, g1) = (set.gpu(0).unwrap(), set.gpu(1).unwrap());
    let data = pattern(10_000, 3);

    let mut pinned = set.alloc_pinned(data.len()).unwrap();
    pinned.as_mut_slice().unwrap().copy_from_slice(&data);
    let mut a = g0.alloc(data.len()).unwrap();
    a.copy_from_pinned(0, &pinned, 0..data.len(), g0.copy_stream())
        .unwrap();

    // Device to device across ordinals, a sub-range.
    let mut b = g1.alloc_zeroed(data.len()).unwrap();
    let e = b
        .copy_from_device(100, &a, 0..5000, g1.copy_stream())
        .unwrap();
    g1.compute_stream().wait(&e).unwrap();
    let mut out = set.alloc_pinned(5000).unwrap();
    b.copy_to_pinned(100, &mut out, 0, 5000, g1.copy_stream())
        .unwrap();
    assert_eq!(out.as_slice().unwrap(), &data[..5000]);

    // Registered host memory: falls back cleanly on emulated devices.
    let reg = set.register_host(&data);
    assert!(!reg.is_registered());
    assert!(reg.fallback_reason().is_some());
    let mut c = g0.alloc_zeroed(4000).unwrap();
    c.copy_from_registered(0, &reg, 6000..10_000, g0.copy_stream())
        .unwrap();
    let mut back = vec![0; 4000];
    c.copy_to_host(0, &mut back).unwrap();
    assert_eq!(back, &data[6000..]);
}

#[test]
fn streams_and_events_are_trivially_ordered() {
    let set = DeviceSet::emulated(&[MIB as u64]);
    let g = set.gpu(0).unwrap();
    let compute = g.compute_stream();
    let copy = g.copy_stream();
    assert_eq!(compute.device(), Device::Gpu(0));
    let start = compute.record_timed().unwrap();
    compute.busy_wait(Duration::from_millis(20)).unwrap();
    let end = compute.record_timed().unwrap();
    assert!(end.is_complete().unwrap());
    assert!(end.elapsed_since(&start).unwrap() >= Duration::from_millis(20));
    copy.wait(&end).unwrap();
    copy.synchronize().unwrap();
    g.synchronize().unwrap();
}

#[test]
fn a_pool_is_shared_between_threads() {
    let set = DeviceSet::emulated(&[64 * MIB as u64]);
    let g = set.gpu(0).unwrap();
    let pool = set.pinned_pool(8192, 2).unwrap();
    std::thread::scope(|s| {
        for t in 0..4u32 {
            let (g, pool) = (g.clone(), &pool);
            s.spawn(move || {
                let data = pattern(100_000 + t as usize, t);
                let mut buf = g.alloc(data.len()).unwrap();
                buf.upload(0, &data, pool, g.copy_stream()).unwrap();
                let mut back = vec![0; data.len()];
                buf.download(0, &mut back, pool, g.copy_stream()).unwrap();
                assert_eq!(back, data);
            });
        }
    });
    assert_eq!(g.live_bytes(), 0);
}

#[test]
fn bad_pool_sizes_are_refused() {
    let set = DeviceSet::emulated(&[MIB as u64]);
    assert!(matches!(
        set.pinned_pool(0, 2),
        Err(Error::ZeroSizedAllocation { .. })
    ));
    assert!(matches!(
        set.pinned_pool(4096, 0),
        Err(Error::ZeroSizedAllocation { .. })
    ));
    assert!(set.alloc_pinned(0).is_err());
    assert_eq!(PinnedPool::DEFAULT_SLOTS, 4);
}

#[test]
fn handles_are_send_and_sync() {
    fn check<T: Send + Sync>() {}
    check::<DeviceSet>();
    check::<bm_device::Gpu>();
    check::<bm_device::DeviceBuffer>();
    check::<bm_device::PinnedBuffer>();
    check::<PinnedPool>();
    check::<bm_device::Stream>();
    check::<bm_device::Event>();
}
