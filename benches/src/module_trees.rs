//! Module trees the planner benches plan, as `bigmodel-module-tree/1`
//! documents: `benches/benches/plan.rs` plans them in process, and `cargo
//! xtask bench` gives the same file to the `bigmodel plan` process and to
//! Accelerate.

use std::fmt::Write as _;

/// A module-tree document and the bytes of its tensors (all F32).
pub struct TreeDocument {
    /// The JSON text.
    pub json: String,
    /// Bytes of every parameter.
    pub bytes: u64,
}

/// 48 layers, each an attention of 4 `Linear(64, 64)` plus a router
/// `Linear(64, 512)` and 512 experts of 3 `Linear(64, 32)`, none with a
/// bias: 98,738 modules and 73,968 parameters, the shape of an MoE model
/// with many small experts.
pub fn moe() -> TreeDocument {
    let mut doc = TreeDocument {
        json: String::with_capacity(8 << 20),
        bytes: 0,
    };
    doc.json.push_str(
        r#"{"format":"bigmodel-module-tree/1","root":{"class":"MoeForCausalLM","children":[{"name":"layers","class":"ModuleList","children":["#,
    );
    for l in 0..48 {
        if l > 0 {
            doc.json.push(',');
        }
        let _ = write!(
            doc.json,
            r#"{{"name":"{l}","class":"MoeDecoderLayer","children":[{{"name":"self_attn","class":"Attention","children":["#
        );
        for (i, p) in ["q_proj", "k_proj", "v_proj", "o_proj"].iter().enumerate() {
            doc.linear(i > 0, p, 64, 64);
        }
        doc.json
            .push_str(r#"]},{"name":"mlp","class":"SparseMoe","children":["#);
        doc.linear(false, "gate", 64, 512);
        doc.json
            .push_str(r#",{"name":"experts","class":"ModuleList","children":["#);
        for e in 0..512 {
            if e > 0 {
                doc.json.push(',');
            }
            let _ = write!(doc.json, r#"{{"name":"{e}","class":"Expert","children":["#);
            for (i, p) in ["gate_proj", "up_proj", "down_proj"].iter().enumerate() {
                doc.linear(i > 0, p, 64, 32);
            }
            doc.json.push_str("]}");
        }
        doc.json.push_str("]}]}]}");
    }
    doc.json.push_str("]}]},\"tied\":[]}");
    doc
}

impl TreeDocument {
    /// A bias-free `Linear(inputs, outputs)` named `name`.
    fn linear(&mut self, comma: bool, name: &str, inputs: usize, outputs: usize) {
        if comma {
            self.json.push(',');
        }
        let _ = write!(
            self.json,
            r#"{{"name":"{name}","class":"Linear","params":[{{"name":"weight","shape":[{outputs},{inputs}],"dtype":"F32"}}]}}"#
        );
        self.bytes += 4 * (inputs * outputs) as u64;
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_moe_document_is_json_of_the_stated_size() {
        let doc = super::moe();
        let value: serde_json::Value = serde_json::from_str(&doc.json).unwrap();
        let mut modules = 0;
        let mut params = 0;
        let mut stack = vec![&value["root"]];
        while let Some(m) = stack.pop() {
            modules += 1;
            params += m["params"].as_array().map_or(0, Vec::len);
            stack.extend(m["children"].as_array().into_iter().flatten());
        }
        assert_eq!((modules, params), (98_738, 73_968));
        assert_eq!(
            doc.bytes,
            48 * 4 * (4 * 64 * 64 + 64 * 512 + 512 * 3 * 64 * 32)
        );
    }
}
