//! Quantized models under a device map: the tiny Llama of
//! tools/make_bnb_fixtures.py quantized while loading (nf4, fp4, int8) and
//! transformers' pre-quantized folders, with the decoder layer offloaded to
//! disk. The planner sizes the layer at its packed bytes, the layer streams
//! exactly those bytes, and the logits equal the in-memory quantized
//! model's bit for bit and transformers + bitsandbytes' within 1e-3.

mod common;

use std::path::Path;
use std::sync::Arc;

use bigmodel::device::DeviceSet;
use bigmodel::plan::{DeviceMap, ModuleSizes, SizeOptions};
use bigmodel::{DeviceMapSpec, Options};
use bm_models::{
    CausalLm, Dispatched, FolderWeights, Logits, WeightSource, load_tree, open_causal_lm,
    open_causal_lm_quantized,
};
use bm_tensor::DType;
use common::{Reference, bnb_fixture, bnb_options, max_abs_diff};
use serde_json::json;

/// The decoder layer on disk, the rest on the CPU.
fn disk_options(offload: &Path) -> Options {
    let map = json!({
        "model.embed_tokens": "cpu", "model.layers.0": "disk", "model.norm": "cpu",
        "model.rotary_emb": "cpu", "lm_head": "cpu",
    });
    Options {
        device_map: Some(DeviceMapSpec::Map(DeviceMap::from_json(&map).unwrap())),
        offload_folder: Some(offload.to_path_buf()),
        force_hooks: true,
        dtype: Some(DType::F32),
        ..Options::default()
    }
}

fn logits(lm: &CausalLm, weights: &dyn WeightSource, ids: &[u32]) -> Vec<f32> {
    let mut cache = lm.decoder().new_cache();
    lm.decoder()
        .forward(weights, ids, &mut cache, Logits::All)
        .unwrap()
        .to_f32_vec()
}

/// Bytes the model's tree holds under `model.layers.0`, loaded in F32.
fn layer_bytes(d: &Dispatched<CausalLm>) -> u64 {
    let tree = d.weights.model().tree();
    let options = SizeOptions {
        dtype: Some(DType::F32),
        ..SizeOptions::default()
    };
    let sizes = ModuleSizes::compute(tree, &options);
    match tree.find("model.layers.0") {
        Some(bigmodel::plan::Node::Module(m)) => sizes.module[m],
        other => panic!("no layer module: {other:?}"),
    }
}

#[test]
fn quantized_on_load_and_offloaded_streams_packed_and_matches_bitsandbytes() {
    let reference = Reference::of("tiny-llama-bnb");
    let offload = tempfile::tempdir().unwrap();
    let dense = open_causal_lm(
        bnb_fixture("base"),
        Arc::new(DeviceSet::cpu_only()),
        &disk_options(&offload.path().join("dense")),
    )
    .unwrap();
    for format in ["nf4", "fp4", "int8"] {
        let o = bnb_options(format);
        let in_memory =
            CausalLm::open_quantized(bnb_fixture("base"), DType::F32, o.clone()).unwrap();
        let folder =
            FolderWeights::open_quantized(bnb_fixture("base"), Some(DType::F32), o.clone())
                .unwrap();
        let d = open_causal_lm_quantized(
            bnb_fixture("base"),
            Arc::new(DeviceSet::cpu_only()),
            &disk_options(&offload.path().join(format)),
            &o,
        )
        .unwrap();
        // The layer is sized packed: its seven linear weights quantized,
        // its two norms dense.
        let packed = layer_bytes(&d);
        let norms = 2 * 48 * 4;
        let linears: u64 = [
            [48, 48],
            [24, 48],
            [24, 48],
            [48, 48],
            [71, 48],
            [71, 48],
            [48, 71],
        ]
        .iter()
        .map(|&[r, c]| o.format.byte_len(r, c) as u64)
        .sum();
        assert_eq!(packed, linears + norms, "{format}");
        assert!(packed < layer_bytes(&dense) / 2, "{format}");
        for i in 0..3 {
            let ids = reference.ids(&format!("prompt.{i}"));
            let before = d.weights.streamed_bytes();
            let ours = logits(&d.model, &d.weights, &ids);
            // One forward streams the offloaded layer once, packed.
            assert_eq!(d.weights.streamed_bytes() - before, packed, "{format}");
            let expected = logits(&in_memory, &folder, &ids);
            assert_eq!(
                ours.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                expected.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                "{format} prompt {i}: offloaded differs from in memory"
            );
            let diff = max_abs_diff(&ours, &reference.floats(&format!("logits_{format}.{i}")).1);
            println!("{format} prompt {i}: max |diff| vs transformers + bitsandbytes {diff:e}");
            assert!(diff <= 1e-3, "{format} prompt {i}: {diff}");
        }
    }
}

#[test]
fn pre_quantized_folders_load_under_a_device_map_without_options() {
    let reference = Reference::of("tiny-llama-bnb");
    let offload = tempfile::tempdir().unwrap();
    for format in ["nf4", "fp4", "int8"] {
        let d = open_causal_lm(
            bnb_fixture(format),
            Arc::new(DeviceSet::cpu_only()),
            &disk_options(&offload.path().join(format)),
        )
        .unwrap();
        let layer = layer_bytes(&d);
        let ids = reference.ids("prompt.0");
        let before = d.weights.streamed_bytes();
        let ours = logits(&d.model, &d.weights, &ids);
        assert_eq!(d.weights.streamed_bytes() - before, layer, "{format}");
        let diff = max_abs_diff(&ours, &reference.floats(&format!("logits_{format}.0")).1);
        assert!(diff <= 1e-3, "{format}: {diff}");
        // What `bigmodel plan` plans is the tree loading dispatched: every
        // tensor at the size the checkpoint stores.
        let config = bigmodel::plan::config::HfConfig::from_value(
            serde_json::from_slice(
                &std::fs::read(bnb_fixture(format).join("config.json")).unwrap(),
            )
            .unwrap(),
            bnb_fixture(format).join("config.json"),
        )
        .unwrap();
        let dense_tree = bigmodel::plan::hf::tree_from_config(&config).unwrap().tree;
        let planned = load_tree(Some(&bnb_fixture(format)), &dense_tree, None, None).unwrap();
        let sizes = |t: &bigmodel::plan::ModuleTree| {
            t.tensors()
                .map(|t| (t.name.to_string(), t.meta.clone()))
                .collect::<Vec<_>>()
        };
        assert_eq!(sizes(&planned), sizes(d.weights.model().tree()), "{format}");
        let err = load_tree(
            Some(&bnb_fixture(format)),
            &dense_tree,
            Some(&bnb_options("nf4")),
            None,
        )
        .unwrap_err();
        assert!(err.to_string().contains("already quantized"), "{err}");
        // Quantizing a folder that is already quantized is refused.
        let err = open_causal_lm_quantized(
            bnb_fixture(format),
            Arc::new(DeviceSet::cpu_only()),
            &disk_options(&offload.path().join("again")),
            &bnb_options("nf4"),
        )
        .unwrap_err();
        assert!(err.to_string().contains("already quantized"), "{err}");
    }
}

#[test]
fn planning_quantized_sizes_linear_weights_packed_and_names_what_cannot_be() {
    let config = bigmodel::plan::config::HfConfig::from_value(
        serde_json::from_str(
            &std::fs::read_to_string(bnb_fixture("base").join("config.json")).unwrap(),
        )
        .unwrap(),
        bnb_fixture("base").join("config.json"),
    )
    .unwrap();
    let tree = bigmodel::plan::hf::tree_from_config(&config).unwrap().tree;
    let total = |t: &bigmodel::plan::ModuleTree| {
        ModuleSizes::compute(
            t,
            &SizeOptions {
                dtype: Some(DType::BF16),
                ..SizeOptions::default()
            },
        )
        .total()
    };
    let nf4 = load_tree(
        Some(&bnb_fixture("base")),
        &tree,
        Some(&bnb_options("nf4")),
        None,
    )
    .unwrap();
    let int8 = load_tree(
        Some(&bnb_fixture("base")),
        &tree,
        Some(&bnb_options("int8")),
        None,
    )
    .unwrap();
    assert!(total(&nf4) < total(&int8) && total(&int8) < total(&tree));
    // The head stays dense by default; naming no skip quantizes it too.
    let head = |t: &bigmodel::plan::ModuleTree| match t.find("lm_head.weight") {
        Some(bigmodel::plan::Node::Tensor(id)) => t.tensor(id).meta.dtype,
        other => panic!("{other:?}"),
    };
    assert_eq!(head(&nf4), head(&tree));
    let mut all = bnb_options("nf4");
    all.skip_modules = Some(Vec::new());
    assert_eq!(
        head(&load_tree(None, &tree, Some(&all), None).unwrap()),
        DType::U8
    );
    let mut none = bnb_options("nf4");
    none.skip_modules = Some(vec!["model".into(), "lm_head".into()]);
    let err = load_tree(None, &tree, Some(&none), None).unwrap_err();
    assert!(
        err.to_string()
            .contains("all 8 Linear/Conv1D weights are kept unquantized"),
        "{err}"
    );
}

/// transformers' `llm_int8_enable_fp32_cpu_offload`: with a device map,
/// the modules it puts on the CPU or disk stay unquantized (in the load
/// dtype), the GPU-placed ones are quantized; a strategy is refused.
#[test]
fn fp32_cpu_offload_keeps_offloaded_modules_dense() {
    let reference = Reference::of("tiny-llama-bnb");
    let offload = tempfile::tempdir().unwrap();
    let map = json!({
        "model.embed_tokens": "cpu", "model.layers.0.self_attn": 0,
        "model.layers.0.mlp": "disk", "model.layers.0.input_layernorm": 0,
        "model.layers.0.post_attention_layernorm": 0, "model.norm": "cpu",
        "model.rotary_emb": "cpu", "lm_head": "cpu",
    });
    let on_gpu = |folder: &str| Options {
        device_map: Some(DeviceMapSpec::Map(DeviceMap::from_json(&map).unwrap())),
        ..disk_options(&offload.path().join(folder))
    };
    for format in ["int8", "nf4"] {
        let mut o = bnb_options(format);
        o.llm_int8_enable_fp32_cpu_offload = true;
        let devices = || Arc::new(DeviceSet::emulated(&[1 << 30]));
        let d =
            open_causal_lm_quantized(bnb_fixture("base"), devices(), &on_gpu(format), &o).unwrap();
        let tree = d.weights.model().tree();
        let dtype = |name: &str| match tree.find(name) {
            Some(bigmodel::plan::Node::Tensor(id)) => tree.tensor(id).meta.dtype,
            other => panic!("{name}: {other:?}"),
        };
        for proj in ["q_proj", "k_proj", "v_proj", "o_proj"] {
            let name = format!("model.layers.0.self_attn.{proj}.weight");
            assert_eq!(dtype(&name), DType::U8, "{format} {name}");
        }
        for proj in ["gate_proj", "up_proj", "down_proj"] {
            let name = format!("model.layers.0.mlp.{proj}.weight");
            // Dense: declared in config.json's dtype (loaded in F32).
            assert_eq!(dtype(&name), DType::F16, "{format} {name}");
        }
        // The plan `bigmodel plan --device-map` makes is this tree.
        let config = bigmodel::plan::config::HfConfig::from_value(
            serde_json::from_slice(
                &std::fs::read(bnb_fixture("base").join("config.json")).unwrap(),
            )
            .unwrap(),
            bnb_fixture("base").join("config.json"),
        )
        .unwrap();
        let dense_tree = bigmodel::plan::hf::tree_from_config(&config).unwrap().tree;
        let map = DeviceMap::from_json(&map).unwrap();
        let planned = load_tree(
            Some(&bnb_fixture("base")),
            &dense_tree,
            Some(&o),
            Some(&map),
        )
        .unwrap();
        assert_eq!(planned.tensors().len(), tree.tensors().len());
        for (a, b) in planned.tensors().zip(tree.tensors()) {
            assert_eq!((&a.name, &a.meta), (&b.name, &b.meta));
        }
        // It runs (the emulated GPU's layers compute on the host) as the
        // model whose MLP is skipped by name does, bit for bit.
        let mut skipped = bnb_options(format);
        skipped.skip_modules = Some(vec!["lm_head".into(), "model.layers.0.mlp".into()]);
        let by_name =
            open_causal_lm_quantized(bnb_fixture("base"), devices(), &on_gpu("by-name"), &skipped)
                .unwrap();
        let ids = reference.ids("prompt.0");
        let ours = logits(&d.model, &d.weights, &ids);
        let expected = logits(&by_name.model, &by_name.weights, &ids);
        assert_eq!(
            ours.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            expected.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            "{format}"
        );
        let diff = max_abs_diff(&ours, &reference.floats(&format!("logits_{format}.0")).1);
        println!("{format}: attention quantized only, max |diff| vs all quantized {diff:e}");
        // A strategy cannot say which modules it would offload.
        let strategy = Options {
            device_map: Some(DeviceMapSpec::Strategy(bigmodel::plan::Mode::Auto)),
            ..on_gpu("strategy")
        };
        let err =
            open_causal_lm_quantized(bnb_fixture("base"), devices(), &strategy, &o).unwrap_err();
        assert!(
            err.to_string()
                .contains("llm_int8_enable_fp32_cpu_offload needs a device map"),
            "{err}"
        );
    }
}
