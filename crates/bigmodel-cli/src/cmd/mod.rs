//! One module per command.

pub mod devices;
pub mod inspect;
pub mod plan;
pub mod shard;

/// The error every command returns: printed as one paragraph on stderr.
pub type CmdResult = Result<(), Box<dyn std::error::Error>>;
