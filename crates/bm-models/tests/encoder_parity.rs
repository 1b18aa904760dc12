//! The tiny random BERT made by tools/make_tiny_llama.py (saved from a task
//! model, so its weights carry the `bert.` prefix, with a WordPiece
//! tokenizer.json): hidden states and embeddings against transformers'.

use std::path::{Path, PathBuf};

use bm_models::{FolderWeights, SentenceEmbedder};
use bm_tensor::DType;
use safetensors::SafeTensors;

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny-bert")
}

fn reference(name: &str) -> Vec<u8> {
    let bytes = std::fs::read(fixture().join("reference.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    st.tensor(name).unwrap().data().to_vec()
}

fn ids(name: &str) -> Vec<u32> {
    reference(name)
        .chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().unwrap()) as u32)
        .collect()
}

fn floats(name: &str) -> Vec<f32> {
    reference(name)
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

const SENTENCES: [&str; 3] = [
    "hello world",
    "the big model runs on the small machine",
    "unknown zebra",
];

#[test]
fn tiny_bert_hidden_states_and_embeddings_match_transformers() {
    let embedder = SentenceEmbedder::open(fixture(), None).unwrap();
    let weights = FolderWeights::open(fixture(), None).unwrap();
    let embeddings = embedder.embed(&SENTENCES).unwrap();
    for (i, sentence) in SENTENCES.iter().enumerate() {
        let want_ids = ids(&format!("ids.{i}"));
        assert_eq!(
            embedder.tokenizer().encode(sentence, true).unwrap(),
            want_ids
        );
        let hidden = embedder.encoder().forward(&weights, &want_ids).unwrap();
        assert_eq!(hidden.shape(), [want_ids.len(), 32]);
        let want = floats(&format!("hidden.{i}"));
        for (a, b) in hidden.to_f32_vec().iter().zip(&want) {
            assert!((a - b).abs() < 1e-5, "{sentence:?}: hidden {a} vs {b}");
        }
        for (a, b) in embeddings[i].iter().zip(&floats(&format!("embedding.{i}"))) {
            assert!((a - b).abs() < 1e-6, "{sentence:?}: embedding {a} vs {b}");
        }
    }
}

#[test]
fn bert_blocks_carry_the_checkpoint_prefix() {
    let embedder = SentenceEmbedder::open(fixture(), Some(DType::BF16)).unwrap();
    assert_eq!(
        embedder.encoder().block_names(),
        [
            "bert.embeddings",
            "bert.encoder.layer.0",
            "bert.encoder.layer.1"
        ]
    );
    let e = embedder.embed(&["hello world"]).unwrap();
    let want = floats("embedding.0");
    let cos: f32 = e[0].iter().zip(&want).map(|(a, b)| a * b).sum();
    assert!(cos > 0.999, "bf16 cosine {cos}");
}

#[test]
fn too_long_inputs_and_non_bert_folders_are_refused() {
    let embedder = SentenceEmbedder::open(fixture(), None).unwrap();
    let weights = FolderWeights::open(fixture(), None).unwrap();
    let err = embedder.encoder().forward(&weights, &[5; 17]).unwrap_err();
    assert_eq!(
        err.to_string(),
        "sequence of 17 tokens is longer than the model's 16 positions"
    );
    // The tokenizer truncates text to the position table instead.
    let long = "the ".repeat(40);
    assert_eq!(embedder.tokenizer().encode(&long, true).unwrap().len(), 16);
    assert!(embedder.embed(&[long]).is_ok());
    let llama = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny-llama");
    let err = SentenceEmbedder::open(llama, None).err().unwrap();
    assert!(err.to_string().contains("supported are bert"), "{err}");
}
