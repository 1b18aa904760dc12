//! Planner speed on three large trees: 1,000,000 tensors; the 100B-parameter
//! `Sequential(1000 x Linear(10000, 10000))`; a 100k-module MoE-style tree.
//! `tools/bench_plan_accelerate.py` times Accelerate on the same trees and
//! reports the ratio.

use criterion::{Criterion, criterion_group, criterion_main};

use bigmodel::plan::{Compat, MaxMemory, Mode, ModuleTree, ModuleTreeBuilder, PlanOptions};
use bigmodel::tensor::{DType, TensorMeta};

fn linear(
    b: &mut ModuleTreeBuilder,
    parent: usize,
    name: &str,
    inputs: usize,
    outputs: usize,
    bias: bool,
) {
    let m = b.add_module(parent, name, "Linear").unwrap();
    b.add_param(m, "weight", TensorMeta::new(DType::F32, [outputs, inputs]))
        .unwrap();
    if bias {
        b.add_param(m, "bias", TensorMeta::new(DType::F32, [outputs]))
            .unwrap();
    }
}

/// 1000 blocks of 500 `Linear(16, 16)`: 1,000,000 tensors.
fn million_tensors() -> ModuleTree {
    let mut b = ModuleTreeBuilder::new("Sequential");
    for i in 0..1000 {
        let block = b.add_module(0, &i.to_string(), "Block").unwrap();
        for j in 0..500 {
            linear(&mut b, block, &j.to_string(), 16, 16, true);
        }
    }
    b.finish().unwrap()
}

/// The seed's example: 100B parameters in 1000 linears.
fn hundred_billion() -> ModuleTree {
    let mut b = ModuleTreeBuilder::new("Sequential");
    for i in 0..1000 {
        linear(&mut b, 0, &i.to_string(), 10_000, 10_000, true);
    }
    b.finish().unwrap()
}

/// The MoE tree `cargo xtask bench` also plans in a whole `bigmodel plan`
/// process and with Accelerate (see `bigmodel_benches::module_trees::moe`).
fn moe() -> ModuleTree {
    ModuleTree::from_json_str(&bigmodel_benches::module_trees::moe().json).unwrap()
}

/// Budgets that hold about `fraction` of the model on two GPUs and some RAM,
/// so the planner splits and offloads.
fn budgets(tree: &ModuleTree) -> MaxMemory {
    let total = bigmodel::plan::ModuleSizes::compute(tree, &Default::default()).total();
    MaxMemory::parse(&format!(
        "0={},1={},cpu={}",
        total / 5,
        total / 5,
        total / 5
    ))
    .unwrap()
}

fn bench(c: &mut Criterion) {
    let trees = [
        ("million_tensors", million_tensors()),
        ("100b_sequential", hundred_billion()),
        ("moe_100k", moe()),
    ];
    for (name, tree) in &trees {
        let options = PlanOptions {
            max_memory: budgets(tree),
            max_memory_from_user: true,
            mode: Mode::Sequential,
            ..PlanOptions::default()
        };
        let mut group = c.benchmark_group(format!("plan/{name}"));
        group.sample_size(10);
        group.bench_function("accelerate_compat", |b| {
            b.iter(|| bigmodel::plan::plan_with(tree, &options, Compat::Accelerate).unwrap())
        });
        group.bench_function("bigmodel_auto", |b| {
            b.iter(|| bigmodel::plan::plan_with(tree, &options, Compat::Auto).unwrap())
        });
        group.finish();
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
