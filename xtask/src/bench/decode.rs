//! The decode rows: time per generated token on the CPU, every weight in
//! RAM, of GPT-2 and of a Llama of the same size (the same width, depth,
//! vocabulary and multiply-adds per token), `bigmodel run` next to PyTorch
//! (`bench_accelerate.py decode`: transformers' eager model) with the same
//! number of threads. Both models have random F32 weights written here.
//!
//! torch's OpenMP threads spin while they wait by default, which collapses
//! when other processes share the cores (8× slower at 2 threads on a loaded
//! 2-core VM); sleeping (`OMP_WAIT_POLICY=PASSIVE`) costs a little on an
//! idle machine. The baseline is the faster of the two, so neither kind of
//! machine handicaps PyTorch.

use std::path::PathBuf;
use std::process::Command;

use bigmodel_benches::safetensors_f32::Tensor;
use serde_json::{Value, json};

use super::Suite;
use super::llama::{LlamaShape, write_model};
use super::process::{COMMAND_LIMIT, capture};
use super::report::{Cell, Row, Unit};
use super::stats::median_fields;

const SECTION: &str = "Decode on the CPU, all in RAM: GPT-2 and a Llama of the same size";

/// GPT-2's sizes (GPT2LMHeadModel: Conv1D weights stored `[in, out]`,
/// learned positions, the head tied to the token embedding).
pub(super) struct GptShape {
    pub(super) layers: usize,
    pub(super) hidden: usize,
    pub(super) heads: usize,
    pub(super) vocab: usize,
    pub(super) positions: usize,
}

impl GptShape {
    /// GPT-2 small (124M parameters); 4 layers and an 8000-token
    /// vocabulary with `--quick`.
    pub(super) fn for_run(quick: bool) -> GptShape {
        GptShape {
            layers: if quick { 4 } else { 12 },
            hidden: 768,
            heads: 12,
            vocab: if quick { 8000 } else { 50257 },
            positions: 1024,
        }
    }

    pub(super) fn config(&self) -> Value {
        json!({
            "architectures": ["GPT2LMHeadModel"],
            "model_type": "gpt2",
            "activation_function": "gelu_new",
            "n_embd": self.hidden,
            "n_head": self.heads,
            "n_layer": self.layers,
            "n_positions": self.positions,
            "n_inner": null,
            "vocab_size": self.vocab,
            "layer_norm_epsilon": 1e-5,
            "tie_word_embeddings": true,
            "torch_dtype": "float32",
            "bos_token_id": 1,
            "eos_token_id": 2,
        })
    }

    /// Every stored tensor in transformers' order.
    pub(super) fn tensors(&self) -> Vec<Tensor> {
        let h = self.hidden;
        let mut t = vec![
            ("transformer.wte.weight".to_string(), vec![self.vocab, h]),
            (
                "transformer.wpe.weight".to_string(),
                vec![self.positions, h],
            ),
        ];
        for l in 0..self.layers {
            let p = format!("transformer.h.{l}");
            for (name, shape) in [
                ("ln_1.weight", vec![h]),
                ("ln_1.bias", vec![h]),
                ("attn.c_attn.weight", vec![h, 3 * h]),
                ("attn.c_attn.bias", vec![3 * h]),
                ("attn.c_proj.weight", vec![h, h]),
                ("attn.c_proj.bias", vec![h]),
                ("ln_2.weight", vec![h]),
                ("ln_2.bias", vec![h]),
                ("mlp.c_fc.weight", vec![h, 4 * h]),
                ("mlp.c_fc.bias", vec![4 * h]),
                ("mlp.c_proj.weight", vec![4 * h, h]),
                ("mlp.c_proj.bias", vec![h]),
            ] {
                t.push((format!("{p}.{name}"), shape));
            }
        }
        t.push(("transformer.ln_f.weight".into(), vec![h]));
        t.push(("transformer.ln_f.bias".into(), vec![h]));
        t
    }

    /// The Llama of the same size: as wide and deep, the same vocabulary
    /// and tied head, full multi-head attention (4·h² per layer, as GPT-2's
    /// c_attn and c_proj) and a gated MLP of width 8h/3 (3·h·8h/3 = 8·h²,
    /// as GPT-2's 4h-wide MLP).
    pub(super) fn llama(&self) -> LlamaShape {
        LlamaShape {
            layers: self.layers,
            hidden: self.hidden,
            intermediate: 8 * self.hidden / 3,
            heads: self.heads,
            kv_heads: self.heads,
            vocab: self.vocab,
            tied: true,
        }
    }
}

/// Parameters of `tensors`.
fn parameters(tensors: &[Tensor]) -> usize {
    tensors
        .iter()
        .map(|(_, s)| s.iter().product::<usize>())
        .sum()
}

impl Suite {
    pub(super) fn decode_rows(&self) -> Vec<Row> {
        eprintln!("== bench: decode on the CPU, GPT-2 and a Llama of the same size");
        let gpt = GptShape::for_run(self.quick);
        let llama = gpt.llama();
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        let runs = if self.quick { 1 } else { 3 };
        let new_tokens = if self.quick { 8 } else { 16 };
        let suffix = if self.quick { "-quick" } else { "" };
        let prompt = llama.prompt_ids();
        let models = [
            (
                "GPT-2",
                write_model(
                    &self.data.join(format!("gpt2{suffix}")),
                    &gpt.config(),
                    &gpt.tensors(),
                    "GPT-2",
                ),
                parameters(&gpt.tensors()),
            ),
            (
                "Llama",
                write_model(
                    &self.data.join(format!("llama-gpt2-size{suffix}")),
                    &llama.config(),
                    &llama.tensors(),
                    "Llama of GPT-2's size",
                ),
                parameters(&llama.tensors()),
            ),
        ];
        let mut rows = Vec::new();
        for (name, folder, params) in models {
            let folder = folder.map(|(dir, _)| dir);
            // Alternating the two sides, so a change of the machine's load
            // falls on both.
            let mut ours = Vec::new();
            let mut spinning = Vec::new();
            let mut sleeping = Vec::new();
            for _ in 0..runs {
                ours.push(self.bigmodel_decode(&folder, &prompt, new_tokens, threads));
                for (policy, answers) in [("ACTIVE", &mut spinning), ("PASSIVE", &mut sleeping)] {
                    answers
                        .push(self.pytorch_decode(&folder, &prompt, new_tokens, threads, policy));
                }
            }
            rows.push(decode_row(
                name,
                &median_of(ours),
                &faster(median_of(spinning), median_of(sleeping)),
                params,
                threads,
                runs,
                new_tokens,
            ));
        }
        rows
    }

    /// `bigmodel run` on `folder`, its rayon pool at `threads` threads.
    fn bigmodel_decode(
        &self,
        folder: &Result<PathBuf, String>,
        prompt: &str,
        new_tokens: usize,
        threads: usize,
    ) -> Result<Value, String> {
        let folder = folder.as_ref().map_err(Clone::clone)?;
        let mut cmd = Command::new(self.cli()?);
        cmd.arg("run")
            .arg(folder)
            .args(["--prompt-ids", prompt])
            .args(["--max-new-tokens", &new_tokens.to_string(), "--json"])
            .env("RAYON_NUM_THREADS", threads.to_string());
        let out = capture(&mut cmd, COMMAND_LIMIT)?;
        serde_json::from_str(out.stdout.trim())
            .map_err(|e| format!("not available: bigmodel run --json: {e}"))
    }

    /// `bench_accelerate.py decode` on `folder` with `threads` threads
    /// waiting with OpenMP's `policy` (`ACTIVE` or `PASSIVE`), which the
    /// answer records as `omp_wait_policy`.
    fn pytorch_decode(
        &self,
        folder: &Result<PathBuf, String>,
        prompt: &str,
        new_tokens: usize,
        threads: usize,
        policy: &str,
    ) -> Result<Value, String> {
        let folder = folder.as_ref().map_err(Clone::clone)?;
        let mut answer = self.baseline_with_env(
            &[
                "decode",
                &folder.to_string_lossy(),
                "--prompt-ids",
                prompt,
                "--new-tokens",
                &new_tokens.to_string(),
                "--threads",
                &threads.to_string(),
            ],
            &[("OMP_WAIT_POLICY", policy)],
        )?;
        answer["omp_wait_policy"] = json!(policy);
        Ok(answer)
    }
}

/// The answer with the smaller `seconds_per_token`, or the one that came.
fn faster(a: Result<Value, String>, b: Result<Value, String>) -> Result<Value, String> {
    let seconds = |r: &Result<Value, String>| {
        r.as_ref()
            .ok()
            .and_then(|v| v["seconds_per_token"].as_f64())
    };
    match (seconds(&a), seconds(&b)) {
        (Some(x), Some(y)) if y < x => b,
        (Some(_), _) => a,
        (None, Some(_)) => b,
        (None, None) => a,
    }
}

/// The median of each numeric field over the answers that came, or the
/// first failure when none did.
fn median_of(answers: Vec<Result<Value, String>>) -> Result<Value, String> {
    let (ok, failed): (Vec<_>, Vec<_>) = answers.into_iter().partition(Result::is_ok);
    match (ok.is_empty(), failed.into_iter().next()) {
        (true, Some(Err(why))) => Err(why),
        _ => Ok(median_fields(
            &ok.into_iter().flatten().collect::<Vec<Value>>(),
        )),
    }
}

/// The row of one model from the two sides' answers (`bigmodel run --json`
/// keys of the CLI contract; `bench_accelerate.py decode` keys).
fn decode_row(
    model: &str,
    ours: &Result<Value, String>,
    theirs: &Result<Value, String>,
    parameters: usize,
    threads: usize,
    runs: usize,
    new_tokens: usize,
) -> Row {
    let seconds = |r: &Result<Value, String>| -> Result<f64, String> {
        let v = r.as_ref().map_err(Clone::clone)?;
        v["seconds_per_token"]
            .as_f64()
            .ok_or_else(|| "not available: no `seconds_per_token` in the answer".into())
    };
    let tokens = match (ours, theirs) {
        (Ok(a), Ok(b)) if a["generated_ids"] == b["generated_ids"] => "; the same tokens",
        (Ok(_), Ok(_)) => "; DIFFERENT tokens",
        _ => "",
    };
    let policy = match theirs
        .as_ref()
        .ok()
        .and_then(|v| v["omp_wait_policy"].as_str())
    {
        Some(p) => format!("; torch faster with OMP_WAIT_POLICY={p}"),
        None => String::new(),
    };
    Row::new(
        SECTION,
        format!("{model}: time per generated token (KV cache)"),
        Unit::Seconds,
    )
    .bigmodel(Cell::from(seconds(ours)))
    .baseline(
        format!("PyTorch (transformers, eager), {threads} thread(s)"),
        Cell::from(seconds(theirs)),
    )
    .note(format!(
        "{:.0}M parameters, F32; 32-token prompt, median of {} decode steps, median of {runs} run(s){tokens}{policy}",
        parameters as f64 / 1e6,
        new_tokens - 1
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_llama_has_gpt2_s_width_depth_and_multiply_adds() {
        let gpt = GptShape::for_run(false);
        let llama = gpt.llama();
        let weights = |t: &[Tensor]| -> usize {
            // Matrices inside the layers: the multiply-adds of a token.
            t.iter()
                .filter(|(n, s)| s.len() == 2 && (n.contains(".h.") || n.contains(".layers.")))
                .map(|(_, s)| s[0] * s[1])
                .sum()
        };
        assert_eq!(weights(&gpt.tensors()), weights(&llama.tensors()));
        assert_eq!(parameters(&gpt.tensors()), 124_439_808);
        assert!(!llama.tensors().iter().any(|(n, _)| n == "lm_head.weight"));
        assert_eq!(llama.config()["tie_word_embeddings"], true);
    }

    #[test]
    fn decode_rows_read_both_sides_and_compare_tokens() {
        let ours = Ok(json!({"seconds_per_token": 0.05, "generated_ids": [5, 6]}));
        let spinning = Ok(json!({"seconds_per_token": 0.4, "omp_wait_policy": "ACTIVE"}));
        let sleeping = Ok(json!({
            "seconds_per_token": 0.1, "generated_ids": [5, 6], "omp_wait_policy": "PASSIVE"
        }));
        let theirs = faster(spinning, sleeping);
        let row = decode_row("GPT-2", &ours, &theirs, 124_000_000, 2, 1, 8);
        assert_eq!(row.ratio(), Some(2.0));
        assert!(row.note.contains("the same tokens"), "{}", row.note);
        assert!(row.note.contains("OMP_WAIT_POLICY=PASSIVE"), "{}", row.note);
        assert!(faster(Err("x".into()), theirs.clone()).is_ok());
        let other = Ok(json!({"seconds_per_token": 0.1, "generated_ids": [5, 7]}));
        let row = decode_row("GPT-2", &ours, &other, 124_000_000, 2, 1, 8);
        assert!(row.note.contains("DIFFERENT"), "{}", row.note);
        let missing: Result<Value, String> = Err("not available: x".into());
        let row = decode_row("Llama", &missing, &theirs, 1, 2, 1, 8);
        assert_eq!(row.ratio(), None);
        assert_eq!(
            median_of(vec![Err("a".into()), Err("b".into())]).unwrap_err(),
            "a"
        );
    }
}
