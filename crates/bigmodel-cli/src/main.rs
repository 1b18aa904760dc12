//! The `bigmodel` command line. The stable surface (commands, flags, JSON
//! keys) is specified in `shared/spec/cli.md`; each command lives in its own
//! module under `cmd/`.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod cmd;
mod sigbus;

/// Load, plan and run models larger than any one device.
#[derive(Parser)]
#[command(name = "bigmodel", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Summarise a checkpoint: tensors, bytes per dtype and module, largest layer.
    Inspect(cmd::inspect::Args),
    /// Rewrite a checkpoint as shards of at most a given size.
    Shard(cmd::shard::Args),
    /// Rewrite a PyTorch .bin checkpoint as safetensors (read without running its pickle).
    Convert(cmd::convert::Args),
    /// Compute a device map for a module tree, checkpoint or config.json.
    Plan(cmd::plan::Args),
    /// List the devices found and their memory.
    Devices(cmd::devices::Args),
    /// Load a decoder folder under a device map and generate greedily.
    Run(cmd::run::Args),
    /// Sentence embeddings from a BERT-family folder under a device map.
    Embed(cmd::embed::Args),
    /// Create a ~1 GB model, run it offloaded and check it against RAM.
    Demo(cmd::demo::Args),
}

fn main() -> ExitCode {
    sigbus::install();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Inspect(a) => cmd::inspect::run(a),
        Command::Shard(a) => cmd::shard::run(a),
        Command::Convert(a) => cmd::convert::run(a),
        Command::Plan(a) => cmd::plan::run(a),
        Command::Devices(a) => cmd::devices::run(a),
        Command::Run(a) => cmd::run::run(a),
        Command::Embed(a) => cmd::embed::run(a),
        Command::Demo(a) => cmd::demo::run(a),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
