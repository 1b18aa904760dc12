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

use std::path::Path;

/// A regular file's text: a FIFO is refused, as reading one would wait
/// for a writer.
pub(crate) fn read_text(path: &Path) -> Result<String, String> {
    let bytes = bigmodel::shard::read_regular(path).map_err(|e| format!("cannot read {e}"))?;
    String::from_utf8(bytes)
        .map_err(|e| format!("{} is not valid JSON: not UTF-8 ({e})", path.display()))
}

/// `text` (read from `path`) as JSON.
pub(crate) fn parse_json(path: &Path, text: &str) -> Result<serde_json::Value, String> {
    serde_json::from_str(text).map_err(|e| format!("{} is not valid JSON: {e}", path.display()))
}

/// The JSON document in the regular file `path`.
pub(crate) fn read_json(path: &Path) -> Result<serde_json::Value, String> {
    parse_json(path, &read_text(path)?)
}

/// The error every command returns: printed as one paragraph on stderr.
pub type CmdResult = Result<(), Box<dyn std::error::Error>>;
