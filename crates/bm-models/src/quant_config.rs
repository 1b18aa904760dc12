//! bitsandbytes settings: quantize-on-load options (Accelerate's
//! `BnbQuantizationConfig`, transformers' `BitsAndBytesConfig`), the
//! `quantization_config` a pre-quantized folder's config.json carries, and
//! which modules stay unquantized.

use std::path::Path;

use bigmodel::plan::config::{ConfigKeys, Float};
use bm_compute::quant::{FourBitType, QuantFormat};
use bm_tensor::DType;

use crate::Error;

/// How to quantize a model's linear layers while loading it.
///
/// The fields are Accelerate's `BnbQuantizationConfig` / transformers'
/// `BitsAndBytesConfig`: `format` is `load_in_4bit` with
/// `bnb_4bit_quant_type` and `bnb_4bit_use_double_quant`, or `load_in_8bit`
/// with `llm_int8_threshold`; the 4-bit block size is bitsandbytes' 64.
#[derive(Clone, Debug, PartialEq)]
pub struct QuantizeOptions {
    /// The format.
    pub format: QuantFormat,
    /// What 4-bit matmuls compute in (`bnb_4bit_compute_dtype`): F32, as
    /// transformers defaults to; `None` computes in the activations' dtype.
    pub compute_dtype: Option<DType>,
    /// Modules left unquantized (`skip_modules`, `llm_int8_skip_modules`),
    /// matched as transformers matches them: a regex from the start of the
    /// module name up to a `.` boundary, or a suffix. `None` leaves what
    /// transformers leaves by default: the output head (`lm_head`) and the
    /// modules tied to it.
    pub skip_modules: Option<Vec<String>>,
    /// Modules kept in float32 and unquantized (`keep_in_fp32_modules`).
    pub keep_in_fp32_modules: Vec<String>,
    /// transformers' `llm_int8_enable_fp32_cpu_offload`: the modules a
    /// given device map puts on the CPU or disk stay unquantized, loaded
    /// in the load dtype (F32 unless one is asked for), and only the
    /// GPU-placed ones are quantized. As in transformers it needs a device
    /// map (a strategy is refused: which modules the planner offloads
    /// depends on what is quantized). Off, bigmodel quantizes offloaded
    /// modules too and runs them with its CPU kernels.
    pub llm_int8_enable_fp32_cpu_offload: bool,
}

impl QuantizeOptions {
    /// The options for `nf4`, `fp4` or `int8` (the names of `--quantize`),
    /// with bitsandbytes' and transformers' defaults: block size 64, no
    /// double quantization, compute in F32, outlier threshold 6.0.
    pub fn named(name: &str) -> Result<QuantizeOptions, Error> {
        let format = match name {
            "int8" => QuantFormat::Int8 { threshold: 6.0 },
            other => QuantFormat::FourBit {
                kind: FourBitType::from_name(other).map_err(|_| {
                    Error::Compute(bm_compute::Error::UnsupportedQuant(format!(
                        "{other:?} (use nf4, fp4 or int8)"
                    )))
                })?,
                blocksize: 64,
                double_quant: false,
            },
        };
        Ok(QuantizeOptions {
            format,
            compute_dtype: Some(DType::F32),
            skip_modules: None,
            keep_in_fp32_modules: Vec::new(),
            llm_int8_enable_fp32_cpu_offload: false,
        })
    }
}

/// The `quantization_config` of a folder transformers saved from a
/// bitsandbytes model: what its quantized weights need to run.
#[derive(Clone, Debug, PartialEq)]
pub struct BnbCheckpoint {
    /// 8-bit (`load_in_8bit`) rather than 4-bit (`load_in_4bit`).
    pub int8: bool,
    /// `bnb_4bit_compute_dtype` (F32 when absent, as transformers).
    pub compute_dtype: DType,
    /// `llm_int8_threshold` (6.0 when absent).
    pub threshold: f32,
}

/// Reads `quantization_config` from a folder's config.json: `None` when
/// there is none. Only `quant_method: "bitsandbytes"` is supported.
pub(crate) fn read_bnb_checkpoint(config: &ConfigKeys) -> Result<Option<BnbCheckpoint>, Error> {
    let Some(q) = config.nested("quantization_config")? else {
        return Ok(None);
    };
    let method = q.opt_str("quant_method")?.unwrap_or_default();
    if method != "bitsandbytes" {
        return Err(q
            .error(
                "quant_method",
                format!("{method:?} is not supported (only bitsandbytes)"),
            )
            .into());
    }
    // transformers writes both `load_in_4bit` and its private `_load_in_4bit`.
    let flag = |key: &str| match q.get(key) {
        Some(_) => q.bool_or(key, false),
        None => q.bool_or(&format!("_{key}"), false),
    };
    let (four, eight) = (flag("load_in_4bit")?, flag("load_in_8bit")?);
    if four == eight {
        return Err(q
            .error(
                "load_in_4bit",
                "exactly one of load_in_4bit and load_in_8bit must be true",
            )
            .into());
    }
    let compute_dtype = match q.opt_str("bnb_4bit_compute_dtype")? {
        None => DType::F32,
        Some(name) => match name.trim_start_matches("torch.") {
            "float32" => DType::F32,
            "float16" => DType::F16,
            "bfloat16" => DType::BF16,
            _ => {
                return Err(q
                    .error(
                        "bnb_4bit_compute_dtype",
                        format!("{name:?} is not float32, float16 or bfloat16"),
                    )
                    .into());
            }
        },
    };
    let threshold = q
        .opt_f64("llm_int8_threshold", Float::NonNegative)?
        .map_or(6.0, |t| t as f32);
    Ok(Some(BnbCheckpoint {
        int8: eight,
        compute_dtype,
        threshold,
    }))
}

/// transformers' `get_keys_to_not_convert` for the decoder families: the
/// output head, and with tied embeddings the input embedding it shares
/// (`model.embed_tokens`, GPT-2's `transformer.wte`). A folder that is not
/// a decoder's, or no folder, spares the head only.
pub(crate) fn default_skip_modules(dir: Option<&Path>) -> Vec<String> {
    let mut skip = vec!["lm_head".to_string()];
    if let Some(Ok(decoder)) = dir.map(crate::DecoderConfig::from_dir)
        && decoder.tie_word_embeddings
    {
        skip.push(module_of(&decoder.embedding_weight()).to_string());
    }
    skip
}

/// Module-name patterns as transformers' `should_convert_module` matches
/// them: a pattern matches a module when, as a regex, it matches from the
/// start up to a module boundary (`layer.1` matches `layer.1.attn`, not
/// `layer.11.attn`), or when the name ends with it.
#[derive(Debug)]
pub(crate) struct ModuleFilter {
    patterns: Vec<(String, fancy_regex::Regex)>,
}

impl ModuleFilter {
    /// Compiles `patterns`; `what` names the option in errors.
    pub(crate) fn new(what: &str, patterns: &[String]) -> Result<ModuleFilter, Error> {
        let patterns = patterns
            .iter()
            .map(|p| {
                fancy_regex::Regex::new(&format!(r"^(?:{p})(?:(?<=\.)|(?=\.|$))"))
                    .map(|re| (p.clone(), re))
                    .map_err(|e| Error::BadOperands {
                        op: "quantize",
                        message: format!("{what}: pattern {p:?} is not a valid regex: {e}"),
                    })
            })
            .collect::<Result<_, _>>()?;
        Ok(ModuleFilter { patterns })
    }

    /// True when a pattern matches `module`.
    pub(crate) fn matches(&self, module: &str) -> bool {
        self.patterns
            .iter()
            .any(|(p, re)| module.ends_with(p.as_str()) || re.is_match(module).unwrap_or(false))
    }
}

/// The module a parameter belongs to (`a.b.weight` -> `a.b`).
pub(crate) fn module_of(tensor: &str) -> &str {
    tensor.rsplit_once('.').map_or("", |(module, _)| module)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn module_filter_matches_like_transformers() {
        let f = ModuleFilter::new(
            "skip_modules",
            &[
                "lm_head".into(),
                "layers.1".into(),
                "mlp.gate".into(),
                "x.*attn".into(),
            ],
        )
        .unwrap();
        assert!(f.matches("lm_head"));
        assert!(f.matches("layers.1.self_attn.q_proj"));
        assert!(!f.matches("layers.11.self_attn.q_proj"));
        // Suffix match, as transformers' `full_name.endswith(key)`.
        assert!(f.matches("model.layers.1"));
        assert!(!f.matches("model.layers.0.mlp.gate_proj"));
        assert!(f.matches("x.layers.3.self_attn"));
        let err = ModuleFilter::new("skip_modules", &["(".into()]).unwrap_err();
        assert!(
            err.to_string().contains("skip_modules: pattern \"(\""),
            "{err}"
        );
        assert_eq!(module_of("model.norm.weight"), "model.norm");
    }

    fn read(json: serde_json::Value) -> Result<Option<BnbCheckpoint>, Error> {
        read_bnb_checkpoint(&ConfigKeys::from_value(json, "config.json").unwrap())
    }

    #[test]
    fn quantization_config_is_read_with_transformers_defaults() {
        assert_eq!(read(json!({})).unwrap(), None);
        let q = read(
            json!({"quantization_config": {"quant_method": "bitsandbytes",
            "_load_in_4bit": true, "load_in_4bit": true, "bnb_4bit_compute_dtype": "bfloat16"}}),
        )
        .unwrap()
        .unwrap();
        assert_eq!(
            (q.int8, q.compute_dtype, q.threshold),
            (false, DType::BF16, 6.0)
        );
        let err = read(json!({"quantization_config": {"quant_method": "gptq"}})).unwrap_err();
        assert_eq!(
            err.to_string(),
            "config.json: key \"quantization_config.quant_method\": \"gptq\" is not supported \
             (only bitsandbytes)"
        );
        let err = read(json!({"quantization_config": {"quant_method": "bitsandbytes"}}));
        assert!(err.unwrap_err().to_string().contains("exactly one of"));
        let err = read(
            json!({"quantization_config": {"quant_method": "bitsandbytes",
            "load_in_8bit": true, "llm_int8_threshold": "high"}}),
        )
        .unwrap_err();
        assert!(err.to_string().contains("llm_int8_threshold"), "{err}");
    }

    #[test]
    fn named_options_and_default_skips() {
        assert_eq!(
            QuantizeOptions::named("int8").unwrap().format,
            QuantFormat::Int8 { threshold: 6.0 }
        );
        let err = QuantizeOptions::named("int4").unwrap_err();
        assert!(
            err.to_string().contains("\"int4\" (use nf4, fp4 or int8)"),
            "{err}"
        );
        let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
        assert_eq!(
            default_skip_modules(Some(&fixtures.join("tiny-llama"))),
            ["lm_head"]
        );
        assert_eq!(
            default_skip_modules(Some(&fixtures.join("tiny-qwen2"))),
            ["lm_head", "model.embed_tokens"]
        );
        assert_eq!(
            default_skip_modules(Some(&fixtures.join("minilm"))),
            ["lm_head"]
        );
        assert_eq!(default_skip_modules(None), ["lm_head"]);
    }
}
