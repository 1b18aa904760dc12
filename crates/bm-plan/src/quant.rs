//! Quantized weights as the planner sees them: bitsandbytes' formats
//! described by their sizes alone, and a module tree whose linear weights
//! are replaced by their packed form, so that every size, budget and
//! offload decision counts packed bytes.
//!
//! The packed form of a weight is one `U8` tensor holding its codes and
//! every part of its quant state (absmax scales, and with double
//! quantization the nested scales, the nested map and the offset): what
//! bitsandbytes keeps for a `Linear4bit` or `Linear8bitLt` weight. Its
//! byte layout is bm-compute's (`QuantizedTensor::to_packed`); this crate
//! only knows its length, and bm-models checks the two agree.

use bm_tensor::{DType, TensorMeta};

use crate::Error;
use crate::tree::{ModuleTree, TensorKind};

/// The values a nested (double-quantized) absmax scale covers, as in
/// bitsandbytes.
const NESTED_BLOCK: u64 = 256;

/// A bitsandbytes weight format, as far as its size goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QuantScheme {
    /// NF4 or FP4: two codes a byte and one absmax per block of
    /// `blocksize` values, itself quantized to 8 bits with `double_quant`.
    FourBit {
        /// Values per absmax scale (64 in transformers and Accelerate).
        blocksize: u64,
        /// `bnb_4bit_use_double_quant`.
        double_quant: bool,
    },
    /// LLM.int8(): one int8 a value and one f32 absmax per output row.
    Int8,
}

impl QuantScheme {
    /// Bytes a `[rows, cols]` weight takes packed, every part of its quant
    /// state included.
    pub fn packed_bytes(&self, rows: u64, cols: u64) -> u64 {
        let n = rows.saturating_mul(cols);
        match *self {
            QuantScheme::FourBit {
                blocksize,
                double_quant,
            } => {
                let blocks = n.div_ceil(blocksize.max(1));
                let scales = if double_quant {
                    // Code per block, nested absmax, 256-entry map, offset.
                    blocks + 4 * blocks.div_ceil(NESTED_BLOCK) + 4 * 256 + 4
                } else {
                    4 * blocks
                };
                n.div_ceil(2) + scales
            }
            QuantScheme::Int8 => n + 4 * rows,
        }
    }
}

/// A weight [`quantize_tree`] replaced by its packed form.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QuantizedWeight {
    /// Its full name (`model.layers.0.mlp.up_proj.weight`).
    pub name: String,
    /// The shape it is quantized in, `[out_features, in_features]`
    /// (bitsandbytes quantizes a `Conv1D` weight, stored `[in, out]`,
    /// transposed).
    pub shape: [usize; 2],
    /// The dtype the tree declared for it.
    pub dtype: DType,
    /// True when the checkpoint stores it `[in, out]` (`Conv1D`).
    pub transposed: bool,
}

/// The modules bitsandbytes quantizes: transformers replaces `nn.Linear`
/// and GPT-2's `Conv1D` (`replace_with_bnb_linear`).
fn quantizable_class(class: &str) -> Option<bool> {
    match class {
        "Linear" => Some(false),
        "Conv1D" => Some(true),
        _ => None,
    }
}

/// `tree` with the `weight` of every `Linear` and `Conv1D` module for which
/// `scheme_of(module name)` gives a scheme replaced by a `U8` tensor of its
/// packed size under that scheme, and the list of what was replaced, in
/// tree order. A tied weight cannot be quantized (its other names would share
/// packed bytes they cannot use): it must be kept dense, and the error
/// names it. A tree with nothing to quantize is an error naming the
/// modules that were looked at, or saying there were none.
pub fn quantize_tree(
    tree: &ModuleTree,
    scheme_of: impl Fn(&str) -> Option<QuantScheme>,
) -> Result<(ModuleTree, Vec<QuantizedWeight>), Error> {
    let mut replaced = Vec::new();
    let mut metas = Vec::new();
    let mut linear_modules = 0;
    for (id, t) in tree.tensors().enumerate() {
        let module = tree.module(t.module);
        let Some(transposed) = quantizable_class(module.class) else {
            continue;
        };
        if t.kind != TensorKind::Param || !t.name.ends_with(".weight") {
            continue;
        }
        linear_modules += 1;
        let Some(scheme) = scheme_of(module.name) else {
            continue;
        };
        let [a, b] = match t.meta.shape[..] {
            [a, b] if t.meta.dtype.is_float() => [a, b],
            _ => {
                return Err(Error::NotQuantizable {
                    what: t.name.to_string(),
                    reason: format!(
                        "a {} weight of shape {:?} is not a float matrix",
                        module.class, t.meta.shape
                    ),
                });
            }
        };
        if let Some(g) = t.tie_group {
            let others: Vec<&str> = tree.tied_groups()[g]
                .iter()
                .filter(|&&o| o != id)
                .map(|&o| tree.tensor(o).name)
                .collect();
            return Err(Error::NotQuantizable {
                what: t.name.to_string(),
                reason: format!(
                    "it is tied to {}; keep {} unquantized (skip_modules)",
                    others.join(", "),
                    module.name
                ),
            });
        }
        let shape = if transposed { [b, a] } else { [a, b] };
        let bytes = scheme.packed_bytes(shape[0] as u64, shape[1] as u64);
        let len = usize::try_from(bytes).map_err(|_| Error::NotQuantizable {
            what: t.name.to_string(),
            reason: format!("{bytes} packed bytes do not fit this machine's address space"),
        })?;
        metas.push((id, TensorMeta::new(DType::U8, vec![len])));
        replaced.push(QuantizedWeight {
            name: t.name.to_string(),
            shape,
            dtype: t.meta.dtype,
            transposed,
        });
    }
    if replaced.is_empty() {
        let reason = if linear_modules == 0 {
            "it has no Linear or Conv1D module to quantize (a tree read from a checkpoint has no \
             class names; plan from config.json)"
                .to_string()
        } else {
            format!("all {linear_modules} Linear/Conv1D weights are kept unquantized")
        };
        return Err(Error::NotQuantizable {
            what: "(model)".into(),
            reason,
        });
    }
    Ok((tree.with_metas(metas), replaced))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tree::ModuleTreeBuilder;
    use crate::{ModuleSizes, SizeOptions};

    fn tree(tied: bool) -> ModuleTree {
        let mut b = ModuleTreeBuilder::new("Model");
        let emb = b.add_module(0, "embed", "Embedding").unwrap();
        b.add_param(emb, "weight", TensorMeta::new(DType::BF16, vec![100, 64]))
            .unwrap();
        let layer = b.add_module(0, "layer", "Block").unwrap();
        let q = b.add_module(layer, "q", "Linear").unwrap();
        b.add_param(q, "weight", TensorMeta::new(DType::BF16, vec![128, 64]))
            .unwrap();
        b.add_param(q, "bias", TensorMeta::new(DType::BF16, vec![128]))
            .unwrap();
        let c = b.add_module(layer, "c", "Conv1D").unwrap();
        b.add_param(c, "weight", TensorMeta::new(DType::BF16, vec![64, 3]))
            .unwrap();
        let head = b.add_module(0, "head", "Linear").unwrap();
        b.add_param(head, "weight", TensorMeta::new(DType::BF16, vec![100, 64]))
            .unwrap();
        if tied {
            b.tie(&["embed.weight", "head.weight"]);
        }
        b.finish().unwrap()
    }

    #[test]
    fn packed_bytes_count_codes_and_every_part_of_the_state() {
        let nf4 = QuantScheme::FourBit {
            blocksize: 64,
            double_quant: false,
        };
        // 4096 values: 2048 code bytes, 64 f32 absmax.
        assert_eq!(nf4.packed_bytes(64, 64), 2048 + 256);
        // BF16 takes 8192: NF4 is 3.56x smaller.
        let nested = QuantScheme::FourBit {
            blocksize: 64,
            double_quant: true,
        };
        // 4097 values: 2049 code bytes, 65 absmax codes, one nested
        // absmax, the nested map, the offset.
        assert_eq!(nested.packed_bytes(1, 4097), 2049 + 65 + 4 + 1024 + 4);
        assert_eq!(QuantScheme::Int8.packed_bytes(3, 5), 15 + 12);
    }

    #[test]
    fn linear_and_conv1d_weights_are_sized_packed() {
        let t = tree(false);
        let (q, replaced) =
            quantize_tree(&t, |m| (m != "head").then_some(QuantScheme::Int8)).unwrap();
        let names: Vec<_> = replaced
            .iter()
            .map(|w| (w.name.as_str(), w.shape))
            .collect();
        // The Conv1D weight, stored [64, 3], is quantized as [3, 64].
        assert_eq!(
            names,
            [("layer.q.weight", [128, 64]), ("layer.c.weight", [3, 64])]
        );
        assert!(replaced[1].transposed);
        let sizes = |tree: &ModuleTree| {
            let s = ModuleSizes::compute(
                tree,
                &SizeOptions {
                    dtype: Some(DType::BF16),
                    ..SizeOptions::default()
                },
            );
            let layer = match tree.find("layer") {
                Some(crate::Node::Module(m)) => m,
                _ => unreachable!(),
            };
            (s.module[layer], s.total())
        };
        let (layer, total) = sizes(&q);
        // q: 8192 + 4 * 128 packed, bias 256 bytes; c: 192 + 4 * 3.
        assert_eq!(layer, 8192 + 512 + 256 + 192 + 12);
        assert_eq!(total, layer + 2 * 100 * 64 * 2);
        assert!(layer < sizes(&t).0);
    }

    #[test]
    fn a_linear_weight_that_is_not_a_float_matrix_is_named() {
        for meta in [
            TensorMeta::new(DType::I32, vec![4, 4]),
            TensorMeta::new(DType::F32, vec![2, 4, 4]),
        ] {
            let mut b = ModuleTreeBuilder::new("Model");
            let m = b.add_module(0, "proj", "Linear").unwrap();
            b.add_param(m, "weight", meta.clone()).unwrap();
            let err = quantize_tree(&b.finish().unwrap(), |_| Some(QuantScheme::Int8)).unwrap_err();
            assert_eq!(
                err.to_string(),
                format!(
                    "cannot quantize proj.weight: a Linear weight of shape {:?} is not a float \
                     matrix",
                    meta.shape
                )
            );
        }
    }

    #[test]
    fn tied_or_absent_weights_are_named() {
        let err = quantize_tree(&tree(true), |_| Some(QuantScheme::Int8)).unwrap_err();
        assert!(
            err.to_string().contains("head.weight")
                && err.to_string().contains("tied to embed.weight"),
            "{err}"
        );
        let (_, replaced) =
            quantize_tree(&tree(true), |m| (m != "head").then_some(QuantScheme::Int8)).unwrap();
        assert_eq!(replaced.len(), 2);
        let err = quantize_tree(&tree(false), |_| None).unwrap_err();
        assert!(
            err.to_string().contains("all 3 Linear/Conv1D weights"),
            "{err}"
        );
        let mut b = ModuleTreeBuilder::new("Model");
        let m = b.add_module(0, "x", "Layer").unwrap();
        b.add_param(m, "weight", TensorMeta::new(DType::F32, vec![4, 4]))
            .unwrap();
        let err = quantize_tree(&b.finish().unwrap(), |_| Some(QuantScheme::Int8)).unwrap_err();
        assert!(
            err.to_string().contains("no Linear or Conv1D module"),
            "{err}"
        );
    }
}
