//! Accelerate's own test cases (behaviour reference §3.4, §3.5, §3.10),
//! planned with the compat planner.

mod common;

use bm_plan::accelerate::{get_balanced_memory, infer_auto_device_map};
use bm_plan::{
    Compat, Device, MaxMemory, ModuleSizes, ModuleTree, Plan, PlanOptions, SizeOptions, SizeRule,
};
use bm_tensor::DType;
use common::{Tree, as_map, expect, mm, model_for_test};

fn sizes(tree: &ModuleTree, dtype: Option<DType>) -> ModuleSizes {
    ModuleSizes::compute(
        tree,
        &SizeOptions {
            dtype,
            rule: SizeRule::Accelerate,
            ..SizeOptions::default()
        },
    )
}

fn infer_with(tree: &ModuleTree, max_memory: MaxMemory, mut options: PlanOptions) -> Plan {
    options.explain = true;
    let s = sizes(tree, options.dtype);
    infer_auto_device_map(tree, &s, &max_memory, &options)
}

fn infer(tree: &ModuleTree, max_memory: MaxMemory, no_split: &[&str]) -> Plan {
    let options = PlanOptions {
        no_split: no_split.iter().map(|s| s.to_string()).collect(),
        ..PlanOptions::default()
    };
    infer_with(tree, max_memory, options)
}

#[test]
fn i1_model_for_test_two_gpus() {
    let plan = infer(&model_for_test(), mm(&[("0", 200), ("1", 200)]), &[]);
    assert_eq!(
        as_map(&plan),
        expect(&[("linear1", "0"), ("batchnorm", "1"), ("linear2", "1")])
    );
    assert!(
        plan.info.is_empty(),
        "no insufficient-memory log: {:?}",
        plan.info
    );
    assert!(
        plan.trace
            .iter()
            .any(|l| l == "Putting linear1 (size=64) (available=100) on 0."),
        "{:?}",
        plan.trace
    );
}

#[test]
fn i2_no_reservation_on_a_second_gpu() {
    let plan = infer(
        &model_for_test(),
        mm(&[("0", 200), ("1", 172), ("2", 200)]),
        &[],
    );
    assert_eq!(
        as_map(&plan),
        expect(&[("linear1", "0"), ("batchnorm", "1"), ("linear2", "1")])
    );
}

#[test]
fn i3_tied_weights_across_modules() {
    let mut t = Tree::new("ModelForTest");
    t.module("linear1", "Linear");
    t.param("linear1.weight", &[5, 4]);
    t.param("linear1.bias", &[4]);
    t.batchnorm("batchnorm", 4);
    t.linear("linear2", 4, 5);
    t.tie(&["linear1.weight", "linear2.weight"]);
    let tree = t.build();
    let s = sizes(&tree, None);
    assert_eq!((s.total(), s.module[1]), (188, 96));
    let plan = infer(&tree, mm(&[("0", 200), ("1", 200)]), &[]);
    assert_eq!(as_map(&plan), expect(&[("", "0")]));
}

fn three_model_for_test() -> ModuleTree {
    let mut t = Tree::new("Sequential");
    for i in 0..3 {
        t.model_for_test_at(&i.to_string());
    }
    t.build()
}

#[test]
fn i4_split_inside_a_submodel() {
    let plan = infer(&three_model_for_test(), mm(&[("0", 500), ("1", 500)]), &[]);
    assert_eq!(
        as_map(&plan),
        expect(&[
            ("0", "0"),
            ("1.linear1", "0"),
            ("1.batchnorm", "0"),
            ("1.linear2", "1"),
            ("2", "1")
        ])
    );
}

#[test]
fn i5_no_split_class() {
    let plan = infer(
        &three_model_for_test(),
        mm(&[("0", 500), ("1", 500)]),
        &["ModelForTest"],
    );
    assert_eq!(as_map(&plan), expect(&[("0", "0"), ("1", "1"), ("2", "1")]));
}

#[test]
fn i6_no_split_of_a_leaf_class_does_not_fail() {
    let plan = infer(
        &three_model_for_test(),
        mm(&[("0", 300), ("1", 300)]),
        &["Linear"],
    );
    assert!(!plan.device_map.is_empty());
}

fn three_layers() -> Tree {
    let mut t = Tree::new("Sequential");
    for name in ["layer1", "layer2", "layer3"] {
        t.model_for_test_at(name);
    }
    t
}

#[test]
fn tw1_tied_partner_is_split() {
    let mut t = three_layers();
    t.tie(&["layer1.linear2.weight", "layer3.linear2.weight"]);
    let plan = infer(&t.build(), mm(&[("0", 400), ("1", 500)]), &[]);
    assert_eq!(
        as_map(&plan),
        expect(&[
            ("layer1", "0"),
            ("layer3.linear2", "0"),
            ("layer2", "1"),
            ("layer3.linear1", "1"),
            ("layer3.batchnorm", "1")
        ])
    );
}

#[test]
fn tw2_two_tied_partners() {
    let mut t = three_layers();
    t.tie(&[
        "layer1.linear2.weight",
        "layer2.linear2.weight",
        "layer3.linear2.weight",
    ]);
    let plan = infer(&t.build(), mm(&[("0", 400), ("1", 500)]), &[]);
    assert_eq!(
        as_map(&plan),
        expect(&[
            ("layer1", "0"),
            ("layer2.linear2", "0"),
            ("layer3.linear2", "0"),
            ("layer2.linear1", "1"),
            ("layer2.batchnorm", "1"),
            ("layer3.linear1", "1"),
            ("layer3.batchnorm", "1")
        ])
    );
}

#[test]
fn tw3_two_tied_groups() {
    let mut t = three_layers();
    t.tie(&[
        "layer1.linear2.weight",
        "layer2.linear2.weight",
        "layer3.linear2.weight",
    ]);
    t.tie(&["layer1.linear1.weight", "layer2.linear1.weight"]);
    let plan = infer(&t.build(), mm(&[("0", 400), ("1", 500)]), &[]);
    assert_eq!(
        as_map(&plan),
        expect(&[
            ("layer1", "0"),
            ("layer2.linear1", "0"),
            ("layer2.linear2", "0"),
            ("layer3.linear2", "0"),
            ("layer2.batchnorm", "1"),
            ("layer3.linear1", "1"),
            ("layer3.batchnorm", "1")
        ])
    );
}

#[test]
fn tw4_module_fully_tied_counted_once() {
    let mut t = Tree::new("Sequential");
    t.linear("linear1", 4, 4);
    t.linear("linear2", 6, 6);
    t.linear("linear3", 4, 4);
    t.linear("linear4", 6, 6);
    t.tie(&["linear1.weight", "linear3.weight"]);
    t.tie(&["linear1.bias", "linear3.bias"]);
    let plan = infer(&t.build(), mm(&[("0", 250), ("1", 400)]), &[]);
    assert_eq!(
        as_map(&plan),
        expect(&[
            ("linear1", "0"),
            ("linear2", "1"),
            ("linear3", "0"),
            ("linear4", "1")
        ])
    );
    // Accelerate prints ['linear3', 'linear3'] (the module once per tied tensor).
    assert!(
        plan.trace
            .iter()
            .any(|l| l == "Putting linear1 and ['linear3'] (available=82) on 0."),
        "{:?}",
        plan.trace
    );
}

#[test]
fn tw5_parameter_tied_into_a_submodule_of_its_own_module() {
    let mut t = Tree::new("Model");
    t.module("compute", "LinearModuleAndSubModule");
    t.param("compute.weight", &[8, 3]);
    t.param("compute.bias", &[8]);
    t.module("compute.weight_submodule", "Module");
    t.param("compute.weight_submodule.parameter", &[8, 3]);
    t.tie(&["compute.weight", "compute.weight_submodule.parameter"]);
    let plan = infer(&t.build(), mm(&[("0", 4), ("cpu", 96000)]), &[]);
    assert!(!plan.device_map.is_empty());
}

fn model_with_buffers(with_linear3: bool) -> ModuleTree {
    let mut t = Tree::new("ModelForTest");
    t.model_for_test_contents("");
    t.buffer("linear1.test_buffer1", &[10, 2], DType::F32);
    t.buffer("batchnorm.test_buffer2", &[10, 3], DType::F32);
    t.buffer("linear2.test_buffer3", &[10, 3], DType::F32);
    if with_linear3 {
        t.linear("linear3", 4, 5);
        t.buffer("linear3.test_buffer4", &[10, 2], DType::F32);
    }
    t.build()
}

fn with_offload_buffers(offload_buffers: bool) -> PlanOptions {
    PlanOptions {
        offload_buffers,
        ..PlanOptions::default()
    }
}

#[test]
fn b1_b2_buffer_warning() {
    let tree = model_with_buffers(false);
    let s = sizes(&tree, None);
    assert_eq!(
        (s.module[1], s.module[2], s.module[3], s.total()),
        (144, 192, 220, 556)
    );
    let memory = mm(&[("0", 400), ("cpu", 1_000_000_000)]);
    let want = expect(&[("linear1", "0"), ("batchnorm", "cpu"), ("linear2", "cpu")]);
    let b1 = infer_with(&tree, memory.clone(), with_offload_buffers(false));
    assert_eq!(as_map(&b1), want);
    assert_eq!(b1.warnings.len(), 1);
    assert!(
        b1.warnings[0]
            .starts_with("Current model requires 280 bytes of buffer for offloaded layers")
    );
    let b2 = infer_with(&tree, memory, with_offload_buffers(true));
    assert_eq!(as_map(&b2), want);
    assert!(b2.warnings.is_empty());
}

#[test]
fn b3_b5_buffer_warning_with_a_second_gpu() {
    let tree = model_with_buffers(true);
    let want = expect(&[
        ("linear1", "0"),
        ("batchnorm", "1"),
        ("linear2", "cpu"),
        ("linear3", "cpu"),
    ]);
    let b3 = infer_with(
        &tree,
        mm(&[("0", 400), ("1", 400), ("cpu", 1_000_000_000)]),
        with_offload_buffers(false),
    );
    assert_eq!(as_map(&b3), want);
    assert!(b3.warnings.is_empty());
    let b4 = infer_with(
        &tree,
        mm(&[("0", 400), ("1", 200), ("cpu", 1_000_000_000)]),
        with_offload_buffers(false),
    );
    assert_eq!(as_map(&b4), want);
    assert!(
        b4.warnings[0].starts_with("Current model requires 200 bytes"),
        "{:?}",
        b4.warnings
    );
    let b5 = infer_with(
        &tree,
        mm(&[("0", 400), ("1", 200), ("cpu", 1_000_000_000)]),
        with_offload_buffers(true),
    );
    assert_eq!(as_map(&b5), want);
    assert!(b5.warnings.is_empty());
}

fn fallback(fallback_allocation: bool) -> PlanOptions {
    PlanOptions {
        fallback_allocation,
        ..PlanOptions::default()
    }
}

fn nested_three_linears() -> ModuleTree {
    let mut t = Tree::new("Sequential");
    t.module("module", "Sequential");
    t.linear("module.linear1", 10, 4);
    t.linear("module.linear2", 4, 4);
    t.linear("module.linear3", 4, 8);
    t.build()
}

#[test]
fn f1_f2_fallback_allocation() {
    let tree = nested_three_linears();
    let f1 = infer_with(&tree, mm(&[("0", 256)]), fallback(false));
    assert_eq!(as_map(&f1), expect(&[("", "disk")]));
    assert!(
        f1.info[0].contains("insufficient memory")
            && f1.info[0].contains("  - 0: 336 bytes required")
    );
    let f2 = infer_with(&tree, mm(&[("0", 256)]), fallback(true));
    assert_eq!(
        as_map(&f2),
        expect(&[
            ("module.linear1", "disk"),
            ("module.linear2", "0"),
            ("module.linear3", "disk")
        ])
    );
    assert!(f2.info.is_empty());
}

#[test]
fn f3_f6_fallback_allocation_more() {
    let mut t = Tree::new("Sequential");
    t.module("module", "Sequential");
    for i in 1..=3 {
        t.linear(&format!("module.linear{i}"), 10, 10);
    }
    let f3 = infer_with(&t.build(), mm(&[("0", 30)]), fallback(true));
    assert_eq!(as_map(&f3), expect(&[("", "disk")]));

    let mut t = Tree::new("Sequential");
    for i in 1..=3 {
        t.module(&format!("module{i}"), "CustomModule");
        t.linear(&format!("module{i}.submodule1"), 20, 20);
        t.linear(&format!("module{i}.submodule2"), 20, 20);
    }
    let f4 = infer_with(&t.build(), mm(&[("0", 5000)]), fallback(true));
    assert_eq!(
        as_map(&f4),
        expect(&[
            ("module1.submodule1", "0"),
            ("module1.submodule2", "disk"),
            ("module2", "disk"),
            ("module3", "disk")
        ])
    );

    let mut t = Tree::new("TiedWeightsModel");
    t.linear("linear1", 10, 10);
    t.linear("linear2", 10, 10);
    t.tie(&["linear1.weight", "linear2.weight"]);
    let f5 = infer_with(&t.build(), mm(&[("0", 600)]), fallback(true));
    assert_eq!(as_map(&f5), expect(&[("", "0")]));

    let mut t = Tree::new("Sequential");
    t.linear("linear1", 10, 10);
    t.buffer("linear1.buffer1", &[5], DType::F32);
    t.batchnorm("batchnorm", 10);
    t.buffer("batchnorm.buffer2", &[5], DType::F32);
    t.linear("linear2", 10, 10);
    t.buffer("linear2.buffer3", &[5], DType::F32);
    let f6 = infer_with(&t.build(), mm(&[("0", 678)]), fallback(true));
    assert_eq!(
        as_map(&f6),
        expect(&[("batchnorm", "0"), ("linear1", "disk"), ("linear2", "disk")])
    );
    assert!(
        f6.warnings[0].contains("Current model requires 40 bytes")
            && f6.warnings[0].contains("offload_buffers")
    );
}

/// `max_memory` as `(key, bytes)` pairs.
type Budgets<'a> = &'a [(&'a str, u64)];

fn balanced(
    tree: &ModuleTree,
    memory: &[(&str, u64)],
    low_zero: bool,
    dtype: Option<DType>,
) -> MaxMemory {
    get_balanced_memory(tree, &sizes(tree, dtype), &mm(memory), &[], low_zero, true)
}

#[test]
fn get_balanced_memory_cases() {
    let tree = model_for_test();
    let cases: &[(Budgets<'_>, Budgets<'_>)] = &[
        (&[("0", 200), ("1", 200)], &[("0", 200), ("1", 200)]),
        (&[("0", 200), ("2", 200)], &[("0", 200), ("2", 200)]),
        (&[("0", 300), ("1", 300)], &[("0", 215), ("1", 300)]),
        (&[("0", 300), ("1", 500)], &[("0", 215), ("1", 500)]),
        (&[("0", 300), ("cpu", 1000)], &[("0", 300), ("cpu", 1000)]),
        (
            &[("0", 0), ("1", 300), ("2", 300)],
            &[("0", 0), ("1", 215), ("2", 300)],
        ),
        (&[("0", 0), ("cpu", 100)], &[("0", 0), ("cpu", 100)]),
    ];
    for (input, want) in cases {
        assert_eq!(balanced(&tree, input, false, None), mm(want), "{input:?}");
    }
    let low: &[(Budgets<'_>, Budgets<'_>)] = &[
        (&[("0", 300), ("1", 300)], &[("0", 0), ("1", 300)]),
        (
            &[("0", 300), ("1", 300), ("2", 300)],
            &[("0", 0), ("1", 215), ("2", 300)],
        ),
        (
            &[("0", 1000), ("1", 1000), ("2", 1000)],
            &[("0", 0), ("1", 215), ("2", 1000)],
        ),
    ];
    for (input, want) in low {
        assert_eq!(
            balanced(&tree, input, true, None),
            mm(want),
            "low_zero {input:?}"
        );
    }
    // "1KB" strings parse to 1000 first.
    let parsed = MaxMemory::parse(r#"{"0": "1KB", "1": "1KB"}"#).unwrap();
    let got = get_balanced_memory(&tree, &sizes(&tree, None), &parsed, &[], false, true);
    assert_eq!(got, mm(&[("0", 215), ("1", 1000)]));
    // A "disk" budget does not crash (Accelerate raises RuntimeError).
    assert_eq!(
        balanced(
            &tree,
            &[("0", 300), ("1", 300), ("disk", 1000)],
            false,
            None
        ),
        mm(&[("0", 215), ("1", 300), ("disk", 1000)])
    );
    // One GPU, defaults read from the machine: 90 %.
    let one = get_balanced_memory(
        &tree,
        &sizes(&tree, None),
        &mm(&[("0", 1000), ("cpu", 5000)]),
        &[],
        false,
        false,
    );
    assert_eq!(one, mm(&[("0", 900), ("cpu", 5000)]));
}

fn seq10() -> ModuleTree {
    let mut t = Tree::new("Sequential");
    for i in 1..=10 {
        t.linear(&format!("linear{i}"), 100, 100);
    }
    t.build()
}

fn linears(range: std::ops::RangeInclusive<u32>, device: &str) -> Vec<(String, String)> {
    range
        .map(|i| (format!("linear{i}"), device.to_string()))
        .collect()
}

fn expect_owned(pairs: Vec<(String, String)>) -> std::collections::HashMap<String, Device> {
    let refs: Vec<(&str, &str)> = pairs
        .iter()
        .map(|(a, b)| (a.as_str(), b.as_str()))
        .collect();
    expect(&refs)
}

#[test]
fn seq10_goldens() {
    let tree = seq10();
    let memory = [
        ("0", 300_000),
        ("1", 300_000),
        ("2", 300_000),
        ("cpu", 1_000_000_000),
    ];
    let seq = infer(&tree, mm(&memory), &[]);
    assert_eq!(
        as_map(&seq),
        expect_owned([linears(1..=6, "0"), linears(7..=10, "1")].concat())
    );

    let bal = balanced(&tree, &memory, false, None);
    assert_eq!(
        bal,
        mm(&[
            ("0", 185_166),
            ("1", 185_166),
            ("2", 300_000),
            ("cpu", 1_000_000_000)
        ])
    );
    let plan = infer(&tree, bal, &[]);
    assert_eq!(
        as_map(&plan),
        expect_owned(
            [
                linears(1..=3, "0"),
                linears(4..=7, "1"),
                linears(8..=10, "2")
            ]
            .concat()
        )
    );

    let low = balanced(&tree, &memory, true, None);
    assert_eq!(
        low,
        mm(&[
            ("0", 0),
            ("1", 252_500),
            ("2", 300_000),
            ("cpu", 1_000_000_000)
        ])
    );
    let plan = infer(&tree, low, &[]);
    assert_eq!(
        as_map(&plan),
        expect_owned([linears(1..=6, "1"), linears(7..=10, "2")].concat())
    );

    let small = [("0", 100_000), ("1", 100_000), ("cpu", 100_000)];
    assert_eq!(balanced(&tree, &small, false, None), mm(&small));
    let plan = infer(&tree, mm(&small), &[]);
    assert_eq!(
        as_map(&plan),
        expect_owned(
            [
                linears(1..=1, "0"),
                linears(2..=3, "1"),
                linears(4..=4, "cpu"),
                linears(5..=10, "disk"),
            ]
            .concat()
        )
    );
    assert_eq!(
        balanced(
            &tree,
            &[("0", 300_000), ("1", 300_000)],
            false,
            Some(DType::F16)
        ),
        mm(&[("0", 126_250), ("1", 300_000)])
    );

    // accelerate#4297: low_zero sums the other GPUs by id, not by position.
    let gap = balanced(
        &tree,
        &[("0", 300_000), ("1", 0), ("2", 300_000), ("3", 300_000)],
        true,
        None,
    );
    assert_eq!(gap.get(Device::Gpu(0)), Some(0), "{gap:?}");
    let sparse = balanced(&tree, &[("0", 300_000), ("3", 300_000)], true, None);
    assert_eq!(sparse, mm(&[("0", 104_000), ("3", 300_000)]));
}

fn tiny_gpt(tied: bool, dtype: DType) -> ModuleTree {
    let mut t = Tree::new("TinyGPT");
    t.dtype = dtype;
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
    if tied {
        t.tie(&["lm_head.weight", "wte.weight"]);
    }
    t.build()
}

#[test]
fn tiny_gpt_goldens() {
    let tree = tiny_gpt(true, DType::F32);
    assert_eq!(sizes(&tree, None).total(), 1_453_056);
    let block = ["Block"];
    let plan = infer(
        &tree,
        mm(&[("0", 400_000), ("1", 400_000), ("cpu", 1_000_000_000)]),
        &block,
    );
    assert_eq!(
        as_map(&plan),
        expect(&[
            ("wte", "1"),
            ("lm_head", "1"),
            ("ln_f", "cpu"),
            ("h", "cpu")
        ])
    );
    let plan = infer(&tree, mm(&[("0", 300_000), ("cpu", 300_000)]), &block);
    assert_eq!(as_map(&plan), expect(&[("", "disk")]));
    let options = PlanOptions {
        no_split: vec!["Block".into()],
        dtype: Some(DType::F16),
        ..PlanOptions::default()
    };
    let plan = infer_with(&tree, mm(&[("0", 300_000), ("cpu", 300_000)]), options);
    assert_eq!(
        as_map(&plan),
        expect(&[
            ("wte", "0"),
            ("lm_head", "0"),
            ("h.0", "cpu"),
            ("h.1", "cpu"),
            ("h.2", "disk"),
            ("h.3", "disk"),
            ("h.4", "disk"),
            ("h.5", "disk"),
            ("ln_f", "disk")
        ])
    );
    let plan = infer(&tree, mm(&[("0", 300_000), ("cpu", 300_000)]), &[]);
    assert_eq!(as_map(&plan), expect(&[("", "disk")]));

    let three = [("0", 1_000_000), ("1", 1_000_000), ("2", 1_000_000)];
    let s = sizes(&tree, None);
    let bal = get_balanced_memory(&tree, &s, &mm(&three), &["Block".to_string()], false, true);
    assert_eq!(bal, mm(&[("0", 733_632), ("1", 733_632), ("2", 1_000_000)]));
    let plan = infer(&tree, bal, &block);
    assert_eq!(
        as_map(&plan),
        expect(&[
            ("wte", "0"),
            ("lm_head", "0"),
            ("h.0", "0"),
            ("h.1", "1"),
            ("h.2", "1"),
            ("h.3", "1"),
            ("h.4", "2"),
            ("h.5", "2"),
            ("ln_f", "2")
        ])
    );
    let low = get_balanced_memory(&tree, &s, &mm(&three), &["Block".to_string()], true, true);
    assert_eq!(low, mm(&[("0", 0), ("1", 975_808), ("2", 1_000_000)]));
    let plan = infer(&tree, low, &block);
    assert_eq!(
        as_map(&plan),
        expect(&[
            ("wte", "1"),
            ("lm_head", "1"),
            ("h.0", "1"),
            ("h.1", "1"),
            ("h.2", "1"),
            ("h.3", "2"),
            ("h.4", "2"),
            ("h.5", "2"),
            ("ln_f", "2")
        ])
    );
    // The same through the top-level entry point (balanced is the default).
    let options = PlanOptions {
        max_memory: mm(&three),
        max_memory_from_user: true,
        no_split: vec!["Block".into()],
        ..PlanOptions::default()
    };
    let plan = bm_plan::plan_with(&tree, &options, Compat::Accelerate).unwrap();
    assert_eq!(plan.device_map.iter().next(), Some(("wte", Device::Gpu(0))));

    let untied = tiny_gpt(false, DType::F32);
    let plan = infer(
        &untied,
        mm(&[("0", 400_000), ("1", 400_000), ("cpu", 1_000_000_000)]),
        &block,
    );
    assert_eq!(
        as_map(&plan),
        expect(&[
            ("wte", "1"),
            ("ln_f", "cpu"),
            ("lm_head", "cpu"),
            ("h", "cpu")
        ])
    );
}

#[test]
fn model_a_direct_params_beside_children() {
    let mut t = Tree::new("ModelA");
    t.param("a", &[100, 100]);
    t.param("b", &[100, 100]);
    t.linear("layer", 100, 100);
    let tree = t.build();
    assert_eq!(
        as_map(&infer(&tree, mm(&[("cpu", 60_000)]), &[])),
        expect(&[("", "disk")])
    );
    assert_eq!(
        as_map(&infer(&tree, mm(&[("0", 80_000), ("cpu", 80_000)]), &[])),
        expect(&[("", "disk")])
    );
}

#[test]
fn direct_buffer_of_a_split_module_gets_a_device() {
    // accelerate#4014: Accelerate drops l0.layer_scalar and check_device_map fails.
    let mut t = Tree::new("M");
    for l in ["l0", "l1"] {
        t.module(l, "Layer");
        t.buffer(&format!("{l}.layer_scalar"), &[1], DType::F32);
        t.linear(&format!("{l}.fc1"), 50, 50);
        t.linear(&format!("{l}.fc2"), 50, 50);
    }
    let tree = t.build();
    let plan = infer(&tree, mm(&[("0", 15_000), ("1", 15_000)]), &[]);
    bm_plan::check_device_map(&tree, &plan.device_map).unwrap();
    assert!(plan.device_map.device_of("l0.layer_scalar").is_some());
}

#[test]
fn tied_layer_eleven_is_not_matched_by_layer_one() {
    // Accelerate raises IndexError ("1." is a substring of "11.weight.").
    let mut t = Tree::new("ModuleList");
    for i in 0..12 {
        t.linear(&i.to_string(), 4, 4);
    }
    t.tie(&["0.weight", "11.weight"]);
    let plan = infer(&t.build(), mm(&[("0", 1_000_000)]), &[]);
    assert_eq!(as_map(&plan), expect(&[("", "0")]));
}

#[test]
fn a_module_holding_several_tied_params_is_counted_once() {
    let mut t = Tree::new("M");
    t.linear("a", 10, 10);
    t.module("b", "B");
    t.linear("b.lin", 10, 10);
    t.linear("b.extra", 50, 50);
    t.tie(&["a.weight", "b.lin.weight"]);
    t.tie(&["a.bias", "b.lin.bias"]);
    let plan = infer(&t.build(), mm(&[("0", 11_000), ("1", 1_000_000)]), &[]);
    assert!(
        plan.trace.iter().any(|l| l.contains("needed size 10640")),
        "{:?}",
        plan.trace
    );
    assert_eq!(as_map(&plan), expect(&[("", "0")]));
}
