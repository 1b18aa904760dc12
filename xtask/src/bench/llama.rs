//! The Llama-style model the load rows use: its shape, config, device
//! maps, and its checkpoint of deterministic random F32 weights.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use bigmodel_benches::safetensors_f32::{self, Tensor};
use serde_json::{Value, json};

/// The sizes of the Llama-style model the load rows use (the demo's shape:
/// about 1 GB of F32 weights; a quarter of that with `--quick`).
pub(super) struct LlamaShape {
    pub(super) layers: usize,
    pub(super) hidden: usize,
    pub(super) intermediate: usize,
    pub(super) heads: usize,
    pub(super) kv_heads: usize,
    pub(super) vocab: usize,
    /// The head reads the token embedding (`tie_word_embeddings`; no
    /// `lm_head.weight` stored).
    pub(super) tied: bool,
}

impl LlamaShape {
    pub(super) fn for_run(quick: bool) -> LlamaShape {
        LlamaShape {
            layers: if quick { 4 } else { 16 },
            hidden: 1024,
            intermediate: 2816,
            heads: 16,
            kv_heads: 4,
            vocab: if quick { 8000 } else { 32000 },
            tied: false,
        }
    }

    pub(super) fn config(&self) -> Value {
        json!({
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": self.hidden,
            "intermediate_size": self.intermediate,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.hidden / self.heads,
            "vocab_size": self.vocab,
            "max_position_embeddings": 2048,
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "hidden_act": "silu",
            "attention_bias": false,
            "mlp_bias": false,
            "tie_word_embeddings": self.tied,
            "torch_dtype": "float32",
            "bos_token_id": 1,
            "eos_token_id": 2,
        })
    }

    /// Every tensor in transformers' order.
    pub(super) fn tensors(&self) -> Vec<Tensor> {
        let (h, i) = (self.hidden, self.intermediate);
        let kv = self.kv_heads * (h / self.heads);
        let mut t = vec![("model.embed_tokens.weight".to_string(), vec![self.vocab, h])];
        for l in 0..self.layers {
            let p = format!("model.layers.{l}");
            t.push((format!("{p}.input_layernorm.weight"), vec![h]));
            t.push((format!("{p}.self_attn.q_proj.weight"), vec![h, h]));
            t.push((format!("{p}.self_attn.k_proj.weight"), vec![kv, h]));
            t.push((format!("{p}.self_attn.v_proj.weight"), vec![kv, h]));
            t.push((format!("{p}.self_attn.o_proj.weight"), vec![h, h]));
            t.push((format!("{p}.post_attention_layernorm.weight"), vec![h]));
            t.push((format!("{p}.mlp.gate_proj.weight"), vec![i, h]));
            t.push((format!("{p}.mlp.up_proj.weight"), vec![i, h]));
            t.push((format!("{p}.mlp.down_proj.weight"), vec![h, i]));
        }
        t.push(("model.norm.weight".into(), vec![h]));
        if !self.tied {
            t.push(("lm_head.weight".into(), vec![self.vocab, h]));
        }
        t
    }

    /// Top-level units of the model in order, for device maps.
    pub(super) fn units(&self) -> Vec<String> {
        let mut u = vec!["model.embed_tokens".to_string()];
        u.extend((0..self.layers).map(|l| format!("model.layers.{l}")));
        u.push("model.norm".into());
        u.push("lm_head".into());
        u
    }

    /// A device map: the embedding, norm and head on `head`, the first half
    /// of the decoder layers on `first`, the second half on `second`.
    pub(super) fn device_map(&self, head: Value, first: Value, second: Value) -> Value {
        let mut map = serde_json::Map::new();
        for unit in self.units() {
            let place = match unit.strip_prefix("model.layers.") {
                Some(l) if l.parse::<usize>().unwrap_or(0) < self.layers / 2 => first.clone(),
                Some(_) => second.clone(),
                None => head.clone(),
            };
            map.insert(unit, place);
        }
        Value::Object(map)
    }

    /// Prompt ids for the first forward: 32 tokens inside the vocabulary.
    pub(super) fn prompt_ids(&self) -> String {
        (0..32)
            .map(|k| ((k * 7919 + 3) % self.vocab).to_string())
            .collect::<Vec<_>>()
            .join(",")
    }
}

/// Writes (once) a Llama-style HF folder with deterministic random F32
/// weights (norm weights 1); returns it and its tensor bytes.
pub(super) fn write_llama(dir: &Path, shape: &LlamaShape) -> Result<(PathBuf, u64), String> {
    write_model(dir, &shape.config(), &shape.tensors(), "Llama-style")
}

/// Writes (once) an HF folder of `config` and `tensors` (in that order) with
/// deterministic random F32 weights, norm weights (`*norm.weight`, GPT-2's
/// `ln_*.weight`) 1; returns it and its tensor bytes. `what` names the
/// model in the progress line.
pub(super) fn write_model(
    dir: &Path,
    config: &Value,
    tensors: &[Tensor],
    what: &str,
) -> Result<(PathBuf, u64), String> {
    let data_bytes = safetensors_f32::data_len(tensors);
    let header = safetensors_f32::header(tensors, &[("format", "pt")]);
    let file_len = header.len() as u64 + data_bytes;
    let config = serde_json::to_string_pretty(config).unwrap_or_default();

    let weights = dir.join("model.safetensors");
    let config_path = dir.join("config.json");
    let fresh = fs::read_to_string(&config_path).is_ok_and(|c| c == config)
        && fs::metadata(&weights).is_ok_and(|m| m.len() == file_len);
    if fresh {
        return Ok((dir.to_path_buf(), data_bytes));
    }
    eprintln!(
        "== bench: writing a {:.0} MB {what} checkpoint to {}",
        data_bytes as f64 / 1e6,
        dir.display()
    );
    // Build beside the final folder and rename, so an interrupted run never
    // leaves a folder that looks complete.
    let partial = dir.with_extension("partial");
    let _ = fs::remove_dir_all(&partial);
    fs::create_dir_all(&partial).map_err(|e| format!("creating {}: {e}", partial.display()))?;
    let write = || -> std::io::Result<()> {
        fs::write(partial.join("config.json"), &config)?;
        let mut f = std::io::BufWriter::with_capacity(
            8 << 20,
            fs::File::create(partial.join("model.safetensors"))?,
        );
        f.write_all(&header)?;
        let mut bytes = Vec::with_capacity(4 << 20);
        for (index, (name, dims)) in tensors.iter().enumerate() {
            let ones = name.ends_with("norm.weight")
                || name
                    .rsplit('.')
                    .nth(1)
                    .is_some_and(|m| m.starts_with("ln_"))
                    && name.ends_with(".weight");
            let mut values = Weights::new(index);
            let mut left = dims.iter().product::<usize>();
            while left > 0 {
                let n = left.min(1 << 20);
                bytes.clear();
                for _ in 0..n {
                    let v = if ones { 1.0f32 } else { values.next() };
                    bytes.extend_from_slice(&v.to_le_bytes());
                }
                f.write_all(&bytes)?;
                left -= n;
            }
        }
        f.into_inner().map_err(|e| e.into_error())?.sync_all()
    };
    write().map_err(|e| format!("writing {}: {e}", partial.display()))?;
    let _ = fs::remove_dir_all(dir);
    fs::rename(&partial, dir)
        .map_err(|e| format!("renaming {} to {}: {e}", partial.display(), dir.display()))?;
    Ok((dir.to_path_buf(), data_bytes))
}

/// The random weights of one tensor: splitmix64 seeded by the tensor's
/// index, mapped to uniform values in [-0.03, 0.03) (std ≈ 0.017, near
/// transformers' initializer_range of 0.02).
struct Weights {
    state: u64,
}

impl Weights {
    fn new(tensor: usize) -> Self {
        Weights {
            state: 0x9E37_79B9_7F4A_7C15u64 ^ (tensor as u64).wrapping_mul(0xD1B5_4A32_D192_ED03),
        }
    }

    fn next(&mut self) -> f32 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        ((z >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * 0.03
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::load::map_has;

    #[test]
    fn device_maps_split_the_layers_in_half() {
        let shape = LlamaShape::for_run(true);
        let map = shape.device_map(json!("cpu"), json!("cpu"), json!("disk"));
        assert_eq!(map["model.layers.1"], "cpu");
        assert_eq!(map["model.layers.2"], "disk");
        assert_eq!(map["lm_head"], "cpu");
        assert!(map_has(&map, "disk"));
        assert_eq!(map.as_object().unwrap().len(), shape.layers + 3);
    }
}
