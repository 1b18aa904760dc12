//! Any text as a `bigmodel-module-tree/1` document: the reader must return
//! `Ok` or an error naming what is wrong, never panic, and an accepted tree
//! must find every module and tensor by its name.
//!
//! Run with `cargo +nightly fuzz run parse_module_tree` from `fuzz/`.

#![no_main]

use bm_plan::{ModuleTree, Node};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    match ModuleTree::from_json_str(text) {
        Ok(tree) => {
            for (m, module) in tree.modules().iter().enumerate() {
                assert_eq!(tree.find(&module.name), Some(Node::Module(m)));
            }
            for (t, tensor) in tree.tensors().iter().enumerate() {
                assert_eq!(tree.find(&tensor.name), Some(Node::Tensor(t)));
            }
        }
        Err(e) => assert!(e.to_string().starts_with("invalid module tree")),
    }
});
