//! Chat templates against transformers 5.23's `apply_chat_template(...,
//! tokenize=False)`: Meta-Llama-3-8B-Instruct's template and
//! Qwen2.5-Instruct's (tools, tool calls, tool responses), over the
//! conversations of tools/make_generation_fixtures.py (chat/rendered.json).

use std::path::{Path, PathBuf};

use bm_models::ChatTemplate;
use serde_json::Value;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/chat")
}

#[test]
fn templates_render_as_transformers_renders_them() {
    let text = std::fs::read_to_string(fixtures().join("rendered.json")).unwrap();
    let cases: Vec<Value> = serde_json::from_str(&text).unwrap();
    let mut per_template = std::collections::BTreeMap::new();
    for case in &cases {
        let name = case["template"].as_str().unwrap();
        let template = ChatTemplate::open_in(fixtures().join(name)).unwrap();
        let messages = case["messages"].as_array().unwrap();
        let tools = case
            .get("tools")
            .and_then(Value::as_array)
            .map(Vec::as_slice);
        let add = case["add_generation_prompt"].as_bool().unwrap();
        let rendered = template.render(messages, tools, add).unwrap();
        assert_eq!(
            rendered,
            case["rendered"].as_str().unwrap(),
            "{name}: {messages:?}"
        );
        *per_template.entry(name.to_string()).or_insert(0) += 1;
    }
    assert_eq!(per_template.get("llama3"), Some(&3), "{per_template:?}");
    assert_eq!(per_template.get("qwen2"), Some(&4), "{per_template:?}");
}

#[test]
fn a_folder_without_a_template_or_with_a_bad_one_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let err = ChatTemplate::open_in(dir.path()).err().unwrap().to_string();
    assert!(err.contains("no chat template"), "{err}");
    let config = dir.path().join("tokenizer_config.json");
    std::fs::write(&config, r#"{"chat_template": 3}"#).unwrap();
    let err = ChatTemplate::open_in(dir.path()).err().unwrap().to_string();
    assert!(
        err.contains("tokenizer_config.json") && err.contains("chat_template"),
        "{err}"
    );
    std::fs::write(&config, r#"{"chat_template": "{% if %}"}"#).unwrap();
    let err = ChatTemplate::open_in(dir.path()).err().unwrap().to_string();
    assert!(
        err.contains("tokenizer_config.json: chat template:"),
        "{err}"
    );
    // Several named templates: tool_use with tools, else default.
    std::fs::write(
        &config,
        r#"{"chat_template": [{"name": "default", "template": "D{{ messages | length }}"},
                               {"name": "tool_use", "template": "T{{ tools | length }}"}],
            "bos_token": {"content": "<s>", "special": true}}"#,
    )
    .unwrap();
    let t = ChatTemplate::open_in(dir.path()).unwrap();
    let user = serde_json::json!({"role": "user", "content": "hi"});
    assert_eq!(
        t.render(std::slice::from_ref(&user), None, true).unwrap(),
        "D1"
    );
    let tools = [serde_json::json!({"name": "f"})];
    assert_eq!(t.render(&[user], Some(&tools), true).unwrap(), "T1");
    // chat_template.jinja wins, with tokenizer_config.json's tokens.
    std::fs::write(dir.path().join("chat_template.jinja"), "{{ bos_token }}J").unwrap();
    let t = ChatTemplate::open_in(dir.path()).unwrap();
    let user = serde_json::json!({"role": "user", "content": "hi"});
    assert_eq!(t.render(&[user], None, true).unwrap(), "<s>J");
}
