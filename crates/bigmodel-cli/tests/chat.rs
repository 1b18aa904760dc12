//! `bigmodel run --chat` and `bigmodel chat` on bm-models' tiny Llama with
//! Qwen2.5's chat template (the committed chat fixture): the prompt is the
//! template's rendering of the conversation, a chat keeps its KV cache and
//! still generates what a fresh run of the whole conversation generates,
//! replies are printed as they come, and bad input is a clear error.

mod common;

use std::path::Path;

use bm_models::{ChatTemplate, TextTokenizer};
use common::{
    bigmodel, bigmodel_with_stdin, copy_folder, edit_json, fixture, json_of, run_json, succeeds,
    tiny_llama,
};
use serde_json::{Value, json};

/// The tiny Llama with Qwen2.5's tokenizer_config.json (its template),
/// and room for the template's long default system message: 1024
/// positions (the rotary frequencies do not depend on the count).
fn chat_model() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    copy_folder(&tiny_llama(), dir.path());
    edit_json(&dir.path().join("config.json"), |doc| {
        doc["max_position_embeddings"] = json!(1024)
    });
    std::fs::copy(
        fixture("chat/qwen2/tokenizer_config.json"),
        dir.path().join("tokenizer_config.json"),
    )
    .unwrap();
    dir
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
    let chat = run_json(
        dir.path(),
        &["--chat", "--prompt", "Hi there", "--max-new-tokens", "5"],
    );
    let ids = chat_ids(
        dir.path(),
        &[json!({"role": "user", "content": "Hi there"})],
    );
    let plain = run_json(dir.path(), &["--prompt-ids", &ids, "--max-new-tokens", "5"]);
    assert_eq!(chat["generated_ids"], plain["generated_ids"]);
    let system = run_json(
        dir.path(),
        &[
            "--chat",
            "--system",
            "Be brief.",
            "--prompt",
            "Hi there",
            "--max-new-tokens",
            "5",
        ],
    );
    let ids = chat_ids(
        dir.path(),
        &[
            json!({"role": "system", "content": "Be brief."}),
            json!({"role": "user", "content": "Hi there"}),
        ],
    );
    let plain = run_json(dir.path(), &["--prompt-ids", &ids, "--max-new-tokens", "5"]);
    assert_eq!(system["generated_ids"], plain["generated_ids"]);
}

#[test]
fn chat_keeps_its_cache_and_replies_as_a_fresh_run_would() {
    let dir = chat_model();
    let d = dir.path().to_str().unwrap();
    let out = bigmodel_with_stdin(
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
        let fresh = run_json(dir.path(), &["--prompt-ids", &ids, "--max-new-tokens", "4"]);
        assert_eq!(
            turns[turn]["generated_ids"], fresh["generated_ids"],
            "turn {turn}"
        );
    }
    // Without --json the replies are printed as they come; /exit ends.
    let out = bigmodel_with_stdin(
        &["chat", d, "--max-new-tokens", "4"],
        "Hello\n/exit\nignored\n",
    );
    succeeds(&out);
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
    let doc = json_of(&bigmodel_with_stdin(
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
        let mut args = vec!["--prompt-ids", &ids, "--max-new-tokens", "4"];
        args.extend_from_slice(quantize);
        run_json(dir.path(), &args)["generated_ids"].clone()
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
            succeeds(&bigmodel(&args));
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
    let tiny = tiny_llama();
    let t = tiny.to_str().unwrap();
    let out = bigmodel_with_stdin(&["chat", t], "Hello\n");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("no chat template"), "{stderr}");
    let dir = chat_model();
    let d = dir.path().to_str().unwrap();
    let out = bigmodel(&["run", d, "--chat", "--prompt-ids", "1,2"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("--chat takes text prompts"), "{stderr}");
    let out = bigmodel(&["run", d, "--system", "x", "--prompt", "hi"]);
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
    let out = bigmodel_with_stdin(&["chat", d], "Hello\n");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success()
            && stderr.contains("tokenizer_config.json: chat template:")
            && stderr.contains("Only user messages"),
        "{stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
}
