//! Module trees inferred from checkpoint headers: names and shapes only.
//! The caller reads the headers (`bigmodel::tree_from_checkpoint` opens a
//! checkpoint): this crate never opens a file.
//!
//! A checkpoint has no class names and no module boundaries, so modules are
//! the dotted prefixes of tensor names. Sibling order follows the tensors'
//! first appearance (shard order, then offset order), except that numbered
//! siblings (`layers.0`, `layers.1`, ... `layers.10`) are kept together in
//! numeric order where the first of them appears. Class names are
//! `ModuleList` for a module whose children are all numbered, `Layer` for a
//! numbered module (so `--no-split Layer` keeps repeated blocks whole) and
//! `Module` otherwise. Every tensor is a parameter: a checkpoint does not
//! say which were buffers. Tied weights are usually stored once; a PyTorch
//! checkpoint stores them under every name, over one storage, and those
//! names are declared tied so that they are sized and placed once.

use std::collections::HashMap;

use bm_tensor::TensorMeta;

use crate::Error;
use crate::tree::{ModuleTree, ModuleTreeBuilder};

#[derive(Default)]
struct Trie {
    children: Vec<(String, usize)>,
    index: HashMap<String, usize>,
    tensors: Vec<(String, TensorMeta)>,
}

fn numeric(name: &str) -> Option<u64> {
    if name.is_empty() || !name.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    name.parse().ok()
}

/// Builds a tree from `(name, meta)` pairs in checkpoint order.
pub fn tree_from_tensors<'a>(
    tensors: impl IntoIterator<Item = (&'a str, &'a TensorMeta)>,
) -> Result<ModuleTree, Error> {
    tree_from_tied_tensors(tensors, &[])
}

/// [`tree_from_tensors`], with groups of names that are one tensor (a
/// PyTorch checkpoint's tied weights, `bm_shard::Checkpoint::ties`), which
/// are declared tied so that they are sized and placed once.
pub fn tree_from_tied_tensors<'a>(
    tensors: impl IntoIterator<Item = (&'a str, &'a TensorMeta)>,
    ties: &[Vec<&str>],
) -> Result<ModuleTree, Error> {
    let mut nodes: Vec<Trie> = vec![Trie::default()];
    let mut tensor_names: HashMap<String, ()> = HashMap::new();
    for (name, meta) in tensors {
        let parts: Vec<&str> = name.split('.').collect();
        if parts.iter().any(|p| p.is_empty()) {
            return Err(Error::tree(
                name,
                "a tensor name has an empty dotted segment",
            ));
        }
        let (last, modules) = parts
            .split_last()
            .ok_or_else(|| Error::tree(name, "empty tensor name"))?;
        let mut at = 0;
        let mut prefix = String::new();
        for part in modules {
            if !prefix.is_empty() {
                prefix.push('.');
            }
            prefix.push_str(part);
            if tensor_names.contains_key(&prefix) {
                return Err(Error::tree(
                    name,
                    format!("{prefix:?} is both a tensor and a module"),
                ));
            }
            at = match nodes[at].index.get(*part) {
                Some(&n) => n,
                None => {
                    nodes.push(Trie::default());
                    let n = nodes.len() - 1;
                    nodes[at].children.push((part.to_string(), n));
                    nodes[at].index.insert(part.to_string(), n);
                    n
                }
            };
        }
        if nodes[at].index.contains_key(*last) {
            return Err(Error::tree(name, "is both a tensor and a module"));
        }
        nodes[at].tensors.push((last.to_string(), meta.clone()));
        tensor_names.insert(name.to_string(), ());
    }
    // Numbered siblings together, in numeric order, where the first appears.
    for node in &mut nodes {
        let mut numbered: Vec<(u64, String, usize)> = node
            .children
            .iter()
            .filter_map(|(n, i)| numeric(n).map(|k| (k, n.clone(), *i)))
            .collect();
        if numbered.is_empty() {
            continue;
        }
        numbered.sort();
        let first = node
            .children
            .iter()
            .position(|(n, _)| numeric(n).is_some())
            .unwrap_or(0);
        let mut ordered: Vec<(String, usize)> = Vec::with_capacity(node.children.len());
        for (pos, child) in node.children.iter().enumerate() {
            if pos == first {
                ordered.extend(numbered.iter().map(|(_, n, i)| (n.clone(), *i)));
            }
            if numeric(&child.0).is_none() {
                ordered.push(child.clone());
            }
        }
        node.children = ordered;
    }
    let class_of = |trie: &Trie, local: &str| -> &'static str {
        if !trie.children.is_empty() && trie.children.iter().all(|(n, _)| numeric(n).is_some()) {
            "ModuleList"
        } else if numeric(local).is_some() {
            "Layer"
        } else {
            "Module"
        }
    };
    let mut builder = ModuleTreeBuilder::new(class_of(&nodes[0], "root"));
    let mut stack = vec![(0usize, 0usize)];
    while let Some((trie, module)) = stack.pop() {
        for (local, meta) in &nodes[trie].tensors {
            builder.add_param(module, local, meta.clone())?;
        }
        let mut created = Vec::with_capacity(nodes[trie].children.len());
        for (local, child) in &nodes[trie].children {
            let id = builder.add_module(module, local, class_of(&nodes[*child], local))?;
            created.push((*child, id));
        }
        stack.extend(created.into_iter().rev());
    }
    for group in ties {
        builder.tie(group);
    }
    builder.finish()
}

#[cfg(test)]
mod tests {
    use super::*;
    use bm_tensor::DType;

    #[test]
    fn modules_come_from_prefixes_in_a_sensible_order() {
        let meta = TensorMeta::new(DType::F16, [4, 4]);
        let names = [
            "model.embed_tokens.weight",
            "model.layers.10.mlp.weight",
            "model.layers.2.mlp.weight",
            "model.layers.1.mlp.weight",
            "model.norm.weight",
            "lm_head.weight",
        ];
        let tree = tree_from_tensors(names.iter().map(|n| (*n, &meta))).unwrap();
        let order: Vec<&str> = tree
            .preorder()
            .iter()
            .map(|m| tree.module(*m).name)
            .collect();
        assert_eq!(
            order,
            [
                "",
                "model",
                "model.embed_tokens",
                "model.layers",
                "model.layers.1",
                "model.layers.1.mlp",
                "model.layers.2",
                "model.layers.2.mlp",
                "model.layers.10",
                "model.layers.10.mlp",
                "model.norm",
                "lm_head"
            ]
        );
        let classes: Vec<&str> = ["model.layers", "model.layers.2", "model.norm"]
            .iter()
            .map(|n| match tree.find(n) {
                Some(crate::Node::Module(m)) => tree.module(m).class,
                other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!(classes, ["ModuleList", "Layer", "Module"]);
    }

    #[test]
    fn a_name_that_is_both_tensor_and_module_is_an_error() {
        let meta = TensorMeta::new(DType::F16, [1]);
        let err = tree_from_tensors([("a.b", &meta), ("a.b.c", &meta)])
            .unwrap_err()
            .to_string();
        assert!(err.contains("both a tensor and a module"), "{err}");
        let err = tree_from_tensors([("a..b", &meta)])
            .unwrap_err()
            .to_string();
        assert!(err.contains("empty dotted segment"), "{err}");
    }

    #[test]
    fn tied_names_are_sized_once() {
        let meta = TensorMeta::new(DType::F32, [4, 6]);
        let names = ["embed.weight", "head.weight", "other.weight"];
        let tree = tree_from_tied_tensors(
            names.iter().map(|n| (*n, &meta)),
            &[vec![names[0], names[1]]],
        )
        .unwrap();
        assert_eq!(tree.tied_names(), [["embed.weight", "head.weight"]]);
        let untied = tree_from_tensors(names.iter().map(|n| (*n, &meta))).unwrap();
        assert!(untied.tied_names().is_empty());
    }
}
