//! `bigmodel run --chat` and `bigmodel chat` on bm-models' tiny Llama with
//! Qwen2.5's chat template (the committed chat fixture): the prompt is the
//! template's rendering of the conversation, a chat keeps its KV cache and
//! still generates what a fresh run of the whole conversation generates,
//! replies are printed as they come, and bad input is a clear error.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use bm_models::{ChatTemplate, TextTokenizer};
use serde_json::{Value, json};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../bm-models/tests/fixtures")
}

/// The tiny Llama with Qwen2.5's tokenizer_config.json (its template),
/// and room for the template's long default system message: 1024
/// positions (the rotary frequencies do not depend on the count).
fn chat_model() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(fixtures().join("tiny-llama")).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, dir.path().join(path.file_name().unwrap())).unwrap();
    }
    let config = dir.path().join("config.json");
    let mut doc: Value = serde_json::from_str(&std::fs::read_to_string(&config).unwrap()).unwrap();
    doc["max_position_embeddings"] = json!(1024);
    std::fs::write(&config, doc.to_string()).unwrap();
    std::fs::copy(
        fixtures().join("chat/qwen2/tokenizer_config.json"),
        dir.path().join("tokenizer_config.json"),
    )
    .unwrap();
    dir
}

fn bigmodel(args: &[&str], stdin: &str) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_bigmodel"))
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run bigmodel");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(stdin.as_bytes())
        .unwrap();
    child.wait_with_output().unwrap()
}

fn json_of(out: &Output) -> Value {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("one JSON document on stdout")
}

/// The ids `apply_chat_template(messages, add_generation_prompt=True)`
/// gives, through the library.
fn chat_ids(dir: &Path, messages: &[Value]) -> String {
    let template = ChatTemplate::open_in(dir).unwrap();
    let text = template.render(messages, None, true).unwrap();
    let tokenizer = TextTokenizer::open(dir.join("tokenizer.json"), None).unwrap();
    let ids = tokenizer.encode(&text, false).unwrap();
    ids.iter().map(u32::to_string).collect::<Vec<_>>().join(",")
}

#[test]
fn run_chat_generates_from_the_rendered_conversation() {
    let dir = chat_model();
    let d = dir.path().to_str().unwrap();
    let chat = json_of(&bigmodel(
        &[
            "run",
            d,
            "--chat",
            "--prompt",
            "Hi there",
            "--max-new-tokens",
            "5",
            "--json",
        ],
        "",
    ));
    let ids = chat_ids(
        dir.path(),
        &[json!({"role": "user", "content": "Hi there"})],
    );
    let plain = json_of(&bigmodel(
        &[
            "run",
            d,
            "--prompt-ids",
            &ids,
            "--max-new-tokens",
            "5",
            "--json",
        ],
        "",
    ));
    assert_eq!(chat["generated_ids"], plain["generated_ids"]);
    let system = json_of(&bigmodel(
        &[
            "run",
            d,
            "--chat",
            "--system",
            "Be brief.",
            "--prompt",
            "Hi there",
            "--max-new-tokens",
            "5",
            "--json",
        ],
        "",
    ));
    let ids = chat_ids(
        dir.path(),
        &[
            json!({"role": "system", "content": "Be brief."}),
            json!({"role": "user", "content": "Hi there"}),
        ],
    );
    let plain = json_of(&bigmodel(
        &[
            "run",
            d,
            "--prompt-ids",
            &ids,
            "--max-new-tokens",
            "5",
            "--json",
        ],
        "",
    ));
    assert_eq!(system["generated_ids"], plain["generated_ids"]);
}

#[test]
fn chat_keeps_its_cache_and_replies_as_a_fresh_run_would() {
    let dir = chat_model();
    let d = dir.path().to_str().unwrap();
    let out = bigmodel(
        &["chat", d, "--max-new-tokens", "4", "--json"],
        "Hello\n\nHow are you?\n",
    );
    let doc = json_of(&out);
    let turns = doc["turns"].as_array().unwrap();
    assert_eq!(turns.len(), 2, "{doc}");
    let first = json!({"role": "user", "content": "Hello"});
    let reply = json!({"role": "assistant", "content": turns[0]["text"]});
    let second = json!({"role": "user", "content": "How are you?"});
    for (turn, messages) in [(0, vec![first.clone()]), (1, vec![first, reply, second])] {
        let ids = chat_ids(dir.path(), &messages);
        let fresh = json_of(&bigmodel(
            &[
                "run",
                d,
                "--prompt-ids",
                &ids,
                "--max-new-tokens",
                "4",
                "--json",
            ],
            "",
        ));
        assert_eq!(
            turns[turn]["generated_ids"], fresh["generated_ids"],
            "turn {turn}"
        );
    }
    // Without --json the replies are printed as they come; /exit ends.
    let out = bigmodel(
        &["chat", d, "--max-new-tokens", "4"],
        "Hello\n/exit\nignored\n",
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert_eq!(
        stdout.trim_end_matches('\n'),
        turns[0]["text"].as_str().unwrap()
    );
}

#[test]
fn chat_quantized_replies_as_a_quantized_run_would() {
    let dir = chat_model();
    let d = dir.path().to_str().unwrap();
    let doc = json_of(&bigmodel(
        &[
            "chat",
            d,
            "--quantize",
            "nf4",
            "--max-new-tokens",
            "4",
            "--json",
        ],
        "Hello\n",
    ));
    let ids = chat_ids(dir.path(), &[json!({"role": "user", "content": "Hello"})]);
    let run = |quantize: &[&str]| {
        let mut args = vec![
            "run",
            d,
            "--prompt-ids",
            &ids,
            "--max-new-tokens",
            "4",
            "--json",
        ];
        args.extend_from_slice(quantize);
        json_of(&bigmodel(&args, ""))["generated_ids"].clone()
    };
    assert_eq!(
        doc["turns"][0]["generated_ids"],
        run(&["--quantize", "nf4"])
    );
    // The flag reaches the model: NF4 weights are not the F32 ones (if the
    // tiny model's greedy tokens happened to agree, this would say so).
    let dense = run(&[]);
    let logits_differ = {
        let dump = |quantize: &[&str], name: &str| {
            let path = dir.path().join(name);
            let p = path.to_str().unwrap();
            let mut args = vec![
                "run",
                d,
                "--prompt-ids",
                &ids,
                "--max-new-tokens",
                "1",
                "--dump-logits",
                p,
            ];
            args.extend_from_slice(quantize);
            let out = bigmodel(&args, "");
            assert!(
                out.status.success(),
                "{}",
                String::from_utf8_lossy(&out.stderr)
            );
            std::fs::read(&path).unwrap()
        };
        dump(&["--quantize", "nf4"], "nf4.bin") != dump(&[], "f32.bin")
    };
    assert!(
        logits_differ,
        "nf4 and f32 logits are equal; greedy ids: {dense}"
    );
}

#[test]
fn chat_errors_name_what_is_missing() {
    let tiny = fixtures().join("tiny-llama");
    let t = tiny.to_str().unwrap();
    let out = bigmodel(&["chat", t], "Hello\n");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("no chat template"), "{stderr}");
    let dir = chat_model();
    let d = dir.path().to_str().unwrap();
    let out = bigmodel(&["run", d, "--chat", "--prompt-ids", "1,2"], "");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("--chat takes text prompts"), "{stderr}");
    let out = bigmodel(&["run", d, "--system", "x", "--prompt", "hi"], "");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("--chat"),
        "{stderr}"
    );
    std::fs::write(
        dir.path().join("tokenizer_config.json"),
        r#"{"chat_template": "{{ raise_exception('Only user messages') }}"}"#,
    )
    .unwrap();
    let out = bigmodel(&["chat", d], "Hello\n");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success()
            && stderr.contains("tokenizer_config.json: chat template:")
            && stderr.contains("Only user messages"),
        "{stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
}
