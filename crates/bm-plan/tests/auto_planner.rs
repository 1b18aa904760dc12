//! bigmodel's own planner: better than Accelerate on the cases where
//! Accelerate leaves devices empty, and always within budgets.

mod common;

use bm_plan::auto::plan;
use bm_plan::{
    Device, DeviceMap, MaxMemory, Mode, ModuleSizes, ModuleTree, Node, PlanOptions, SizeOptions,
};
use bm_tensor::DType;
use common::{Tree, as_map, expect, mm};

fn options(memory: MaxMemory, no_split: &[&str], mode: Mode) -> PlanOptions {
    PlanOptions {
        max_memory: memory,
        max_memory_from_user: true,
        no_split: no_split.iter().map(|s| s.to_string()).collect(),
        mode,
        explain: true,
        ..PlanOptions::default()
    }
}

fn tiny_gpt() -> ModuleTree {
    let mut t = Tree::new("TinyGPT");
    t.module("wte", "Embedding");
    t.param("wte.weight", &[1000, 64]);
    t.module("h", "ModuleList");
    for i in 0..6 {
        let b = format!("h.{i}");
        t.module(&b, "Block");
        t.layernorm(&format!("{b}.ln"), 64);
        t.linear(&format!("{b}.attn"), 64, 192);
        t.linear(&format!("{b}.proj"), 64, 64);
        t.module(&format!("{b}.mlp"), "Sequential");
        t.linear(&format!("{b}.mlp.0"), 64, 256);
        t.module(&format!("{b}.mlp.1"), "GELU");
        t.linear(&format!("{b}.mlp.2"), 256, 64);
    }
    t.layernorm("ln_f", 64);
    t.linear_no_bias("lm_head", 64, 1000);
    t.tie(&["lm_head.weight", "wte.weight"]);
    t.build()
}

fn seq10() -> ModuleTree {
    let mut t = Tree::new("Sequential");
    for i in 1..=10 {
        t.linear(&format!("linear{i}"), 100, 100);
    }
    t.build()
}

/// Bytes per device from a device map.
fn bytes_per_device(tree: &ModuleTree, map: &DeviceMap) -> std::collections::BTreeMap<Device, u64> {
    let sizes = ModuleSizes::compute(tree, &SizeOptions::default());
    let mut out = std::collections::BTreeMap::new();
    for (name, device) in map.iter() {
        let node = tree.find(name).unwrap();
        *out.entry(device).or_insert(0) += sizes.of(node);
    }
    out
}

/// Invariants of every plan: covers the model, within budgets.
fn check(tree: &ModuleTree, opts: &PlanOptions) -> bm_plan::Plan {
    let p = plan(tree, opts).unwrap();
    bm_plan::check_device_map(tree, &p.device_map).unwrap();
    for (device, bytes) in bytes_per_device(tree, &p.device_map) {
        if let Some(budget) = opts.max_memory.get(device) {
            assert!(
                bytes <= budget,
                "{device}: {bytes} > {budget}\n{:#?}",
                p.trace
            );
        }
    }
    let from_plan: std::collections::BTreeMap<Device, u64> =
        p.device_bytes.iter().copied().collect();
    assert_eq!(from_plan, bytes_per_device(tree, &p.device_map));
    p
}

#[test]
fn tiny_gpt_uses_both_gpus_where_accelerate_leaves_gpu0_empty() {
    let tree = tiny_gpt();
    let opts = options(
        mm(&[("0", 400_000), ("1", 400_000), ("cpu", 1_000_000_000)]),
        &["Block"],
        Mode::Sequential,
    );
    let p = check(&tree, &opts);
    let bytes = bytes_per_device(&tree, &p.device_map);
    // Accelerate: {"wte":1,"lm_head":1,"ln_f":"cpu","h":"cpu"}: 256000 bytes on GPUs.
    assert!(
        bytes[&Device::Gpu(0)] > 0 && bytes[&Device::Gpu(1)] > 0,
        "{:?}\n{:#?}",
        p.device_map,
        p.trace
    );
    assert!(bytes[&Device::Gpu(0)] + bytes[&Device::Gpu(1)] > 256_000);
    assert!(!bytes.contains_key(&Device::Disk));
}

#[test]
fn model_a_keeps_what_it_can_in_ram_where_accelerate_sends_all_to_disk() {
    let mut t = Tree::new("ModelA");
    t.param("a", &[100, 100]);
    t.param("b", &[100, 100]);
    t.linear("layer", 100, 100);
    let tree = t.build();
    let p = check(
        &tree,
        &options(mm(&[("0", 80_000), ("cpu", 80_000)]), &[], Mode::Sequential),
    );
    // GPU 0 cannot hold a layer and the 40000-byte streaming reserve; RAM holds a and b.
    assert_eq!(
        as_map(&p),
        expect(&[("a", "cpu"), ("b", "cpu"), ("layer", "disk")])
    );
}

#[test]
fn no_reserve_when_nothing_is_offloaded() {
    // Accelerate reserves the largest layer on GPU 0 even when all fits:
    // ModelForTest {0:200,1:200} puts only linear1 on 0. Everything fits on 0 here.
    let tree = common::model_for_test();
    let p = check(
        &tree,
        &options(mm(&[("0", 236), ("1", 200)]), &[], Mode::Sequential),
    );
    assert_eq!(as_map(&p), expect(&[("", "0")]));
    assert!(
        p.trace.iter().any(|l| l.contains("no streaming reserve")),
        "{:#?}",
        p.trace
    );
}

#[test]
fn back_fill_before_offloading_to_a_slower_tier() {
    let mut t = Tree::new("Sequential");
    // 70, 50 and 25 bytes: F32 params of 17.5 elements are impossible, so use U8.
    t.dtype = DType::U8;
    for (i, n) in [(1, 70), (2, 50), (3, 25)] {
        t.module(&format!("l{i}"), "Leaf");
        t.param(&format!("l{i}.w"), &[n]);
    }
    let tree = t.build();
    let p = check(
        &tree,
        &options(mm(&[("0", 100), ("cpu", 60)]), &[], Mode::Sequential),
    );
    // No unit on a slower tier while a faster device has room for it.
    let sizes = ModuleSizes::compute(&tree, &SizeOptions::default());
    let bytes = bytes_per_device(&tree, &p.device_map);
    for (name, device) in p.device_map.iter() {
        let size = sizes.of(tree.find(name).unwrap());
        if device == Device::Disk {
            assert!(
                bytes.get(&Device::Cpu).copied().unwrap_or(0) + size > 60,
                "{name} could stay in RAM"
            );
        }
    }
    // l1 (70) fits neither GPU 0 nor RAM (60) and streams from disk, so GPU 0
    // keeps 70 bytes free; l2 stays in RAM and l3 still lands on the GPU.
    assert_eq!(
        as_map(&p),
        expect(&[("l1", "disk"), ("l2", "cpu"), ("l3", "0")]),
        "{:#?}",
        p.trace
    );
}

#[test]
fn balanced_spreads_evenly_and_low_0_spares_gpu_0() {
    let tree = seq10();
    let memory = mm(&[
        ("0", 300_000),
        ("1", 300_000),
        ("2", 300_000),
        ("cpu", 1_000_000_000),
    ]);
    let p = check(&tree, &options(memory.clone(), &[], Mode::Balanced));
    let bytes = bytes_per_device(&tree, &p.device_map);
    assert_eq!(
        bytes.values().copied().collect::<Vec<_>>(),
        vec![4 * 40400, 4 * 40400, 2 * 40400]
    );
    let p = check(&tree, &options(memory, &[], Mode::BalancedLow0));
    let bytes = bytes_per_device(&tree, &p.device_map);
    assert_eq!(bytes.get(&Device::Gpu(0)), None);
    assert_eq!(bytes[&Device::Gpu(1)], 5 * 40400);
    // Balanced GPUs get their caps reported in max_memory.
    let p = check(
        &tree,
        &options(mm(&[("0", 300_000), ("1", 300_000)]), &[], Mode::Auto),
    );
    assert_eq!(p.max_memory.get(Device::Gpu(0)), Some(5 * 40400));
}

#[test]
fn disk_budget_is_honoured_and_failure_says_by_how_much() {
    let tree = seq10();
    let err = plan(
        &tree,
        &options(
            mm(&[("0", 100_000), ("cpu", 100_000), ("disk", 100_000)]),
            &[],
            Mode::Sequential,
        ),
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("does not fit"), "{err}");
    assert!(
        err.contains("0: asked") && err.contains("cpu: asked") && err.contains("disk: asked"),
        "{err}"
    );
    assert!(err.contains("short by"), "{err}");
    // With enough disk it plans.
    check(
        &tree,
        &options(
            mm(&[("0", 100_000), ("cpu", 100_000), ("disk", 1_000_000)]),
            &[],
            Mode::Sequential,
        ),
    );
}

#[test]
fn reserve_and_runtime_bytes_are_charged() {
    let tree = seq10();
    let mut opts = options(
        mm(&[("0", 404_000), ("cpu", 1_000_000)]),
        &[],
        Mode::Sequential,
    );
    let p = check(&tree, &opts);
    assert_eq!(as_map(&p), expect(&[("", "0")]));
    opts.reserve = mm(&[("0", 40_400)]);
    let p = check(&tree, &opts);
    let bytes = bytes_per_device(&tree, &p.device_map);
    assert!(
        bytes[&Device::Gpu(0)] <= 404_000 - 40_400 - 40_400,
        "streaming reserve plus user reserve: {bytes:?}"
    );
    // 10 000 runtime bytes per layer: fewer layers fit on GPU 0.
    opts.reserve = MaxMemory::default();
    opts.runtime_bytes = (1..=10)
        .map(|i| match tree.find(&format!("linear{i}")) {
            Some(Node::Module(m)) => (m, 10_000),
            other => panic!("{other:?}"),
        })
        .collect();
    let p = check(&tree, &opts);
    let on_gpu = p
        .device_map
        .iter()
        .filter(|(_, d)| *d == Device::Gpu(0))
        .count();
    assert!(on_gpu < 10 && on_gpu > 0, "{:?}", p.device_map);
    // A reserve for a device without a budget is an error.
    opts.reserve = mm(&[("1", 5)]);
    assert!(plan(&tree, &opts).is_err());
}

#[test]
fn unknown_no_split_class_warns() {
    let p = check(
        &seq10(),
        &options(mm(&[("0", 1_000_000)]), &["LlamaDecoderLayer"], Mode::Auto),
    );
    assert!(p.warnings[0].contains("LlamaDecoderLayer"));
}

/// Layers of `seq10` (40400 bytes each) the plan puts on GPU 0.
fn layers_on_gpu0(memory: MaxMemory, prefetch_depth: usize) -> (usize, Vec<String>) {
    let tree = seq10();
    let plan = plan(
        &tree,
        &PlanOptions {
            prefetch_depth,
            ..options(memory, &[], Mode::Sequential)
        },
    )
    .unwrap();
    let on_gpu = plan
        .device_map
        .iter()
        .filter(|(_, d)| *d == Device::Gpu(0))
        .count();
    (on_gpu, plan.trace)
}

#[test]
fn streaming_room_covers_the_prefetched_layers_unless_it_would_empty_the_gpu() {
    let layer = 40_400;
    let five_layers = mm(&[("0", 5 * layer), ("cpu", 100 * layer)]);
    // One layer streams while it runs, and each prefetched one needs room too.
    assert_eq!(layers_on_gpu0(five_layers.clone(), 0).0, 4);
    assert_eq!(layers_on_gpu0(five_layers, 1).0, 3);
    // Room for two streamed layers would leave GPU 0 nothing of its own:
    // the planner gives up prefetch room rather than the GPU.
    let (on_gpu, trace) = layers_on_gpu0(mm(&[("0", 5 * layer / 2), ("cpu", 100 * layer)]), 1);
    assert_eq!(on_gpu, 1);
    assert!(
        trace
            .iter()
            .any(|l| l.contains("planning with prefetch depth 0")),
        "{trace:#?}"
    );
}

/// Issue 10: runtime bytes and prefetch depths past 64 bits used to wrap
/// (or panic in debug builds) into a plausible map. They are an error that
/// names the streaming reserve, and a depth beyond the number of layers is
/// the same plan as one that prefetches them all.
#[test]
fn absurd_runtime_bytes_and_prefetch_depths_never_wrap_into_a_plan() {
    let tree = seq10();
    let layer = 40_400;
    let memory = mm(&[("0", 5 * layer), ("cpu", 100 * layer)]);
    for per_layer in [u64::MAX / 4, u64::MAX] {
        let opts = PlanOptions {
            runtime_bytes: (1..=10)
                .map(|i| match tree.find(&format!("linear{i}")) {
                    Some(Node::Module(m)) => (m, per_layer),
                    other => panic!("{other:?}"),
                })
                .collect(),
            ..options(memory.clone(), &[], Mode::Sequential)
        };
        let e = plan(&tree, &opts).unwrap_err().to_string();
        assert!(
            e.contains("the streaming reserve on 0")
                && e.contains("needs more than 2^64 bytes, more than its 197.27 KiB"),
            "{e}"
        );
    }
    assert_eq!(
        layers_on_gpu0(memory.clone(), usize::MAX),
        layers_on_gpu0(memory, 10)
    );
}
