//! Opening a model folder's JSON files. Reading them is bm-plan's config
//! reader (`bigmodel::plan::config`), the one the planner uses too, so a
//! key means the same thing, and is checked the same way, everywhere.

use std::path::Path;

use bigmodel::plan::config::{ConfigKeys, HfConfig};

use crate::Error;

/// Reads `dir/config.json`; a family not among `supported` (this crate's
/// list for the caller) is an unsupported-architecture error.
pub(crate) fn read_config(dir: &Path, supported: &'static str) -> Result<HfConfig, Error> {
    let path = dir.join("config.json");
    // A config.json that is there but not a file (a FIFO) is refused by
    // the reader, naming what it is.
    if !bm_shard::exists(&path)? {
        // A `shard` writing this folder writes config.json last.
        if let Some(holder) = bm_shard::writer_of(dir) {
            return Err(Error::Shard(bm_shard::Error::Locked {
                folder: dir.to_path_buf(),
                holder,
                waited: None,
            }));
        }
        return Err(Error::Io {
            source: std::io::Error::new(
                std::io::ErrorKind::NotFound,
                "no config.json in the model folder",
            ),
            path,
        });
    }
    HfConfig::parse(&read_text(&path)?, path).map_err(|e| unsupported(e, supported))
}

/// A config of no family bm-plan knows as this crate reports it, with
/// `supported` the caller's list; other reader errors as they are.
pub(crate) fn unsupported(e: bigmodel::plan::Error, supported: &'static str) -> Error {
    match e {
        bigmodel::plan::Error::UnsupportedModel {
            model_type,
            architectures,
            ..
        } => {
            let archs: Vec<&str> = architectures.iter().map(String::as_str).collect();
            Error::UnsupportedArchitecture {
                found: found(model_type.as_deref().unwrap_or_default(), &archs),
                supported,
            }
        }
        other => other.into(),
    }
}

/// `model_type` and `architectures` as an unsupported-architecture error
/// shows them.
pub(crate) fn found(model_type: &str, architectures: &[&str]) -> String {
    let archs = if architectures.is_empty() {
        String::new()
    } else {
        format!("{architectures:?}")
    };
    format!("{model_type} {archs}").trim().to_string()
}

/// Reads the JSON object in `path` (a sentence-transformers settings file).
pub(crate) fn read_keys(path: &Path) -> Result<ConfigKeys, Error> {
    Ok(ConfigKeys::parse(&read_text(path)?, path)?)
}

/// A regular file's text: a FIFO would block the read, so it is refused.
fn read_text(path: &Path) -> Result<String, Error> {
    let bytes = bm_shard::read_regular(path)?;
    String::from_utf8(bytes).map_err(|e| Error::Io {
        path: path.to_path_buf(),
        source: std::io::Error::new(std::io::ErrorKind::InvalidData, e),
    })
}
