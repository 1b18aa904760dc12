//! Keeps docs/guide.md true: every command of its `sh` blocks is run with
//! the built binary, in order, in a scratch folder laid out with the names
//! the guide uses, and must succeed (or fail as marked).
//!
//! The guide's conventions, parsed here:
//! * every command starts with `bigmodel ` (a trailing `\` continues it);
//! * `# expect: TEXT` before a command: its stdout or stderr contains TEXT;
//! * `# fails: MESSAGE` before a command: it exits non-zero, without a
//!   panic, and its stderr contains MESSAGE;
//! * no other comments, and every fenced block names its language, so no
//!   command escapes the test by a typo.
//!
//! The guide's example paths map onto committed fixtures:
//!
//! | guide                        | fixture                                              |
//! |------------------------------|------------------------------------------------------|
//! | `Llama-2-7b-hf/config.json`  | `crates/bm-plan/tests/fixtures/configs/llama-2-7b.json` |
//! | `tiny-llama/`                | `crates/bm-models/tests/fixtures/tiny-llama/`        |
//! | `tiny-bert/`                 | `crates/bm-models/tests/fixtures/tiny-bert/`         |
//! | `Mixtral-8x7B-v0.1/config.json` | `crates/bm-plan/tests/fixtures/configs/mixtral-8x7b.json` |
//! | `tiny-mixtral/`              | `crates/bm-models/tests/fixtures/tiny-mixtral/`      |
//! | `tiny-t5/`                   | `crates/bm-models/tests/fixtures/tiny-t5/`           |
//! | `old-model/`                 | `crates/bm-shard/tests/fixtures/torch/tiny-llama/`   |
//! | `evil/pytorch_model.bin`     | `crates/bm-shard/tests/fixtures/torch/bad/malicious_system.bin` |
//! | `partial-map.json`           | the map the guide prints next to the command         |
//! | `tiny-chat/`                 | `tiny-llama/` with `chat/llama3/tokenizer_config.json` (Llama 3's chat template) and 1024 positions |
//! | `questions.txt`              | two lines: `Hello` and `What is 2 + 2?`              |
//!
//! and `bigmodel demo` runs at its tiny test scale (`BM_DEMO_SCALE=tiny`)
//! with its cache in the scratch folder, instead of creating 1 GB.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::copy_folder;

const GUIDE: &str = include_str!("../../../docs/guide.md");

/// The languages a fenced block may name; `sh` blocks are run here and
/// `rust` blocks are doc tests of the `bigmodel` crate.
const LANGUAGES: [&str; 5] = ["sh", "rust", "text", "json", "python"];

/// The map `partial-map.json` holds, as the guide prints it.
const PARTIAL_MAP: &str = r#"{"model.embed_tokens": 0, "model.layers": 1}"#;

/// One command of a `sh` block.
#[derive(Debug, PartialEq)]
struct GuideCommand {
    /// 1-based line in the guide where the command starts.
    line: usize,
    text: String,
    expect: Vec<String>,
    fails: Option<String>,
}

/// The commands of every `sh` block, with their directives.
fn parse_guide(markdown: &str) -> Result<Vec<GuideCommand>, String> {
    let mut commands = Vec::new();
    let mut language: Option<&str> = None;
    let mut expect = Vec::new();
    let mut fails = None;
    let mut pending: Option<(usize, String)> = None;
    for (index, raw) in markdown.lines().enumerate() {
        let line_no = index + 1;
        let line = raw.trim_end();
        if let Some(tag) = line.trim_start().strip_prefix("```") {
            match language {
                None => {
                    let tag = tag.trim();
                    if !LANGUAGES.contains(&tag) {
                        return Err(format!(
                            "line {line_no}: a fenced block must name one of {LANGUAGES:?}, not {tag:?}"
                        ));
                    }
                    language = Some(tag);
                }
                Some(_) => {
                    if let Some((start, _)) = pending {
                        return Err(format!("line {start}: command continued past its block"));
                    }
                    if !expect.is_empty() || fails.is_some() {
                        return Err(format!(
                            "line {line_no}: `# expect:`/`# fails:` with no command after it"
                        ));
                    }
                    language = None;
                }
            }
            continue;
        }
        if language != Some("sh") {
            continue;
        }
        if let Some((start, mut text)) = pending.take() {
            text.push(' ');
            text.push_str(line.trim());
            pending = Some((start, text));
        } else if line.trim().is_empty() {
            continue;
        } else if let Some(comment) = line.trim().strip_prefix('#') {
            let comment = comment.trim();
            if let Some(text) = comment.strip_prefix("expect:") {
                expect.push(text.trim().to_string());
            } else if let Some(text) = comment.strip_prefix("fails:") {
                if fails.is_some() {
                    return Err(format!("line {line_no}: two `# fails:` for one command"));
                }
                fails = Some(text.trim().to_string());
            } else {
                return Err(format!(
                    "line {line_no}: only `# expect: TEXT` and `# fails: MESSAGE` comments are allowed, found {line:?}"
                ));
            }
            continue;
        } else {
            pending = Some((line_no, line.trim().to_string()));
        }
        if let Some((start, text)) = pending.take() {
            if let Some(stripped) = text.strip_suffix('\\') {
                pending = Some((start, stripped.trim_end().to_string()));
                continue;
            }
            if !text.starts_with("bigmodel ") {
                return Err(format!(
                    "line {start}: a command must start with `bigmodel `, found {text:?}"
                ));
            }
            if expect.iter().chain(&fails).any(String::is_empty) {
                return Err(format!("line {start}: an empty `# expect:` or `# fails:`"));
            }
            commands.push(GuideCommand {
                line: start,
                text,
                expect: std::mem::take(&mut expect),
                fails: fails.take(),
            });
        }
    }
    if language.is_some() {
        return Err("the guide ends inside a fenced block".into());
    }
    Ok(commands)
}

fn fixtures(crate_dir: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(crate_dir)
        .join("tests/fixtures")
}

/// The scratch folder with the guide's example paths in place.
fn guide_folder() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    std::fs::create_dir(root.join("Llama-2-7b-hf")).unwrap();
    std::fs::copy(
        fixtures("bm-plan").join("configs/llama-2-7b.json"),
        root.join("Llama-2-7b-hf/config.json"),
    )
    .unwrap();
    copy_folder(
        &fixtures("bm-models").join("tiny-llama"),
        &root.join("tiny-llama"),
    );
    copy_folder(
        &fixtures("bm-models").join("tiny-bert"),
        &root.join("tiny-bert"),
    );
    std::fs::create_dir(root.join("Mixtral-8x7B-v0.1")).unwrap();
    std::fs::copy(
        fixtures("bm-plan").join("configs/mixtral-8x7b.json"),
        root.join("Mixtral-8x7B-v0.1/config.json"),
    )
    .unwrap();
    copy_folder(
        &fixtures("bm-models").join("tiny-mixtral"),
        &root.join("tiny-mixtral"),
    );
    copy_folder(
        &fixtures("bm-models").join("tiny-t5"),
        &root.join("tiny-t5"),
    );
    let torch = fixtures("bm-shard").join("torch");
    copy_folder(&torch.join("tiny-llama"), &root.join("old-model"));
    std::fs::create_dir(root.join("evil")).unwrap();
    std::fs::copy(
        torch.join("bad/malicious_system.bin"),
        root.join("evil/pytorch_model.bin"),
    )
    .unwrap();
    std::fs::write(root.join("partial-map.json"), PARTIAL_MAP).unwrap();
    copy_folder(
        &fixtures("bm-models").join("tiny-llama"),
        &root.join("tiny-chat"),
    );
    std::fs::copy(
        fixtures("bm-models").join("chat/llama3/tokenizer_config.json"),
        root.join("tiny-chat/tokenizer_config.json"),
    )
    .unwrap();
    // Room for the template's headers: the rotary frequencies do not
    // depend on the number of positions.
    let config = root.join("tiny-chat/config.json");
    let text = std::fs::read_to_string(&config).unwrap();
    let text = text.replace(
        "\"max_position_embeddings\": 128",
        "\"max_position_embeddings\": 1024",
    );
    assert!(text.contains("1024"), "tiny-llama's config.json changed");
    std::fs::write(&config, text).unwrap();
    std::fs::write(root.join("questions.txt"), "Hello\nWhat is 2 + 2?\n").unwrap();
    dir
}

/// Runs one command through `sh` in `dir`, `bigmodel` on the PATH.
fn run_command(command: &GuideCommand, dir: &Path) -> Result<(), String> {
    let binary = Path::new(env!("CARGO_BIN_EXE_bigmodel"));
    let mut path = std::ffi::OsString::from(binary.parent().unwrap());
    if let Some(old) = std::env::var_os("PATH") {
        path.push(":");
        path.push(old);
    }
    let output = Command::new("sh")
        .arg("-c")
        .arg(&command.text)
        .current_dir(dir)
        .env("PATH", path)
        .env("BM_DEMO_SCALE", "tiny")
        .env("BM_DEMO_DIR", dir.join("demo-cache"))
        .output()
        .map_err(|e| format!("cannot start sh: {e}"))?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    let context = || {
        format!(
            "guide line {}: `{}`\n--- stdout\n{stdout}\n--- stderr\n{stderr}",
            command.line, command.text
        )
    };
    if stderr.contains("panicked") {
        return Err(format!("panicked\n{}", context()));
    }
    match &command.fails {
        Some(message) => {
            if output.status.success() {
                return Err(format!(
                    "should fail with {message:?} but succeeded\n{}",
                    context()
                ));
            }
            if !stderr.contains(message.as_str()) {
                return Err(format!("should fail with {message:?}\n{}", context()));
            }
        }
        None => {
            if !output.status.success() {
                return Err(format!("failed ({})\n{}", output.status, context()));
            }
        }
    }
    for text in &command.expect {
        if !stdout.contains(text.as_str()) && !stderr.contains(text.as_str()) {
            return Err(format!("output lacks {text:?}\n{}", context()));
        }
    }
    Ok(())
}

#[test]
fn every_command_of_the_guide_runs_as_shown() {
    let commands = parse_guide(GUIDE).unwrap_or_else(|e| panic!("docs/guide.md: {e}"));
    // The guide covers every command of the CLI contract.
    for sub in [
        "inspect", "shard", "plan", "devices", "run", "embed", "demo",
    ] {
        let prefix = format!("bigmodel {sub} ");
        let exact = format!("bigmodel {sub}");
        assert!(
            commands
                .iter()
                .any(|c| c.text.starts_with(&prefix) || c.text == exact),
            "docs/guide.md shows no `bigmodel {sub}` command"
        );
    }
    assert!(
        GUIDE.contains(&format!("`partial-map.json` is `{PARTIAL_MAP}`")),
        "the guide must print partial-map.json as the test writes it: {PARTIAL_MAP}"
    );
    let dir = guide_folder();
    let failures: Vec<String> = commands
        .iter()
        .filter_map(|c| run_command(c, dir.path()).err())
        .collect();
    assert!(
        failures.is_empty(),
        "{} of {} guide commands went wrong:\n\n{}",
        failures.len(),
        commands.len(),
        failures.join("\n\n")
    );
}

#[test]
fn the_parser_reads_directives_and_continuations() {
    let markdown = "text\n\n```sh\n# expect: 6.28 GiB\nbigmodel plan a \\\n  --mode sequential\n\n# fails: does not fit\nbigmodel plan b\n```\n\n```rust\nfn main() {}\n```\n";
    assert_eq!(
        parse_guide(markdown).unwrap(),
        [
            GuideCommand {
                line: 5,
                text: "bigmodel plan a --mode sequential".into(),
                expect: vec!["6.28 GiB".into()],
                fails: None,
            },
            GuideCommand {
                line: 9,
                text: "bigmodel plan b".into(),
                expect: vec![],
                fails: Some("does not fit".into()),
            },
        ]
    );
}

#[test]
fn the_parser_refuses_what_would_escape_the_test() {
    let cases = [
        ("```\nbigmodel plan x\n```\n", "must name one of"),
        ("```sh\ncargo run\n```\n", "must start with `bigmodel `"),
        (
            "```sh\n# expects: x\nbigmodel plan x\n```\n",
            "only `# expect: TEXT`",
        ),
        (
            "```sh\nbigmodel plan x\n# expect: y\n```\n",
            "no command after it",
        ),
        (
            "```sh\nbigmodel plan x \\\n```\n",
            "continued past its block",
        ),
        ("```sh\nbigmodel plan x\n", "ends inside a fenced block"),
        ("```sh\n# fails:\nbigmodel plan x\n```\n", "empty"),
    ];
    for (markdown, message) in cases {
        let err = parse_guide(markdown).unwrap_err();
        assert!(err.contains(message), "{markdown:?}: {err}");
    }
}
