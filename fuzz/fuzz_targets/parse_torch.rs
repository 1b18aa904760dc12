//! Any bytes, as a PyTorch checkpoint: the zip reader, the legacy-format
//! reader and the restricted unpickler behind both must return `Ok` or an
//! `Err` naming the file, never panic, hang or allocate far beyond the
//! input, and an accepted file must describe tensors whose bytes lie inside
//! it and can be gathered.
//!
//! Inputs starting `PK` reach the zip reader; inputs starting with the
//! legacy prefix `80 02 8a 0a` reach the unpickler directly. Seed the
//! corpus with `crates/bm-shard/tests/fixtures/torch/**/*.bin`.
//!
//! Run with `cargo +nightly fuzz run parse_torch` from `fuzz/`.

#![no_main]

use std::path::Path;

use bm_shard::torch::{gather, parse};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let path = Path::new("fuzz.bin");
    match parse(path, data) {
        Ok(file) => {
            for t in &file.tensors {
                let span = t.span();
                assert!(span.start <= span.end && span.end <= data.len());
                let storage = &file.storages[t.storage];
                assert!(storage.start <= span.start && span.end <= storage.end);
                if let Some(strides) = &t.strides {
                    let mut out = vec![0u8; t.meta.byte_len()];
                    let elem = t.meta.dtype.size_in_bytes();
                    gather(&data[span], &t.meta.shape, strides, elem, &mut out);
                }
            }
        }
        Err(e) => assert!(e.to_string().starts_with("fuzz.bin")),
    }
});
