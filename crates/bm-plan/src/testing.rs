//! Fixtures shared by the unit tests.

use bm_tensor::{DType, TensorMeta};

use crate::tree::{ModuleTree, ModuleTreeBuilder};

/// Adds `Linear(inputs, outputs)` (weight then bias) under `parent`.
pub(crate) fn linear(
    b: &mut ModuleTreeBuilder,
    parent: usize,
    name: &str,
    inputs: usize,
    outputs: usize,
    dtype: DType,
) -> usize {
    let m = b.add_module(parent, name, "Linear").unwrap();
    b.add_param(m, "weight", TensorMeta::new(dtype, [outputs, inputs]))
        .unwrap();
    b.add_param(m, "bias", TensorMeta::new(dtype, [outputs]))
        .unwrap();
    m
}

/// Accelerate's `ModelForTest` (TMU:63-71) with float tensors in `dtype`.
pub(crate) fn model_for_test_builder(dtype: DType) -> ModuleTreeBuilder {
    let mut b = ModuleTreeBuilder::new("ModelForTest");
    linear(&mut b, 0, "linear1", 3, 4, dtype);
    let bn = b.add_module(0, "batchnorm", "BatchNorm1d").unwrap();
    b.add_param(bn, "weight", TensorMeta::new(dtype, [4]))
        .unwrap();
    b.add_param(bn, "bias", TensorMeta::new(dtype, [4]))
        .unwrap();
    b.add_buffer(bn, "running_mean", TensorMeta::new(dtype, [4]), true)
        .unwrap();
    b.add_buffer(bn, "running_var", TensorMeta::new(dtype, [4]), true)
        .unwrap();
    b.add_buffer(
        bn,
        "num_batches_tracked",
        TensorMeta::new(DType::I64, []),
        true,
    )
    .unwrap();
    linear(&mut b, 0, "linear2", 4, 5, dtype);
    b
}

/// `ModelForTest` built.
pub(crate) fn model_for_test(dtype: DType) -> ModuleTree {
    model_for_test_builder(dtype).finish().unwrap()
}
