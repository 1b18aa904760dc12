//! `bigmodel inspect`.

use super::CmdResult;

/// Arguments of `bigmodel inspect`.
#[derive(clap::Args)]
pub struct Args {}

/// Runs the command.
pub fn run(_args: Args) -> CmdResult {
    Err("`bigmodel inspect` is not implemented yet".into())
}
