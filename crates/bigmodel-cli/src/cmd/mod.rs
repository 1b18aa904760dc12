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

/// A regular file's text, mapped rather than copied: the pages come from
/// the page cache instead of fresh memory the kernel must clear, which for
/// a 10 MB module tree is a measurable part of `plan`.
pub(crate) struct MappedText(bigmodel::tensor::MmapView);

impl MappedText {
    pub(crate) fn text(&self) -> &str {
        // SAFETY: checked to be UTF-8 by `map_text`; the map is read-only.
        unsafe { std::str::from_utf8_unchecked(self.0.as_bytes()) }
    }
}

/// Maps the regular file `path` and checks that it is UTF-8.
pub(crate) fn map_text(path: &Path) -> Result<MappedText, String> {
    let file = bigmodel::shard::open_regular(path).map_err(|e| format!("cannot read {e}"))?;
    let map = bigmodel::tensor::MmapView::map_file(&file, path)
        .map_err(|e| format!("cannot read {e}"))?;
    if let Err(e) = std::str::from_utf8(map.as_bytes()) {
        return Err(format!(
            "{} is not valid JSON: not UTF-8 ({e})",
            path.display()
        ));
    }
    Ok(MappedText(map))
}

/// `text` (read from `path`) as JSON.
pub(crate) fn parse_json(path: &Path, text: &str) -> Result<serde_json::Value, String> {
    serde_json::from_str(text).map_err(|e| format!("{} is not valid JSON: {e}", path.display()))
}

/// The JSON document in the regular file `path`.
pub(crate) fn read_json(path: &Path) -> Result<serde_json::Value, String> {
    parse_json(path, &read_text(path)?)
}

/// Warns on stderr about each checkpoint or offload file written in place
/// while this process had it mapped: what was computed from it may mix its
/// old and new bytes. Called once, at the end of a command that computed.
pub(crate) fn warn_changed_files() {
    for changed in bigmodel::tensor::changed_mapped_files() {
        eprintln!("warning: {changed}");
    }
}

/// The error every command returns: printed as one paragraph on stderr.
pub type CmdResult = Result<(), Box<dyn std::error::Error>>;
