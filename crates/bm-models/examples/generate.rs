//! Greedy generation from a Hugging Face decoder folder, with timings.
//!
//! `cargo run --release -p bm-models --example generate -- MODEL_DIR [N] [DTYPE] [IDS]`
//! (IDS comma-separated, default `1,2,3,4`; DTYPE f32, f16 or bf16, default
//! the checkpoint's).

use bm_models::{CausalLm, GenerateOptions};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let dir = args
        .first()
        .ok_or("usage: generate MODEL_DIR [N] [DTYPE] [IDS]")?;
    let max_new_tokens = args.get(1).map_or(Ok(16), |n| n.parse())?;
    let dtype = args.get(2).map(|d| d.parse()).transpose()?;
    let prompt: Vec<u32> = match args.get(3) {
        Some(ids) => ids.split(',').map(str::parse).collect::<Result<_, _>>()?,
        None => vec![1, 2, 3, 4],
    };
    let lm = CausalLm::open(dir, dtype)?;
    let options = GenerateOptions {
        max_new_tokens,
        ..GenerateOptions::default()
    };
    let generation = lm.generate_ids(&prompt, &options)?;
    let steps = &generation.step_seconds;
    let decode: f64 = steps[1..].iter().sum::<f64>() / (steps.len() - 1).max(1) as f64;
    println!("tokens: {:?}", generation.tokens);
    println!("dtype: {}", lm.decoder().dtype());
    println!("prompt forward: {:.4} s", steps[0]);
    println!("per token: {:.4} s ({:.1} tokens/s)", decode, 1.0 / decode);
    Ok(())
}
