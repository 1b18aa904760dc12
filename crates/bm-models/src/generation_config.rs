//! A model folder's `generation_config.json`: the defaults transformers'
//! `generate` starts from (sampling settings, lengths, end tokens), which
//! the caller's own settings override.

use std::path::{Path, PathBuf};

use bigmodel::plan::config::{ConfigKeys, Float};

use crate::config::read_keys;
use crate::{Error, Sampling};

/// The generation defaults of a model folder, as transformers' `generate`
/// (5.x) settles them: `generation_config.json` when the folder has one,
/// transformers' global defaults for what it does not say or sets to
/// `null` (`do_sample` false, `temperature` 1, `top_k` 50, `top_p` 1,
/// `repetition_penalty` 1), and the end tokens of config.json when the
/// file gives none.
#[derive(Clone, Debug, PartialEq)]
pub struct GenerationConfig {
    /// Greedy or sampling, and the processors' settings (seed 0).
    pub sampling: Sampling,
    /// `max_new_tokens`, if given.
    pub max_new_tokens: Option<usize>,
    /// `max_length` (prompt and new tokens together), if the file gives it.
    pub max_length: Option<usize>,
    /// Tokens that end a sequence (`eos_token_id`, one id or a list).
    pub eos_token_ids: Vec<u32>,
    /// Where an encoder–decoder's first decoder token comes from.
    pub decoder_start: DecoderStart,
}

/// Where an encoder–decoder's first decoder token comes from, as
/// transformers' `generate` (5.x) picks it: its generation config's
/// `decoder_start_token_id`, else that config's `bos_token_id`. The
/// generation config is generation_config.json when the folder has one
/// (config.json's tokens are then not read at all), else the one
/// transformers makes from config.json.
#[derive(Clone, Debug, PartialEq)]
pub enum DecoderStart {
    /// The folder has no generation_config.json: config.json's tokens.
    ModelConfig,
    /// generation_config.json's token (`None`: it names neither).
    File {
        /// The file, for errors.
        path: PathBuf,
        /// Its `decoder_start_token_id`, else its `bos_token_id`.
        token: Option<u32>,
    },
}

/// A config's first decoder token: `decoder_start_token_id`, else
/// `bos_token_id` (transformers' fallback), at most one id. The rule for
/// config.json and generation_config.json alike.
pub(crate) fn start_token(keys: &ConfigKeys) -> Result<Option<u32>, Error> {
    let mut key = "decoder_start_token_id";
    let mut ids = keys.token_ids(key)?;
    if ids.is_empty() {
        key = "bos_token_id";
        ids = keys.token_ids(key)?;
    }
    match ids.as_slice() {
        [] => Ok(None),
        [id] => Ok(Some(*id)),
        ids => Err(keys
            .error(key, format!("{ids:?}: expected one token id"))
            .into()),
    }
}

impl GenerationConfig {
    /// transformers' defaults, with the model's end tokens (config.json's
    /// `eos_token_id`).
    pub fn defaults(eos_token_ids: &[u32]) -> GenerationConfig {
        GenerationConfig {
            sampling: Sampling {
                top_k: 50,
                ..Sampling::default()
            },
            max_new_tokens: None,
            max_length: None,
            eos_token_ids: eos_token_ids.to_vec(),
            decoder_start: DecoderStart::ModelConfig,
        }
    }

    /// Reads `dir/generation_config.json` if the folder has one, over
    /// [`GenerationConfig::defaults`]. Errors name the file and the key.
    pub fn from_dir(
        dir: impl AsRef<Path>,
        eos_token_ids: &[u32],
    ) -> Result<GenerationConfig, Error> {
        let path = dir.as_ref().join("generation_config.json");
        let defaults = GenerationConfig::defaults(eos_token_ids);
        if !bm_shard::exists(&path)? {
            return Ok(defaults);
        }
        GenerationConfig::from_keys(&read_keys(&path)?, defaults)
    }

    /// The settings of a parsed `generation_config.json` over `defaults`.
    /// A `null` is as if the key were absent: transformers 5 fills every
    /// unset field from its global defaults.
    pub fn from_keys(
        keys: &ConfigKeys,
        defaults: GenerationConfig,
    ) -> Result<GenerationConfig, Error> {
        let d = &defaults.sampling;
        let float = |key: &str, default: f32| -> Result<f32, Error> {
            Ok(keys
                .opt_f64(key, Float::Finite)?
                .map_or(default, |v| v as f32))
        };
        // 0 is allowed: no top-k filtering.
        let top_k = match keys.get("top_k") {
            Some(v) => v
                .as_u64()
                .and_then(|n| usize::try_from(n).ok())
                .ok_or_else(|| keys.error("top_k", format!("expected a count, found {v}")))?,
            None => d.top_k,
        };
        let eos = match keys.token_ids("eos_token_id")? {
            ids if ids.is_empty() => defaults.eos_token_ids.clone(),
            ids => ids,
        };
        let sampling = Sampling {
            do_sample: keys.bool_or("do_sample", d.do_sample)?,
            temperature: float("temperature", d.temperature)?,
            top_k,
            top_p: float("top_p", d.top_p)?,
            repetition_penalty: float("repetition_penalty", d.repetition_penalty)?,
            seed: d.seed,
        };
        // The ranges matter only for the settings in use (sampling ones
        // when sampling), as in transformers.
        sampling.check().map_err(|e| match e {
            Error::BadGenerateOption { option, message } => keys.error(option, message).into(),
            other => other,
        })?;
        Ok(GenerationConfig {
            sampling,
            max_new_tokens: keys.opt_count("max_new_tokens", usize::MAX)?,
            max_length: keys.opt_count("max_length", usize::MAX)?,
            eos_token_ids: eos,
            decoder_start: DecoderStart::File {
                path: keys.file().to_path_buf(),
                token: start_token(keys)?,
            },
        })
    }

    /// New tokens for a prompt (or a left-padded batch) of `prompt_len`
    /// tokens: `max_new_tokens`, else what `max_length` leaves after the
    /// prompt, else `fallback`. A `max_length` that leaves nothing is an
    /// error, as in transformers.
    pub fn max_new_tokens_for(&self, prompt_len: usize, fallback: usize) -> Result<usize, Error> {
        match (self.max_new_tokens, self.max_length) {
            (Some(n), _) => Ok(n),
            (None, Some(total)) if total > prompt_len => Ok(total - prompt_len),
            (None, Some(total)) => Err(Error::BadGenerateOption {
                option: "max_length",
                message: format!(
                    "{total} (generation_config.json) leaves no room after a prompt of {prompt_len} tokens; give max_new_tokens"
                ),
            }),
            (None, None) => Ok(fallback),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::DecoderConfig;
    use serde_json::{Value, json};

    fn model() -> DecoderConfig {
        DecoderConfig::from_json(
            "config.json",
            json!({
                "model_type": "llama", "vocab_size": 16, "hidden_size": 8,
                "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
                "eos_token_id": [2, 5],
            }),
        )
        .unwrap()
    }

    fn parse(file: Value) -> Result<GenerationConfig, Error> {
        let keys = ConfigKeys::from_value(file, "generation_config.json").unwrap();
        GenerationConfig::from_keys(&keys, GenerationConfig::defaults(&model().eos_token_ids))
    }

    #[test]
    fn transformers_defaults_fill_what_the_file_does_not_say() {
        let g = parse(json!({"do_sample": true, "temperature": 0.6, "top_p": 0.9})).unwrap();
        assert_eq!(
            g.sampling,
            Sampling {
                do_sample: true,
                temperature: 0.6,
                top_k: 50,
                top_p: 0.9,
                repetition_penalty: 1.0,
                seed: 0,
            }
        );
        assert_eq!(g.eos_token_ids, [2, 5]);
        // A null is unset, so transformers' default (top_k 50) applies.
        let g = parse(json!({"eos_token_id": 7, "top_k": null, "max_length": 10})).unwrap();
        assert_eq!((&g.eos_token_ids[..], g.sampling.top_k), (&[7][..], 50));
        assert_eq!(parse(json!({"top_k": 0})).unwrap().sampling.top_k, 0);
        assert_eq!(g.max_new_tokens_for(4, 16).unwrap(), 6);
        let err = g.max_new_tokens_for(10, 16).unwrap_err().to_string();
        assert!(
            err.starts_with("max_length: 10 (generation_config.json) leaves no room"),
            "{err}"
        );
        let g = parse(json!({"max_new_tokens": 3, "max_length": 10})).unwrap();
        assert_eq!(g.max_new_tokens_for(4, 16).unwrap(), 3);
        assert_eq!(
            parse(json!({})).unwrap().max_new_tokens_for(4, 16).unwrap(),
            16
        );
    }

    #[test]
    fn bad_values_name_the_file_and_key() {
        for (file, key) in [
            (
                json!({"do_sample": true, "temperature": 0.0}),
                "temperature",
            ),
            (json!({"do_sample": true, "top_p": 2}), "top_p"),
            (json!({"repetition_penalty": "x"}), "repetition_penalty"),
            (json!({"top_k": -1}), "top_k"),
            (json!({"max_new_tokens": 0}), "max_new_tokens"),
            (json!({"eos_token_id": "x"}), "eos_token_id"),
        ] {
            let err = parse(file).unwrap_err().to_string();
            assert!(
                err.starts_with("generation_config.json: key") && err.contains(key),
                "{err}"
            );
        }
        // A temperature of 0 with greedy decoding is not used, so not checked.
        parse(json!({"temperature": 0.0})).unwrap();
    }
}
