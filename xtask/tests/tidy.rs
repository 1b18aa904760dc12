//! Tidy: the architecture invariants of docs/ARCHITECTURE.md, checked by
//! reading the workspace's `Cargo.toml` files and sources as text
//! (rust-analyzer's `tidy` tests). Runs in `cargo test --workspace`.
//!
//! * the bm-* library crates (and the `bigmodel` facade) depend only on
//!   each other and the chosen set of crates, plus the exceptions listed
//!   with their reason;
//! * only bm-device names cudarc, only its `cuda` module does it in code,
//!   and only its `lib.rs` looks at the `cuda` feature;
//! * bm-tensor and bm-json are leaves, and neither bm-plan nor bm-shard
//!   reaches bm-device, directly or through another crate, whatever the
//!   features;
//! * the code map of docs/ARCHITECTURE.md lists every edge between the
//!   workspace's crates;
//! * every source file opens with a `//!` doc comment;
//! * every `unsafe` block and `unsafe impl` has a `SAFETY:` comment;
//! * the README and docs/ link only inside the repository.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// What every bm-* library crate may depend on (crates.io).
const CHOSEN: &[&str] = &[
    "cudarc",
    "half",
    "safetensors",
    "memmap2",
    "bytemuck",
    "serde_json",
    "parking_lot",
];

/// Dependencies beyond the chosen set, per crate, and why.
const EXCEPTIONS: &[(&str, &str, &str)] = &[
    (
        "bm-compute",
        "gemm",
        "CPU matrix products: SIMD GEMM kernels we would otherwise write",
    ),
    (
        "bm-compute",
        "rayon",
        "threads for the CPU kernels (gemm's own parallelism uses it)",
    ),
    (
        "bm-models",
        "tokenizers",
        "reading Hugging Face tokenizer.json the way transformers does",
    ),
    (
        "bm-models",
        "fancy-regex",
        "transformers' module-name patterns (regexes with look-around)",
    ),
    (
        "bm-models",
        "minijinja",
        "rendering the Jinja chat templates of tokenizer_config.json as transformers does",
    ),
    (
        "bm-models",
        "minijinja-contrib",
        "Python's str and dict methods, which chat templates call, for minijinja",
    ),
];

/// What the library crates' tests and benches may use besides the above.
const DEV_ONLY: &[(&str, &str)] = &[
    ("tempfile", "temporary folders for tests"),
    ("criterion", "the benches"),
];

/// The library crates of the stack: every `bm-*` member, and the facade.
fn libraries(members: &BTreeMap<String, String>) -> Vec<String> {
    members
        .keys()
        .filter(|name| name.starts_with("bm-") || *name == "bigmodel")
        .cloned()
        .collect()
}

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives in the workspace")
        .to_path_buf()
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// One dependency entry of a manifest.
#[derive(Debug)]
struct Dep {
    name: String,
    /// `dependencies`, `dev-dependencies` or `build-dependencies`.
    kind: String,
}

/// The dependencies a `Cargo.toml` declares, in every dependency table
/// (`[dependencies]`, `[dev-dependencies]`, target-specific ones, and the
/// `[dependencies.name]` form).
fn dependencies(manifest: &str) -> Vec<Dep> {
    let mut deps = Vec::new();
    let mut table: Option<String> = None;
    for line in manifest.lines().map(str::trim) {
        if line.starts_with('[') {
            let header = line.trim_matches(['[', ']']).to_string();
            let parts: Vec<&str> = header.split('.').collect();
            let kind = parts
                .iter()
                .find(|p| p.ends_with("dependencies"))
                .map(|p| p.to_string());
            table = None;
            if let Some(kind) = kind {
                let last = parts.last().copied().unwrap_or_default();
                if last.ends_with("dependencies") {
                    table = Some(kind);
                } else if !header.starts_with("workspace") {
                    // [dependencies.name]
                    deps.push(Dep {
                        name: last.to_string(),
                        kind,
                    });
                }
            }
            continue;
        }
        let Some(kind) = &table else { continue };
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let name: String = line
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '-' || *c == '_')
            .collect();
        if !name.is_empty() {
            deps.push(Dep {
                name,
                kind: kind.clone(),
            });
        }
    }
    deps
}

/// Every workspace member's name and manifest, read from the root manifest.
fn members() -> BTreeMap<String, String> {
    let root = root();
    let manifest = read(&root.join("Cargo.toml"));
    let start = manifest
        .find("members = [")
        .expect("the root manifest lists members");
    let list = &manifest[start..start + manifest[start..].find(']').expect("a closed list")];
    list.split('"')
        .skip(1)
        .step_by(2)
        .map(|dir| {
            let text = read(&root.join(dir).join("Cargo.toml"));
            let name = text
                .lines()
                .find_map(|l| l.trim().strip_prefix("name = \""))
                .and_then(|l| l.strip_suffix('"'))
                .unwrap_or_else(|| panic!("{dir}/Cargo.toml has no name"))
                .to_string();
            (name, text)
        })
        .collect()
}

#[test]
fn library_crates_depend_only_on_the_chosen_set() {
    let members = members();
    let mut problems = Vec::new();
    let libs = libraries(&members);
    assert!(libs.len() >= 8, "found only the library crates {libs:?}");
    for lib in &libs {
        for dep in dependencies(&members[lib]) {
            let name = dep.name.as_str();
            let allowed = members.contains_key(name)
                || CHOSEN.contains(&name)
                || EXCEPTIONS.iter().any(|(c, d, _)| c == lib && *d == name)
                || (dep.kind == "dev-dependencies" && DEV_ONLY.iter().any(|(d, _)| *d == name));
            if !allowed {
                problems.push(format!(
                    "{lib} depends on {name} ({}): not in the chosen set; add it to EXCEPTIONS \
                     with the reason, or drop it",
                    dep.kind
                ));
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// The workspace crates `name` depends on (normal and build dependencies,
/// optional ones included: features only forward), transitively.
fn workspace_closure(members: &BTreeMap<String, String>, name: &str) -> BTreeSet<String> {
    let mut seen = BTreeSet::new();
    let mut todo = vec![name.to_string()];
    while let Some(crate_name) = todo.pop() {
        for dep in dependencies(&members[&crate_name]) {
            if dep.kind != "dev-dependencies"
                && members.contains_key(&dep.name)
                && seen.insert(dep.name.clone())
            {
                todo.push(dep.name);
            }
        }
    }
    seen
}

#[test]
fn bm_tensor_is_a_leaf_and_the_pure_crates_never_reach_a_device() {
    let members = members();
    for leaf in ["bm-tensor", "bm-json"] {
        assert!(
            workspace_closure(&members, leaf).is_empty(),
            "{leaf} must depend on no workspace crate"
        );
    }
    for pure in ["bm-tensor", "bm-shard", "bm-plan"] {
        let closure = workspace_closure(&members, pure);
        assert!(
            !closure.contains("bm-device"),
            "{pure} reaches bm-device through {closure:?}"
        );
        for c in std::iter::once(pure.to_string()).chain(closure) {
            assert!(
                !dependencies(&members[&c])
                    .iter()
                    .any(|d| d.name == "cudarc"),
                "{pure} reaches cudarc through {c}"
            );
        }
    }
}

#[test]
fn the_code_map_table_lists_every_workspace_edge() {
    let members = members();
    let doc = read(&root().join("docs/ARCHITECTURE.md"));
    let mut listed: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for row in doc.lines().filter(|l| l.starts_with("| `")) {
        let cells: Vec<&str> = row.split('|').map(str::trim).collect();
        let uses: BTreeSet<String> = cells[2]
            .split([',', '('])
            .map(str::trim)
            .filter(|w| members.contains_key(*w))
            .map(str::to_string)
            .collect();
        for name in cells[1].split(", ") {
            listed.insert(name.trim_matches('`').to_string(), uses.clone());
        }
    }
    let mut crates = libraries(&members);
    crates.push("bigmodel-cli".to_string());
    for name in &crates {
        let actual: BTreeSet<String> = dependencies(&members[name])
            .into_iter()
            .filter(|d| d.kind != "dev-dependencies" && members.contains_key(&d.name))
            .map(|d| d.name)
            .collect();
        assert_eq!(
            listed.get(name),
            Some(&actual),
            "docs/ARCHITECTURE.md's code map row for {name} does not match its Cargo.toml"
        );
    }
}

/// Every `.rs` file of the workspace's crates, tests, benches, examples,
/// xtask and fuzz targets.
fn sources() -> Vec<PathBuf> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        let Ok(entries) = std::fs::read_dir(dir) else {
            return;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            let name = entry.file_name();
            if path.is_dir() {
                if name != "target"
                    && name != "fixtures"
                    && !name.to_string_lossy().starts_with('.')
                {
                    walk(&path, out);
                }
            } else if path.extension().is_some_and(|e| e == "rs") {
                out.push(path);
            }
        }
    }
    let root = root();
    let mut out = Vec::new();
    for dir in ["crates", "benches", "xtask", "fuzz"] {
        walk(&root.join(dir), &mut out);
    }
    out.sort();
    assert!(out.len() > 50, "found only {} sources", out.len());
    out
}

/// `line` without its `//` comment, and with string and character
/// literals emptied, so that text in comments and strings is not taken for
/// code.
fn code_of(line: &str) -> String {
    let chars: Vec<char> = line.chars().collect();
    let mut out = String::new();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        let next = chars.get(i + 1).copied();
        match c {
            '/' if next == Some('/') => break,
            // A raw string: r"..." or r#"..."#.
            'r' if matches!(next, Some('"' | '#'))
                && !out.ends_with(|p: char| p.is_alphanumeric() || p == '_') =>
            {
                let hashes = chars[i + 1..].iter().take_while(|&&h| h == '#').count();
                let close: String = std::iter::once('"')
                    .chain("#".repeat(hashes).chars())
                    .collect();
                let body = i + 2 + hashes;
                let rest: String = chars.get(body..).unwrap_or_default().iter().collect();
                out.push_str("\"\"");
                match rest.find(&close) {
                    Some(end) => i = body + rest[..end].chars().count() + close.chars().count(),
                    None => break,
                }
                continue;
            }
            '"' => {
                out.push_str("\"\"");
                i += 1;
                while i < chars.len() && chars[i] != '"' {
                    i += if chars[i] == '\\' { 2 } else { 1 };
                }
            }
            // A character literal ('x', '\n'); a lifetime ('a) is kept.
            '\'' if next == Some('\\') || chars.get(i + 2) == Some(&'\'') => {
                out.push_str("' '");
                i += 1;
                while i < chars.len() && chars[i] != '\'' {
                    i += if chars[i] == '\\' { 2 } else { 1 };
                }
            }
            c => out.push(c),
        }
        i += 1;
    }
    out
}

/// True when `code` has `word` as a whole identifier.
fn has_word(code: &str, word: &str) -> bool {
    code.split(|c: char| !(c.is_alphanumeric() || c == '_'))
        .any(|w| w == word)
}

fn relative(path: &Path) -> String {
    path.strip_prefix(root())
        .unwrap_or(path)
        .display()
        .to_string()
}

#[test]
fn only_bm_device_names_cudarc_and_reads_the_cuda_feature() {
    let members = members();
    for (name, manifest) in &members {
        if name != "bm-device" {
            assert!(
                !dependencies(manifest).iter().any(|d| d.name == "cudarc"),
                "{name} depends on cudarc: only bm-device may"
            );
        }
    }
    let mut problems = Vec::new();
    for path in sources() {
        let rel = relative(&path);
        let cuda_module =
            rel == "crates/bm-device/src/cuda.rs" || rel.starts_with("crates/bm-device/src/cuda/");
        let is_src = rel.starts_with("crates/") && rel.contains("/src/");
        for (i, line) in read(&path).lines().enumerate() {
            let code = code_of(line);
            if has_word(&code, "cudarc") && !cuda_module {
                problems.push(format!(
                    "{rel}:{}: names cudarc outside bm-device's cuda module",
                    i + 1
                ));
            }
            // The feature's name is in a string literal, so look at the line.
            if is_src
                && line.contains("feature = \"cuda\"")
                && !line.trim_start().starts_with("//")
                && rel != "crates/bm-device/src/lib.rs"
            {
                problems.push(format!(
                    "{rel}:{}: reads the cuda feature; only bm-device's lib.rs chooses between \
                     `cuda` and its stand-in",
                    i + 1
                ));
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn every_source_file_opens_with_a_doc_comment() {
    let missing: Vec<String> = sources()
        .into_iter()
        .filter(|path| !read(path).starts_with("//!"))
        .map(|path| relative(&path))
        .collect();
    assert!(
        missing.is_empty(),
        "these files do not open with a `//!` comment saying what they are:\n{}",
        missing.join("\n")
    );
}

/// True when line `at`, or the comment block right above the statement it
/// belongs to, says `SAFETY:`. The statement starts at the first line above
/// that ends the previous one (`;`, `{`, `}` or `,`); attributes may sit
/// between the comment and the code.
fn has_safety_comment(lines: &[&str], at: usize) -> bool {
    if lines[at].contains("SAFETY:") {
        return true;
    }
    let mut in_statement = true;
    for line in lines[..at].iter().rev().map(|l| l.trim()) {
        if line.starts_with("//") {
            if line.contains("SAFETY:") {
                return true;
            }
            in_statement = false;
        } else if line.starts_with("#[") {
            in_statement = false;
        } else if in_statement && !line.is_empty() && !line.ends_with([';', '{', '}', ',']) {
            // The statement goes on above.
        } else {
            return false;
        }
    }
    false
}

#[test]
fn every_unsafe_block_says_why_it_is_sound() {
    let mut problems = Vec::new();
    for path in sources() {
        let text = read(&path);
        let lines: Vec<&str> = text.lines().collect();
        for (i, line) in lines.iter().enumerate() {
            let code = code_of(line);
            let words: Vec<&str> = code
                .split(|c: char| !(c.is_alphanumeric() || c == '_' || c == '{'))
                .filter(|w| !w.is_empty())
                .collect();
            let unsafe_block = words
                .windows(2)
                .any(|w| w[0] == "unsafe" && (w[1].starts_with('{') || w[1] == "impl"))
                || code.trim_end().ends_with("unsafe")
                || code.contains("unsafe{");
            if unsafe_block && !has_safety_comment(&lines, i) {
                problems.push(format!("{}:{}: {}", relative(&path), i + 1, line.trim()));
            }
        }
    }
    assert!(
        problems.is_empty(),
        "these unsafe blocks have no `// SAFETY:` comment saying why they are sound:\n{}",
        problems.join("\n")
    );
}

/// Markdown links and paths in `text` that leave the repository: a user who
/// clones it must be able to read every page it points at.
fn links_outside(text: &str) -> Vec<String> {
    let mut found = Vec::new();
    for (n, line) in text.lines().enumerate() {
        // The workplace's shared folder beside the checkout, and relative
        // links that climb out of the repository's root (from a page at the
        // root or one folder down, two `../` always do).
        let outside = ["../shared", "shared/spec/", "shared/reference/", "](../../"];
        if outside.iter().any(|bad| line.contains(bad)) {
            found.push(format!("line {}: {}", n + 1, line.trim()));
        }
    }
    found
}

#[test]
fn docs_link_only_inside_the_repository() {
    let mut pages = vec![root().join("README.md"), root().join("benches/README.md")];
    for entry in std::fs::read_dir(root().join("docs")).expect("docs/ is there") {
        let path = entry.expect("a docs entry").path();
        if path.extension().is_some_and(|e| e == "md") {
            pages.push(path);
        }
    }
    let mut problems = Vec::new();
    for page in &pages {
        for link in links_outside(&read(page)) {
            problems.push(format!("{}: {link}", relative(page)));
        }
    }
    assert!(
        problems.is_empty(),
        "these docs point outside the repository (copy what they need into docs/):\n{}",
        problems.join("\n")
    );
    assert_eq!(
        links_outside("see [a](../shared/spec/cli.md)\n[b](docs/cli.md)\n[c](../../x)"),
        [
            "line 1: see [a](../shared/spec/cli.md)",
            "line 3: [c](../../x)"
        ]
    );
}

#[test]
fn the_tidy_helpers_read_what_they_should() {
    let deps = dependencies(
        "[package]\nname = \"x\"\n[dependencies]\na.workspace = true\nb = \"1\"\n\
         [target.'cfg(unix)'.dependencies]\nc = \"1\"\n[dependencies.d]\nversion = \"1\"\n\
         [dev-dependencies]\ne = \"1\"\n[features]\nf = []\n",
    );
    let names: Vec<(&str, &str)> = deps
        .iter()
        .map(|d| (d.name.as_str(), d.kind.as_str()))
        .collect();
    assert_eq!(
        names,
        [
            ("a", "dependencies"),
            ("b", "dependencies"),
            ("c", "dependencies"),
            ("d", "dependencies"),
            ("e", "dev-dependencies")
        ]
    );
    assert_eq!(
        code_of(r#"let s = "unsafe { x }"; // unsafe {"#),
        r#"let s = ""; "#
    );
    assert_eq!(
        code_of(r##"f(r#"a"b"#, '"', 'x, "\"")"##),
        r#"f("", ' ', 'x, "")"#
    );
    assert!(has_word("use cudarc::driver;", "cudarc"));
    assert!(!has_word("fn names_cudarc_too()", "cudarc"));
    let lines = [
        "// SAFETY: fine.",
        "#[allow(x)]",
        "unsafe { y }",
        "z();",
        "unsafe { w }",
        "// SAFETY: fine.",
        "self.ctx",
        "    .f(unsafe { v });",
    ];
    assert!(has_safety_comment(&lines, 2));
    assert!(!has_safety_comment(&lines, 4));
    assert!(has_safety_comment(&lines, 7));
}
