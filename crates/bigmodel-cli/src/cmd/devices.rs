//! `bigmodel devices`.

use super::CmdResult;

/// Arguments of `bigmodel devices`.
#[derive(clap::Args)]
pub struct Args {}

/// Runs the command.
pub fn run(_args: Args) -> CmdResult {
    Err("`bigmodel devices` is not implemented yet".into())
}
