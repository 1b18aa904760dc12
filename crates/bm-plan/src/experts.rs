//! Expert-level placement of mixture-of-experts models (`--experts-on`,
//! llama.cpp's `--n-cpu-moe`): the experts of every sparse layer go to one
//! device (the CPU or disk), everything else stays where the plan put it.
//!
//! A layer is one unit for the planners (its class is no-split), so a plan
//! places it whole; [`place_experts`] then splits each map entry that holds
//! experts into its children down to the experts lists, the rest of the
//! layer keeping the entry's device. Offloaded experts are then fetched one
//! at a time by the model's compute, which asks only for the experts its
//! router picked.

use crate::plan::DeviceMap;
use crate::tree::{ModuleId, ModuleTree, Node};
use crate::{Device, Error};

/// The experts lists of `tree`: every `ModuleList` named `experts` (the
/// checkpoint layout of Mixtral's `block_sparse_moe.experts` and Qwen's
/// `mlp.experts`, one module per expert), in traversal order.
pub fn expert_lists(tree: &ModuleTree) -> Vec<ModuleId> {
    tree.preorder()
        .iter()
        .copied()
        .filter(|&m| {
            let module = tree.module(m);
            module.class == "ModuleList" && module.name.rsplit('.').next() == Some("experts")
        })
        .collect()
}

/// `map` with every experts list of `tree` on `device`: a key that holds
/// experts lists is replaced by the keys of its children (recursively, down
/// to the lists) on its own device, a key inside a list moves to `device`,
/// and the keys are put in traversal order. An error when `tree` has no
/// experts.
pub fn place_experts(
    tree: &ModuleTree,
    map: &DeviceMap,
    device: Device,
) -> Result<DeviceMap, Error> {
    let lists = expert_lists(tree);
    if lists.is_empty() {
        return Err(Error::NoExperts);
    }
    let mut entries = Vec::with_capacity(map.len() + 8 * lists.len());
    for (key, on) in map.iter() {
        let module = match tree.find(key) {
            Some(Node::Module(m)) => Some(m),
            Some(Node::Tensor(t)) => Some(tree.tensor(t).module),
            None => None,
        };
        let Some(m) = module else {
            entries.push((key.to_string(), on));
            continue;
        };
        if lists.iter().any(|&l| tree.is_within(m, l)) {
            entries.push((key.to_string(), device));
            continue;
        }
        let below: Vec<ModuleId> = match tree.find(key) {
            Some(Node::Module(_)) => lists
                .iter()
                .copied()
                .filter(|&l| tree.is_within(l, m))
                .collect(),
            _ => Vec::new(),
        };
        if below.is_empty() {
            entries.push((key.to_string(), on));
        } else {
            split(tree, m, on, &below, device, &mut entries);
        }
    }
    let mut placed = DeviceMap::from_entries(entries);
    placed.sort_traversal(tree);
    Ok(placed)
}

/// The keys of module `m` (on `on`) with the experts lists `lists` below it
/// on `device`: its own tensors and children, children holding lists split
/// again.
pub(crate) fn split(
    tree: &ModuleTree,
    m: ModuleId,
    on: Device,
    lists: &[ModuleId],
    device: Device,
    out: &mut Vec<(String, Device)>,
) {
    let module = tree.module(m);
    for &t in module.params.iter().chain(module.buffers) {
        out.push((tree.tensor(t).name.to_string(), on));
    }
    for &c in module.children {
        let name = tree.module(c).name.to_string();
        if lists.contains(&c) {
            out.push((name, device));
        } else if lists.iter().any(|&l| tree.is_within(l, c)) {
            split(tree, c, on, lists, device, out);
        } else {
            out.push((name, on));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ModuleTreeBuilder;
    use bm_tensor::{DType, TensorMeta};

    /// Two layers, each with attention, a router and two experts.
    fn moe() -> ModuleTree {
        let mut b = ModuleTreeBuilder::new("M");
        let layers = b.add_module(0, "layers", "ModuleList").unwrap();
        for i in 0..2 {
            let layer = b.add_module(layers, &i.to_string(), "Layer").unwrap();
            let attn = b.add_module(layer, "attn", "Linear").unwrap();
            b.add_param(attn, "weight", TensorMeta::new(DType::F32, [4, 4]))
                .unwrap();
            let block = b.add_module(layer, "mlp", "SparseMoeBlock").unwrap();
            let gate = b.add_module(block, "gate", "Linear").unwrap();
            b.add_param(gate, "weight", TensorMeta::new(DType::F32, [2, 4]))
                .unwrap();
            let experts = b.add_module(block, "experts", "ModuleList").unwrap();
            for e in 0..2 {
                let expert = b.add_module(experts, &e.to_string(), "MLP").unwrap();
                b.add_param(expert, "weight", TensorMeta::new(DType::F32, [4, 4]))
                    .unwrap();
            }
        }
        b.finish().unwrap()
    }

    #[test]
    fn experts_move_and_the_rest_of_each_layer_stays() {
        let tree = moe();
        assert_eq!(expert_lists(&tree).len(), 2);
        let map = DeviceMap::from_json(&serde_json::json!({
            "layers.0": 0, "layers.1": "cpu",
        }))
        .unwrap();
        let placed = place_experts(&tree, &map, Device::Disk).unwrap();
        assert_eq!(
            placed.to_json(),
            serde_json::json!({
                "layers.0.attn": 0, "layers.0.mlp.gate": 0, "layers.0.mlp.experts": "disk",
                "layers.1.attn": "cpu", "layers.1.mlp.gate": "cpu", "layers.1.mlp.experts": "disk",
            })
        );
        crate::check_device_map(&tree, &placed).unwrap();
        // One key for the whole model, and a key inside an experts list.
        let whole = DeviceMap::from_json(&serde_json::json!({"": 0})).unwrap();
        let placed = place_experts(&tree, &whole, Device::Cpu).unwrap();
        assert_eq!(placed.get("layers.1.mlp.experts"), Some(Device::Cpu));
        assert_eq!(placed.get("layers.1.attn"), Some(Device::Gpu(0)));
        crate::check_device_map(&tree, &placed).unwrap();
        let inside = DeviceMap::from_json(&serde_json::json!({
            "layers.0": 0, "layers.1.attn": 0, "layers.1.mlp.gate": 0, "layers.1.mlp.experts.0": 0,
            "layers.1.mlp.experts.1": "cpu",
        }))
        .unwrap();
        let placed = place_experts(&tree, &inside, Device::Disk).unwrap();
        assert_eq!(placed.get("layers.1.mlp.experts.0"), Some(Device::Disk));
        assert_eq!(placed.get("layers.1.mlp.experts.1"), Some(Device::Disk));
    }

    #[test]
    fn a_model_without_experts_is_an_error() {
        let mut b = ModuleTreeBuilder::new("M");
        let l = b.add_module(0, "l", "Linear").unwrap();
        b.add_param(l, "weight", TensorMeta::new(DType::F32, [2, 2]))
            .unwrap();
        let tree = b.finish().unwrap();
        let map = DeviceMap::from_json(&serde_json::json!({"": "cpu"})).unwrap();
        let err = place_experts(&tree, &map, Device::Cpu).unwrap_err();
        assert!(err.to_string().contains("no experts"), "{err}");
    }
}
