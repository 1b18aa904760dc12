//! A corpus of hostile and broken inputs, generated here: safetensors
//! headers, shard indexes and offload folders built to break a reader
//! (lengths past the end, duplicate keys, absurd numbers, links and FIFOs
//! where files belong, ...). Each case must give `Ok` or an error naming the
//! file at fault and saying what is wrong, never a panic, a hang or an echo
//! of a file that should not have been read.

use std::path::{Path, PathBuf};

use bm_shard::Checkpoint;
use bm_shard::offload::OffloadFolder;
use serde_json::json;

/// What a case must give.
enum Expect {
    /// Opens.
    Ok,
    /// Fails; the message holds all of these.
    Err(&'static [&'static str]),
}

/// A safetensors file: `json` as the header (its length prefix computed
/// unless `len` overrides it), then `data`.
fn st(dir: &Path, name: &str, json: &str, data: &[u8], len: Option<u64>) -> PathBuf {
    let mut bytes = len.unwrap_or(json.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(json.as_bytes());
    bytes.extend_from_slice(data);
    let path = dir.join(name);
    std::fs::write(&path, bytes).unwrap();
    path
}

fn one(json: &str, data_len: usize) -> impl Fn(&Path) -> PathBuf + '_ {
    move |dir| st(dir, "m.safetensors", json, &vec![1; data_len], None)
}

fn check(case: &str, result: Result<(), String>, expect: &Expect, names: &Path) {
    match (result, expect) {
        (Ok(()), Expect::Ok) => {}
        (Err(e), Expect::Err(parts)) => {
            assert!(
                e.contains(&names.display().to_string()),
                "{case}: the error does not name {}: {e}",
                names.display()
            );
            for p in *parts {
                assert!(e.contains(p), "{case}: expected {p:?} in: {e}");
            }
        }
        (Ok(()), Expect::Err(_)) => panic!("{case}: accepted"),
        (Err(e), Expect::Ok) => panic!("{case}: refused: {e}"),
    }
}

type Build = Box<dyn Fn(&Path) -> PathBuf>;

/// Plants files in (the test's root, the folder under test).
type Prepare = Box<dyn Fn(&Path, &Path)>;

/// A case with a JSON index: name, index, what to plant, expectation.
type IndexCase = (&'static str, serde_json::Value, Prepare, Expect);

#[test]
fn hostile_safetensors_headers() {
    let t = |name: &str, offsets: &str| {
        format!(r#""{name}":{{"dtype":"U8","shape":[4],"data_offsets":{offsets}}}"#)
    };
    let cases: Vec<(&str, Build, Expect)> = vec![
        (
            "header length past the end of the file",
            Box::new(|d| st(d, "m.safetensors", "{}", &[], Some(1 << 20))),
            Expect::Err(&["header length 1048576 is larger than the file"]),
        ),
        (
            "header length beyond the limit",
            Box::new(|d| st(d, "m.safetensors", "{}", &[], Some(u64::MAX))),
            Expect::Err(&["exceeds the 100000000-byte limit"]),
        ),
        (
            "a file shorter than the length prefix",
            Box::new(|d| {
                let p = d.join("m.safetensors");
                std::fs::write(&p, [1, 2, 3]).unwrap();
                p
            }),
            Expect::Err(&["too short"]),
        ),
        (
            "a tensor given twice",
            Box::new(move |d| {
                let json = format!("{{{},{}}}", t("a", "[0,4]"), t("a", "[4,8]"));
                st(d, "m.safetensors", &json, &[0; 8], None)
            }),
            Expect::Err(&["tensor \"a\" appears twice"]),
        ),
        (
            "__metadata__ given twice",
            Box::new(one(
                r#"{"__metadata__":{"a":"b"},"__metadata__":{"a":"b"}}"#,
                0,
            )),
            Expect::Err(&["`__metadata__` appears twice"]),
        ),
        (
            "a __metadata__ key given twice",
            Box::new(one(r#"{"__metadata__":{"a":"b","a":"c"}}"#, 0)),
            Expect::Err(&["`__metadata__` key \"a\" appears twice"]),
        ),
        (
            "a field given twice",
            Box::new(one(
                r#"{"w":{"dtype":"U8","dtype":"U8","shape":[1],"data_offsets":[0,1]}}"#,
                1,
            )),
            Expect::Err(&["tensor \"w\": `dtype` appears twice"]),
        ),
        (
            "negative offsets",
            Box::new(move |d| {
                let json = format!("{{{}}}", t("w", "[-4,0]"));
                st(d, "m.safetensors", &json, &[0; 4], None)
            }),
            Expect::Err(&[
                "tensor \"w\"",
                "`data_offsets` must be two non-negative integers, found [-4,0]",
            ]),
        ),
        (
            "float offsets",
            Box::new(move |d| {
                let json = format!("{{{}}}", t("w", "[0.0,4.0]"));
                st(d, "m.safetensors", &json, &[0; 4], None)
            }),
            Expect::Err(&["`data_offsets` must be two non-negative integers"]),
        ),
        (
            "offsets beyond 64 bits",
            Box::new(move |d| {
                let json = format!("{{{}}}", t("w", "[0,18446744073709551616]"));
                st(d, "m.safetensors", &json, &[0; 4], None)
            }),
            Expect::Err(&["`data_offsets` must be two non-negative integers"]),
        ),
        (
            "three offsets",
            Box::new(move |d| {
                let json = format!("{{{}}}", t("w", "[0,4,8]"));
                st(d, "m.safetensors", &json, &[0; 4], None)
            }),
            Expect::Err(&["`data_offsets` must be two"]),
        ),
        (
            "overlapping tensors",
            Box::new(move |d| {
                let json = format!("{{{},{}}}", t("a", "[0,4]"), t("b", "[2,6]"));
                st(d, "m.safetensors", &json, &[0; 6], None)
            }),
            Expect::Err(&["\"a\" (bytes 0..4) and \"b\" (bytes 2..6) overlap"]),
        ),
        (
            "empty tensors sharing an offset",
            Box::new(one(
                r#"{"a":{"dtype":"F32","shape":[0],"data_offsets":[0,0]},"b":{"dtype":"F16","shape":[0,5],"data_offsets":[0,0]},"c":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}"#,
                1,
            )),
            Expect::Ok,
        ),
        (
            "a shape whose product overflows",
            Box::new(one(
                r#"{"w":{"dtype":"F64","shape":[4294967296,4294967296,4294967296],"data_offsets":[0,0]}}"#,
                0,
            )),
            Expect::Err(&["tensor \"w\"", "overflows"]),
        ),
        (
            "a huge shape the offsets do not cover",
            Box::new(one(
                r#"{"w":{"dtype":"F32","shape":[1000000,1000000],"data_offsets":[0,4]}}"#,
                4,
            )),
            Expect::Err(&["needs 4000000000000"]),
        ),
        (
            "a header that is not UTF-8",
            Box::new(|d| {
                let mut json = b"{\"w".to_vec();
                json.push(0xff);
                json.extend_from_slice(br#"":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}"#);
                json.resize(json.len().next_multiple_of(8), b' ');
                let mut bytes = (json.len() as u64).to_le_bytes().to_vec();
                bytes.extend_from_slice(&json);
                bytes.push(0);
                let p = d.join("m.safetensors");
                std::fs::write(&p, bytes).unwrap();
                p
            }),
            Expect::Err(&["not UTF-8 (invalid byte at header offset 3)"]),
        ),
        (
            "__metadata__ that is a list",
            Box::new(one(r#"{"__metadata__":["format","pt"]}"#, 0)),
            Expect::Err(&[
                "`__metadata__` must be an object of strings, found [\"format\",\"pt\"]",
            ]),
        ),
        (
            "__metadata__ with a nested object",
            Box::new(one(r#"{"__metadata__":{"format":{"pt":1}}}"#, 0)),
            Expect::Err(&["`__metadata__` key \"format\" must map to a string, found {\"pt\":1}"]),
        ),
        (
            "nesting 1000 levels deep in an ignored field",
            Box::new(|d| {
                let json = format!(
                    r#"{{"w":{{"x":{}{},"dtype":"U8","shape":[1],"data_offsets":[0,1]}}}}"#,
                    "[".repeat(1000),
                    "]".repeat(1000)
                );
                st(d, "m.safetensors", &json, &[0], None)
            }),
            Expect::Err(&["not valid JSON", "nesting 128 levels deep or more"]),
        ),
        (
            "an unknown field, ignored as safetensors ignores it",
            Box::new(one(
                r#"{"w":{"x":[{"y":null}],"dtype":"U8","shape":[1],"data_offsets":[0,1]}}"#,
                1,
            )),
            Expect::Ok,
        ),
        (
            "a dtype that is a number",
            Box::new(one(
                r#"{"w":{"dtype":7,"shape":[1],"data_offsets":[0,1]}}"#,
                1,
            )),
            Expect::Err(&["tensor \"w\": `dtype` must be a string, found 7"]),
        ),
        (
            "a name with a NUL escape and a surrogate pair",
            Box::new(one(
                r#"{"a\u0000b\ud83d\ude00":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}"#,
                1,
            )),
            Expect::Ok,
        ),
        (
            "a lone surrogate in a name",
            Box::new(one(
                r#"{"a\ud83d":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}"#,
                1,
            )),
            Expect::Err(&["not valid JSON", "surrogate"]),
        ),
        (
            "garbage after the header object",
            Box::new(one(r#"{} {}"#, 0)),
            Expect::Err(&["not valid JSON: trailing characters at byte 3"]),
        ),
        (
            "a header that is a list",
            Box::new(one("[1,2]", 0)),
            Expect::Err(&["not a JSON object"]),
        ),
        ("an empty header object", Box::new(one("{}", 0)), Expect::Ok),
        (
            "an empty name",
            Box::new(one(
                r#"{"":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}"#,
                1,
            )),
            Expect::Ok,
        ),
    ];
    for (case, build, expect) in cases {
        let dir = tempfile::tempdir().unwrap();
        let path = build(dir.path());
        let result = Checkpoint::open(&path)
            .map(|_| ())
            .map_err(|e| e.to_string());
        check(case, result, &expect, &path);
    }
}

/// A folder holding `s1.safetensors` (tensor `a`) and an index written by
/// `index`, after `prepare` has planted whatever it plants.
fn index_case(
    dir: &Path,
    weight_map: serde_json::Value,
    prepare: &dyn Fn(&Path, &Path),
) -> PathBuf {
    let ckpt = dir.join("ckpt");
    std::fs::create_dir(&ckpt).unwrap();
    st(
        &ckpt,
        "s1.safetensors",
        r#"{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}"#,
        &[1],
        None,
    );
    prepare(dir, &ckpt);
    let index = ckpt.join("model.safetensors.index.json");
    std::fs::write(&index, json!({"weight_map": weight_map}).to_string()).unwrap();
    index
}

fn mkfifo(path: &Path) -> bool {
    let made = std::process::Command::new("mkfifo").arg(path).status();
    made.is_ok_and(|s| s.success())
}

#[cfg(unix)]
#[test]
fn hostile_indexes() {
    use std::os::unix::fs::symlink;
    let nothing = |_: &Path, _: &Path| {};
    let cases: Vec<IndexCase> = vec![
        (
            "a shard that is a folder",
            json!({"a": "s1.safetensors", "b": "sub"}),
            Box::new(|_, c| std::fs::create_dir(c.join("sub")).unwrap()),
            Expect::Err(&["tensor \"b\" names shard \"sub\", which is a folder, not a file"]),
        ),
        (
            "a shard that is a FIFO",
            json!({"a": "s1.safetensors", "b": "pipe.safetensors"}),
            Box::new(|_, c| assert!(mkfifo(&c.join("pipe.safetensors")))),
            Expect::Err(&["\"pipe.safetensors\", which is a FIFO, not a file"]),
        ),
        (
            "a shard that is absent",
            json!({"a": "s1.safetensors", "b": "gone.safetensors"}),
            Box::new(nothing),
            Expect::Err(&["\"gone.safetensors\", which does not exist"]),
        ),
        (
            "a shard that is a dangling link",
            json!({"a": "s1.safetensors", "b": "dangling.safetensors"}),
            Box::new(|_, c| symlink("nowhere", c.join("dangling.safetensors")).unwrap()),
            Expect::Err(&["which is a symbolic link to nothing"]),
        ),
        (
            "a shard linked out of the folder",
            json!({"a": "s1.safetensors", "b": "out.safetensors"}),
            Box::new(|d, c| {
                std::fs::write(d.join("secret"), b"not a checkpoint").unwrap();
                symlink(d.join("secret"), c.join("out.safetensors")).unwrap();
            }),
            Expect::Err(&["outside the folder", "refusing to read it"]),
        ),
        (
            "a shard in a linked folder leading out",
            json!({"a": "s1.safetensors", "b": "sub/x.safetensors"}),
            Box::new(|d, c| {
                std::fs::create_dir(d.join("elsewhere")).unwrap();
                std::fs::write(d.join("elsewhere/x.safetensors"), b"x").unwrap();
                symlink(d.join("elsewhere"), c.join("sub")).unwrap();
            }),
            Expect::Err(&["outside the folder"]),
        ),
        (
            "an absolute shard path",
            json!({"a": "/etc/passwd"}),
            Box::new(nothing),
            Expect::Err(&["is an absolute path; refusing to read it"]),
        ),
        (
            "a shard path climbing out",
            json!({"a": "sub/../../s1.safetensors"}),
            Box::new(nothing),
            Expect::Err(&["contains `..`"]),
        ),
        (
            "the same file spelled two ways",
            json!({"a": "./s1.safetensors", "b": "s1.safetensors"}),
            Box::new(|_, c| {
                st(
                    c,
                    "s1.safetensors",
                    r#"{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"b":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}"#,
                    &[1, 2],
                    None,
                );
            }),
            Expect::Ok,
        ),
        (
            "two links to one file",
            json!({"a": "s1.safetensors", "b": "alias.safetensors"}),
            Box::new(|_, c| {
                st(
                    c,
                    "s1.safetensors",
                    r#"{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"b":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}"#,
                    &[1, 2],
                    None,
                );
                symlink("s1.safetensors", c.join("alias.safetensors")).unwrap();
            }),
            Expect::Ok,
        ),
        (
            "a weight_map value that is a number",
            json!({"a": 1}),
            Box::new(nothing),
            Expect::Err(&["tensor \"a\" maps to 1, expected a shard file name"]),
        ),
        (
            "an empty shard name",
            json!({"a": ""}),
            Box::new(nothing),
            Expect::Err(&["which is empty"]),
        ),
        (
            "a shard name of `.`",
            json!({"a": "."}),
            Box::new(nothing),
            Expect::Err(&["which names no file"]),
        ),
    ];
    for (case, map, prepare, expect) in cases {
        let dir = tempfile::tempdir().unwrap();
        let index = index_case(dir.path(), map, &*prepare);
        let result = Checkpoint::open(&index)
            .map(|_| ())
            .map_err(|e| e.to_string());
        check(case, result, &expect, &index);
    }
    // A weight_map listing a tensor twice (JSON parsers keep one silently).
    let dir = tempfile::tempdir().unwrap();
    let index = index_case(dir.path(), json!({}), &nothing);
    std::fs::write(
        &index,
        r#"{"weight_map":{"a":"s1.safetensors","a":"s1.safetensors"}}"#,
    )
    .unwrap();
    let e = Checkpoint::open(&index).unwrap_err().to_string();
    assert!(e.contains("tensor \"a\" is listed twice"), "{e}");
}

/// An offload folder with `index.json` = `index`, after `prepare`.
fn offload_case(dir: &Path, index: serde_json::Value, prepare: &dyn Fn(&Path, &Path)) -> PathBuf {
    let folder = dir.join("offload");
    std::fs::create_dir(&folder).unwrap();
    prepare(dir, &folder);
    std::fs::write(folder.join("index.json"), index.to_string()).unwrap();
    folder
}

#[cfg(unix)]
#[test]
fn hostile_offload_folders() {
    use std::os::unix::fs::symlink;
    let w4 = |_: &Path, f: &Path| std::fs::write(f.join("w.dat"), [0u8; 16]).unwrap();
    let cases: Vec<IndexCase> = vec![
        (
            "a plain entry",
            json!({"w": {"dtype": "float32", "shape": [4]}}),
            Box::new(w4),
            Expect::Ok,
        ),
        (
            "a shape whose size overflows",
            json!({"w": {"dtype": "float32", "shape": [u64::MAX, 4]}}),
            Box::new(w4),
            Expect::Err(&["entry \"w\"", "overflows"]),
        ),
        (
            "an absurd shape",
            json!({"w": {"dtype": "float32", "shape": [1_000_000_000, 1_000_000]}}),
            Box::new(w4),
            Expect::Err(&["w.dat holds 16 bytes", "needs 4000000000000000"]),
        ),
        (
            "a negative dimension",
            json!({"w": {"dtype": "float32", "shape": [-4]}}),
            Box::new(w4),
            Expect::Err(&["`shape` must be a list of non-negative integers, found [-4]"]),
        ),
        (
            "a .dat shorter than its entry",
            json!({"w": {"dtype": "float32", "shape": [8]}}),
            Box::new(w4),
            Expect::Err(&["w.dat holds 16 bytes", "needs 32"]),
        ),
        (
            "a .dat linked out of the folder",
            json!({"w": {"dtype": "float32", "shape": [4]}}),
            Box::new(|d, f| {
                std::fs::write(d.join("passwd"), [0u8; 16]).unwrap();
                symlink(d.join("passwd"), f.join("w.dat")).unwrap();
            }),
            Expect::Err(&[
                "w.dat resolves to",
                "outside the folder",
                "refusing to read it",
            ]),
        ),
        (
            "a .dat that is a FIFO",
            json!({"w": {"dtype": "float32", "shape": [4]}}),
            Box::new(|_, f| assert!(mkfifo(&f.join("w.dat")))),
            Expect::Err(&["w.dat is a FIFO, not a file"]),
        ),
        (
            "a .dat that is absent",
            json!({"w": {"dtype": "float32", "shape": [4]}}),
            Box::new(|_, _| {}),
            Expect::Err(&["w.dat does not exist"]),
        ),
        (
            "an entry name with a separator",
            json!({"../w": {"dtype": "float32", "shape": [4]}}),
            Box::new(w4),
            Expect::Err(&["contains a path separator"]),
        ),
        (
            "safetensors_file naming a system file",
            json!({"w": {"safetensors_file": "/etc/passwd", "weight_name": "w"}}),
            Box::new(|_, _| {}),
            Expect::Err(&[
                "safetensors_file \"/etc/passwd\", which is not a *.safetensors file; refusing to read it",
            ]),
        ),
        (
            "safetensors_file linked out of its folder",
            json!({"w": {"safetensors_file": "LINK", "weight_name": "w"}}),
            Box::new(|_, _| {}),
            Expect::Err(&["outside the folder", "refusing to read it"]),
        ),
        (
            "safetensors_file climbing with `..`",
            json!({"w": {"safetensors_file": "a/../b.safetensors"}}),
            Box::new(|_, _| {}),
            Expect::Err(&["contains `..`"]),
        ),
        (
            "an unknown dtype",
            json!({"w": {"dtype": "float31", "shape": [4]}}),
            Box::new(w4),
            Expect::Err(&["entry \"w\": unknown dtype \"float31\""]),
        ),
        (
            "an entry that is a string",
            json!({"w": "w.dat"}),
            Box::new(w4),
            Expect::Err(&["entry \"w\": expected an object, found \"w.dat\""]),
        ),
    ];
    for (case, index, prepare, expect) in cases {
        let dir = tempfile::tempdir().unwrap();
        // The out-of-folder link case needs a path known only here.
        let index = if index["w"]["safetensors_file"] == "LINK" {
            let ckpt = dir.path().join("ckpt");
            std::fs::create_dir(&ckpt).unwrap();
            std::fs::write(dir.path().join("passwd"), b"root:x:0:0").unwrap();
            symlink(dir.path().join("passwd"), ckpt.join("m.safetensors")).unwrap();
            json!({"w": {"safetensors_file": ckpt.join("m.safetensors"), "weight_name": "w"}})
        } else {
            index
        };
        let folder = offload_case(dir.path(), index, &*prepare);
        let result = OffloadFolder::open(&folder)
            .map(|_| ())
            .map_err(|e| e.to_string());
        // A refused file is never read: its bytes never show as a header
        // length.
        if let Err(e) = &result {
            assert!(!e.contains("header length"), "{case}: {e}");
        }
        check(case, result, &expect, &folder);
    }
    // An entry given twice.
    let dir = tempfile::tempdir().unwrap();
    let folder = offload_case(dir.path(), json!({}), &w4);
    std::fs::write(
        folder.join("index.json"),
        r#"{"w":{"dtype":"float32","shape":[4]},"w":{"dtype":"float32","shape":[4]}}"#,
    )
    .unwrap();
    let e = OffloadFolder::open(&folder).unwrap_err().to_string();
    assert!(e.contains("entry \"w\" appears twice"), "{e}");
}
