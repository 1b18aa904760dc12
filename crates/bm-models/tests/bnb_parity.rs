//! The tiny Llama of tools/make_bnb_fixtures.py quantized with bitsandbytes:
//! our logits against transformers + bitsandbytes', for the folders
//! transformers saved (nf4 with double quantization, fp4, int8) and for
//! quantizing the dense folder while loading; the quantized parts we make
//! against the saved ones; and broken pre-quantized folders.

mod common;

use std::collections::HashMap;

use bm_models::{
    CausalLm, DecoderConfig, Error, FolderWeights, LinearWeight, Logits, WeightLayout, WeightSource,
};
use bm_tensor::DType;
use common::{Reference, bnb_fixture, bnb_options, fixture, max_abs_diff};
use safetensors::SafeTensors;
use safetensors::tensor::TensorView;

/// Linear weights of the one-layer model.
const LINEARS: [&str; 7] = [
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
];

fn linear_names() -> impl Iterator<Item = String> {
    LINEARS.iter().map(|l| format!("model.layers.0.{l}.weight"))
}

/// Max |ours - transformers'| over the reference prompts.
fn logits_diff(weights: &dyn WeightSource, format: &str) -> f32 {
    let reference = Reference::of("tiny-llama-bnb");
    let config = DecoderConfig::from_dir(bnb_fixture("base")).unwrap();
    let decoder = bm_models::Decoder::new(config, DType::F32).unwrap();
    let mut worst = 0f32;
    for i in 0..3 {
        let ids = reference.ids(&format!("prompt.{i}"));
        let (_, want) = reference.floats(&format!("logits_{format}.{i}"));
        let mut cache = decoder.new_cache();
        let logits = decoder
            .forward(weights, &ids, &mut cache, Logits::All)
            .unwrap();
        assert_eq!(logits.shape(), [ids.len(), 64]);
        let diff = max_abs_diff(&logits.to_f32_vec(), &want);
        println!("{format} prompt {i}: max |diff| {diff:e}");
        worst = worst.max(diff);
    }
    worst
}

#[test]
fn four_bit_logits_match_transformers_bitsandbytes_within_1e_3() {
    for format in ["nf4", "fp4"] {
        let saved = FolderWeights::open(bnb_fixture(format), Some(DType::F32)).unwrap();
        let diff = logits_diff(&saved, format);
        assert!(diff <= 1e-3, "{format} pre-quantized: {diff}");
        let on_load = FolderWeights::open_quantized(
            bnb_fixture("base"),
            Some(DType::F32),
            bnb_options(format),
        )
        .unwrap();
        let diff = logits_diff(&on_load, format);
        assert!(diff <= 1e-3, "{format} quantized on load: {diff}");
    }
}

// LLM.int8() runs as bitsandbytes runs it (float16 activations quantized
// row-wise, outlier columns at threshold 2.5 in full precision), so only
// summation order differs: the documented tolerance is 1e-3 (docs/compat.md).
#[test]
fn int8_logits_match_transformers_bitsandbytes_within_1e_3() {
    let saved = FolderWeights::open(bnb_fixture("int8"), Some(DType::F32)).unwrap();
    let diff = logits_diff(&saved, "int8");
    assert!(diff <= 1e-3, "int8 pre-quantized: {diff}");
    let on_load =
        FolderWeights::open_quantized(bnb_fixture("base"), Some(DType::F32), bnb_options("int8"))
            .unwrap();
    let diff = logits_diff(&on_load, "int8");
    assert!(diff <= 1e-3, "int8 quantized on load: {diff}");
}

#[test]
fn quantizing_on_load_writes_what_transformers_saved() {
    for format in ["nf4", "fp4", "int8"] {
        let bytes = std::fs::read(bnb_fixture(format).join("model.safetensors")).unwrap();
        let saved = SafeTensors::deserialize(&bytes).unwrap();
        let ours = FolderWeights::open_quantized(
            bnb_fixture("base"),
            Some(DType::F32),
            bnb_options(format),
        )
        .unwrap();
        let mut keys = 0;
        for name in linear_names() {
            let LinearWeight::Quantized(q) =
                ours.linear_weight(&name, WeightLayout::Linear).unwrap()
            else {
                panic!("{format}: {name} was not quantized");
            };
            for e in q.to_entries(&name) {
                let t = saved.tensor(&e.name).unwrap();
                assert_eq!(t.shape(), e.meta.shape, "{format} {}", e.name);
                assert!(
                    t.data() == e.bytes.as_ref(),
                    "{format} {}: bytes differ",
                    e.name
                );
                keys += 1;
            }
        }
        // Every quant-state entry transformers saved was produced.
        let saved_state = saved
            .names()
            .into_iter()
            .filter(|n| n.starts_with("model.layers."))
            .filter(|n| !n.ends_with("layernorm.weight"))
            .count();
        assert_eq!(keys, saved_state, "{format}");
        // The head and the embeddings stay dense (transformers' defaults).
        assert!(matches!(
            ours.linear_weight("lm_head.weight", WeightLayout::Linear)
                .unwrap(),
            LinearWeight::Dense(_)
        ));
    }
}

#[test]
fn pre_quantized_folders_open_through_causal_lm() {
    let lm = CausalLm::open(bnb_fixture("nf4"), None).unwrap();
    assert_eq!(lm.decoder().dtype(), DType::F32);
    let weights = FolderWeights::open(bnb_fixture("nf4"), None).unwrap();
    let err = weights
        .tensor("model.layers.0.mlp.up_proj.weight")
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "tensor model.layers.0.mlp.up_proj.weight is stored quantized (bitsandbytes); only \
         linear layers can use it"
    );
    let LinearWeight::Quantized(q) = weights
        .linear_weight("model.layers.0.mlp.down_proj.weight", WeightLayout::Linear)
        .unwrap()
    else {
        panic!("down_proj is quantized")
    };
    // The MLP width is odd: 71 columns, rows starting mid-byte.
    assert_eq!(q.shape(), [48, 71]);
    assert_eq!(q.compute_dtype(), Some(DType::F32));
    let err =
        FolderWeights::open_quantized(bnb_fixture("nf4"), None, bnb_options("nf4")).unwrap_err();
    assert!(err.to_string().contains("already quantized"), "{err}");
    let lm =
        CausalLm::open_quantized(bnb_fixture("base"), DType::BF16, bnb_options("fp4")).unwrap();
    let generation = lm
        .generate_ids(
            &[1, 2, 3],
            &bm_models::GenerateOptions {
                max_new_tokens: 3,
                ..Default::default()
            },
        )
        .unwrap();
    assert_eq!(generation.tokens.len(), 3);
}

// GPT-2's Conv1D weights are stored [in, out]; bitsandbytes quantizes them
// transposed, and its tied head stays dense.
#[test]
fn conv1d_weights_are_quantized_transposed() {
    let dir = fixture("tiny-gpt2");
    let dense = FolderWeights::open(&dir, Some(DType::F32)).unwrap();
    let ours = FolderWeights::open_quantized(&dir, Some(DType::F32), bnb_options("int8")).unwrap();
    let name = "transformer.h.0.attn.c_attn.weight";
    let d = dense.tensor(name).unwrap();
    assert_eq!(d.shape(), [16, 48]);
    let LinearWeight::Quantized(q) = ours.linear_weight(name, WeightLayout::Conv1D).unwrap() else {
        panic!("c_attn was not quantized")
    };
    assert_eq!(q.shape(), [48, 16]);
    let (dv, qv) = (
        d.to_f32_vec(),
        q.dequantize(DType::F32).unwrap().to_f32_vec(),
    );
    for o in 0..48 {
        let row_max = (0..16).map(|i| dv[i * 48 + o].abs()).fold(0.0, f32::max);
        for i in 0..16 {
            // One int8 step of the row's scale, plus float16 rounding.
            let tolerance = row_max / 127.0 * 0.51 + row_max * 1e-3;
            assert!(
                (qv[o * 16 + i] - dv[i * 48 + o]).abs() <= tolerance,
                "[{o}, {i}]"
            );
        }
    }
    assert!(matches!(
        ours.linear_weight("transformer.wte.weight", WeightLayout::Linear)
            .unwrap(),
        LinearWeight::Dense(_)
    ));
    let lm = CausalLm::open_quantized(&dir, DType::F32, bnb_options("nf4")).unwrap();
    let options = bm_models::GenerateOptions {
        max_new_tokens: 2,
        ..Default::default()
    };
    assert_eq!(lm.generate_ids(&[1, 2], &options).unwrap().tokens.len(), 2);
}

#[test]
fn skip_and_fp32_modules_stay_dense() {
    let mut o = bnb_options("nf4");
    o.skip_modules = Some(vec!["model.layers.0.mlp".into()]);
    o.keep_in_fp32_modules = vec!["o_proj".into()];
    let w = FolderWeights::open_quantized(bnb_fixture("base"), Some(DType::BF16), o).unwrap();
    let kind = |name: &str| match w.linear_weight(name, WeightLayout::Linear).unwrap() {
        LinearWeight::Dense(t) | LinearWeight::DenseTransposed(t) => format!("dense {}", t.dtype()),
        LinearWeight::Quantized(_) | LinearWeight::QuantizedOnGpu(_) => "quantized".into(),
    };
    assert_eq!(kind("model.layers.0.mlp.up_proj.weight"), "dense BF16");
    assert_eq!(kind("model.layers.0.self_attn.o_proj.weight"), "dense F32");
    assert_eq!(kind("model.layers.0.self_attn.q_proj.weight"), "quantized");
    // An explicit skip list replaces the default one, as in transformers.
    assert_eq!(kind("lm_head.weight"), "quantized");
    let mut o = bnb_options("int8");
    o.skip_modules = Some(vec!["(".into()]);
    let err = FolderWeights::open_quantized(bnb_fixture("base"), None, o).unwrap_err();
    assert!(err.to_string().contains("not a valid regex"), "{err}");
}

/// A copy of pre-quantized folder `format` whose safetensors entries went
/// through `edit` (a name -> (dtype, shape, bytes) map), and config.json
/// through `edit_config`.
fn broken_copy(
    format: &str,
    edit: impl FnOnce(&mut HashMap<String, (safetensors::Dtype, Vec<usize>, Vec<u8>)>),
    edit_config: impl FnOnce(&mut serde_json::Value),
) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let bytes = std::fs::read(bnb_fixture(format).join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: HashMap<_, _> = st
        .tensors()
        .into_iter()
        .map(|(k, t)| (k, (t.dtype(), t.shape().to_vec(), t.data().to_vec())))
        .collect();
    edit(&mut tensors);
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|(k, (d, s, b))| (k.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    safetensors::serialize_to_file(views, None, &dir.path().join("model.safetensors")).unwrap();
    let config = std::fs::read_to_string(bnb_fixture(format).join("config.json")).unwrap();
    let mut config: serde_json::Value = serde_json::from_str(&config).unwrap();
    edit_config(&mut config);
    std::fs::write(dir.path().join("config.json"), config.to_string()).unwrap();
    dir
}

fn open_error(dir: &tempfile::TempDir) -> String {
    match FolderWeights::open(dir.path(), None) {
        Ok(_) => panic!("a broken folder opened"),
        Err(e @ (Error::Compute(_) | Error::Config { .. })) => e.to_string(),
        Err(other) => panic!("unexpected error kind: {other}"),
    }
}

const Q: &str = "model.layers.0.self_attn.q_proj.weight";

fn set_state(
    tensors: &mut HashMap<String, (safetensors::Dtype, Vec<usize>, Vec<u8>)>,
    key: &str,
    v: serde_json::Value,
) {
    let entry = tensors
        .get_mut(&format!("{Q}.quant_state.bitsandbytes__nf4"))
        .unwrap();
    let mut state: serde_json::Value = serde_json::from_slice(&entry.2).unwrap();
    state[key] = v;
    entry.2 = state.to_string().into_bytes();
    entry.1 = vec![entry.2.len()];
}

#[test]
fn broken_pre_quantized_folders_name_the_tensor_and_field() {
    let keep = |_: &mut serde_json::Value| {};
    let cases: Vec<(tempfile::TempDir, String)> = vec![
        (
            broken_copy("nf4", |t| drop(t.remove(&format!("{Q}.absmax"))), keep),
            format!("quantized weight {Q}: absmax: entry {Q}.absmax is missing"),
        ),
        (
            broken_copy(
                "nf4",
                |t| drop(t.remove(&format!("{Q}.quant_state.bitsandbytes__nf4"))),
                keep,
            ),
            // The first orphaned part found (absmax, quant_map, nested_*).
            " has no quant_state.bitsandbytes__nf4/__fp4 or SCB entry beside it".into(),
        ),
        (
            broken_copy(
                "nf4",
                |t| {
                    let state = t
                        .remove(&format!("{Q}.quant_state.bitsandbytes__nf4"))
                        .unwrap();
                    t.insert(format!("{Q}.quant_state.bitsandbytes__int4"), state);
                },
                keep,
            ),
            format!(
                "quantized weight {Q}: quant_state: unsupported quantization: 4-bit quant type \"int4\""
            ),
        ),
        (
            broken_copy("nf4", |t| set_state(t, "blocksize", 48.into()), keep),
            format!(
                "quantized weight {Q}: blocksize: unsupported quantization: 4-bit block size 48"
            ),
        ),
        (
            broken_copy("nf4", |t| set_state(t, "quant_type", "fp4".into()), keep),
            format!("quantized weight {Q}: quant_type: \"fp4\" differs from the entry's suffix"),
        ),
        (
            broken_copy(
                "nf4",
                |t| set_state(t, "shape", serde_json::json!([48])),
                keep,
            ),
            format!("quantized weight {Q}: shape: [48] is not the shape of a non-empty matrix"),
        ),
        (
            broken_copy(
                "nf4",
                |t| set_state(t, "nested_blocksize", 128.into()),
                keep,
            ),
            format!("quantized weight {Q}: nested_blocksize: 128 is not supported"),
        ),
        (
            broken_copy(
                "nf4",
                |t| {
                    let a = t.get_mut(&format!("{Q}.nested_absmax")).unwrap();
                    a.2.extend([0; 4]);
                    a.1 = vec![2];
                },
                keep,
            ),
            format!("quantized weight {Q}: nested_absmax: expected F32 with 1 values"),
        ),
        (
            broken_copy(
                "nf4",
                |t| t.get_mut(&format!("{Q}.quant_map")).unwrap().2[0] ^= 1,
                keep,
            ),
            format!("quantized weight {Q}: quant_map: does not match the nf4 table"),
        ),
        (
            broken_copy(
                "nf4",
                |t| {
                    let w = t.get_mut(Q).unwrap();
                    w.2.pop();
                    w.1 = vec![w.2.len(), 1];
                },
                keep,
            ),
            format!("quantized weight {Q}: weight: 1151 packed bytes"),
        ),
        (
            broken_copy(
                "int8",
                |t| {
                    t.get_mut("model.layers.0.mlp.up_proj.weight_format")
                        .unwrap()
                        .2 = vec![2];
                },
                keep,
            ),
            "quantized weight model.layers.0.mlp.up_proj.weight: weight_format: expected U8 0"
                .into(),
        ),
        (
            broken_copy(
                "int8",
                |t| {
                    let scb = t.get_mut("model.layers.0.mlp.up_proj.SCB").unwrap();
                    scb.2.truncate(70 * 4);
                    scb.1 = vec![2, 35];
                },
                keep,
            ),
            "quantized weight model.layers.0.mlp.up_proj.weight: SCB: expected F32 with 71 values"
                .into(),
        ),
        (
            broken_copy(
                "nf4",
                |_| {},
                |c| {
                    c["quantization_config"]["load_in_4bit"] = false.into();
                    c["quantization_config"]["_load_in_4bit"] = false.into();
                    c["quantization_config"]["load_in_8bit"] = true.into();
                },
            ),
            "but quantization_config says load_in_8bit".into(),
        ),
        (
            broken_copy(
                "nf4",
                |_| {},
                |c| {
                    c["quantization_config"]["quant_method"] = "awq".into();
                },
            ),
            "key \"quantization_config.quant_method\": \"awq\" is not supported".into(),
        ),
        (
            broken_copy(
                "fp4",
                |t| {
                    t.retain(|k, _| {
                        !k.contains(".quant_state.")
                            && !k.ends_with("absmax")
                            && !k.ends_with("quant_map")
                    })
                },
                keep,
            ),
            "key \"quantization_config\": declares bitsandbytes quantization, but no weight \
             has a quant state"
                .into(),
        ),
    ];
    for (dir, want) in &cases {
        let err = open_error(dir);
        assert!(err.contains(want.as_str()), "got: {err}\nwant: {want}");
    }
}
