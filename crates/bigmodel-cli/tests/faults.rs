//! The fault suite (issue 27): what an operator's bad day does to the
//! folders bigmodel writes. Two writers at once on one folder (`shard`,
//! `run` with a shared `--offload-folder`), a SIGKILL at several points of
//! a run followed by a run with another budget and dtype, SIGINT and
//! SIGTERM in the middle of a write, a writer in another pid namespace
//! (with `unshare`, when this machine allows it), and a full disk (a small
//! tmpfs in a private mount namespace, when allowed). Cases the machine
//! cannot run print why and pass.
//!
//! The checks are the same everywhere: every command either succeeds with
//! the output it gives alone, or fails with a message naming the folder;
//! no temporary, lock file or index describing bytes that are not there
//! outlives it.
#![cfg(unix)]

mod common;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use bigmodel::shard::offload::{OffloadEntry, OffloadFolder};
use bigmodel::shard::{Checkpoint, FolderLock, Sharing};
use common::*;

fn command(args: &[&str]) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_bigmodel"));
    cmd.args(args);
    cmd
}

fn spawn(args: &[&str]) -> Child {
    command(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start bigmodel")
}

/// Names in `dir` that bigmodel's writers must not leave behind:
/// temporaries, writer locks and folder locks.
fn leftovers(dir: &Path) -> Vec<String> {
    let Ok(listing) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut names: Vec<String> = listing
        .filter_map(Result::ok)
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(".bigmodel-"))
        .collect();
    names.sort();
    names
}

fn signal(child: &Child, signal: i32) {
    // SAFETY: kill with the pid of a child this process started and has
    // not waited for yet (so the pid is still its).
    unsafe { libc::kill(child.id() as i32, signal) };
}

/// A safetensors file of `count` F32 tensors `w0`, `w1`, ... of `bytes`
/// each, filled with values that differ per tensor.
fn write_checkpoint(path: &Path, count: usize, bytes: usize) {
    let mut header = serde_json::Map::new();
    for i in 0..count {
        header.insert(
            format!("w{i}"),
            serde_json::json!({"dtype": "F32", "shape": [bytes / 4], "data_offsets": [i * bytes, (i + 1) * bytes]}),
        );
    }
    let mut text = serde_json::Value::Object(header).to_string();
    while !text.len().is_multiple_of(8) {
        text.push(' ');
    }
    let mut out = (text.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(text.as_bytes());
    for i in 0..count {
        out.extend((0..bytes / 4).flat_map(|k| ((k * 31 + i * 7) as f32).to_le_bytes()));
    }
    std::fs::write(path, out).unwrap();
}

/// Asserts that `dir` holds one whole checkpoint with exactly the tensors
/// of `source`, byte for byte, and nothing of an earlier write.
fn assert_whole_copy(dir: &Path, source: &Path) {
    let copy = Checkpoint::open(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    let source = Checkpoint::open(source).unwrap();
    let names = |c: &Checkpoint| {
        let mut v: Vec<String> = c.tensors().map(|(n, _)| n.to_string()).collect();
        v.sort();
        v
    };
    assert_eq!(names(&copy), names(&source));
    for (name, _) in source.tensors() {
        assert_eq!(
            copy.view(name).unwrap().as_bytes(),
            source.view(name).unwrap().as_bytes(),
            "{name}"
        );
    }
    // No shard file beyond those the index (or the single file) names.
    let named: Vec<PathBuf> = copy.files().iter().map(|f| f.path.clone()).collect();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "safetensors") {
            assert!(named.contains(&path), "stale shard {}", path.display());
        }
    }
    assert_eq!(leftovers(dir), Vec::<String>::new());
}

/// Reads a child's stderr on a thread, line by line.
fn stderr_lines(child: &mut Child) -> mpsc::Receiver<String> {
    let (send, receive) = mpsc::channel();
    let stderr = child.stderr.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if send.send(line).is_err() {
                return;
            }
        }
    });
    receive
}

/// Waits (at most a minute) for a line of `lines` containing `needle`.
fn wait_for_line(lines: &mpsc::Receiver<String>, needle: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match lines.recv_timeout(left) {
            Ok(line) if line.contains(needle) => return line,
            Ok(_) => {}
            Err(e) => panic!("no line with {needle:?}: {e}"),
        }
    }
}

fn wait(mut child: Child) -> (ExitStatus, String) {
    let status = child.wait().unwrap();
    let mut stderr = String::new();
    if let Some(mut s) = child.stderr.take() {
        std::io::Read::read_to_string(&mut s, &mut stderr).unwrap();
    }
    (status, stderr)
}

/// The tiny Llama with the layers and lm_head on disk: every weight there
/// is written to the offload folder as `.dat` when its dtype changes.
fn disk_map(dir: &Path, layers_on_disk: &[usize]) -> PathBuf {
    let mut map = serde_json::json!({
        "model.embed_tokens": "cpu", "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "disk",
    });
    for layer in 0..3 {
        let place = if layers_on_disk.contains(&layer) {
            "disk"
        } else {
            "cpu"
        };
        map[format!("model.layers.{layer}")] = place.into();
    }
    let names: Vec<String> = layers_on_disk.iter().map(usize::to_string).collect();
    let path = dir.join(format!("map-{}.json", names.join("-")));
    std::fs::write(&path, map.to_string()).unwrap();
    path
}

/// `run` arguments for the tiny Llama: greedy, 3 tokens, the logits of the
/// prompt dumped to `logits` (they show any weight that is not this run's).
fn run_args(dtype: &str, map: &Path, folder: &Path, logits: &Path) -> Vec<String> {
    [
        "run",
        tiny_llama().to_str().unwrap(),
        "--prompt",
        "Hello, wörld!",
        "--max-new-tokens",
        "3",
        "--dtype",
        dtype,
        "--device-map",
        map.to_str().unwrap(),
        "--offload-folder",
        folder.to_str().unwrap(),
        "--dump-logits",
        logits.to_str().unwrap(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

fn strs(args: &[String]) -> Vec<&str> {
    args.iter().map(String::as_str).collect()
}

/// The logits a run of `dtype` under `map` gives with a folder of its own.
fn reference_logits(dir: &Path, dtype: &str, map: &Path) -> Vec<u8> {
    let folder = dir.join(format!("alone-{dtype}-{}", map.display().to_string().len()));
    let logits = dir.join(format!("alone-{dtype}.safetensors"));
    succeeds(&bigmodel(&strs(&run_args(dtype, map, &folder, &logits))));
    std::fs::read(&logits).unwrap()
}

/// Every `.dat` entry of the offload index describes the bytes its file
/// holds: the checkpoint tensor in the entry's dtype.
fn assert_index_describes_its_files(folder: &Path) {
    let opened = OffloadFolder::open(folder).unwrap();
    let checkpoint = Checkpoint::open(tiny_llama()).unwrap();
    let entries = bigmodel::shard::offload::load_index(folder).unwrap();
    for (name, entry) in entries {
        let OffloadEntry::Dat(meta) = entry else {
            continue;
        };
        let expected = checkpoint.read_as(&name, meta.dtype).unwrap();
        assert_eq!(
            opened.view(&name).unwrap().as_bytes(),
            expected.as_bytes(),
            "{name}: the index says {}, the file holds other bytes",
            meta.dtype
        );
    }
}

#[test]
fn a_second_writer_waits_for_the_lock_or_fails_naming_the_holder() {
    let dir = tempfile::tempdir().unwrap();
    let source = dir.path().join("source.safetensors");
    write_checkpoint(&source, 4, 1 << 16);
    let out = dir.path().join("out");
    let me = format!("is being written by pid {} on ", std::process::id());

    // `shard`: at once with --wait-lock 0; else it says it waits, and
    // finishes when the holder lets go.
    let lock = FolderLock::acquire(&out, &Sharing::default()).unwrap();
    let shard = |extra: &[&str]| {
        let mut args = vec![
            "shard",
            source.to_str().unwrap(),
            out.to_str().unwrap(),
            "--max-shard-size",
            "100KB",
        ];
        args.extend_from_slice(extra);
        args.iter().map(|s| s.to_string()).collect::<Vec<_>>()
    };
    fails(&bigmodel(&strs(&shard(&["--wait-lock", "0"]))), &me);
    fails(&bigmodel(&strs(&shard(&["--wait-lock", "1"]))), &me);
    // A reader of the folder being written hears the same, not "no
    // weights" or "no config.json".
    fails(&bigmodel(&["inspect", out.to_str().unwrap()]), &me);
    fails(
        &bigmodel(&["run", out.to_str().unwrap(), "--prompt", "Hi"]),
        &me,
    );
    let config_first = dir.path().join("config-first");
    let other = FolderLock::acquire(&config_first, &Sharing::default()).unwrap();
    std::fs::copy(
        tiny_llama().join("config.json"),
        config_first.join("config.json"),
    )
    .unwrap();
    fails(
        &bigmodel(&["run", config_first.to_str().unwrap(), "--prompt", "Hi"]),
        &me,
    );
    drop(other);
    let mut waiting = spawn(&strs(&shard(&[])));
    let lines = stderr_lines(&mut waiting);
    let told = wait_for_line(&lines, "waiting for it to finish");
    assert!(told.contains(&me), "{told}");
    drop(lock);
    let status = waiting.wait().unwrap();
    assert!(status.success(), "{status}");
    assert_whole_copy(&out, &source);

    // `run` writing an offload folder.
    let folder = dir.path().join("offload");
    let logits = dir.path().join("logits.safetensors");
    let args = run_args("f16", &disk_map(dir.path(), &[0, 1, 2]), &folder, &logits);
    let lock = FolderLock::acquire(&folder, &Sharing::default()).unwrap();
    let mut now = args.clone();
    now.extend(["--wait-lock".into(), "0".into()]);
    fails(&bigmodel(&strs(&now)), &me);
    let mut waiting = spawn(&strs(&args));
    let lines = stderr_lines(&mut waiting);
    wait_for_line(&lines, "waiting for it to finish");
    drop(lock);
    assert!(waiting.wait().unwrap().success());
    assert_eq!(leftovers(&folder), Vec::<String>::new());
    assert_index_describes_its_files(&folder);
}

#[test]
fn two_shards_into_one_folder_leave_one_whole_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let source = dir.path().join("source.safetensors");
    write_checkpoint(&source, 12, 1 << 20);
    let out = dir.path().join("out");
    for round in 0..4 {
        // 12 shards against 3: each one's stale-shard removal would take
        // the other's files if they ran at once.
        let sizes = if round % 2 == 0 {
            ["1MB", "5MB"]
        } else {
            ["5MB", "1MB"]
        };
        let children: Vec<Child> = sizes
            .iter()
            .map(|size| {
                spawn(&[
                    "shard",
                    source.to_str().unwrap(),
                    out.to_str().unwrap(),
                    "--max-shard-size",
                    size,
                ])
            })
            .collect();
        for child in children {
            let (status, stderr) = wait(child);
            assert!(status.success(), "round {round}: {stderr}");
        }
        assert_whole_copy(&out, &source);
    }
}

#[test]
fn two_runs_sharing_an_offload_folder_keep_their_own_weights() {
    let dir = tempfile::tempdir().unwrap();
    let map = disk_map(dir.path(), &[0, 1, 2]);
    let f16 = reference_logits(dir.path(), "f16", &map);
    let bf16 = reference_logits(dir.path(), "bf16", &map);
    assert_ne!(f16, bf16, "the two dtypes must give different logits");
    let shared = dir.path().join("shared");
    for round in 0..5 {
        let runs: Vec<(Child, PathBuf, &Vec<u8>)> = [("f16", &f16), ("bf16", &bf16)]
            .into_iter()
            .map(|(dtype, reference)| {
                let logits = dir.path().join(format!("{dtype}-{round}.safetensors"));
                let child = spawn(&strs(&run_args(dtype, &map, &shared, &logits)));
                (child, logits, reference)
            })
            .collect();
        for (child, logits, reference) in runs {
            let (status, stderr) = wait(child);
            assert!(status.success(), "round {round}: {stderr}");
            assert!(
                std::fs::read(&logits).unwrap() == *reference,
                "round {round}: {} computed with weights that were not its own",
                logits.display()
            );
        }
        assert_index_describes_its_files(&shared);
        assert_eq!(leftovers(&shared), Vec::<String>::new());
    }
}

#[test]
fn a_killed_run_leaves_a_folder_every_later_run_can_use() {
    let dir = tempfile::tempdir().unwrap();
    let all = disk_map(dir.path(), &[0, 1, 2]);
    let fewer = disk_map(dir.path(), &[2]);
    let folder = dir.path().join("offload");
    let logits = dir.path().join("logits.safetensors");
    succeeds(&bigmodel(&strs(&run_args("f16", &all, &folder, &logits))));
    // What a run killed after rewriting a `.dat` in another dtype leaves
    // with an index written by an earlier one: an entry whose file holds
    // another number of bytes. And an entry into a checkpoint since
    // deleted.
    let dat = folder.join("model.layers.0.mlp.up_proj.weight.dat");
    let len = std::fs::metadata(&dat).unwrap().len() as usize;
    std::fs::write(&dat, vec![7u8; 2 * len]).unwrap();
    let index_path = folder.join("index.json");
    let mut index: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&index_path).unwrap()).unwrap();
    index["gone.weight"] = serde_json::json!({
        "safetensors_file": dir.path().join("deleted/model.safetensors"),
        "weight_name": "gone.weight",
    });
    std::fs::write(&index_path, index.to_string()).unwrap();

    // A run with a larger budget (layer 0 in RAM) and another dtype.
    let reference = reference_logits(dir.path(), "bf16", &fewer);
    let out = bigmodel(&strs(&run_args("bf16", &fewer, &folder, &logits)));
    succeeds(&out);
    assert_eq!(std::fs::read(&logits).unwrap(), reference);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("removed 2 index entries that disagreed with their files")
            && stderr.contains("model.layers.0.mlp.up_proj.weight")
            && stderr.contains("gone.weight"),
        "{stderr}"
    );
    assert_index_describes_its_files(&folder);
}

#[test]
fn a_sigkill_at_several_points_then_a_run_with_another_budget() {
    let dir = tempfile::tempdir().unwrap();
    let all = disk_map(dir.path(), &[0, 1, 2]);
    let fewer = disk_map(dir.path(), &[1, 2]);
    let reference = reference_logits(dir.path(), "bf16", &fewer);
    // Points seen in the folder, then delays after the start.
    let points: Vec<(&str, Option<Duration>)> = vec![
        (".bigmodel-lock", None),
        (".bigmodel-tmp-", None),
        ("index.json rewritten", None),
        ("", Some(Duration::from_millis(5))),
        ("", Some(Duration::from_millis(30))),
        ("", Some(Duration::from_millis(100))),
    ];
    let index_id = |folder: &Path| {
        use std::os::unix::fs::MetadataExt;
        std::fs::metadata(folder.join("index.json"))
            .map(|m| m.ino())
            .ok()
    };
    for (k, (point, delay)) in points.into_iter().enumerate() {
        let folder = dir.path().join(format!("offload-{k}"));
        let logits = dir.path().join(format!("killed-{k}.safetensors"));
        // The folder holds an earlier run's files in bf16, so the killed
        // one rewrites them in f16 (same sizes: only the index tells them
        // apart).
        succeeds(&bigmodel(&strs(&run_args("bf16", &all, &folder, &logits))));
        let index_before = index_id(&folder);
        let mut child = spawn(&strs(&run_args("f16", &all, &folder, &logits)));
        let hit = loop {
            if let Some(delay) = delay {
                std::thread::sleep(delay);
                break true;
            }
            let seen = if point.starts_with("index.json") {
                index_id(&folder) != index_before
            } else {
                std::fs::read_dir(&folder)
                    .unwrap()
                    .filter_map(Result::ok)
                    .any(|e| e.file_name().to_string_lossy().contains(point))
            };
            if seen || child.try_wait().unwrap().is_some() {
                break seen;
            }
        };
        signal(&child, libc::SIGKILL);
        let status = child.wait().unwrap();
        eprintln!("kill point {point:?}/{delay:?}: seen {hit}, {status}");
        // A larger budget (layer 0 in RAM) and the first dtype again.
        let after = dir.path().join(format!("after-{k}.safetensors"));
        succeeds(&bigmodel(&strs(&run_args("bf16", &fewer, &folder, &after))));
        assert_eq!(
            std::fs::read(&after).unwrap(),
            reference,
            "after a kill at {point:?}/{delay:?}"
        );
        assert_index_describes_its_files(&folder);
        assert_eq!(leftovers(&folder), Vec::<String>::new(), "after {point:?}");
    }
}

#[test]
fn shard_quantize_writes_its_config_once_and_last() {
    let dir = tempfile::tempdir().unwrap();
    // The quantized model's folder, with side files to copy before the
    // config.
    let source = dir.path().join("source");
    std::fs::create_dir(&source).unwrap();
    let base = fixture("tiny-llama-bnb/base");
    for name in ["config.json", "model.safetensors"] {
        std::fs::copy(base.join(name), source.join(name)).unwrap();
    }
    for k in 0..8 {
        std::fs::write(source.join(format!("side-{k}.txt")), vec![b'x'; 1 << 16]).unwrap();
    }
    for round in 0..3 {
        let out = dir.path().join(format!("out-{round}"));
        let mut child = spawn(&[
            "shard",
            source.to_str().unwrap(),
            out.to_str().unwrap(),
            "--max-shard-size",
            "1GB",
            "--quantize",
            "nf4",
        ]);
        // The first config.json anyone could read (a process killed
        // then would leave it) is the final one.
        let config = out.join("config.json");
        let first = loop {
            if let Ok(text) = std::fs::read_to_string(&config) {
                break text;
            }
            if child.try_wait().unwrap().is_some() {
                break std::fs::read_to_string(&config).unwrap_or_default();
            }
        };
        let (status, stderr) = wait(child);
        assert!(status.success(), "{stderr}");
        assert!(
            first.contains("quantization_config"),
            "round {round}: config.json appeared without quantization_config"
        );
        for k in 0..8 {
            assert!(out.join(format!("side-{k}.txt")).is_file());
        }
    }
}

/// Starts `args`, stops it as soon as `folder` holds a temporary, sends
/// `sig` and lets it go on. Returns its exit status and whether the
/// temporary was caught in flight (else the signal came when it was seen
/// last or after the command ended).
fn interrupt_mid_write(args: &[&str], folder: &Path, sig: i32) -> (ExitStatus, bool) {
    for _ in 0..20 {
        let mut child = spawn(args);
        let caught = loop {
            let in_flight = leftovers(folder)
                .iter()
                .any(|n| n.starts_with(".bigmodel-tmp-"));
            if in_flight {
                signal(&child, libc::SIGSTOP);
                break leftovers(folder)
                    .iter()
                    .any(|n| n.starts_with(".bigmodel-tmp-"));
            }
            if child.try_wait().unwrap().is_some() {
                break false;
            }
        };
        if !caught {
            signal(&child, libc::SIGCONT);
            let _ = child.wait();
            continue;
        }
        signal(&child, sig);
        signal(&child, libc::SIGCONT);
        let (status, _) = wait(child);
        return (status, true);
    }
    (ExitStatus::default(), false)
}

#[test]
fn interrupts_remove_what_is_in_flight_and_exit_128_plus_the_signal() {
    let dir = tempfile::tempdir().unwrap();
    let source = dir.path().join("source.safetensors");
    write_checkpoint(&source, 16, 4 << 20);
    for (sig, code) in [(libc::SIGINT, 130), (libc::SIGTERM, 143)] {
        let out = dir.path().join(format!("out-{sig}"));
        let args = [
            "shard",
            source.to_str().unwrap(),
            out.to_str().unwrap(),
            "--max-shard-size",
            "8MB",
        ];
        let (status, caught) = interrupt_mid_write(&args, &out, sig);
        assert!(caught, "shard never had a temporary in flight to interrupt");
        assert_eq!(status.code(), Some(code), "{status}");
        assert_eq!(leftovers(&out), Vec::<String>::new());
    }
    // `run` writing its offload folder: the writes are small, so the
    // signal may come after them, during generation.
    let map = disk_map(dir.path(), &[0, 1, 2]);
    for (sig, code) in [(libc::SIGINT, 130), (libc::SIGTERM, 143)] {
        let folder = dir.path().join(format!("offload-{sig}"));
        let logits = dir.path().join("logits.safetensors");
        let args = run_args("f16", &map, &folder, &logits);
        let (status, caught) = interrupt_mid_write(&strs(&args), &folder, sig);
        if caught {
            assert_eq!(status.code(), Some(code), "{status}");
        } else {
            eprintln!("run: no write caught in flight; signalling a running one instead");
            let mut child = spawn(&strs(&args));
            while !folder.exists() && child.try_wait().unwrap().is_none() {}
            signal(&child, sig);
            let (status, stderr) = wait(child);
            assert!(
                status.code() == Some(0) || status.code() == Some(code),
                "{status}: {stderr}"
            );
        }
        assert_eq!(leftovers(&folder), Vec::<String>::new());
    }
}

/// Whether `unshare ARGS true` works here (namespaces need privileges or
/// unprivileged user namespaces).
fn unshare_works(args: &[&str]) -> bool {
    Command::new("unshare")
        .args(args)
        .arg("true")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

#[test]
fn a_writer_in_another_pid_namespace_keeps_its_files() {
    if !unshare_works(&["--pid", "--fork", "--kill-child", "--mount-proc"]) {
        eprintln!("skipped: `unshare --pid --fork --mount-proc` is not allowed here");
        return;
    }
    let has_flock = Command::new("flock")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !has_flock {
        eprintln!("skipped: no `flock` command to hold a lock in the other namespace");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let source = dir.path().join("source.safetensors");
    write_checkpoint(&source, 4, 1 << 16);
    let out = dir.path().join("out");
    std::fs::create_dir(&out).unwrap();
    // A writer of another pid namespace (a second container on a shared
    // volume): its pid means nothing here, its lock does. `flock` holds its
    // writer lock while it "writes" its finished shard.
    let id = "00000000000000e1";
    let lock = out.join(format!(".bigmodel-tmp-{id}.lock"));
    let finished = out.join(format!(".bigmodel-tmp-{id}-0"));
    std::fs::write(&lock, b"").unwrap();
    std::fs::write(&finished, vec![1u8; 1 << 16]).unwrap();
    let mut other = Command::new("unshare")
        .args(["--pid", "--fork", "--kill-child", "--mount-proc", "flock"])
        .arg(&lock)
        .args(["sleep", "60"])
        .stdin(Stdio::null())
        .spawn()
        .unwrap();
    // Until flock holds it.
    let deadline = Instant::now() + Duration::from_secs(30);
    while std::fs::File::open(&lock).unwrap().try_lock().is_ok() {
        assert!(Instant::now() < deadline, "flock never took the lock");
        std::thread::sleep(Duration::from_millis(10));
    }
    let args = [
        "shard",
        source.to_str().unwrap(),
        out.to_str().unwrap(),
        "--max-shard-size",
        "100KB",
    ];
    succeeds(&bigmodel(&args));
    assert!(
        finished.exists() && lock.exists(),
        "a live writer's files were removed"
    );
    // Once that writer is gone (its lock with it), the next write removes
    // what it left.
    signal(&other, libc::SIGKILL);
    other.wait().unwrap();
    while std::fs::File::open(&lock).unwrap().try_lock().is_err() {
        assert!(Instant::now() < deadline, "the killed writer's lock stays");
        std::thread::sleep(Duration::from_millis(10));
    }
    succeeds(&bigmodel(&args));
    assert_eq!(leftovers(&out), Vec::<String>::new());
    assert_whole_copy(&out, &source);
}

/// Runs `script` with `sh -c` in a private mount namespace where `mount`
/// works (as root, else as root of a new user namespace); `None` when
/// neither is allowed here.
fn in_mount_namespace(script: &str) -> Option<std::process::Output> {
    for flags in [&["--mount"][..], &["--map-root-user", "--mount"]] {
        if !unshare_works(flags) {
            continue;
        }
        return Some(
            Command::new("unshare")
                .args(flags)
                .args(["sh", "-c", script])
                .output()
                .unwrap(),
        );
    }
    None
}

#[test]
fn a_full_disk_fails_cleanly_and_leaves_earlier_output_whole() {
    let dir = tempfile::tempdir().unwrap();
    let small = dir.path().join("small.safetensors");
    write_checkpoint(&small, 2, 1 << 16);
    let large = dir.path().join("large.safetensors");
    write_checkpoint(&large, 8, 1 << 20);
    let mount = dir.path().join("full");
    std::fs::create_dir(&mount).unwrap();
    let bin = env!("CARGO_BIN_EXE_bigmodel");
    let out = mount.join("out");
    let offload = mount.join("offload");
    let map = disk_map(dir.path(), &[0, 1, 2]);
    let logits = dir.path().join("logits.safetensors");
    // In the namespace: a 2 MiB tmpfs; a small checkpoint that fits, then
    // a large one that does not into the same folder, then a run whose
    // offload folder does not fit; each status and the listings printed.
    let script = format!(
        "mount -t tmpfs -o size=2m tmpfs {m} || exit 99
         {b} shard {small} {o} --max-shard-size 100KB >/dev/null; echo small=$?
         {b} shard {large} {o} --max-shard-size 1MB 2>&1 >/dev/null; echo large=$?
         dd if=/dev/zero of={m}/filler bs=1024 count=1800 2>/dev/null
         {b} run {model} --prompt Hi --max-new-tokens 1 --dtype f16 --device-map {map} --offload-folder {f} --dump-logits {l} 2>&1 >/dev/null; echo run=$?
         ls -A {o}; echo ---; ls -A {f}; echo ---
         {b} inspect {o} --json >/dev/null; echo inspect=$?",
        m = mount.display(),
        b = bin,
        small = small.display(),
        large = large.display(),
        o = out.display(),
        model = tiny_llama().display(),
        map = map.display(),
        f = offload.display(),
        l = logits.display(),
    );
    let Some(result) = in_mount_namespace(&script) else {
        eprintln!("skipped: no mount namespace in which to mount a small tmpfs here");
        return;
    };
    let text = String::from_utf8_lossy(&result.stdout).into_owned();
    if result.status.code() == Some(99) {
        eprintln!("skipped: mounting a tmpfs is not allowed here");
        return;
    }
    assert!(text.contains("small=0"), "{text}");
    assert!(
        text.contains("large=1") && text.contains("No space left on device"),
        "{text}"
    );
    assert!(
        text.contains("run=1") && text.contains("No space left on device"),
        "{text}"
    );
    assert!(!text.contains("panicked"), "{text}");
    assert!(!text.contains(".bigmodel-"), "leftovers: {text}");
    assert!(
        text.contains("inspect=0"),
        "the earlier output is whole: {text}"
    );
}
