//! The ledger's activation formula against a measured peak: a counting
//! allocator records the most heap bytes live during one decoder layer's
//! forward pass on the CPU (the tiny Llama, a prompt long enough that
//! activations dwarf bookkeeping), which must lie between half the
//! formula's peak and the formula's peak (bm-plan's
//! `ModelShape::activation_peak`).

use std::alloc::{GlobalAlloc, Layout, System};
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};

use bigmodel::plan::config::HfConfig;
use bigmodel::plan::{ModelShape, Workload};
use bm_models::{CausalLm, FolderWeights, Logits};
use bm_tensor::DType;

/// The system allocator, counting live bytes and their peak.
struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

// SAFETY: every call is forwarded to the system allocator unchanged; the
// counters only observe sizes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract is the system allocator's.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            let live = LIVE.fetch_add(layout.size(), Ordering::SeqCst) + layout.size();
            PEAK.fetch_max(live, Ordering::SeqCst);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `alloc` above with this layout.
        unsafe { System.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size(), Ordering::SeqCst);
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

#[test]
fn a_layers_measured_peak_is_within_the_ledgers_formula() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny-llama");
    let config = dir.join("config.json");
    let hf = HfConfig::parse(&std::fs::read_to_string(&config).unwrap(), &config).unwrap();
    let shape = ModelShape::of(&hf);
    let lm = CausalLm::open(&dir, Some(DType::F32)).unwrap();
    let weights = FolderWeights::open(&dir, Some(DType::F32)).unwrap();
    let decoder = lm.decoder();
    let n: usize = std::env::var("H16N").map_or(120, |v| v.parse().unwrap());
    let prompt: Vec<u32> = (0..n).map(|i| (i * 7 % 250) as u32 + 3).collect();
    let w = Workload {
        batch: 1,
        prompt_len: prompt.len() as u64,
        max_seq_len: prompt.len() as u64,
        all_logits: false,
    };
    // Warm up once (thread pools, rotary tables), then embed and run one
    // layer with a fresh cache, measuring only the layer.
    let mut cache = decoder.new_cache();
    decoder
        .forward(&weights, &prompt, &mut cache, Logits::Last)
        .unwrap();
    let positions: Vec<usize> = (0..prompt.len()).collect();
    let x = decoder.embed(&weights, &prompt, &positions).unwrap();
    let mut cache = decoder.new_cache();
    let before = LIVE.load(Ordering::SeqCst);
    PEAK.store(before, Ordering::SeqCst);
    let out = decoder
        .layer(&weights, 0, &x, &positions, &mut cache)
        .unwrap();
    let measured = PEAK.load(Ordering::SeqCst) - before;
    drop(out);
    // The formula counts the layer's input, held by the caller here.
    let input = shape.embedding_peak(&w, 4);
    let kv = shape.kv_bytes_per_layer(&w, 4);
    let formula = shape.activation_peak(&w, 4);
    let measured_with_input = measured as u64 + input;
    println!("measured {measured_with_input} (KV {kv} within), formula {formula} + KV {kv}");
    assert!(
        measured_with_input <= formula + 2 * kv,
        "measured {measured_with_input} over formula {formula} + KV {kv} (a growing Vec may hold twice its length)"
    );
    assert!(
        measured_with_input * 2 >= formula,
        "measured {measured_with_input} under half the formula {formula}"
    );
}
