//! What bm-models' integration tests share: the fixture folders, the
//! reference files the fixture scripts saved from transformers, copies of
//! fixtures to break, and the quantization options of the bitsandbytes
//! fixtures.

// Every test binary compiles this module and uses a part of it.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

use bm_compute::quant::{FourBitType, QuantFormat};
use bm_models::QuantizeOptions;
use safetensors::SafeTensors;

/// A fixture folder or file (`tests/fixtures/NAME`).
pub fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

/// A file or folder of the bitsandbytes fixtures
/// (tools/make_bnb_fixtures.py: `base`, `nf4`, `fp4`, `int8`).
pub fn bnb_fixture(name: &str) -> PathBuf {
    fixture("tiny-llama-bnb").join(name)
}

/// A safetensors file of I64 ids and F32 values saved by a fixture script.
pub struct Reference(Vec<u8>);

impl Reference {
    /// The file at `path`.
    pub fn open(path: impl AsRef<Path>) -> Reference {
        Reference(std::fs::read(path).unwrap())
    }

    /// Fixture folder `model`'s `reference.safetensors`.
    pub fn of(model: &str) -> Reference {
        Reference::open(fixture(model).join("reference.safetensors"))
    }

    /// Tensor `name`'s shape and bytes.
    pub fn data(&self, name: &str) -> (Vec<usize>, Vec<u8>) {
        let st = SafeTensors::deserialize(&self.0).unwrap();
        let t = st.tensor(name).unwrap();
        (t.shape().to_vec(), t.data().to_vec())
    }

    /// I64 tensor `name` as token ids.
    pub fn ids(&self, name: &str) -> Vec<u32> {
        self.data(name)
            .1
            .chunks_exact(8)
            .map(|c| u32::try_from(i64::from_le_bytes(c.try_into().unwrap())).unwrap())
            .collect()
    }

    /// F32 tensor `name`'s shape and values.
    pub fn floats(&self, name: &str) -> (Vec<usize>, Vec<f32>) {
        let (shape, data) = self.data(name);
        let values = data
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        (shape, values)
    }

    /// How many `prompt.N` tensors the file holds.
    pub fn prompts(&self) -> usize {
        let st = SafeTensors::deserialize(&self.0).unwrap();
        st.names()
            .iter()
            .filter(|n| n.starts_with("prompt."))
            .count()
    }
}

/// The largest |a - b| of two buffers of the same length.
pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// A temporary copy of fixture folder `model`.
pub fn copy_fixture(model: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(fixture(model)).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), dir.path().join(entry.file_name())).unwrap();
    }
    dir
}

/// Rewrites the JSON file at `path` through `edit`.
pub fn edit_json(path: &Path, edit: impl FnOnce(&mut serde_json::Value)) {
    let mut doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    edit(&mut doc);
    std::fs::write(path, doc.to_string()).unwrap();
}

/// The options tools/make_bnb_fixtures.py had transformers quantize the
/// tiny Llama's `format` folder with (nf4 with double quantization, int8
/// with threshold 2.5).
pub fn bnb_options(format: &str) -> QuantizeOptions {
    let mut o = QuantizeOptions::named(format).unwrap();
    o.format = match o.format {
        QuantFormat::FourBit {
            kind: FourBitType::Nf4,
            blocksize,
            ..
        } => QuantFormat::FourBit {
            kind: FourBitType::Nf4,
            blocksize,
            double_quant: true,
        },
        QuantFormat::Int8 { .. } => QuantFormat::Int8 { threshold: 2.5 },
        other => other,
    };
    o
}
