//! A small DSL to build the module trees of Accelerate's tests.
#![allow(dead_code)] // each test file uses a different part of it

use std::collections::HashMap;

use bm_plan::{Device, MaxMemory, ModuleId, ModuleTree, ModuleTreeBuilder};
use bm_tensor::{DType, TensorMeta};

/// Builds trees by full dotted path; parents must exist.
pub struct Tree {
    b: ModuleTreeBuilder,
    pub dtype: DType,
}

fn split(path: &str) -> (&str, &str) {
    match path.rfind('.') {
        Some(i) => (&path[..i], &path[i + 1..]),
        None => ("", path),
    }
}

impl Tree {
    pub fn new(root_class: &str) -> Self {
        Tree {
            b: ModuleTreeBuilder::new(root_class),
            dtype: DType::F32,
        }
    }

    pub fn module(&mut self, path: &str, class: &str) -> ModuleId {
        let (parent, local) = split(path);
        let parent = self
            .b
            .module_id(parent)
            .unwrap_or_else(|| panic!("no parent for {path}"));
        self.b.add_module(parent, local, class).unwrap()
    }

    pub fn param(&mut self, path: &str, shape: &[usize]) {
        let (parent, local) = split(path);
        let m = self.b.module_id(parent).unwrap();
        self.b
            .add_param(m, local, TensorMeta::new(self.dtype, shape))
            .unwrap();
    }

    pub fn buffer(&mut self, path: &str, shape: &[usize], dtype: DType) {
        let (parent, local) = split(path);
        let m = self.b.module_id(parent).unwrap();
        self.b
            .add_buffer(m, local, TensorMeta::new(dtype, shape), true)
            .unwrap();
    }

    pub fn linear(&mut self, path: &str, inputs: usize, outputs: usize) {
        self.module(path, "Linear");
        self.param(&format!("{path}.weight"), &[outputs, inputs]);
        self.param(&format!("{path}.bias"), &[outputs]);
    }

    pub fn linear_no_bias(&mut self, path: &str, inputs: usize, outputs: usize) {
        self.module(path, "Linear");
        self.param(&format!("{path}.weight"), &[outputs, inputs]);
    }

    pub fn batchnorm(&mut self, path: &str, c: usize) {
        self.module(path, "BatchNorm1d");
        self.param(&format!("{path}.weight"), &[c]);
        self.param(&format!("{path}.bias"), &[c]);
        let d = self.dtype;
        self.buffer(&format!("{path}.running_mean"), &[c], d);
        self.buffer(&format!("{path}.running_var"), &[c], d);
        self.buffer(&format!("{path}.num_batches_tracked"), &[], DType::I64);
    }

    pub fn layernorm(&mut self, path: &str, c: usize) {
        self.module(path, "LayerNorm");
        self.param(&format!("{path}.weight"), &[c]);
        self.param(&format!("{path}.bias"), &[c]);
    }

    /// `ModelForTest` at `path` (`""` for the root's contents).
    pub fn model_for_test_contents(&mut self, path: &str) {
        let p = |s: &str| {
            if path.is_empty() {
                s.to_string()
            } else {
                format!("{path}.{s}")
            }
        };
        self.linear(&p("linear1"), 3, 4);
        self.batchnorm(&p("batchnorm"), 4);
        self.linear(&p("linear2"), 4, 5);
    }

    pub fn model_for_test_at(&mut self, path: &str) {
        self.module(path, "ModelForTest");
        self.model_for_test_contents(path);
    }

    pub fn tie(&mut self, names: &[&str]) {
        let mut names: Vec<&str> = names.to_vec();
        names.sort();
        self.b.tie(&names);
    }

    pub fn build(self) -> ModuleTree {
        self.b.finish().unwrap()
    }
}

pub fn model_for_test() -> ModuleTree {
    let mut t = Tree::new("ModelForTest");
    t.model_for_test_contents("");
    t.build()
}

/// `max_memory` from `(key, bytes)` pairs.
pub fn mm(pairs: &[(&str, u64)]) -> MaxMemory {
    MaxMemory::new(
        pairs
            .iter()
            .map(|(k, v)| (Device::parse_key(k).unwrap(), *v)),
    )
    .unwrap()
}

/// An expected device map from `(name, device key)` pairs.
pub fn expect(pairs: &[(&str, &str)]) -> HashMap<String, Device> {
    pairs
        .iter()
        .map(|(n, d)| (n.to_string(), Device::parse_key(d).unwrap()))
        .collect()
}

pub fn as_map(plan: &bm_plan::Plan) -> HashMap<String, Device> {
    plan.device_map
        .iter()
        .map(|(n, d)| (n.to_string(), d))
        .collect()
}
