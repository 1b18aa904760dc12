//! Hostile inputs at the limits (issue 27): config.json numbers out of
//! their range for every key a family reads (each an error naming the file
//! and the key, from `plan` where the planner reads the key and from `run`
//! or `embed` where only the model does), budgets that send the model to
//! disk without an offload folder (the refusal names the modules and where
//! the budgets came from), and model folders that may be entered but not
//! listed, or not entered at all (permission denied, naming the path).

mod common;

use std::ffi::OsString;
use std::path::Path;
use std::process::Command;

use common::hostile::{Case, edited_copy, err, failures, os};
use common::{copy_folder, fixture, tiny_llama};
use serde_json::{Value, json};

/// `run FOLDER --prompt-ids 1 --max-new-tokens 1` plus `extra`.
fn run_args(folder: &Path, extra: &[&str]) -> Vec<OsString> {
    let mut args = os(&[
        &"run",
        &folder,
        &"--prompt-ids",
        &"1",
        &"--max-new-tokens",
        &"1",
    ]);
    args.extend(extra.iter().map(OsString::from));
    args
}

/// Sets `key` (dotted for a nested object) of a config to `value`.
fn set(config: &mut Value, key: &str, value: Value) {
    let mut target = config;
    let mut parts: Vec<&str> = key.split('.').collect();
    let last = parts.pop().unwrap();
    for part in parts {
        target = &mut target[part];
    }
    target[last] = value;
}

#[test]
fn config_numbers_out_of_range_are_errors_naming_the_key() {
    let root = tempfile::tempdir().unwrap();
    let d = root.path();
    // (fixture, key, value, command): every float key a family reads, and
    // the counts of heads, windows and experts at their edges.
    let edits: &[(&str, &str, Value, &str)] = &[
        ("tiny-llama", "partial_rotary_factor", json!(1e30), "plan"),
        ("tiny-llama", "partial_rotary_factor", json!(1e30), "run"),
        ("tiny-llama", "partial_rotary_factor", json!(0), "plan"),
        // Shadowed by rope_parameters' 0.75, still checked.
        ("tiny-phi3", "partial_rotary_factor", json!(1e30), "plan"),
        (
            "tiny-phi3",
            "rope_parameters.partial_rotary_factor",
            json!(-1),
            "run",
        ),
        ("tiny-llama", "rms_norm_eps", json!(-1e-6), "run"),
        ("tiny-llama", "rms_norm_eps", json!(1e30), "run"),
        ("tiny-llama", "rope_theta", json!(0), "run"),
        ("tiny-llama", "rope_theta", json!(1e39), "run"),
        ("tiny-phi3", "rope_parameters.rope_theta", json!(0.5), "run"),
        (
            "tiny-phi3",
            "rope_parameters.long_factor",
            json!([1, 1e30, 1]),
            "run",
        ),
        (
            "tiny-phi3",
            "rope_parameters.short_factor",
            json!([1, 0, 1]),
            "run",
        ),
        ("tiny-phi3", "rope_parameters.factor", json!(-4), "run"),
        (
            "tiny-phi3",
            "rope_parameters.attention_factor",
            json!(1e30),
            "run",
        ),
        ("tiny-gemma2", "attn_logit_softcapping", json!(0), "run"),
        ("tiny-gemma2", "final_logit_softcapping", json!(1e30), "run"),
        ("tiny-gemma2", "query_pre_attn_scalar", json!(-256), "run"),
        ("tiny-gpt2", "layer_norm_epsilon", json!(2), "run"),
        ("tiny-t5", "layer_norm_epsilon", json!(-1), "run"),
        ("tiny-bert", "layer_norm_eps", json!(1e30), "embed"),
        ("tiny-llama", "head_dim", json!(1u64 << 23), "plan"),
        ("tiny-llama", "head_dim", json!(0), "plan"),
        ("tiny-mistral", "sliding_window", json!(0), "run"),
        ("tiny-mistral", "sliding_window", json!(1u64 << 40), "run"),
        (
            "tiny-mixtral",
            "num_local_experts",
            json!(1_000_000),
            "plan",
        ),
        ("tiny-mixtral", "num_experts_per_tok", json!(1000), "plan"),
        ("tiny-qwen2-moe", "decoder_sparse_step", json!(0), "plan"),
        (
            "tiny-t5",
            "relative_attention_num_buckets",
            json!(1u64 << 40),
            "plan",
        ),
    ];
    let mut cases = Vec::new();
    for (i, (name, key, value, command)) in edits.iter().enumerate() {
        let folder = edited_copy(&fixture(name), &d.join(format!("{i}-{name}")), |c| {
            set(c, key, value.clone())
        });
        let args = match *command {
            "plan" => os(&[&"plan", &folder.join("config.json")]),
            "embed" => os(&[&"embed", &folder, &"hi"]),
            _ => run_args(&folder, &[]),
        };
        cases.push(Case {
            name: key,
            args,
            expect: err(&["config.json", &format!("key \"{key}\"")]),
        });
    }
    // Out of f32's range in generation_config.json and a negative int8
    // threshold in quantization_config.
    let temperature = d.join("temperature");
    copy_folder(&fixture("tiny-llama"), &temperature);
    std::fs::write(
        temperature.join("generation_config.json"),
        json!({"do_sample": true, "temperature": 1e39}).to_string(),
    )
    .unwrap();
    cases.push(Case {
        name: "a temperature past f32",
        args: run_args(&temperature, &[]),
        expect: err(&[
            "generation_config.json",
            "key \"temperature\"",
            "out of range",
        ]),
    });
    let threshold = edited_copy(&fixture("tiny-llama-bnb/int8"), &d.join("threshold"), |c| {
        c["quantization_config"]["llm_int8_threshold"] = json!(-6.0)
    });
    cases.push(Case {
        name: "a negative llm_int8_threshold",
        args: run_args(&threshold, &[]),
        expect: err(&[
            "key \"quantization_config.llm_int8_threshold\"",
            "out of range",
        ]),
    });
    let failures = failures(&cases);
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn budgets_sending_modules_to_disk_say_which_and_why() {
    let llama = tiny_llama();
    let config = llama.join("config.json");
    let cases = vec![
        Case {
            name: "a CPU budget of 0 without an offload folder",
            args: run_args(&llama, &["--max-memory", "cpu=0"]),
            expect: err(&[
                "please pass along an `offload_folder`",
                "modules on disk: the whole model;",
                "budgets given by max_memory (--max-memory): cpu 0 B",
            ]),
        },
        Case {
            name: "a CPU budget for the embedding alone",
            args: run_args(&llama, &["--max-memory", "cpu=100KB"]),
            expect: err(&[
                "modules on disk: model.layers, lm_head;",
                "budgets given by max_memory (--max-memory): cpu 97.66 KiB",
            ]),
        },
        Case {
            name: "run --verify under a CPU budget for the embedding alone",
            args: run_args(&llama, &["--max-memory", "cpu=100KB", "--verify"]),
            expect: err(&[
                "modules on disk: model.layers, lm_head;",
                "budgets given by max_memory (--max-memory): cpu 97.66 KiB",
            ]),
        },
        Case {
            name: "a plan that fits nowhere",
            args: os(&[&"plan", &config, &"--max-memory", &"cpu=1KB,disk=1KB"]),
            expect: err(&[
                "the model does not fit",
                "budgets given by max_memory (--max-memory): cpu 1000 B, disk 1000 B",
            ]),
        },
    ];
    let failures = failures(&cases);
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// The binary run as a user that file permissions bind: this user when it
/// is not root, else `nobody` through `setpriv` (root reads any folder).
/// `None` when neither is possible here.
fn as_bound_user() -> Option<Command> {
    let bin = env!("CARGO_BIN_EXE_bigmodel");
    let uid = Command::new("id").arg("-u").output().ok()?;
    if String::from_utf8_lossy(&uid.stdout).trim() != "0" {
        return Some(Command::new(bin));
    }
    let mut setpriv = Command::new("setpriv");
    setpriv.args(["--reuid=65534", "--regid=65534", "--clear-groups", bin]);
    let works = Command::new("setpriv")
        .args([
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            bin,
            "--version",
        ])
        .output()
        .is_ok_and(|o| o.status.success());
    works.then_some(setpriv)
}

#[test]
fn folders_that_may_not_be_listed_or_entered_say_permission_denied() {
    use std::os::unix::fs::PermissionsExt;
    let Some(_) = as_bound_user() else {
        eprintln!("skipped: running as root without setpriv, permissions bind no one");
        return;
    };
    let root = tempfile::tempdir().unwrap();
    let d = root.path();
    let mode = |path: &Path, mode: u32| {
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap()
    };
    mode(d, 0o755);
    // A sharded copy, a single-file copy and a config alone, each in a
    // folder that may be entered but not listed.
    let sharded = d.join("sharded");
    let out = common::bigmodel(&[
        OsString::from("shard"),
        tiny_llama().into(),
        sharded.clone().into(),
        "--max-shard-size".into(),
        "200KB".into(),
    ]);
    common::succeeds(&out);
    let single = d.join("single");
    copy_folder(&tiny_llama(), &single);
    let config_only = d.join("config-only");
    std::fs::create_dir(&config_only).unwrap();
    std::fs::copy(
        tiny_llama().join("config.json"),
        config_only.join("config.json"),
    )
    .unwrap();
    for folder in [&sharded, &single, &config_only] {
        for entry in std::fs::read_dir(folder).unwrap() {
            mode(&entry.unwrap().path(), 0o644);
        }
        mode(folder, 0o311);
    }
    let closed = d.join("closed");
    copy_folder(&tiny_llama(), &closed);
    mode(&closed, 0o000);

    let run = |args: &[&dyn AsRef<std::ffi::OsStr>]| {
        let out = as_bound_user().unwrap().args(os(args)).output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        (out.status.success(), stderr)
    };
    // Weights under transformers' names are found by name, as transformers
    // finds them.
    for folder in [&sharded, &single] {
        let (ok, stderr) = run(&[&"inspect", folder]);
        assert!(ok, "inspect {}: {stderr}", folder.display());
        let (ok, stderr) = run(&[
            &"run",
            folder,
            &"--prompt-ids",
            &"1",
            &"--max-new-tokens",
            &"1",
        ]);
        assert!(ok, "run {}: {stderr}", folder.display());
    }
    // Nothing there by name: no weights, and why only names were tried;
    // a plan from the config alone, as for a folder that may be listed.
    let (ok, stderr) = run(&[&"run", &config_only, &"--prompt-ids", &"1"]);
    assert!(
        !ok && stderr.contains("config-only: no weights")
            && stderr.contains("permission denied listing the folder"),
        "{stderr}"
    );
    let (ok, stderr) = run(&[&"plan", &config_only]);
    assert!(ok, "{stderr}");
    // A folder that may not be entered: its config.json is named, not
    // reported missing.
    let (ok, stderr) = run(&[&"run", &closed, &"--prompt-ids", &"1"]);
    assert!(
        !ok && stderr.contains("closed/config.json: Permission denied")
            && !stderr.contains("no config.json"),
        "{stderr}"
    );
    let (ok, stderr) = run(&[&"inspect", &closed]);
    assert!(
        !ok && stderr.contains("closed/model.safetensors: Permission denied"),
        "{stderr}"
    );
    // Let the temporary folder be removed.
    for folder in [&sharded, &single, &config_only, &closed] {
        mode(folder, 0o755);
    }
}

/// A `chat` session on a copy of the tiny Llama (with a chat template)
/// whose checkpoint `change` alters after the first reply, while the model
/// is loaded: (success, stderr).
fn chat_session(change: impl FnOnce(&Path)) -> (bool, String) {
    use std::io::{BufRead, BufReader, Write};
    use std::process::Stdio;
    let dir = tempfile::tempdir().unwrap();
    copy_folder(&tiny_llama(), dir.path());
    common::edit_json(&dir.path().join("config.json"), |c| {
        c["max_position_embeddings"] = json!(1024)
    });
    std::fs::copy(
        fixture("chat/qwen2/tokenizer_config.json"),
        dir.path().join("tokenizer_config.json"),
    )
    .unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_bigmodel"))
        .args(os(&[&"chat", &dir.path(), &"--max-new-tokens", &"1"]))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    writeln!(stdin, "Hi").unwrap();
    // The first reply: the model is loaded and its checkpoint mapped.
    let mut reply = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut reply)
        .unwrap();
    change(&dir.path().join("model.safetensors"));
    writeln!(stdin, "/exit").unwrap();
    drop(stdin);
    let out = child.wait_with_output().unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn a_checkpoint_written_in_place_while_in_use_is_a_warning() {
    use std::io::Write;
    let (ok, stderr) = chat_session(|checkpoint| {
        let mut file = std::fs::OpenOptions::new()
            .append(true)
            .open(checkpoint)
            .unwrap();
        file.write_all(&[0; 8]).unwrap();
    });
    assert!(
        ok && stderr.contains("warning: ")
            && stderr.contains("model.safetensors was changed in place while in use")
            && stderr.contains("578312 bytes when mapped, 578320 now"),
        "{stderr}"
    );
    // Replaced by a new file (a rename), the mapping keeps its bytes: no
    // warning; untouched, none either.
    let (ok, stderr) = chat_session(|checkpoint| {
        let new = checkpoint.with_extension("new");
        std::fs::copy(checkpoint, &new).unwrap();
        std::fs::rename(&new, checkpoint).unwrap();
    });
    assert!(ok && !stderr.contains("warning"), "{stderr}");
    let (ok, stderr) = chat_session(|_| {});
    assert!(ok && !stderr.contains("warning"), "{stderr}");
}
