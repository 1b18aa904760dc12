//! `experts_on` in bigmodel's planner: the rest of every layer is placed
//! first, then the experts fill the room left on the devices that compute
//! their layers, then the `experts_on` device, then a slower one; budgets,
//! no-split classes and tied weights hold. Accelerate's planner still
//! places whole layers and moves the experts afterwards.

mod common;

use std::collections::BTreeMap;

use bm_plan::{
    Compat, Device, DeviceMap, LedgerItem, MaxMemory, Mode, ModuleSizes, ModuleTree, PlanOptions,
    SizeOptions, auto, place_experts, plan_with,
};
use common::{Tree, as_map, expect, mm};

/// F32 sizes, hand-checkable: `embed` and `head` 160 bytes each, and three
/// `Layer`s (no-split) of `attn` 64 + `mlp.gate` 32 + `norm` 16 = 112 bytes
/// besides two experts of 128 bytes each. 1424 bytes in all, 656 of them
/// outside the experts.
fn moe(tied_head: bool) -> ModuleTree {
    let mut t = Tree::new("Moe");
    t.module("embed", "Embedding");
    t.param("embed.weight", &[10, 4]);
    t.module("layers", "ModuleList");
    for i in 0..3 {
        let l = format!("layers.{i}");
        t.module(&l, "Layer");
        t.linear_no_bias(&format!("{l}.attn"), 4, 4);
        t.module(&format!("{l}.mlp"), "SparseMoeBlock");
        t.linear_no_bias(&format!("{l}.mlp.gate"), 4, 2);
        t.module(&format!("{l}.mlp.experts"), "ModuleList");
        for e in 0..2 {
            t.module(&format!("{l}.mlp.experts.{e}"), "Expert");
            t.linear_no_bias(&format!("{l}.mlp.experts.{e}.w"), 4, 8);
        }
        t.module(&format!("{l}.norm"), "RMSNorm");
        t.param(&format!("{l}.norm.weight"), &[4]);
    }
    t.linear_no_bias("head", 4, 10);
    if tied_head {
        t.tie(&["embed.weight", "head.weight"]);
    }
    t.build()
}

fn options(memory: MaxMemory, experts_on: Option<Device>) -> PlanOptions {
    PlanOptions {
        max_memory: memory,
        max_memory_from_user: true,
        no_split: vec!["Layer".into()],
        mode: Mode::Sequential,
        explain: true,
        experts_on,
        ..PlanOptions::default()
    }
}

fn bytes(tree: &ModuleTree, map: &DeviceMap) -> BTreeMap<Device, u64> {
    let sizes = ModuleSizes::compute(tree, &SizeOptions::default());
    map.bytes_per_device(tree, &sizes).into_iter().collect()
}

/// The plan, checked: covers the model, within budgets, its bytes and
/// ledger those of its map.
fn plan(tree: &ModuleTree, options: &PlanOptions) -> bm_plan::Plan {
    let p = auto::plan(tree, options).unwrap();
    bm_plan::check_device_map(tree, &p.device_map).unwrap();
    let placed = bytes(tree, &p.device_map);
    for (device, b) in &placed {
        if let Some(budget) = options.max_memory.get(*device) {
            assert!(*b <= budget, "{device}: {b} > {budget}\n{:#?}", p.trace);
        }
    }
    assert_eq!(
        p.device_bytes.iter().copied().collect::<BTreeMap<_, _>>(),
        placed
    );
    // A map that leaves the GPU empty runs on the CPU, where the plan's
    // ledger still charges the GPU it planned to execute on.
    let gpu_budget = options.max_memory.gpus().any(|(_, b)| b > 0);
    if !gpu_budget || p.device_map.iter().any(|(_, d)| d.is_gpu()) {
        assert_eq!(
            auto::ledger(tree, &p.device_map, options).unwrap(),
            p.ledger,
            "the ledger of the map is the plan's"
        );
    }
    p
}

/// The map with experts kept apart (as the planner emits it).
fn layer_split(i: usize, rest: &str, experts: &str) -> Vec<(String, String)> {
    ["attn", "mlp.gate", "mlp.experts", "norm"]
        .iter()
        .map(|k| {
            let d = if *k == "mlp.experts" { experts } else { rest };
            (format!("layers.{i}.{k}"), d.to_string())
        })
        .collect()
}

fn expected(entries: Vec<(String, String)>) -> std::collections::HashMap<String, Device> {
    let pairs: Vec<(&str, &str)> = entries
        .iter()
        .map(|(n, d)| (n.as_str(), d.as_str()))
        .collect();
    expect(&pairs)
}

#[test]
fn cpu_execution_refills_ram_with_experts_the_rest_left_room_for() {
    let tree = moe(false);
    // 1200 bytes of RAM, with no streaming room: the CPU runs experts on
    // disk from their mapping in place. The rest of every layer, embed and
    // head take 656; 544 are left, room for 4 experts (layers 0 and 1).
    // Layer 2 keeps its experts on disk.
    let p = plan(&tree, &options(mm(&[("cpu", 1200)]), Some(Device::Disk)));
    let mut want = vec![
        ("embed".to_string(), "cpu".to_string()),
        ("layers.0".into(), "cpu".into()),
        ("layers.1".into(), "cpu".into()),
    ];
    want.extend(layer_split(2, "cpu", "disk"));
    want.push(("head".into(), "cpu".into()));
    assert_eq!(as_map(&p), expected(want), "{:#?}", p.trace);
    assert_eq!(
        p.device_bytes,
        vec![(Device::Cpu, 656 + 512), (Device::Disk, 256)]
    );
    assert_eq!(p.ledger.get(Device::Cpu, LedgerItem::Streaming), 0);

    // Whole layers then experts moved (the planner before the refill, and
    // what Accelerate's planner still does): RAM holds embed, layers 0 and
    // 1 and head (1056 of 1200, a third layer of 368 does not fit); layer
    // 2 runs from disk, and the experts of layers 0 and 1 go to disk too.
    let whole = auto::plan(&tree, &options(mm(&[("cpu", 1200)]), None)).unwrap();
    let moved = place_experts(&tree, &whole.device_map, Device::Disk).unwrap();
    let mut want = vec![("embed".to_string(), "cpu".to_string())];
    want.extend(layer_split(0, "cpu", "disk"));
    want.extend(layer_split(1, "cpu", "disk"));
    want.extend(layer_split(2, "disk", "disk"));
    want.push(("head".into(), "cpu".into()));
    assert_eq!(
        moved
            .iter()
            .map(|(n, d)| (n.to_string(), d))
            .collect::<std::collections::HashMap<_, _>>(),
        expected(want)
    );
    assert_eq!(bytes(&tree, &moved)[&Device::Disk], 768 + 112);
}

#[test]
fn gpu_execution_keeps_every_layer_s_rest_and_then_experts_on_the_gpu() {
    let tree = moe(false);
    // The same sums on GPU 0: the experts of layers 1 and 2 go to the CPU.
    let p = plan(
        &tree,
        &options(mm(&[("0", 1200), ("cpu", 1000)]), Some(Device::Cpu)),
    );
    let mut want = vec![
        ("embed".to_string(), "0".to_string()),
        ("layers.0".into(), "0".into()),
    ];
    want.extend(layer_split(1, "0", "cpu"));
    want.extend(layer_split(2, "0", "cpu"));
    want.push(("head".into(), "0".into()));
    assert_eq!(as_map(&p), expected(want), "{:#?}", p.trace);
    assert!(p.warnings.is_empty(), "{:?}", p.warnings);
    // 1456 bytes of GPU hold the whole model with no streaming room.
    let p = plan(
        &tree,
        &options(mm(&[("0", 1424), ("cpu", 1000)]), Some(Device::Cpu)),
    );
    assert_eq!(as_map(&p), expect(&[("", "0")]));
    // One byte less: experts stream, and the room held back for them is
    // what a prompt may hold of one layer, all its offloaded experts. Two
    // experts off the GPU (layer 2's) need 256 bytes of it, which leaves
    // 1167: 656 + 3 experts; 4 would need 1168.
    let p = plan(
        &tree,
        &options(mm(&[("0", 1423), ("cpu", 1000)]), Some(Device::Cpu)),
    );
    assert_eq!(
        p.device_bytes,
        vec![(Device::Gpu(0), 656 + 3 * 128), (Device::Cpu, 3 * 128)],
        "{:#?}",
        p.trace
    );
    assert_eq!(p.ledger.get(Device::Gpu(0), LedgerItem::Streaming), 256);
}

#[test]
fn experts_beyond_the_experts_on_budget_go_to_a_slower_tier_with_a_warning() {
    let tree = moe(false);
    // GPU as above; the CPU holds one of the four experts left.
    let p = plan(
        &tree,
        &options(mm(&[("0", 1200), ("cpu", 200)]), Some(Device::Cpu)),
    );
    let map = as_map(&p);
    assert_eq!(map["layers.1.mlp.experts.0"], Device::Cpu);
    assert_eq!(map["layers.1.mlp.experts.1"], Device::Disk);
    assert_eq!(map["layers.2.mlp.experts"], Device::Disk);
    assert_eq!(
        p.warnings,
        vec!["experts on cpu: 3 expert(s) (384 B) found no room there and went to a slower device"]
    );
}

#[test]
fn budgets_no_split_and_ties_hold_for_every_budget() {
    let tree = moe(true);
    let (mut planned, mut beside, mut apart) = (0, 0, 0);
    for gpu in (0..=1500).step_by(25) {
        for experts_on in [Device::Cpu, Device::Disk] {
            let opts = options(mm(&[("0", gpu), ("cpu", 600)]), Some(experts_on));
            // The smallest budgets cannot hold a layer and its streaming room.
            if auto::plan(&tree, &opts).is_err() {
                continue;
            }
            let p = plan(&tree, &opts);
            planned += 1;
            let map = &p.device_map;
            let on = |name: &str| map.device_of(name).unwrap();
            assert_eq!(on("embed.weight"), on("head.weight"), "tied, GPU {gpu}");
            for i in 0..3 {
                let rest = on(&format!("layers.{i}.attn.weight"));
                for part in ["mlp.gate.weight", "norm.weight"] {
                    assert_eq!(on(&format!("layers.{i}.{part}")), rest, "GPU {gpu}");
                }
                for e in 0..2 {
                    let expert = on(&format!("layers.{i}.mlp.experts.{e}.w.weight"));
                    // Beside its layer on the GPU, else on `experts_on` or slower.
                    assert!(
                        (expert == rest && rest.is_gpu())
                            || expert == experts_on
                            || expert == Device::Disk,
                        "GPU {gpu}: layer {i} on {rest}, expert {e} on {expert}"
                    );
                    if expert == rest {
                        beside += 1;
                    } else {
                        apart += 1;
                    }
                }
            }
        }
    }
    // Most budgets plan (the smallest cannot hold a layer and its
    // streaming room), with experts both beside their layers and apart.
    assert!(
        planned > 80 && beside > 0 && apart > 0,
        "{planned} {beside} {apart}"
    );
}

#[test]
fn accelerate_s_planner_places_whole_layers_and_then_moves_the_experts() {
    let tree = moe(false);
    let memory = mm(&[("0", 1200), ("cpu", 1000)]);
    let accelerate = plan_with(&tree, &options(memory.clone(), None), Compat::Accelerate).unwrap();
    let with_experts = plan_with(
        &tree,
        &options(memory, Some(Device::Disk)),
        Compat::Accelerate,
    )
    .unwrap();
    assert_eq!(
        with_experts.device_map,
        place_experts(&tree, &accelerate.device_map, Device::Disk).unwrap()
    );
    let disk = with_experts
        .device_bytes
        .iter()
        .find(|(d, _)| *d == Device::Disk)
        .map(|(_, b)| *b);
    assert_eq!(disk, Some(768));
}

#[test]
fn a_model_without_experts_is_an_error() {
    let tree = common::model_for_test();
    let err = auto::plan(&tree, &options(mm(&[("cpu", 1000)]), Some(Device::Disk))).unwrap_err();
    assert!(err.to_string().contains("no experts"), "{err}");
}
