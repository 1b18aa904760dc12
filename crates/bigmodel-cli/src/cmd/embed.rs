//! `bigmodel embed`: sentence embeddings from a BERT-family folder placed
//! under a device map.

use std::path::PathBuf;
use std::sync::Arc;

use bigmodel::device::DeviceSet;
use bm_models::{open_sentence_embedder, open_sentence_embedder_quantized};
use serde_json::json;

use super::CmdResult;
use super::run::{PlacementArgs, print_device_map};

/// Arguments of `bigmodel embed`.
#[derive(clap::Args)]
pub struct Args {
    /// A sentence-transformers or BERT folder (config.json, safetensors or
    /// PyTorch .bin weights, tokenizer.json), e.g. all-MiniLM-L6-v2.
    model_dir: PathBuf,
    /// The texts to embed.
    #[arg(required = true)]
    texts: Vec<String>,
    #[command(flatten)]
    placement: PlacementArgs,
    #[command(flatten)]
    quantize: super::run::QuantizeArgs,
    /// Print one JSON document: `embeddings` (one list of floats per text).
    #[arg(long)]
    json: bool,
}

/// Runs the command.
pub fn run(args: Args) -> CmdResult {
    if let Some(i) = args.texts.iter().position(String::is_empty) {
        return Err(format!("text {} is empty: give some text", i + 1).into());
    }
    let quantize = args.quantize.options()?;
    let mut options = args.placement.options(None)?;
    let (bar, progress) = super::run::load_progress_bar(args.json);
    options.load_progress = Some(progress);
    let devices = Arc::new(DeviceSet::probe());
    let dispatched = match &quantize {
        Some(q) => open_sentence_embedder_quantized(&args.model_dir, devices, &options, q),
        None => open_sentence_embedder(&args.model_dir, devices, &options),
    }
    .map_err(|e| format!("{}: {e}", args.model_dir.display()))?;
    bar.finish_and_clear();
    let embeddings = dispatched.model.embed(&args.texts)?;
    if args.json {
        println!("{}", json!({ "embeddings": embeddings }));
    } else {
        print_device_map(&dispatched.weights);
        for (text, embedding) in args.texts.iter().zip(&embeddings) {
            let head: Vec<String> = embedding
                .iter()
                .take(4)
                .map(|v| format!("{v:.5}"))
                .collect();
            println!(
                "{text:?}: [{}, ...] ({} values)",
                head.join(", "),
                embedding.len()
            );
        }
    }
    Ok(())
}
