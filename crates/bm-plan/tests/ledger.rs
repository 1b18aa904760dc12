//! The memory ledger: a plan for a declared workload fits its ledger on
//! every device, the runtime items land where layers execute, and the
//! ledger of any map is computed the same way.

use bm_plan::config::HfConfig;
use bm_plan::hf::{HfModel, tree_from_config};
use bm_plan::{Compat, Device, LedgerItem, MaxMemory, Mode, PlanOptions, Workload, plan_with};
use bm_tensor::DType;

const GIB: u64 = 1 << 30;

fn llama_7b() -> HfModel {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/configs/llama-2-7b.json"
    );
    let text = std::fs::read_to_string(path).unwrap();
    tree_from_config(&HfConfig::parse(&text, path).unwrap()).unwrap()
}

fn options(model: &HfModel, budgets: &[(Device, u64)], w: &Workload) -> PlanOptions {
    let max_memory = MaxMemory::new(budgets.iter().copied()).unwrap();
    let on_gpu = max_memory.gpus().any(|(_, b)| b > 0);
    let mut options = PlanOptions {
        max_memory,
        max_memory_from_user: true,
        no_split: model.no_split.clone(),
        mode: Mode::Auto,
        prefetch_depth: 1,
        ..PlanOptions::default()
    };
    model
        .runtime_charges(w, on_gpu, DType::F16)
        .apply(&mut options);
    options
}

const WORKLOAD: Workload = Workload {
    batch: 2,
    prompt_len: 2048,
    max_seq_len: 4096,
    all_logits: false,
};

#[test]
fn a_plan_fits_its_ledger_and_runtime_items_sit_where_layers_run() {
    let model = llama_7b();
    let budgets = [
        (Device::Gpu(0), 6 * GIB),
        (Device::Gpu(1), 6 * GIB),
        (Device::Cpu, 30 * GIB),
    ];
    let options = options(&model, &budgets, &WORKLOAD);
    let plan = plan_with(&model.tree, &options, Compat::Auto).unwrap();
    let ledger = &plan.ledger;
    assert!(
        ledger.shortfalls(&options.max_memory).is_empty(),
        "{ledger:?}"
    );
    let shape = model.shape;
    // 2 · 4096 · 4096 tokens · 2 sequences · 2 bytes per layer, on the GPUs
    // only: CPU-placed layers run on GPU 0.
    let kv_per_layer = shape.kv_bytes_per_layer(&WORKLOAD, 2);
    assert_eq!(kv_per_layer, 128 << 20);
    let kv: u64 = [Device::Gpu(0), Device::Gpu(1)]
        .iter()
        .map(|d| ledger.get(*d, LedgerItem::KvCache))
        .sum();
    assert_eq!(kv, 32 * kv_per_layer);
    assert_eq!(ledger.get(Device::Cpu, LedgerItem::KvCache), 0);
    let peak = shape.activation_peak(&WORKLOAD, 2);
    assert_eq!(ledger.get(Device::Gpu(1), LedgerItem::Activations), peak);
    // The head runs on the last GPU or, offloaded, on GPU 0.
    let logits = shape.logits_bytes(&WORKLOAD);
    let head = plan.device_map.device_of("lm_head.weight").unwrap();
    let head_runs = if head.is_gpu() { head } else { Device::Gpu(0) };
    assert_eq!(ledger.get(head_runs, LedgerItem::Logits), logits);
    assert!(ledger.get(Device::Gpu(0), LedgerItem::Streaming) > 0);
    // The ledger of the plan's own map is the plan's ledger.
    let again = bm_plan::auto::ledger(&model.tree, &plan.device_map, &options).unwrap();
    assert_eq!(&again, ledger);
}

#[test]
fn the_activation_peak_is_charged_once_per_device_not_per_layer() {
    let model = llama_7b();
    let w = Workload {
        batch: 1,
        prompt_len: 4096,
        max_seq_len: 4096,
        all_logits: false,
    };
    let budgets = [(Device::Gpu(0), 40 * GIB), (Device::Cpu, 30 * GIB)];
    let with = options(&model, &budgets, &w);
    let plan = plan_with(&model.tree, &with, Compat::Auto).unwrap();
    assert!(plan.device_map.iter().all(|(_, d)| d == Device::Gpu(0)));
    let ledger = &plan.ledger;
    let peak = model.shape.activation_peak(&w, 2);
    assert_eq!(ledger.get(Device::Gpu(0), LedgerItem::Activations), peak);
    // A budget one byte under the ledger's total moves something off GPU 0.
    let total = ledger.total(Device::Gpu(0));
    let tight = options(
        &model,
        &[(Device::Gpu(0), total - 1), (Device::Cpu, 30 * GIB)],
        &w,
    );
    let plan = plan_with(&model.tree, &tight, Compat::Auto).unwrap();
    assert!(
        plan.device_map.iter().any(|(_, d)| d == Device::Cpu),
        "{:?}",
        plan.device_map
    );
    assert!(plan.ledger.shortfalls(&tight.max_memory).is_empty());
}

#[test]
fn on_the_cpu_alone_runtime_items_are_charged_in_f32_to_the_cpu() {
    let model = llama_7b();
    let budgets = [(Device::Cpu, 40 * GIB)];
    let options = options(&model, &budgets, &WORKLOAD);
    let plan = plan_with(&model.tree, &options, Compat::Auto).unwrap();
    let ledger = &plan.ledger;
    assert_eq!(
        ledger.get(Device::Cpu, LedgerItem::KvCache),
        32 * model.shape.kv_bytes_per_layer(&WORKLOAD, 4)
    );
    assert_eq!(
        ledger.get(Device::Cpu, LedgerItem::Activations),
        model.shape.activation_peak(&WORKLOAD, 4)
    );
    assert!(ledger.shortfalls(&options.max_memory).is_empty());
}

#[test]
fn overheads_come_off_the_budget_and_show_in_the_ledger() {
    let model = llama_7b();
    let budgets = [(Device::Gpu(0), 40 * GIB), (Device::Cpu, 30 * GIB)];
    let mut options = options(&model, &budgets, &WORKLOAD);
    options.overheads = vec![
        (Device::Gpu(0), LedgerItem::CudaContext, 500 << 20),
        (Device::Gpu(0), LedgerItem::GemmWorkspace, 32 << 20),
        (Device::Cpu, LedgerItem::Staging, 32 << 20),
    ];
    let plan = plan_with(&model.tree, &options, Compat::Auto).unwrap();
    assert_eq!(
        plan.ledger.get(Device::Gpu(0), LedgerItem::CudaContext),
        500 << 20
    );
    assert_eq!(plan.ledger.get(Device::Cpu, LedgerItem::Staging), 32 << 20);
    assert!(plan.ledger.shortfalls(&options.max_memory).is_empty());
    options.overheads = vec![(Device::Gpu(3), LedgerItem::CudaContext, 1)];
    assert!(plan_with(&model.tree, &options, Compat::Auto).is_err());
}
