//! `bigmodel plan`.

use super::CmdResult;

/// Arguments of `bigmodel plan`.
#[derive(clap::Args)]
pub struct Args {}

/// Runs the command.
pub fn run(_args: Args) -> CmdResult {
    Err("`bigmodel plan` is not implemented yet".into())
}
