//! The memory ledger and its dry run (`bigmodel::verify_ledger`) on
//! host-emulated GPUs: a plan that passes the dry run generates the
//! declared number of tokens without running out of memory, every GPU's
//! peak stays within its ledger, and a budget shrunk by the activation
//! peak fails the dry run before anything is loaded. A plan sizes weights
//! in the dtype loading takes.

mod common;

use std::path::PathBuf;
use std::sync::Arc;

use bigmodel::device::DeviceSet;
use bigmodel::plan::config::HfConfig;
use bigmodel::plan::hf::tree_from_config;
use bigmodel::plan::{Compat, Device, LedgerItem, MaxMemory, PlanOptions, Workload, plan_with};
use bigmodel::{DeviceMapSpec, Options, verify_ledger};
use bm_models::{GenerateOptions, open_causal_lm};
use bm_tensor::DType;

fn tiny_llama() -> PathBuf {
    common::fixture("tiny-llama")
}

const KIB: u64 = 1 << 10;

#[test]
fn a_verified_plan_generates_within_its_ledger_and_a_smaller_budget_fails_the_dry_run() {
    let config = tiny_llama().join("config.json");
    let hf = HfConfig::parse(&std::fs::read_to_string(&config).unwrap(), &config).unwrap();
    let model = tree_from_config(&hf).unwrap();
    let prompt: Vec<u32> = (1..=8).collect();
    let new_tokens = 32;
    let workload = Workload {
        batch: 1,
        prompt_len: prompt.len() as u64,
        max_seq_len: (prompt.len() + new_tokens) as u64,
        all_logits: false,
    };
    let budgets = [(Device::Gpu(0), 300 * KIB), (Device::Gpu(1), 300 * KIB)];
    let max_memory =
        MaxMemory::new(budgets.iter().copied().chain([(Device::Cpu, 64 << 20)])).unwrap();
    let mut options = PlanOptions {
        overheads: bigmodel::overheads(&max_memory, &[]),
        max_memory,
        max_memory_from_user: true,
        no_split: model.no_split.clone(),
        prefetch_depth: 1,
        ..PlanOptions::default()
    };
    model
        .runtime_charges(&workload, true, DType::F32)
        .apply(&mut options);
    let plan = plan_with(&model.tree, &options, Compat::Auto).unwrap();
    let ledger = &plan.ledger;
    assert!(
        ledger.get(Device::Gpu(0), LedgerItem::Activations) > 0,
        "{ledger:?}"
    );
    assert!(
        plan.device_map.iter().any(|(_, d)| d == Device::Gpu(1)),
        "the plan uses both GPUs: {:?}",
        plan.device_map
    );
    let capacities = [300 * KIB, 300 * KIB];
    let devices = Arc::new(DeviceSet::emulated(&capacities));
    assert_eq!(verify_ledger(ledger, &devices).unwrap(), []);
    // The dry run freed what it allocated.
    assert!(devices.gpus().iter().all(|g| g.live_bytes() == 0));

    let offload = tempfile::tempdir().unwrap();
    let run_options = Options {
        device_map: Some(DeviceMapSpec::Map(plan.device_map.clone())),
        offload_folder: Some(offload.path().to_path_buf()),
        prefetch_depth: Some(plan.prefetch_depth),
        ..Options::default()
    };
    let dispatched = open_causal_lm(tiny_llama(), devices.clone(), &run_options).unwrap();
    let generation = dispatched
        .model
        .generate_ids(
            &prompt,
            &GenerateOptions {
                max_new_tokens: new_tokens,
                stop_tokens: Vec::new(),
                ..GenerateOptions::default()
            },
        )
        .unwrap();
    assert_eq!(generation.tokens.len(), new_tokens);
    for (i, gpu) in devices.gpus().iter().enumerate() {
        let d = Device::Gpu(i as u32);
        assert!(
            gpu.peak_bytes() <= ledger.total(d),
            "GPU {i}: peak {} over the ledger's {}",
            gpu.peak_bytes(),
            ledger.total(d)
        );
    }

    // GPU 0 with exactly the ledger fits; less by the activation peak does
    // not, and the dry run says by how much before anything is loaded.
    let exact = ledger.total(Device::Gpu(0));
    let peak = ledger.get(Device::Gpu(0), LedgerItem::Activations);
    let fits = DeviceSet::emulated(&[exact, capacities[1]]);
    assert_eq!(verify_ledger(ledger, &fits).unwrap(), []);
    let short = DeviceSet::emulated(&[exact - peak, capacities[1]]);
    let shortfalls = verify_ledger(ledger, &short).unwrap();
    assert_eq!(shortfalls.len(), 1, "{shortfalls:?}");
    assert_eq!(shortfalls[0].device, Device::Gpu(0));
    assert_eq!(shortfalls[0].short_by(), peak);
    assert!(shortfalls[0].to_string().starts_with("0 is short by"));
}

/// `tiny-llama` with a config.json that says float16 over its F32 weights.
fn tiny_llama_labelled_f16() -> tempfile::TempDir {
    let dir = common::copy_fixture("tiny-llama");
    common::edit_json(&dir.path().join("config.json"), |c| {
        c["dtype"] = "float16".into()
    });
    dir
}

#[test]
fn a_plan_sizes_weights_in_the_dtype_loading_takes_not_the_configs() {
    let dir = tiny_llama_labelled_f16();
    let config = dir.path().join("config.json");
    let hf = HfConfig::parse(&std::fs::read_to_string(&config).unwrap(), &config).unwrap();
    let model = tree_from_config(&hf).unwrap();
    assert_eq!(model.dtype, DType::F16, "the config's dtype");
    let dtype = bm_models::folder_load_dtype(dir.path(), model.family, None).unwrap();
    assert_eq!(dtype, Some(DType::F32), "the stored dtype");

    // Budgets that split the F32 model over two GPUs (it would fit one at
    // the config's F16 sizes).
    let max_memory = MaxMemory::new([
        (Device::Gpu(0), 400 * KIB),
        (Device::Gpu(1), 400 * KIB),
        (Device::Cpu, 64 << 20),
    ])
    .unwrap();
    let options = PlanOptions {
        max_memory: max_memory.clone(),
        max_memory_from_user: true,
        no_split: model.no_split.clone(),
        dtype,
        ..PlanOptions::default()
    };
    let plan = plan_with(&model.tree, &options, Compat::Auto).unwrap();

    // Loading plans for itself, with the same decision, and allocates
    // exactly what the plan placed on each GPU.
    let devices = Arc::new(DeviceSet::emulated(&[400 * KIB, 400 * KIB]));
    let run_options = Options {
        device_map: Some(DeviceMapSpec::Strategy(bigmodel::plan::Mode::Auto)),
        max_memory: Some(max_memory),
        ..Options::default()
    };
    let dispatched = open_causal_lm(dir.path(), devices.clone(), &run_options).unwrap();
    assert_eq!(
        dispatched.weights.model().hf_device_map().as_ref(),
        Some(&plan.device_map)
    );
    let mut loaded = 0;
    for (i, gpu) in devices.gpus().iter().enumerate() {
        let planned = plan
            .device_bytes
            .iter()
            .find(|(d, _)| *d == Device::Gpu(i as u32))
            .map_or(0, |(_, b)| *b);
        assert!(planned > 0, "the model is split: {:?}", plan.device_bytes);
        assert_eq!(gpu.live_bytes(), planned, "GPU {i}");
        loaded += planned;
    }
    // Every tensor in F32, as stored (the config's F16 would be half).
    let elements: u64 = model.tree.tensors().map(|t| t.meta.numel() as u64).sum();
    assert_eq!(loaded, elements * 4);
}
