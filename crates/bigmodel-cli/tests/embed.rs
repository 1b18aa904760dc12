//! `bigmodel embed`: the tiny BERT fixture (all in RAM and half on disk,
//! the same embeddings), all-MiniLM-L6-v2 against sentence-transformers
//! when BM_MINILM_DIR is set, and bad input.

mod common;

use std::process::Output;

use common::{bigmodel, fixture, succeeds};
use serde_json::{Value, json};

fn embeddings(out: &Output) -> Vec<Vec<f64>> {
    succeeds(out);
    let v: Value = serde_json::from_slice(&out.stdout).expect("one JSON document");
    v["embeddings"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            e.as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap())
                .collect()
        })
        .collect()
}

#[test]
fn tiny_bert_embeddings_are_unit_length_and_the_same_half_on_disk() {
    let dir = fixture("tiny-bert");
    let texts = ["a tiny test", "offloaded layers stream from disk"];
    let mut args = vec!["embed", dir.to_str().unwrap()];
    args.extend(texts);
    args.push("--json");
    let in_ram = embeddings(&bigmodel(&args));
    assert_eq!(in_ram.len(), 2);
    for e in &in_ram {
        let norm = e.iter().map(|x| x * x).sum::<f64>().sqrt();
        assert!((norm - 1.0).abs() < 1e-5, "{norm}");
    }
    let config: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    let layers = config["num_hidden_layers"].as_u64().unwrap();
    let mut map = serde_json::Map::new();
    map.insert("bert.embeddings".into(), json!("cpu"));
    for i in 0..layers {
        map.insert(
            format!("bert.encoder.layer.{i}"),
            json!(if i < layers / 2 { "cpu" } else { "disk" }),
        );
    }
    map.insert("bert.pooler".into(), json!("cpu"));
    map.insert("classifier".into(), json!("cpu"));
    let tmp = tempfile::tempdir().unwrap();
    let map_path = tmp.path().join("map.json");
    std::fs::write(&map_path, Value::Object(map).to_string()).unwrap();
    let offload = tmp.path().join("offload");
    args.extend([
        "--device-map",
        map_path.to_str().unwrap(),
        "--offload-folder",
        offload.to_str().unwrap(),
    ]);
    assert_eq!(embeddings(&bigmodel(&args)), in_ram);
}

#[test]
fn minilm_matches_sentence_transformers_with_half_its_layers_on_disk() {
    let Some(dir) = std::env::var_os("BM_MINILM_DIR") else {
        // Straight to stderr: libtest would capture println! and hide the skip.
        let _ =
            std::io::Write::write_all(&mut std::io::stderr(), b"skipped: BM_MINILM_DIR not set\n");
        return;
    };
    let reference: Value = serde_json::from_str(
        &std::fs::read_to_string(fixture("minilm").join("reference.json")).unwrap(),
    )
    .unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let map = json!({
        "embeddings": "cpu", "encoder.layer.0": "cpu", "encoder.layer.1": "cpu",
        "encoder.layer.2": "cpu", "encoder.layer.3": "disk", "encoder.layer.4": "disk",
        "encoder.layer.5": "disk", "pooler": "cpu",
    });
    let map_path = tmp.path().join("map.json");
    std::fs::write(&map_path, map.to_string()).unwrap();
    let offload = tmp.path().join("offload");
    let mut args = vec!["embed", dir.to_str().unwrap()];
    let sentences: Vec<&str> = reference["sentences"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s.as_str().unwrap())
        .collect();
    args.extend(&sentences);
    args.extend([
        "--device-map",
        map_path.to_str().unwrap(),
        "--offload-folder",
        offload.to_str().unwrap(),
        "--json",
    ]);
    let got = embeddings(&bigmodel(&args));
    assert!(got.len() >= 5);
    for (i, want) in reference["embeddings"]
        .as_array()
        .unwrap()
        .iter()
        .enumerate()
    {
        let want: Vec<f64> = want
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap())
            .collect();
        let dot: f64 = want.iter().zip(&got[i]).map(|(a, b)| a * b).sum();
        let norms = want.iter().map(|a| a * a).sum::<f64>().sqrt()
            * got[i].iter().map(|b| b * b).sum::<f64>().sqrt();
        assert!(
            dot / norms >= 0.99999,
            "sentence {i}: cosine {}",
            dot / norms
        );
    }
}

#[test]
fn bad_input_is_a_clear_error() {
    let fails_with = |args: &[&str], needle: &str| {
        let out = bigmodel(args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} succeeded");
        assert!(
            stderr.contains(needle),
            "{args:?}: {stderr:?} lacks {needle:?}"
        );
        assert!(!stderr.contains("panicked"), "{stderr}");
    };
    let bert = fixture("tiny-bert");
    fails_with(&["embed", bert.to_str().unwrap(), ""], "text 1 is empty");
    fails_with(&["embed", "/no/such/folder", "text"], "config.json");
    let llama = fixture("tiny-llama");
    fails_with(
        &["embed", llama.to_str().unwrap(), "text"],
        "supported are bert",
    );
    let out = bigmodel(&["embed", bert.to_str().unwrap()]);
    assert!(!out.status.success());
}
