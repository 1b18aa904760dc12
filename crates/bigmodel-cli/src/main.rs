//! The `bigmodel` command line. The stable surface (commands, flags, JSON
//! keys) is specified in `docs/cli.md`; each command lives in its own
//! module under `cmd/`.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod cmd;
mod interrupt;
mod sigbus;

/// mimalloc rather than glibc's malloc: a command's many small allocations
/// (a 99k-module tree has ~400k) come from pages it holds, where glibc's
/// faulted in a fresh page at a time; `bigmodel plan` on that tree takes
/// about half the CPU time (benches/README.md).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

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
    /// Load a decoder folder under a device map and generate from one or more prompts.
    Run(cmd::run::Args),
    /// Talk with a decoder folder through its chat template (one line per message).
    Chat(cmd::chat::Args),
    /// Sentence embeddings from a BERT-family folder under a device map.
    Embed(cmd::embed::Args),
    /// Create a ~1 GB model, run it offloaded and check it against RAM.
    Demo(cmd::demo::Args),
}

fn main() -> ExitCode {
    sigbus::install();
    interrupt::install();
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) if !e.use_stderr() => e.exit(),
        Err(e) => {
            let args: Vec<String> = std::env::args().skip(1).collect();
            let help = help_command(&args);
            eprintln!("{}", one_paragraph(&e.render().to_string(), &help));
            return ExitCode::from(2);
        }
    };
    let exit_at_once = matches!(&cli.command, Command::Plan(a) if !a.uses_devices());
    let result = match cli.command {
        Command::Inspect(a) => cmd::inspect::run(a),
        Command::Shard(a) => cmd::shard::run(a),
        Command::Convert(a) => cmd::convert::run(a),
        Command::Plan(a) => cmd::plan::run(a),
        Command::Devices(a) => cmd::devices::run(a),
        Command::Run(a) => cmd::run::run(a),
        Command::Chat(a) => cmd::chat::run(a),
        Command::Embed(a) => cmd::embed::run(a),
        Command::Demo(a) => cmd::demo::run(a),
    };
    match result {
        Ok(()) if exit_at_once => exit_now(),
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Ends a successful process without the C runtime's exit handlers:
/// mimalloc, linked in statically, hands every page it holds back to the
/// kernel there (a `madvise` per chunk: 2-3 % of `bigmodel plan` on a
/// 99k-module tree), which the kernel's teardown of the process does anyway.
/// Only for a command that allocated nothing on a device, as a CUDA
/// profiler writes its data from an exit handler.
fn exit_now() -> ! {
    use std::io::Write as _;
    let _ = std::io::stdout().flush();
    // SAFETY: `_exit` ends the process at once; every value of the command
    // was dropped when it returned, and standard output is flushed above
    // (standard error is not buffered).
    unsafe { libc::_exit(0) }
}

/// The command whose `--help` a usage error points to: `bigmodel` and the
/// first argument naming a subcommand, if one does.
fn help_command(args: &[String]) -> String {
    let cli = <Cli as clap::CommandFactory>::command();
    let sub = args
        .iter()
        .find(|a| cli.get_subcommands().any(|c| c.get_name() == a.as_str()));
    match sub {
        Some(sub) => format!("bigmodel {sub}"),
        None => "bigmodel".into(),
    }
}

/// A clap usage error as the CLI contract wants every error: one paragraph.
/// Clap's message, tip and context lines are joined; its usage block and
/// help line give way to the `--help` hint of `command`.
fn one_paragraph(rendered: &str, command: &str) -> String {
    let mut text = String::new();
    for line in rendered.lines().map(str::trim).filter(|l| !l.is_empty()) {
        if line.starts_with("Usage: ") || line.starts_with("For more information") {
            continue;
        }
        if !text.is_empty() {
            text += if text.ends_with(':') { " " } else { "; " };
        }
        text += line;
    }
    let text = text.trim_end_matches('.');
    format!("{text}. For more information, try '{command} --help'.")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Clap's rendering of each kind of usage error becomes one line.
    #[test]
    fn usage_errors_are_one_paragraph_with_the_help_hint() {
        for (args, wanted) in [
            (
                &["bigmodel", "plan", "x", "--max-seq-len", "-5"][..],
                "error: unexpected argument '-5' found; tip: to pass '-5' as a value, use '-- -5'. For more information, try 'bigmodel plan --help'.",
            ),
            (
                &["bigmodel", "inspect"],
                "error: the following required arguments were not provided: <CHECKPOINT>. For more information, try 'bigmodel inspect --help'.",
            ),
            (
                &[
                    "bigmodel",
                    "run",
                    "m",
                    "--max-new-tokens",
                    "99999999999999999999999",
                ],
                "error: invalid value '99999999999999999999999' for '--max-new-tokens <MAX_NEW_TOKENS>': number too large to fit in target type. For more information, try 'bigmodel run --help'.",
            ),
            (
                &["bigmodel", "nosuch"],
                "error: unrecognized subcommand 'nosuch'. For more information, try 'bigmodel --help'.",
            ),
        ] {
            let e = Cli::try_parse_from(args).err().unwrap();
            let rest: Vec<String> = args[1..].iter().map(|a| a.to_string()).collect();
            let help = help_command(&rest);
            assert_eq!(one_paragraph(&e.render().to_string(), &help), wanted);
        }
    }
}
