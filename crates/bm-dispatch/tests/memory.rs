//! Memory bounds measured with a counting global allocator: empty init of
//! a 100B-parameter model allocates a few MB, and loading keeps peak heap
//! at the CPU-resident part plus bounded staging.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use bm_device::DeviceSet;
use bm_dispatch::{LoadOptions, Model, ModelBuilder, STAGING_BYTES, load_checkpoint_in_model};
use bm_plan::DeviceMap;
use bm_shard::Checkpoint;
use bm_tensor::DType;

struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

// SAFETY: defers to the system allocator; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let live = LIVE.fetch_add(layout.size(), Ordering::Relaxed) + layout.size();
        PEAK.fetch_max(live, Ordering::Relaxed);
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
        // SAFETY: same contract as the caller's.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// Peak heap growth while `f` runs.
fn peak_growth<T>(f: impl FnOnce() -> T) -> (T, usize) {
    let base = LIVE.load(Ordering::SeqCst);
    PEAK.store(base, Ordering::SeqCst);
    let out = f();
    (out, PEAK.load(Ordering::SeqCst) - base)
}

// One test function: the counters are process-wide, so the two
// measurements must not run in parallel.
#[test]
fn empty_init_and_loading_stay_within_their_memory_bounds() {
    // Sequential(1000 x Linear(10000, 10000)): 100B parameters, no bytes.
    let (model, grew) = peak_growth(|| {
        let mut b = ModelBuilder::new("Sequential");
        for i in 0..1000 {
            b.linear(
                ModelBuilder::ROOT,
                &i.to_string(),
                10_000,
                10_000,
                true,
                DType::F32,
            )
            .unwrap();
        }
        Model::empty(b.build().unwrap(), Arc::new(DeviceSet::cpu_only())).unwrap()
    });
    assert_eq!(model.tree().parameter_count(), 100_010_000_000);
    assert!(
        grew < 4 << 20,
        "empty init of 100B parameters took {grew} bytes"
    );
    drop(model);

    // 32 layers of 1 MiB F32 weights; two stay on the CPU (as F16, cast),
    // the rest go to disk through the offload folder (cast, so rewritten).
    let dir = tempfile::tempdir().unwrap();
    let side = 512;
    let layers = 32;
    let mut b = ModelBuilder::new("Sequential");
    let mut tensors = Vec::new();
    for i in 0..layers {
        b.linear(
            ModelBuilder::ROOT,
            &i.to_string(),
            side,
            side,
            false,
            DType::F32,
        )
        .unwrap();
        let bytes: Vec<u8> = (0..side * side)
            .flat_map(|k| ((k % 97) as f32 / 7.0).to_le_bytes())
            .collect();
        tensors.push((format!("{i}.weight"), bytes));
    }
    let path = dir.path().join("model.safetensors");
    write_f32_checkpoint(&path, &tensors, side);
    let ckpt = Checkpoint::open(&path).unwrap();
    let model = Model::empty(b.build().unwrap(), Arc::new(DeviceSet::cpu_only())).unwrap();
    let map =
        DeviceMap::from_json(&serde_json::json!({"0": "cpu", "1": "cpu", "": "disk"})).unwrap();
    let folder = tempfile::tempdir().unwrap();
    let options = LoadOptions {
        dtype: Some(DType::F16),
        offload_folder: Some(folder.path().to_path_buf()),
        ..LoadOptions::default()
    };
    let (report, grew) =
        peak_growth(|| load_checkpoint_in_model(&model, &ckpt, Some(&map), &options).unwrap());
    assert_eq!(report.written_to_folder.len(), layers - 2);
    let cpu_part = 2 * side * side * 2;
    let checkpoint_bytes = layers * side * side * 4;
    // Bookkeeping (names, index JSON) is small next to one tensor.
    let slack = 1 << 20;
    assert!(
        grew <= cpu_part + STAGING_BYTES + slack,
        "peak heap growth {grew} > CPU part {cpu_part} + staging {STAGING_BYTES} + {slack} (checkpoint {checkpoint_bytes})"
    );
}

fn write_f32_checkpoint(path: &std::path::Path, tensors: &[(String, Vec<u8>)], side: usize) {
    let mut header = serde_json::Map::new();
    let mut offset = 0;
    for (name, bytes) in tensors {
        header.insert(
            name.clone(),
            serde_json::json!({"dtype": "F32", "shape": [side, side], "data_offsets": [offset, offset + bytes.len()]}),
        );
        offset += bytes.len();
    }
    let mut text = serde_json::Value::Object(header).to_string();
    while !text.len().is_multiple_of(8) {
        text.push(' ');
    }
    use std::io::Write;
    let mut f = std::fs::File::create(path).unwrap();
    f.write_all(&(text.len() as u64).to_le_bytes()).unwrap();
    f.write_all(text.as_bytes()).unwrap();
    for (_, bytes) in tensors {
        f.write_all(bytes).unwrap();
    }
}
