//! `bigmodel shard`.

use super::CmdResult;

/// Arguments of `bigmodel shard`.
#[derive(clap::Args)]
pub struct Args {}

/// Runs the command.
pub fn run(_args: Args) -> CmdResult {
    Err("`bigmodel shard` is not implemented yet".into())
}
