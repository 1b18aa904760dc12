//! Emulated GPUs behind a simulated link: copies on the copy stream run on
//! a copy-engine thread at the link's speed, concurrently with the caller;
//! frees never block; uses on several streams are ordered by events; the
//! reader pool uploads files and mappings. What CI runs of the GPU data
//! path without a GPU. Timing assertions are orderings and lower bounds
//! the simulation guarantees, with generous upper bounds.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bm_device::{DeviceSet, Error, ReadSource, ReaderOptions, SimulatedLink, SourceFile};

const MIB: usize = 1 << 20;

fn pattern(len: usize, seed: u32) -> Vec<u8> {
    (0..len as u32)
        .map(|i| (i.wrapping_mul(2_654_435_761).wrapping_add(seed) >> 13) as u8)
        .collect()
}

/// 1 GB/s and 2 ms: a 4 MiB copy takes at least 6.2 ms.
fn link() -> SimulatedLink {
    SimulatedLink {
        bytes_per_second: 1e9,
        latency: Duration::from_millis(2),
    }
}

fn linked(capacities: &[u64]) -> DeviceSet {
    DeviceSet::emulated_with_link(capacities, link())
}

#[test]
fn a_copy_takes_the_link_time_while_the_caller_goes_on() {
    let set = linked(&[64 * MIB as u64]);
    let g = set.gpu(0).unwrap();
    assert_eq!(g.link(), Some(link()));
    let data = pattern(32 * MIB, 1);
    let mut pinned = set.alloc_pinned(data.len()).unwrap();
    pinned.as_mut_slice().unwrap().copy_from_slice(&data);
    let mut buf = g.alloc_on(data.len(), g.copy_stream()).unwrap();

    // 32 MiB at 1 GB/s: at least 35.5 ms on the engine.
    let floor = link().transfer_time(data.len() as u64);
    let enqueued = Instant::now();
    let start = g.copy_stream().record_timed().unwrap();
    buf.copy_from_pinned(0, &pinned, 0..data.len(), g.copy_stream())
        .unwrap();
    let end = g.copy_stream().record_timed().unwrap();
    let returned = enqueued.elapsed();
    // The caller got control back before the copy could have finished.
    assert!(!end.is_complete().unwrap(), "returned after {returned:?}");

    // Host "compute" meanwhile: both take about the same time, together
    // about as long as one of them.
    g.compute_stream().busy_wait(floor).unwrap();
    end.synchronize().unwrap();
    let both = enqueued.elapsed();
    let copy = end.elapsed_since(&start).unwrap();
    assert!(copy >= floor, "{copy:?} < {floor:?}");
    assert!(copy < floor * 20 + Duration::from_secs(1), "{copy:?}");
    assert!(both < floor * 20 + Duration::from_secs(1), "{both:?}");

    let mut back = vec![0u8; data.len()];
    buf.copy_to_host(0, &mut back).unwrap();
    assert_eq!(back, data);
}

#[test]
fn copies_on_the_copy_stream_complete_in_order() {
    let set = linked(&[16 * MIB as u64]);
    let g = set.gpu(0).unwrap();
    let mut pinned = set.alloc_pinned(MIB).unwrap();
    pinned.as_mut_slice().unwrap().fill(7);
    let mut bufs: Vec<_> = (0..4).map(|_| g.alloc(MIB).unwrap()).collect();
    let events: Vec<_> = bufs
        .iter_mut()
        .map(|b| {
            b.copy_from_pinned(0, &pinned, 0..MIB, g.copy_stream())
                .unwrap()
        })
        .collect();
    events[3].synchronize().unwrap();
    for e in &events {
        assert!(e.is_complete().unwrap());
    }
    let ends: Vec<Duration> = events
        .iter()
        .map(|e| e.elapsed_since(&events[0]).unwrap())
        .collect();
    assert!(ends.windows(2).all(|w| w[0] <= w[1]), "{ends:?}");
}

#[test]
fn dropping_a_buffer_under_a_copy_returns_its_budget_at_once() {
    // A copy of at least a second, so that a drop which waited for it
    // cannot be mistaken for a slow (loaded) test machine.
    let slow = SimulatedLink {
        latency: Duration::from_secs(1),
        ..link()
    };
    let set = DeviceSet::emulated_with_link(&[64 * MIB as u64], slow);
    let g = set.gpu(0).unwrap();
    let pinned = set.alloc_pinned(32 * MIB).unwrap();
    let mut buf = g.alloc(32 * MIB).unwrap();
    assert_eq!(g.live_bytes(), 32 * MIB as u64);
    let copied = buf
        .copy_from_pinned(0, &pinned, 0..32 * MIB, g.copy_stream())
        .unwrap();
    drop(buf);
    // The drop did not wait for the copy, and the budget is back.
    assert!(!copied.is_complete().unwrap());
    assert_eq!(g.live_bytes(), 0);
    let again = g.alloc(64 * MIB).unwrap();
    copied.synchronize().unwrap();
    drop(again);
    assert_eq!((g.live_bytes(), g.peak_bytes()), (0, 64 * MIB as u64));
}

#[test]
fn uses_on_two_streams_are_ordered_by_events() {
    let set = linked(&[64 * MIB as u64]);
    let g = set.gpu(0).unwrap();
    let data = pattern(8 * MIB, 2);
    let pool = set.pinned_pool(MIB, 3).unwrap();
    // Filled on the (asynchronous) copy stream, read back from the compute
    // stream: the read waits for every slot's copy.
    let mut buf = g.alloc_on(data.len(), g.copy_stream()).unwrap();
    assert_eq!(buf.home_stream().role(), bm_device::StreamRole::Copy);
    buf.upload(0, &data, &pool, g.copy_stream()).unwrap();
    let mut other = g.alloc_zeroed(data.len()).unwrap();
    other
        .copy_from_device(0, &buf, 0..data.len(), g.compute_stream())
        .unwrap();
    let mut back = vec![0u8; data.len()];
    other.copy_to_host(0, &mut back).unwrap();
    assert_eq!(back, data);
    // And a download through the pool on the copy stream.
    let mut down = vec![0u8; data.len()];
    other
        .download(0, &mut down, &pool, g.copy_stream())
        .unwrap();
    assert_eq!(down, data);
}

#[test]
fn a_host_copy_into_a_buffer_in_use_waits_for_that_use() {
    let set = linked(&[16 * MIB as u64]);
    let g = set.gpu(0).unwrap();
    let mut pinned = set.alloc_pinned(4 * MIB).unwrap();
    pinned.as_mut_slice().unwrap().fill(1);
    let mut buf = g.alloc(4 * MIB).unwrap();
    let first = buf
        .copy_from_pinned(0, &pinned, 0..4 * MIB, g.copy_stream())
        .unwrap();
    // A pageable copy over the same bytes must land after the queued one.
    buf.copy_from_host(0, &[2u8; 1000]).unwrap();
    assert!(first.is_complete().unwrap());
    let mut back = vec![0u8; 1001];
    buf.copy_to_host(0, &mut back).unwrap();
    assert!(back[..1000].iter().all(|&b| b == 2));
    assert_eq!(back[1000], 1);
}

#[test]
fn emulated_allocations_are_counted() {
    let set = DeviceSet::emulated(&[MIB as u64]);
    let g = set.gpu(0).unwrap();
    let before = g.driver_allocations();
    let a = g.alloc(100).unwrap();
    let b = g.alloc_zeroed(100).unwrap();
    assert_eq!(g.driver_allocations(), before + 2);
    drop((a, b));
    // A refused allocation takes nothing.
    assert!(g.alloc(2 * MIB).is_err());
    assert_eq!(g.driver_allocations(), before + 2);
    g.release_cached_memory().unwrap();
}

#[test]
fn the_reader_pool_uploads_files_and_mappings() {
    let set = linked(&[64 * MIB as u64]);
    let g = set.gpu(0).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("weights.bin");
    let data = pattern(5 * MIB + 4321, 3);
    std::fs::write(&path, &data).unwrap();
    let pool = set
        .reader_pool(ReaderOptions {
            threads: 3,
            slot_bytes: 256 * 1024,
            slots: 5,
        })
        .unwrap();
    assert_eq!((pool.threads(), pool.slot_bytes()), (3, 256 * 1024));
    assert!(
        !pool.is_pinned(),
        "emulated devices stage in pageable memory"
    );

    for direct in [false, true] {
        let file = SourceFile::open(&path, direct).unwrap();
        // An unaligned range across many slots, to an offset.
        let range = 1234..(data.len() as u64 - 77);
        let n = (range.end - range.start) as usize;
        let mut buf = g.alloc_on(n + 10, g.copy_stream()).unwrap();
        let done = pool
            .upload_from_file(&file, range.clone(), &mut buf, 10, g.copy_stream())
            .unwrap();
        done.synchronize().unwrap();
        let mut back = vec![0u8; n];
        buf.copy_to_host(10, &mut back).unwrap();
        assert!(
            back == data[range.start as usize..range.end as usize],
            "direct asked: {direct}, used: {}",
            file.is_direct()
        );
    }

    // Mapped (here: shared in-memory) bytes, from three threads at once.
    let bytes: Arc<Vec<u8>> = Arc::new(data.clone());
    std::thread::scope(|s| {
        for t in 0..3usize {
            let (pool, g, bytes) = (&pool, g.clone(), Arc::clone(&bytes));
            s.spawn(move || {
                let range = (t * 1000) as u64..(bytes.len() - t * 999) as u64;
                let n = (range.end - range.start) as usize;
                let mut buf = g.alloc(n).unwrap();
                pool.upload(
                    &ReadSource::Bytes(bytes.clone()),
                    range.clone(),
                    &mut buf,
                    0,
                    g.copy_stream(),
                )
                .unwrap();
                let mut back = vec![0u8; n];
                buf.copy_to_host(0, &mut back).unwrap();
                assert!(back == bytes[range.start as usize..range.end as usize]);
            });
        }
    });
    assert_eq!(g.live_bytes(), 0);
}

#[test]
fn reader_pool_errors_name_the_source_and_leave_the_pool_usable() {
    let set = DeviceSet::emulated(&[16 * MIB as u64, MIB as u64]);
    let g = set.gpu(0).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("shrinks.bin");
    let data = pattern(2 * MIB, 4);
    std::fs::write(&path, &data).unwrap();
    let pool = set
        .reader_pool(ReaderOptions {
            threads: 2,
            slot_bytes: 64 * 1024,
            slots: 3,
        })
        .unwrap();
    let file = SourceFile::open(&path, false).unwrap();
    let mut buf = g.alloc(2 * MIB).unwrap();

    // Beyond the file, beyond the buffer, another GPU's stream.
    let err = pool
        .upload_from_file(&file, 0..2 * MIB as u64 + 1, &mut buf, 0, g.copy_stream())
        .unwrap_err();
    assert!(matches!(err, Error::OutOfBounds { .. }), "{err}");
    let err = pool
        .upload_from_file(&file, 0..2 * MIB as u64, &mut buf, 1, g.copy_stream())
        .unwrap_err();
    assert!(matches!(err, Error::OutOfBounds { .. }), "{err}");
    let wrong = set.gpu(1).unwrap().copy_stream();
    let err = pool
        .upload_from_file(&file, 0..10, &mut buf, 0, wrong)
        .unwrap_err();
    assert!(matches!(err, Error::WrongDevice { .. }), "{err}");

    // The file shrinks after it was opened: a read error naming it.
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(MIB as u64)
        .unwrap();
    let err = pool
        .upload_from_file(&file, 0..2 * MIB as u64, &mut buf, 0, g.copy_stream())
        .unwrap_err();
    let text = err.to_string();
    assert!(matches!(err, Error::Read { .. }), "{text}");
    assert!(text.contains("shrinks.bin"), "{text}");

    // Every slot came back: the pool still works.
    let done = pool
        .upload_from_file(&file, 0..MIB as u64, &mut buf, 0, g.copy_stream())
        .unwrap();
    done.synchronize().unwrap();
    let mut back = vec![0u8; MIB];
    buf.copy_to_host(0, &mut back).unwrap();
    assert_eq!(back, &data[..MIB]);
    assert!(matches!(
        set.reader_pool(ReaderOptions {
            threads: 0,
            slot_bytes: 4096,
            slots: 1
        }),
        Err(Error::ZeroSizedAllocation { .. })
    ));
}
