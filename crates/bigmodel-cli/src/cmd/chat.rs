//! `bigmodel chat`: an interactive conversation with a decoder folder. Each
//! line read is a user message; the conversation is rendered with the
//! model's chat template and the reply printed as it is generated. The KV
//! cache is kept between turns, so a turn runs only what is new.

use std::io::{BufRead, IsTerminal, Write};
use std::path::PathBuf;
use std::sync::Arc;

use bigmodel::device::DeviceSet;
use bm_models::{ChatTemplate, GenerateOptions, open_causal_lm, open_causal_lm_quantized};
use serde_json::{Value, json};

use super::CmdResult;
use super::run::{
    PlacementArgs, QuantizeArgs, SamplingArgs, TextStream, load_progress_bar, parse_dtype,
};

/// Arguments of `bigmodel chat`.
#[derive(clap::Args)]
pub struct Args {
    /// An HF decoder folder with tokenizer.json and a chat template
    /// (chat_template.jinja, or chat_template in tokenizer_config.json).
    model_dir: PathBuf,
    /// A system message opening the conversation.
    #[arg(long)]
    system: Option<String>,
    #[command(flatten)]
    placement: PlacementArgs,
    /// The dtype weights are loaded and computed in: f32, f16, bf16.
    #[arg(long)]
    dtype: Option<String>,
    #[command(flatten)]
    quantize: QuantizeArgs,
    #[command(flatten)]
    sampling: SamplingArgs,
    /// Print nothing while chatting; at the end of the input, one JSON
    /// document: turns (user, generated_ids, text) and seed when sampling.
    #[arg(long)]
    json: bool,
}

/// Runs the command: one turn per line of standard input, until its end
/// or a line `/exit`.
pub fn run(args: Args) -> CmdResult {
    let dtype = args.dtype.as_deref().map(parse_dtype).transpose()?;
    let quantize = args.quantize.options()?;
    let template = ChatTemplate::open_in(&args.model_dir)?;
    let mut options = args.placement.options(dtype)?;
    let (bar, progress) = load_progress_bar(args.json);
    options.load_progress = Some(progress);
    let devices = Arc::new(DeviceSet::probe());
    let dispatched = match &quantize {
        Some(q) => open_causal_lm_quantized(&args.model_dir, devices, &options, q),
        None => open_causal_lm(&args.model_dir, devices, &options),
    }
    .map_err(|e| format!("{}: {e}", args.model_dir.display()))?;
    bar.finish_and_clear();
    let lm = &dispatched.model;
    lm.tokenizer().ok_or_else(|| {
        format!(
            "{}: no tokenizer.json, and chat needs one",
            args.model_dir.display()
        )
    })?;
    let config = lm.generation_config();
    let sampling = args.sampling.sampling(config)?;
    let seed = SamplingArgs::reported_seed(&sampling);

    let interactive = std::io::stdin().is_terminal() && !args.json;
    if interactive {
        eprintln!(
            "Chatting with {} (end with Ctrl-D or /exit).",
            args.model_dir.display()
        );
    }
    let mut messages: Vec<Value> = Vec::new();
    if let Some(system) = &args.system {
        messages.push(json!({"role": "system", "content": system}));
    }
    let mut conversation = lm.new_conversation();
    let mut turns = Vec::new();
    let mut lines = std::io::stdin().lock().lines();
    loop {
        if interactive {
            eprint!("> ");
            std::io::stderr().flush()?;
        }
        let Some(line) = lines.next() else { break };
        let line = line?;
        let message = line.trim();
        if message == "/exit" {
            break;
        }
        if message.is_empty() {
            continue;
        }
        messages.push(json!({"role": "user", "content": message}));
        let rendered = template.render(&messages, None, true)?;
        let history = lm.encode_chat(&rendered)?;
        let generate = GenerateOptions {
            max_new_tokens: args.sampling.max_new_tokens(config, history.len())?,
            stop_tokens: config.eos_token_ids.clone(),
            keep_prompt_logits: false,
            sampling: sampling.clone(),
            // Each turn draws from its own stream of the seed.
            first_stream: turns.len() as u64,
        };
        let mut stream = TextStream::new(lm);
        let mut on_token = |_: usize, token: u32| {
            if !args.json {
                stream.push(token);
            }
        };
        let reply =
            lm.generate_in_conversation(&mut conversation, &history, &generate, &mut on_token)?;
        if !args.json {
            stream.finish();
        }
        if let Some(room) = reply.capped_to {
            eprintln!(
                "note: the reply stopped after {room} tokens, the room left in the model's positions (max_position_embeddings)"
            );
        }
        let text = lm.decode(&reply.tokens)?;
        messages.push(json!({"role": "assistant", "content": text}));
        turns.push(json!({"user": message, "generated_ids": reply.tokens, "text": text}));
    }
    if args.json {
        let mut doc = json!({ "turns": turns });
        if let Some(seed) = seed {
            doc["seed"] = json!(seed);
        }
        println!("{}", serde_json::to_string_pretty(&doc)?);
    }
    super::warn_changed_files();
    Ok(())
}
