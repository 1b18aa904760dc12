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

/// 48 layers, each attention (4 linears) plus a router and 512 experts of 3
/// linears: about 99k modules and 74k parameters.
fn moe() -> ModuleTree {
    let mut b = ModuleTreeBuilder::new("MoeForCausalLM");
    let layers = b.add_module(0, "layers", "ModuleList").unwrap();
    for l in 0..48 {
        let layer = b
            .add_module(layers, &l.to_string(), "MoeDecoderLayer")
            .unwrap();
        let attn = b.add_module(layer, "self_attn", "Attention").unwrap();
        for p in ["q_proj", "k_proj", "v_proj", "o_proj"] {
            linear(&mut b, attn, p, 64, 64, false);
        }
        let mlp = b.add_module(layer, "mlp", "SparseMoe").unwrap();
        linear(&mut b, mlp, "gate", 64, 512, false);
        let experts = b.add_module(mlp, "experts", "ModuleList").unwrap();
        for e in 0..512 {
            let expert = b.add_module(experts, &e.to_string(), "Expert").unwrap();
            for p in ["gate_proj", "up_proj", "down_proj"] {
                linear(&mut b, expert, p, 64, 32, false);
            }
        }
    }
    b.finish().unwrap()
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
