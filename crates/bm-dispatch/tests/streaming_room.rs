//! The planner's ledger charges streaming room where the runtime allocates
//! it: on a GPU that executes offloaded layers, the running layer and the
//! prefetched one; on the CPU, nothing, since offloaded layers run there
//! from their mapping in place. Its host staging is what a model that uses
//! a GPU keeps for uploads. Host allocations are counted by this test
//! binary's global allocator, so the file holds this one test.

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bm_device::DeviceSet;
use bm_dispatch::{
    Activations, DispatchOptions, LoadOptions, Model, ModelBuilder, STAGING_BYTES, dispatch_model,
    host_staging_bytes, load_checkpoint_in_model,
};
use bm_plan::{DeviceMap, Ledger, LedgerItem, PlanOptions};
use bm_shard::Checkpoint;
use bm_tensor::DType;

/// Counts the bytes the process holds on the heap, and their peak.
struct Counting;

static LIVE: AtomicU64 = AtomicU64::new(0);
static PEAK: AtomicU64 = AtomicU64::new(0);

fn grew(bytes: usize) {
    let now = LIVE.fetch_add(bytes as u64, Ordering::Relaxed) + bytes as u64;
    PEAK.fetch_max(now, Ordering::Relaxed);
}

// SAFETY: every call is forwarded to the system allocator unchanged; the
// counters only observe the sizes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract, passed on.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            grew(layout.size());
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract, passed on.
        unsafe { System.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size() as u64, Ordering::Relaxed);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: the caller's contract, passed on.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            LIVE.fetch_sub(layout.size() as u64, Ordering::Relaxed);
            grew(new_size);
        }
        p
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

const WIDTH: usize = 256;
const LAYERS: usize = 4;
/// One layer's weight and bias, in F32.
const LAYER_BYTES: u64 = ((WIDTH * WIDTH + WIDTH) * 4) as u64;
/// What a pass's (or a small model's) bookkeeping may allocate on the host
/// besides weights (the residency table, prefetch jobs, guards, names):
/// far below one layer.
const BOOKKEEPING: u64 = 32 << 10;

fn model_on(devices: DeviceSet, map: &DeviceMap, dir: &std::path::Path) -> Model {
    let mut b = ModelBuilder::new("Stack");
    for i in 0..LAYERS {
        b.linear(
            ModelBuilder::ROOT,
            &i.to_string(),
            WIDTH,
            WIDTH,
            true,
            DType::F32,
        )
        .unwrap();
    }
    let tensors: Vec<(String, Vec<usize>, Vec<f32>)> = (0..LAYERS)
        .flat_map(|i| {
            [
                (
                    format!("{i}.weight"),
                    vec![WIDTH, WIDTH],
                    common::values(i as u32, WIDTH * WIDTH),
                ),
                (
                    format!("{i}.bias"),
                    vec![WIDTH],
                    common::values(100 + i as u32, WIDTH),
                ),
            ]
        })
        .collect();
    let path = dir.join("model.safetensors");
    common::write_safetensors(&path, &tensors);
    let offload = dir.join("offload");
    let model = Model::empty(b.build().unwrap(), Arc::new(devices)).unwrap();
    let load = LoadOptions {
        offload_folder: Some(offload.clone()),
        ..LoadOptions::default()
    };
    load_checkpoint_in_model(&model, &Checkpoint::open(&path).unwrap(), Some(map), &load).unwrap();
    let dispatch = DispatchOptions {
        offload_dir: Some(offload),
        prefetch_depth: 1,
        ..DispatchOptions::default()
    };
    dispatch_model(&model, map, &dispatch).unwrap();
    model
}

/// The ledger of `map`, prefetching one layer as the model was dispatched,
/// with the host staging of a model that uses a GPU when `gpu`.
fn ledger_of(model: &Model, map: &DeviceMap, gpu: bool) -> Ledger {
    let staging = (
        bm_plan::Device::Cpu,
        LedgerItem::Staging,
        host_staging_bytes(),
    );
    let options = PlanOptions {
        prefetch_depth: 1,
        overheads: if gpu { vec![staging] } else { Vec::new() },
        ..PlanOptions::default()
    };
    bm_plan::auto::ledger(model.tree(), map, &options).unwrap()
}

/// Runs every layer once. In an offloaded layer, waits until the next
/// offloaded layer's weights are prefetched, the most a pass holds at once.
fn pass(model: &Model, offloaded: &[usize], on_each: impl Fn(usize, &mut bm_dispatch::Forward)) {
    for i in 0..LAYERS {
        let mut g = model.enter(&i.to_string(), Activations::default()).unwrap();
        on_each(i, &mut g);
        if offloaded.contains(&i) && offloaded.last() != Some(&i) {
            // Two tensors of this layer and two of the next.
            let deadline = Instant::now() + Duration::from_secs(60);
            while model.materialised().0 < 4 && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(2));
            }
            assert_eq!(model.materialised().0, 4, "layer {}'s prefetch", i + 1);
        }
        g.exit(Activations::default()).unwrap();
    }
}

#[test]
fn the_ledger_charges_streaming_room_where_the_runtime_allocates_it() {
    // Offloaded layers executing on a GPU: the running one and the one
    // prefetched are copied there.
    let map =
        DeviceMap::from_json(&serde_json::json!({"0": 0, "1": "disk", "2": "disk", "3": "cpu"}))
            .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let host_before = LIVE.load(Ordering::Relaxed);
    let model = model_on(DeviceSet::emulated(&[16 << 20]), &map, dir.path());
    let gpu = model.devices().gpu(0).unwrap();
    let ledger = ledger_of(&model, &map, true);
    // The host holds layer 3 and the staging of uploads (the emulated GPU's
    // memory is host memory too: not counted here). No load casts, so the
    // host cast's chunk the ledger keeps room for is not allocated.
    let host = LIVE.load(Ordering::Relaxed) - host_before - gpu.live_bytes();
    let charged = ledger.total(bm_plan::Device::Cpu);
    assert!(
        host <= charged && charged - host <= STAGING_BYTES as u64 + BOOKKEEPING,
        "the host holds {host} bytes after loading, the ledger charges {charged}"
    );
    let (before, charged) = (
        gpu.live_bytes(),
        ledger.get(bm_plan::Device::Gpu(0), LedgerItem::Streaming),
    );
    gpu.reset_peak();
    pass(&model, &[1, 2, 3], |_, _| {});
    assert_eq!(charged, 2 * LAYER_BYTES);
    assert_eq!(gpu.peak_bytes() - before, charged);
    drop(model);

    // Offloaded layers executing on the CPU read the mapping in place: the
    // ledger charges no streaming room, and a pass allocates none.
    let map = DeviceMap::from_json(
        &serde_json::json!({"0": "cpu", "1": "disk", "2": "disk", "3": "disk"}),
    )
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let model = model_on(DeviceSet::cpu_only(), &map, dir.path());
    let charged = ledger_of(&model, &map, false).get(bm_plan::Device::Cpu, LedgerItem::Streaming);
    let before = LIVE.load(Ordering::Relaxed);
    PEAK.store(before, Ordering::Relaxed);
    pass(&model, &[1, 2, 3], |i, g| {
        let w = g.weight("weight").unwrap();
        let stored = model.weight(&format!("{i}.weight")).unwrap();
        assert!(w.bytes.is_mapped(), "layer {i}");
        assert!(
            Arc::ptr_eq(&w.bytes, &stored.bytes),
            "layer {i} runs in place"
        );
    });
    let allocated = PEAK.load(Ordering::Relaxed).saturating_sub(before);
    assert!(
        allocated.abs_diff(charged) <= BOOKKEEPING,
        "a pass allocated at most {allocated} host bytes, the ledger charges {charged} of streaming room"
    );
    assert_eq!(charged, 0);
}
