//! One module per command.

pub mod calibrate;
pub mod chat;
pub mod convert;
pub mod demo;
pub mod devices;
pub mod embed;
pub mod inspect;
pub mod plan;
pub mod run;
pub mod shard;

/// The error every command returns: printed as one paragraph on stderr.
pub type CmdResult = Result<(), Box<dyn std::error::Error>>;
