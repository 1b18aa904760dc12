//! The memory ledger: every byte a device must hold to run a plan for a
//! declared workload (batch, prompt length, sequence length), item by item,
//! and the per-architecture formulas behind the runtime items.
//!
//! The planner charges these items while it places units (see
//! [`crate::auto`]), so a plan that fits its budgets fits its ledger; the
//! ledger of any device map (a user's, or Accelerate's) is computed by
//! [`crate::auto::ledger`]. What is charged where:
//!
//! * `weights`: the bytes placed on the device (packed sizes, as
//!   [`crate::ModuleSizes`] counts them).
//! * `kv_cache`: keys and values of the declared batch and sequence length,
//!   on the device that executes each layer.
//! * `activations`: the largest transient peak of the blocks the device
//!   executes (formulas in [`ModelShape::activation_peak`]).
//! * `logits`: the head's output on the device that executes the head.
//! * `streaming`: room on a GPU execution device for the offloaded units in
//!   flight (the running one plus `prefetch_depth` prefetched); none on the
//!   CPU, where bm-dispatch runs offloaded units from their mapping in place.
//! * `staging`, `gemm_workspace`, `cuda_context`: fixed per-device costs the
//!   caller measured or knows (bm-plan never asks a device), passed as
//!   [`crate::PlanOptions::overheads`].
//! * `reserve`: what the user held back with `--reserve`.

use std::fmt;

use bm_tensor::DType;

use crate::config::{Family, HfConfig};
use crate::device::{Device, MaxMemory};
use crate::size::human_bytes;

/// One line of a device's ledger.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum LedgerItem {
    /// Parameters and buffers placed on the device.
    Weights,
    /// Keys and values of the layers the device executes.
    KvCache,
    /// The largest transient activation peak of a block the device executes.
    Activations,
    /// The head's output buffer.
    Logits,
    /// Room for offloaded units in flight on the execution device.
    Streaming,
    /// Page-locked host buffers that stage uploads to GPUs.
    Staging,
    /// cuBLAS's GEMM workspace.
    GemmWorkspace,
    /// What the CUDA context itself takes on the GPU.
    CudaContext,
    /// Bytes held back by the user (`--reserve`).
    Reserve,
}

impl LedgerItem {
    /// Every item, in the order tables list them.
    pub const ALL: [LedgerItem; 9] = [
        LedgerItem::Weights,
        LedgerItem::KvCache,
        LedgerItem::Activations,
        LedgerItem::Logits,
        LedgerItem::Streaming,
        LedgerItem::Staging,
        LedgerItem::GemmWorkspace,
        LedgerItem::CudaContext,
        LedgerItem::Reserve,
    ];

    /// The JSON key (`bigmodel plan --json`'s `ledger`).
    pub fn key(self) -> &'static str {
        match self {
            LedgerItem::Weights => "weights",
            LedgerItem::KvCache => "kv_cache",
            LedgerItem::Activations => "activations",
            LedgerItem::Logits => "logits",
            LedgerItem::Streaming => "streaming",
            LedgerItem::Staging => "staging",
            LedgerItem::GemmWorkspace => "gemm_workspace",
            LedgerItem::CudaContext => "cuda_context",
            LedgerItem::Reserve => "reserve",
        }
    }
}

impl fmt::Display for LedgerItem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.key())
    }
}

/// Bytes per device and item. Devices in Accelerate's order, items in
/// [`LedgerItem::ALL`]'s; an item of zero bytes is not listed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Ledger {
    rows: Vec<(Device, Vec<(LedgerItem, u64)>)>,
}

/// A device whose ledger exceeds its budget.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shortfall {
    /// The device.
    pub device: Device,
    /// What its ledger adds up to.
    pub needed: u64,
    /// Its budget.
    pub budget: u64,
}

impl Shortfall {
    /// Bytes missing.
    pub fn short_by(&self) -> u64 {
        self.needed - self.budget
    }
}

impl fmt::Display for Shortfall {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} is short by {} ({} bytes): the ledger needs {}, the budget is {}",
            self.device,
            human_bytes(self.short_by()),
            self.short_by(),
            human_bytes(self.needed),
            human_bytes(self.budget)
        )
    }
}

impl Ledger {
    /// Adds `bytes` to `item` of `device`.
    pub fn add(&mut self, device: Device, item: LedgerItem, bytes: u64) {
        if bytes == 0 {
            return;
        }
        let at = match self.rows.binary_search_by(|(d, _)| d.cmp(&device)) {
            Ok(i) => i,
            Err(i) => {
                self.rows.insert(i, (device, Vec::new()));
                i
            }
        };
        let items = &mut self.rows[at].1;
        match items.binary_search_by(|(x, _)| x.cmp(&item)) {
            Ok(i) => items[i].1 = items[i].1.saturating_add(bytes),
            Err(i) => items.insert(i, (item, bytes)),
        }
    }

    /// The bytes of `item` on `device` (0 when not listed).
    pub fn get(&self, device: Device, item: LedgerItem) -> u64 {
        self.items(device)
            .iter()
            .find(|(x, _)| *x == item)
            .map_or(0, |(_, b)| *b)
    }

    /// The items of `device`.
    pub fn items(&self, device: Device) -> &[(LedgerItem, u64)] {
        self.rows
            .iter()
            .find(|(d, _)| *d == device)
            .map_or(&[], |(_, items)| items.as_slice())
    }

    /// The devices listed.
    pub fn devices(&self) -> impl Iterator<Item = Device> + '_ {
        self.rows.iter().map(|(d, _)| *d)
    }

    /// Everything `device` must hold.
    pub fn total(&self, device: Device) -> u64 {
        self.items(device)
            .iter()
            .fold(0u64, |a, (_, b)| a.saturating_add(*b))
    }

    /// The devices whose ledger exceeds their budget in `max_memory` (a
    /// device without a budget has no limit).
    pub fn shortfalls(&self, max_memory: &MaxMemory) -> Vec<Shortfall> {
        self.devices()
            .filter_map(|device| {
                let budget = max_memory.get(device)?;
                let needed = self.total(device);
                (needed > budget).then_some(Shortfall {
                    device,
                    needed,
                    budget,
                })
            })
            .collect()
    }

    /// `{device: {item: bytes}}`.
    pub fn to_json(&self) -> serde_json::Value {
        let mut object = serde_json::Map::new();
        for (device, items) in &self.rows {
            let mut row = serde_json::Map::new();
            for (item, bytes) in items {
                row.insert(item.key().to_string(), (*bytes).into());
            }
            object.insert(device.to_string(), serde_json::Value::Object(row));
        }
        serde_json::Value::Object(object)
    }
}

/// What the model will be asked to do: the ledger's runtime items and the
/// prediction depend on it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Workload {
    /// Sequences computed together.
    pub batch: u64,
    /// Tokens of the first forward pass (the prompt).
    pub prompt_len: u64,
    /// Tokens a sequence may reach (prompt plus generated): the KV cache's
    /// length.
    pub max_seq_len: u64,
    /// The first pass returns logits for every prompt position
    /// (`--dump-logits`), not only the last.
    pub all_logits: bool,
}

impl Workload {
    /// Rows of the first forward pass, the largest a pass has.
    fn rows(&self) -> u64 {
        self.batch.saturating_mul(self.prompt_len)
    }
}

/// How a block's MLP is laid out, as far as its buffers go.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MlpKind {
    /// `down(act(gate(x)) * up(x))` with separate projections.
    Gated,
    /// Phi-3's fused `gate_up_proj`, split into two columns.
    FusedGated,
    /// `proj(act(fc(x)))` (GPT-2, BERT).
    Plain,
}

/// The sizes of a transformer that decide its runtime memory and its
/// compute, read from its config.json.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ModelShape {
    /// Width of the residual stream.
    pub hidden: u64,
    /// Width of the MLP.
    pub intermediate: u64,
    /// Query heads.
    pub heads: u64,
    /// Key/value heads.
    pub kv_heads: u64,
    /// Width of a head.
    pub head_dim: u64,
    /// Rows of the token embedding (columns of the logits).
    pub vocab: u64,
    /// Repeated blocks.
    pub layers: u64,
    /// MLP layout.
    pub mlp: MlpKind,
    /// Queries, keys and values come from one fused projection and are
    /// split (Phi-3, GPT-2).
    pub fused_qkv: bool,
    /// Queries and keys are rotated (rotary families).
    pub rotary: bool,
    /// Each sub-block's output is normed again (Gemma 2).
    pub post_norms: bool,
    /// A decoder (KV cache, logits); false for encoders.
    pub decoder: bool,
    /// Experts each token is routed to in a sparse (mixture-of-experts)
    /// layer (`num_experts_per_tok`); 0 for a model without experts.
    pub experts_per_token: u64,
}

impl ModelShape {
    /// The shape `config` describes.
    pub fn of(config: &HfConfig) -> ModelShape {
        // A mixture-of-experts layer runs one gated expert at a time over
        // the rows routed to it, charged as one gated MLP (not measured).
        let mlp = match config.family {
            Family::Phi3 => MlpKind::FusedGated,
            Family::Gpt2 | Family::Bert | Family::T5 => MlpKind::Plain,
            _ => MlpKind::Gated,
        };
        ModelShape {
            hidden: config.hidden_size as u64,
            intermediate: config.intermediate_size as u64,
            heads: config.heads as u64,
            kv_heads: config.kv_heads as u64,
            head_dim: config.head_dim as u64,
            vocab: config.vocab_size as u64,
            layers: config.num_layers as u64,
            mlp,
            fused_qkv: matches!(config.family, Family::Phi3 | Family::Gpt2),
            rotary: config.family.is_rotary(),
            post_norms: config.family == Family::Gemma2,
            decoder: config.family != Family::Bert,
            experts_per_token: config.moe.as_ref().map_or(0, |m| m.top_k as u64),
        }
    }

    /// Bytes of one element of activations and KV cache computed on a
    /// device: the CPU kernels compute and cache in f32 whatever the
    /// weights' dtype; GPUs in `dtype`.
    pub fn element_bytes(on_gpu: bool, dtype: DType) -> u64 {
        if on_gpu {
            dtype.size_in_bytes() as u64
        } else {
            4
        }
    }

    /// KV-cache bytes of one layer: keys and values of `kv_heads·head_dim`
    /// elements per token, for `batch × max_seq_len` tokens.
    pub fn kv_bytes_per_layer(&self, w: &Workload, element: u64) -> u64 {
        if !self.decoder {
            return 0;
        }
        (2 * self.kv_heads * self.head_dim)
            .saturating_mul(w.batch)
            .saturating_mul(w.max_seq_len)
            .saturating_mul(element)
    }

    /// The transient peak of one block's forward pass over the first pass's
    /// `n = batch·prompt_len` rows, in bytes of `element`.
    ///
    /// The CPU kernels (and bm-models' block code) keep every intermediate
    /// tensor of a block until the block returns, so the peak is the sum of
    /// what the block creates up to its largest step. With `H` the hidden
    /// width, `I` the MLP width, `Q = heads·head_dim` and
    /// `K = kv_heads·head_dim`, per row:
    ///
    /// * held from attention on: the block's input and its norm (`2H`),
    ///   `q`, `k`, `v` (`Q + 2K`), for a fused projection its output too
    ///   (`Q + 2K`), for rotary families the rotated `q` and `k` (`Q + K`);
    /// * attention adds the per-head outputs and their concatenation
    ///   (`2Q`) and one f32 score row of `max_seq_len` per head;
    /// * the MLP step adds the attention output (`Q`), its projection, the
    ///   residual sum and its norm (`3H`, one more `H` with Gemma 2's post
    ///   norms), then for a gated MLP `gate`, `act(gate)`, `up` and their
    ///   product (`4I`), for Phi-3's fused one the fused output, its halves,
    ///   `act` and the product (`6I`), for GPT-2/BERT's `fc` and `act(fc)`
    ///   (`2I`).
    ///
    /// The peak is the larger step. Checked against the peak a counting
    /// allocator measures around a real layer forward on the CPU in
    /// bm-models' `tests/activation_peak.rs` (BERT's encoder layer is
    /// charged the same, unmeasured).
    pub fn activation_peak(&self, w: &Workload, element: u64) -> u64 {
        let (h, i) = (self.hidden, self.intermediate);
        let q = self.heads * self.head_dim;
        let k = self.kv_heads * self.head_dim;
        let held = 2 * h
            + (q + 2 * k)
            + if self.fused_qkv { q + 2 * k } else { 0 }
            + if self.rotary { q + k } else { 0 };
        let attention = held + 2 * q;
        let mlp = held
            + q
            + 3 * h
            + if self.post_norms { h } else { 0 }
            + match self.mlp {
                MlpKind::Gated => 4 * i,
                MlpKind::FusedGated => 6 * i,
                MlpKind::Plain => 2 * i,
            };
        let scores = self.heads.saturating_mul(w.max_seq_len).saturating_mul(4);
        let attention = w
            .rows()
            .saturating_mul(attention * element)
            .saturating_add(scores);
        w.rows().saturating_mul(mlp * element).max(attention)
    }

    /// The embedding's output: `n × H`.
    pub fn embedding_peak(&self, w: &Workload, element: u64) -> u64 {
        w.rows().saturating_mul(self.hidden * element)
    }

    /// The head's logits, held until the next token is picked: the last
    /// position of each sequence, or every prompt position with
    /// `all_logits`, as f32 (the CPU's, and the widest a GPU writes).
    pub fn logits_bytes(&self, w: &Workload) -> u64 {
        if !self.decoder {
            return 0;
        }
        let rows = if w.all_logits { w.rows() } else { w.batch };
        rows.saturating_mul(self.vocab * 4)
    }

    /// Floating-point operations of one block for `rows` new tokens that
    /// attend to `context` positions: two per multiply-add of the
    /// projections and the MLP, and of the scores and their weighted sum.
    pub fn block_flops(&self, rows: u64, context: u64) -> f64 {
        self.linear_flops(rows) + self.attention_flops(rows, context as f64)
    }

    /// Floating-point operations of one block's linears (projections and
    /// MLP) for `rows` tokens.
    pub fn linear_flops(&self, rows: u64) -> f64 {
        let (h, i) = (self.hidden as f64, self.intermediate as f64);
        let q = (self.heads * self.head_dim) as f64;
        let k = (self.kv_heads * self.head_dim) as f64;
        let projections = h * (2.0 * q + 2.0 * k);
        let mlp = match self.mlp {
            MlpKind::Gated | MlpKind::FusedGated => 3.0 * h * i,
            MlpKind::Plain => 2.0 * h * i,
        };
        2.0 * rows as f64 * (projections + mlp)
    }

    /// Elements one row passes through a block's element-wise ops: (simple
    /// ones: the two norms and residual adds, the rotation of queries and
    /// keys, the MLP's product; activations: the MLP's non-linearity).
    pub fn elementwise_per_row(&self) -> (u64, u64) {
        let rotated = if self.rotary {
            (self.heads + self.kv_heads) * self.head_dim
        } else {
            0
        };
        let product = match self.mlp {
            MlpKind::Gated | MlpKind::FusedGated => self.intermediate,
            MlpKind::Plain => 0,
        };
        (4 * self.hidden + rotated + product, self.intermediate)
    }

    /// Floating-point operations of one block's attention for `rows`
    /// tokens attending to `context` positions on average: per row and
    /// head, `2 · head_dim` per key for the scores and as many for the
    /// weighted sum of values.
    pub fn attention_flops(&self, rows: u64, context: f64) -> f64 {
        4.0 * rows as f64 * (self.heads * self.head_dim) as f64 * context
    }

    /// Floating-point operations of the head for `rows` tokens.
    pub fn head_flops(&self, rows: u64) -> f64 {
        2.0 * rows as f64 * (self.hidden * self.vocab) as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn llama_7b() -> ModelShape {
        ModelShape {
            hidden: 4096,
            intermediate: 11008,
            heads: 32,
            kv_heads: 32,
            head_dim: 128,
            vocab: 32000,
            layers: 32,
            mlp: MlpKind::Gated,
            fused_qkv: false,
            rotary: true,
            post_norms: false,
            decoder: true,
            experts_per_token: 0,
        }
    }

    #[test]
    fn llama_7b_runtime_items() {
        let w = Workload {
            batch: 1,
            prompt_len: 4096,
            max_seq_len: 4096,
            all_logits: false,
        };
        let s = llama_7b();
        // 2 · 4096 · 4096 tokens · 2 bytes = 64 MiB per layer, 2 GiB in all.
        assert_eq!(s.kv_bytes_per_layer(&w, 2), 64 << 20);
        // MLP step: input, norm, q, k, v, rotated q and k (7·4096), the
        // attention output, projection, sum and norm (4·4096), 4·11008.
        assert_eq!(s.activation_peak(&w, 2), 4096 * (11 * 4096 + 4 * 11008) * 2);
        assert_eq!(s.logits_bytes(&w), 32000 * 4);
        let all = Workload {
            all_logits: true,
            ..w
        };
        assert_eq!(s.logits_bytes(&all), 4096 * 32000 * 4);
        // About 2 · 6.5e9 / 32 flops per token per layer, and 2·7e9 per token in all.
        let per_token = s.block_flops(1, 1) * 32.0 + s.head_flops(1);
        assert!((per_token / 13.0e9 - 1.0).abs() < 0.05, "{per_token}");
    }

    #[test]
    fn ledger_adds_orders_and_finds_shortfalls() {
        let mut l = Ledger::default();
        l.add(Device::Cpu, LedgerItem::Weights, 10);
        l.add(Device::Gpu(0), LedgerItem::KvCache, 5);
        l.add(Device::Gpu(0), LedgerItem::Weights, 7);
        l.add(Device::Gpu(0), LedgerItem::Weights, 1);
        l.add(Device::Gpu(0), LedgerItem::Logits, 0);
        assert_eq!(
            l.devices().collect::<Vec<_>>(),
            [Device::Gpu(0), Device::Cpu]
        );
        assert_eq!(
            l.items(Device::Gpu(0)),
            [(LedgerItem::Weights, 8), (LedgerItem::KvCache, 5)]
        );
        assert_eq!(l.total(Device::Gpu(0)), 13);
        let budgets = MaxMemory::new([(Device::Gpu(0), 12), (Device::Cpu, 10)]).unwrap();
        let short = l.shortfalls(&budgets);
        assert_eq!(short.len(), 1);
        assert_eq!(short[0].short_by(), 1);
        assert!(
            short[0].to_string().starts_with("0 is short by 1 B"),
            "{}",
            short[0]
        );
        assert_eq!(
            l.to_json(),
            serde_json::json!({"0": {"weights": 8, "kv_cache": 5}, "cpu": {"weights": 10}})
        );
    }
}
