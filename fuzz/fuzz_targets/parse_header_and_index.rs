//! Any bytes, as a safetensors file and as an index: the parsers must
//! return `Ok` or an `Err` naming the file, never panic, and an accepted
//! header must describe tensors that tile its data buffer.
//!
//! Run with `cargo +nightly fuzz run parse_header_and_index` from `fuzz/`.

#![no_main]

use std::path::Path;

use bm_shard::{Header, Index};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let path = Path::new("fuzz.safetensors");
    match Header::parse(path, data) {
        Ok(header) => {
            let data_len = data.len() as u64 - header.data_start();
            let mut covered = 0;
            for t in &header.tensors {
                assert_eq!(t.data_offsets.0, covered);
                assert_eq!(t.data_offsets.1 - t.data_offsets.0, t.meta.byte_len() as u64);
                covered = t.data_offsets.1;
            }
            assert_eq!(covered, data_len);
        }
        Err(e) => assert!(e.to_string().contains("fuzz.safetensors")),
    }
    match Index::parse(Path::new("fuzz.index.json"), data) {
        Ok(index) => {
            for (_, file) in &index.weight_map {
                assert!(!file.contains("..") || !file.split(['/', '\\']).any(|p| p == ".."));
                assert!(!Path::new(file).is_absolute());
            }
        }
        Err(e) => assert!(e.to_string().contains("fuzz.index.json")),
    }
});
