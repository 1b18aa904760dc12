//! Opening a PyTorch checkpoint reads its zip directory and its pickle and
//! nothing else, on a sparse archive of 5 GiB that needs zip64 records (the
//! format torch writes past 4 GiB): shown by the process's own I/O and
//! memory counters, no timing. The only test in this binary, so no other
//! test's I/O counts.

#![cfg(target_os = "linux")]

use std::fs::File;
use std::io::{Seek, SeekFrom, Write};
use std::path::Path;

use bm_shard::Checkpoint;

const GIB: u64 = 1 << 30;

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

/// A zip local header for a STORED record of `len` bytes (zip64 sizes in
/// the central directory only, as torch's writer puts them).
fn local_header(out: &mut File, name: &str, len: u64) {
    out.write_all(&0x0403_4b50u32.to_le_bytes()).unwrap();
    out.write_all(&[45, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0])
        .unwrap(); // version, flags, method, time, date, crc
    let size = u32::try_from(len).unwrap_or(u32::MAX);
    out.write_all(&size.to_le_bytes()).unwrap();
    out.write_all(&size.to_le_bytes()).unwrap();
    out.write_all(&(name.len() as u16).to_le_bytes()).unwrap();
    out.write_all(&0u16.to_le_bytes()).unwrap();
    out.write_all(name.as_bytes()).unwrap();
}

/// Writes `archive/data.pkl` (the pickle of one 5 GiB uint8 tensor, made by
/// tools/make_torch_bin_fixtures.py) and a sparse 5 GiB `archive/data/0`.
fn write_sparse_archive(path: &Path) -> u64 {
    let pickle = std::fs::read(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/torch/u8_5gib.pkl"),
    )
    .unwrap();
    let storage = 5 * GIB;
    let mut out = File::create(path).unwrap();
    let mut central = Vec::new();
    let records: [(&str, u64); 2] = [
        ("archive/data.pkl", pickle.len() as u64),
        ("archive/data/0", storage),
    ];
    for (name, len) in records {
        let offset = out.stream_position().unwrap();
        local_header(&mut out, name, len);
        if name.ends_with("data.pkl") {
            out.write_all(&pickle).unwrap();
        } else {
            out.seek(SeekFrom::Current(len as i64)).unwrap(); // a hole
        }
        let mut extra = 1u16.to_le_bytes().to_vec();
        extra.extend_from_slice(&24u16.to_le_bytes());
        for v in [len, len, offset] {
            extra.extend_from_slice(&v.to_le_bytes());
        }
        central.extend_from_slice(&0x0201_4b50u32.to_le_bytes());
        central.extend_from_slice(&[45, 0, 45, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
        central.extend_from_slice(&[0xff; 8]); // sizes: in the zip64 field
        central.extend_from_slice(&(name.len() as u16).to_le_bytes());
        central.extend_from_slice(&(extra.len() as u16).to_le_bytes());
        central.extend_from_slice(&[0; 10]);
        central.extend_from_slice(&[0xff; 4]); // offset: in the zip64 field
        central.extend_from_slice(name.as_bytes());
        central.extend_from_slice(&extra);
    }
    let cd_offset = out.stream_position().unwrap();
    out.write_all(&central).unwrap();
    let eocd64 = out.stream_position().unwrap();
    out.write_all(&0x0606_4b50u32.to_le_bytes()).unwrap();
    out.write_all(&44u64.to_le_bytes()).unwrap();
    out.write_all(&[45, 0, 45, 0, 0, 0, 0, 0, 0, 0, 0, 0])
        .unwrap();
    for v in [2u64, 2, central.len() as u64, cd_offset] {
        out.write_all(&v.to_le_bytes()).unwrap();
    }
    out.write_all(&0x0706_4b50u32.to_le_bytes()).unwrap();
    out.write_all(&0u32.to_le_bytes()).unwrap();
    out.write_all(&eocd64.to_le_bytes()).unwrap();
    out.write_all(&1u32.to_le_bytes()).unwrap();
    out.write_all(&0x0605_4b50u32.to_le_bytes()).unwrap();
    out.write_all(&[0, 0, 0, 0, 2, 0, 2, 0]).unwrap();
    out.write_all(&(central.len() as u32).to_le_bytes())
        .unwrap();
    out.write_all(&[0xff; 4]).unwrap();
    out.write_all(&[0, 0]).unwrap();
    out.stream_position().unwrap()
}

#[test]
fn open_reads_only_the_directory_and_pickle_of_a_sparse_5_gib_zip64_archive() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("pytorch_model.bin");
    let file_len = write_sparse_archive(&path);
    assert!(file_len > 5 * GIB);

    let read_before = proc_field("io", "rchar:");
    let rss_file_before = proc_field("status", "RssFile:");
    let ckpt = Checkpoint::open(dir.path()).unwrap();
    let view = ckpt.view("big").unwrap();
    let read = proc_field("io", "rchar:") - read_before;
    let rss_file_growth_kb = proc_field("status", "RssFile:").saturating_sub(rss_file_before);

    assert_eq!(ckpt.meta("big").unwrap().shape, [5 << 30]);
    assert_eq!(view.len() as u64, 5 * GIB);
    assert!(view.file_offset() > 0 && (view.file_offset() as u64) < 1024);
    assert_eq!(ckpt.total_bytes(), 5 * GIB);
    // The format sniff reads 262 bytes; directory and pickle come through
    // the mapping. Slack for the /proc reads themselves.
    assert!(read < 64 * 1024, "read {read} bytes");
    assert!(
        rss_file_growth_kb < 4096,
        "file-backed RSS grew by {rss_file_growth_kb} kB"
    );
    // The hole reads as zeros at its far end.
    assert_eq!(&view.as_bytes()[(5 << 30) - 4..], &[0; 4]);
}
