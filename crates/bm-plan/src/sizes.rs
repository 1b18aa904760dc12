//! Module sizes: Accelerate's `compute_module_sizes`, and the sizes a load
//! really produces.

use std::collections::HashMap;

use bm_tensor::DType;

use crate::tree::{ModuleTree, Node, TensorKind};

/// How a requested dtype changes the size of a tensor.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SizeRule {
    /// Accelerate's rule: a requested dtype only ever shrinks a float
    /// tensor (`min` of the two byte sizes), integer and bool tensors keep
    /// theirs, `bool` counts 1/8 byte, and `special_dtypes` win even for
    /// integer tensors.
    Accelerate,
    /// What loading really allocates: a float tensor takes the requested
    /// dtype's size (up or down), integer and bool tensors keep theirs
    /// (`bool` is one byte).
    #[default]
    Loaded,
}

/// Options of a size computation.
#[derive(Clone, Debug, Default)]
pub struct SizeOptions {
    /// The dtype the weights are loaded in, if any.
    pub dtype: Option<DType>,
    /// Per-tensor dtype overrides, by full name.
    pub special_dtypes: HashMap<String, DType>,
    /// The sizing rule.
    pub rule: SizeRule,
}

/// Sizes of every tensor and module subtree.
#[derive(Clone, Debug)]
pub struct ModuleSizes {
    /// Per tensor; 0 for the second and later names of a tied tensor.
    pub tensor: Vec<u64>,
    /// Per module: the whole subtree, parameters and all buffers (also
    /// non-persistent ones), as Accelerate counts.
    pub module: Vec<u64>,
    /// Per module: the buffers of the subtree only
    /// (`compute_module_total_buffer_size`).
    pub buffers: Vec<u64>,
}

fn is_integer(dtype: DType) -> bool {
    matches!(
        dtype,
        DType::Bool | DType::U8 | DType::I8 | DType::I16 | DType::I32 | DType::I64
    )
}

/// Bytes of `numel` elements of `dtype` under `rule`. Accelerate counts a
/// bool as 1/8 byte; the fraction is rounded up to whole bytes.
fn elements_bytes(numel: u64, dtype: DType, rule: SizeRule) -> u64 {
    match (dtype, rule) {
        (DType::Bool, SizeRule::Accelerate) => numel.div_ceil(8),
        _ => numel.saturating_mul(dtype.size_in_bytes() as u64),
    }
}

impl ModuleSizes {
    /// Computes every size in one pass over the tensors and one over the
    /// modules (children before parents).
    pub fn compute(tree: &ModuleTree, options: &SizeOptions) -> ModuleSizes {
        let tensors = tree.tensors();
        let mut tensor = vec![0u64; tensors.len()];
        let mut module = vec![0u64; tree.modules().len()];
        let mut buffers = vec![0u64; tree.modules().len()];
        for (id, t) in tensors.clone().enumerate() {
            if !t.counted {
                continue;
            }
            let numel = t.meta.numel() as u64;
            let own = t.meta.dtype;
            let special = if options.special_dtypes.is_empty() {
                None
            } else {
                options.special_dtypes.get(t.name).copied()
            };
            let size = match options.rule {
                SizeRule::Accelerate => match (special, options.dtype) {
                    (Some(s), _) => elements_bytes(numel, s, options.rule),
                    (None, None) => elements_bytes(numel, own, options.rule),
                    (None, Some(_)) if is_integer(own) => elements_bytes(numel, own, options.rule),
                    (None, Some(d)) => {
                        let smaller = if d.size_in_bytes() < own.size_in_bytes() {
                            d
                        } else {
                            own
                        };
                        elements_bytes(numel, smaller, options.rule)
                    }
                },
                SizeRule::Loaded => {
                    let target = if own.is_float() {
                        special.or(options.dtype).unwrap_or(own)
                    } else {
                        own
                    };
                    elements_bytes(numel, target, options.rule)
                }
            };
            tensor[id] = size;
            module[t.module] += size;
            if matches!(t.kind, TensorKind::Buffer { .. }) {
                buffers[t.module] += size;
            }
        }
        for &m in tree.preorder().iter().rev() {
            if let Some(parent) = tree.module(m).parent {
                module[parent] += module[m];
                buffers[parent] += buffers[m];
            }
        }
        ModuleSizes {
            tensor,
            module,
            buffers,
        }
    }

    /// The size of a module or tensor.
    pub fn of(&self, node: Node) -> u64 {
        match node {
            Node::Module(m) => self.module[m],
            Node::Tensor(t) => self.tensor[t],
        }
    }

    /// The whole model.
    pub fn total(&self) -> u64 {
        self.module[0]
    }

    /// The size dictionary as Accelerate builds it: `(name, size)` in the
    /// insertion order of `compute_module_sizes` (for each tensor in
    /// `named_module_tensors` order: `""`, then every dotted prefix, then the
    /// tensor itself, each name on first touch).
    pub fn accelerate_dict(&self, tree: &ModuleTree) -> Vec<(String, u64)> {
        let mut seen = vec![false; tree.modules().len()];
        let mut out = Vec::new();
        for t in tree.named_module_tensors() {
            let tensor = tree.tensor(t);
            let mut chain = Vec::new();
            let mut m = Some(tensor.module);
            while let Some(id) = m {
                if seen[id] {
                    break;
                }
                chain.push(id);
                m = tree.module(id).parent;
            }
            for &id in chain.iter().rev() {
                seen[id] = true;
                out.push((tree.module(id).name.to_string(), self.module[id]));
            }
            out.push((tensor.name.to_string(), self.tensor[t]));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::model_for_test;

    fn dict(tree: &ModuleTree, options: &SizeOptions) -> HashMap<String, u64> {
        ModuleSizes::compute(tree, options)
            .accelerate_dict(tree)
            .into_iter()
            .collect()
    }

    fn acc(dtype: Option<DType>) -> SizeOptions {
        SizeOptions {
            dtype,
            special_dtypes: HashMap::new(),
            rule: SizeRule::Accelerate,
        }
    }

    #[test]
    fn compute_module_sizes_of_model_for_test() {
        let tree = model_for_test(DType::F32);
        let got = dict(&tree, &acc(None));
        let want: HashMap<String, u64> = [
            ("", 236),
            ("linear1", 64),
            ("linear1.weight", 48),
            ("linear1.bias", 16),
            ("linear2", 100),
            ("linear2.weight", 80),
            ("linear2.bias", 20),
            ("batchnorm", 72),
            ("batchnorm.weight", 16),
            ("batchnorm.bias", 16),
            ("batchnorm.running_mean", 16),
            ("batchnorm.running_var", 16),
            ("batchnorm.num_batches_tracked", 8),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        assert_eq!(got, want);
        // Insertion order: params first (and their modules), then buffers.
        let order: Vec<_> = ModuleSizes::compute(&tree, &acc(None))
            .accelerate_dict(&tree)
            .into_iter()
            .map(|(k, _)| k)
            .collect();
        assert_eq!(
            &order[..4],
            ["", "linear1", "linear1.weight", "linear1.bias"]
        );
        assert_eq!(order.last().unwrap(), "batchnorm.num_batches_tracked");
    }

    #[test]
    fn half_model_and_dtype_only_shrinks() {
        let half = model_for_test(DType::F16);
        let got = dict(&half, &acc(None));
        assert_eq!(got[""], 122);
        assert_eq!(got["batchnorm"], 40);
        assert_eq!(got["batchnorm.num_batches_tracked"], 8);
        let f32_tree = model_for_test(DType::F32);
        assert_eq!(
            dict(&f32_tree, &acc(Some(DType::F16))),
            got,
            "dtype=float16 == .half()"
        );
        assert_eq!(dict(&f32_tree, &acc(Some(DType::I8)))[""], 65);
        // dtype=float32 on an fp16 model keeps fp16 sizes (the min rule).
        assert_eq!(dict(&half, &acc(Some(DType::F32)))[""], 122);
        // The loaded rule upcasts.
        let loaded = SizeOptions {
            dtype: Some(DType::F32),
            ..SizeOptions::default()
        };
        assert_eq!(dict(&half, &loaded)[""], 236);
    }

    #[test]
    fn special_dtypes_win_even_for_integer_tensors() {
        let tree = model_for_test(DType::F32);
        let mut o = acc(Some(DType::F16));
        o.special_dtypes.insert("linear2.weight".into(), DType::F32);
        let got = dict(&tree, &o);
        assert_eq!(
            (got[""], got["linear2"], got["linear2.weight"]),
            (162, 90, 80)
        );
        let mut o = acc(None);
        o.special_dtypes
            .insert("batchnorm.num_batches_tracked".into(), DType::F16);
        assert_eq!(dict(&tree, &o)["batchnorm.num_batches_tracked"], 2);
    }

    #[test]
    fn total_buffer_size_counts_every_buffer() {
        // TMU:401-411: extra buffers on linear1 (10x10) and on the root (20x10).
        for (dtype, want) in [(DType::F32, 1240), (DType::F16, 624)] {
            let mut b = crate::testing::model_for_test_builder(dtype);
            let linear1 = b.module_id("linear1").unwrap();
            b.add_buffer(
                linear1,
                "test_buffer",
                bm_tensor::TensorMeta::new(dtype, [10, 10]),
                true,
            )
            .unwrap();
            b.add_buffer(
                0,
                "test_buffer2",
                bm_tensor::TensorMeta::new(dtype, [20, 10]),
                true,
            )
            .unwrap();
            let tree = b.finish().unwrap();
            let sizes = ModuleSizes::compute(&tree, &acc(None));
            assert_eq!(sizes.buffers[0], want);
        }
    }
}
