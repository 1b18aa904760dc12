//! Text in and out through the Hugging Face `tokenizers` crate.

use std::path::{Path, PathBuf};

use tokenizers::{Tokenizer, TruncationParams};

use crate::Error;

/// A `tokenizer.json`, set up to encode one text at a time: no padding, and
/// truncation only where the model's position table ends.
pub struct TextTokenizer {
    inner: Tokenizer,
    path: PathBuf,
}

impl TextTokenizer {
    /// Opens `path`; `max_len` truncates encodings to that many tokens.
    pub fn open(path: impl AsRef<Path>, max_len: Option<usize>) -> Result<TextTokenizer, Error> {
        let path = path.as_ref().to_path_buf();
        let err = |e: tokenizers::Error| Error::Tokenizer {
            path: path.clone(),
            message: e.to_string(),
        };
        let mut inner = Tokenizer::from_file(&path).map_err(err)?;
        inner.with_padding(None);
        let truncation = max_len.map(|max_length| TruncationParams {
            max_length,
            ..TruncationParams::default()
        });
        inner.with_truncation(truncation).map_err(err)?;
        Ok(TextTokenizer { inner, path })
    }

    /// `dir/tokenizer.json` if it exists.
    pub fn open_in(dir: &Path, max_len: Option<usize>) -> Result<Option<TextTokenizer>, Error> {
        let path = dir.join("tokenizer.json");
        if bm_shard::exists(&path)? {
            TextTokenizer::open(path, max_len).map(Some)
        } else {
            Ok(None)
        }
    }

    /// Token ids of `text`, with the model's special tokens when
    /// `special_tokens` (as transformers' tokenizers add them by default).
    pub fn encode(&self, text: &str, special_tokens: bool) -> Result<Vec<u32>, Error> {
        let encoding = self
            .inner
            .encode(text, special_tokens)
            .map_err(|e| self.error(e))?;
        Ok(encoding.get_ids().to_vec())
    }

    /// Text of `ids`, special tokens skipped.
    pub fn decode(&self, ids: &[u32]) -> Result<String, Error> {
        self.inner.decode(ids, true).map_err(|e| self.error(e))
    }

    fn error(&self, e: tokenizers::Error) -> Error {
        Error::Tokenizer {
            path: self.path.clone(),
            message: e.to_string(),
        }
    }
}
