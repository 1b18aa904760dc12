//! Reading `config.json` with errors that name the file and the key.

use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::Error;

/// A parsed config file.
pub(crate) struct ConfigFile {
    path: PathBuf,
    json: Value,
    /// `"outer."` for a nested object, so errors name the full key.
    prefix: String,
}

impl ConfigFile {
    /// Reads `dir/config.json`.
    pub(crate) fn open(dir: &Path) -> Result<ConfigFile, Error> {
        let path = dir.join("config.json");
        if !path.is_file() {
            return Err(Error::Io {
                source: std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    "no config.json in the model folder",
                ),
                path,
            });
        }
        let json = read_json(&path)?;
        Ok(ConfigFile::from_value(path, json))
    }

    /// A config from JSON already in memory (`path` is only used in errors).
    pub(crate) fn from_value(path: PathBuf, json: Value) -> ConfigFile {
        ConfigFile {
            path,
            json,
            prefix: String::new(),
        }
    }

    /// The object under `key` (e.g. `rope_parameters`), read with the same
    /// accessors; its errors name `key.inner`.
    pub(crate) fn nested(&self, key: &str) -> Result<Option<ConfigFile>, Error> {
        match self.get(key) {
            None => Ok(None),
            Some(v @ Value::Object(_)) => Ok(Some(ConfigFile {
                path: self.path.clone(),
                json: v.clone(),
                prefix: format!("{}{key}.", self.prefix),
            })),
            Some(v) => Err(self.error(key, format!("expected an object, found {v}"))),
        }
    }

    pub(crate) fn error(&self, key: &str, message: impl Into<String>) -> Error {
        Error::Config {
            path: self.path.clone(),
            key: format!("{}{key}", self.prefix),
            message: message.into(),
        }
    }

    /// The raw value of `key`, `None` when absent or null.
    pub(crate) fn get(&self, key: &str) -> Option<&Value> {
        self.json.get(key).filter(|v| !v.is_null())
    }

    pub(crate) fn opt_usize(&self, key: &str) -> Result<Option<usize>, Error> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => match v.as_u64() {
                Some(n) if n > 0 => Ok(Some(n as usize)),
                _ => Err(self.error(key, format!("expected a positive integer, found {v}"))),
            },
        }
    }

    pub(crate) fn usize(&self, key: &str) -> Result<usize, Error> {
        self.opt_usize(key)?
            .ok_or_else(|| self.error(key, "missing"))
    }

    pub(crate) fn opt_f64(&self, key: &str) -> Result<Option<f64>, Error> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_f64()
                .map(Some)
                .ok_or_else(|| self.error(key, format!("expected a number, found {v}"))),
        }
    }

    /// A number whose absence means `default` and whose `null` means none
    /// (transformers' `float | None = default` fields).
    pub(crate) fn nullable_f64(
        &self,
        key: &str,
        default: Option<f64>,
    ) -> Result<Option<f64>, Error> {
        match self.json.get(key) {
            None => Ok(default),
            Some(Value::Null) => Ok(None),
            Some(v) => v
                .as_f64()
                .map(Some)
                .ok_or_else(|| self.error(key, format!("expected a number or null, found {v}"))),
        }
    }

    /// A positive integer whose absence means `default` and whose `null`
    /// means none (transformers' `int | None = default` fields).
    pub(crate) fn nullable_usize(
        &self,
        key: &str,
        default: Option<usize>,
    ) -> Result<Option<usize>, Error> {
        match self.json.get(key) {
            None => Ok(default),
            Some(_) => self.opt_usize(key),
        }
    }

    /// A list of numbers, if present.
    pub(crate) fn opt_f64s(&self, key: &str) -> Result<Option<Vec<f64>>, Error> {
        let bad = |v: &Value| self.error(key, format!("expected a list of numbers, found {v}"));
        match self.get(key) {
            None => Ok(None),
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| v.as_f64().ok_or_else(|| bad(v)))
                .collect::<Result<_, _>>()
                .map(Some),
            Some(v) => Err(bad(v)),
        }
    }

    /// A list of strings, if present.
    pub(crate) fn opt_strings(&self, key: &str) -> Result<Option<Vec<&str>>, Error> {
        let bad = |v: &Value| self.error(key, format!("expected a list of strings, found {v}"));
        match self.get(key) {
            None => Ok(None),
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| v.as_str().ok_or_else(|| bad(v)))
                .collect::<Result<_, _>>()
                .map(Some),
            Some(v) => Err(bad(v)),
        }
    }

    pub(crate) fn bool_or(&self, key: &str, default: bool) -> Result<bool, Error> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v
                .as_bool()
                .ok_or_else(|| self.error(key, format!("expected true or false, found {v}"))),
        }
    }

    pub(crate) fn opt_str(&self, key: &str) -> Option<&str> {
        self.get(key).and_then(Value::as_str)
    }

    /// Token ids given as one integer or a list of them.
    pub(crate) fn token_ids(&self, key: &str) -> Result<Vec<u32>, Error> {
        let bad = |v: &Value| self.error(key, format!("expected a token id or a list, found {v}"));
        match self.get(key) {
            None => Ok(Vec::new()),
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| v.as_u64().map(|n| n as u32).ok_or_else(|| bad(v)))
                .collect(),
            Some(v) => v.as_u64().map(|n| vec![n as u32]).ok_or_else(|| bad(v)),
        }
    }
}

/// Reads and parses a JSON file.
pub(crate) fn read_json(path: &Path) -> Result<Value, Error> {
    let text = std::fs::read_to_string(path).map_err(|source| Error::Io {
        path: path.to_path_buf(),
        source,
    })?;
    serde_json::from_str(&text).map_err(|e| Error::Json {
        path: path.to_path_buf(),
        message: e.to_string(),
    })
}
