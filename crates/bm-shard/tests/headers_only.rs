//! Opening a checkpoint reads its headers and nothing else: shown on a
//! sparse 64 GiB file by the process's own I/O and memory counters (no
//! timing). The only test in this binary, so no other test's I/O counts.

#![cfg(target_os = "linux")]

use std::io::Write;

use bm_shard::Checkpoint;

/// A field of a `/proc/self/*` file, in the unit it is written in.
fn proc_field(file: &str, key: &str) -> u64 {
    let text = std::fs::read_to_string(format!("/proc/self/{file}")).unwrap();
    let line = text
        .lines()
        .find(|l| l.starts_with(key))
        .unwrap_or_else(|| panic!("{key} not in /proc/self/{file}"));
    line[key.len()..]
        .trim()
        .trim_end_matches(" kB")
        .parse()
        .unwrap()
}

#[test]
fn open_reads_only_headers_of_a_sparse_64_gib_file() {
    const TENSORS: u64 = 64;
    const GIB: u64 = 1 << 30;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("huge.safetensors");
    let entries: Vec<String> = (0..TENSORS)
        .map(|i| {
            format!(
                r#""layers.{i}.weight":{{"dtype":"BF16","shape":[32768,16384],"data_offsets":[{},{}]}}"#,
                i * GIB,
                (i + 1) * GIB
            )
        })
        .collect();
    let json = format!("{{{}}}", entries.join(","));
    let mut file = std::fs::File::create(&path).unwrap();
    file.write_all(&(json.len() as u64).to_le_bytes()).unwrap();
    file.write_all(json.as_bytes()).unwrap();
    file.set_len(8 + json.len() as u64 + TENSORS * GIB).unwrap();
    drop(file);

    let read_before = proc_field("io", "rchar:");
    let rss_file_before = proc_field("status", "RssFile:");
    let ckpt = Checkpoint::open(&path).unwrap();
    let total: u64 = ckpt.tensors().map(|(_, m)| m.byte_len() as u64).sum();
    let views: Vec<_> = ckpt.tensors().map(|(n, _)| ckpt.view(n).unwrap()).collect();
    let read = proc_field("io", "rchar:") - read_before;
    let rss_file_growth_kb = proc_field("status", "RssFile:").saturating_sub(rss_file_before);

    assert_eq!(total, TENSORS * GIB);
    assert_eq!(views.len(), TENSORS as usize);
    // The 8-byte prefix and the JSON, plus slack for /proc reads themselves.
    assert!(
        read < 8 + json.len() as u64 + 64 * 1024,
        "read {read} bytes for a {}-byte header",
        json.len()
    );
    // Touching the mapping would bring file pages in; none were.
    assert!(
        rss_file_growth_kb < 4096,
        "file-backed RSS grew by {rss_file_growth_kb} kB"
    );
}
