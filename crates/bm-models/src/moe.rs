//! The sparse MLP of the mixture-of-experts families (Mixtral, Qwen2-MoE,
//! Qwen3-MoE), as transformers' eager experts loop computes it: the router
//! picks each token's experts, each expert some token picked runs on the
//! rows of its tokens, and their outputs are summed, weighted.
//!
//! Only the experts the router picked for the tokens of this pass are
//! fetched from the [`WeightSource`] (all the picked ones in a prefill, at
//! most `top_k` per layer in a decode step), one expert at a time: a
//! source that streams offloaded weights on demand (expert-level offload)
//! then moves no other expert's bytes.

use crate::decoder::{Decoder, fetch_linear};
use crate::family::Moe;
use crate::ops::{self, ExpertSum, Routing};
use crate::weights::{LinearWeight, WeightLayout, WeightSource};
use crate::{Error, Tensor};

impl Decoder {
    /// The sparse MLP of layer `block` on the normed `x` (`[seq, hidden]`).
    pub(crate) fn sparse_mlp(
        &self,
        src: &dyn WeightSource,
        block: &str,
        x: &Tensor,
        moe: &Moe,
    ) -> Result<Tensor, Error> {
        let c = self.config();
        let hidden = c.hidden_size;
        let prefix = format!("{block}.{}", moe.layout.block());
        let router = fetch_linear(
            src,
            &format!("{prefix}.gate.weight"),
            [moe.experts, hidden],
            WeightLayout::Linear,
        )?;
        let mut routing = Routing::new(&router.forward(x, None)?, moe.top_k, moe.renormalize)?;
        if moe.round_weights {
            routing.round_weights(self.dtype());
        }
        let seq = x.shape()[0];
        let mut sum = ExpertSum::new(self.dtype(), seq, hidden);
        for expert in routing.selected() {
            let (tokens, weights) = routing.assignments(expert);
            let rows = ops::gather_rows(x, &tokens)?;
            let name = format!("{prefix}.experts.{expert}");
            let y = self.gated(
                src,
                &name,
                moe.layout.projections(),
                moe.expert_intermediate_size,
                &rows,
            )?;
            sum.add(&tokens, &y, &weights)?;
        }
        if let Some(width) = moe.shared_expert_intermediate_size {
            let shared = self.gated(
                src,
                &format!("{prefix}.shared_expert"),
                ["gate_proj", "up_proj", "down_proj"],
                width,
                x,
            )?;
            let gate = fetch_linear(
                src,
                &format!("{prefix}.shared_expert_gate.weight"),
                [1, hidden],
                WeightLayout::Linear,
            )?;
            let scale = ops::sigmoid_values(&gate.forward(x, None)?)?;
            let all: Vec<usize> = (0..seq).collect();
            sum.add(&all, &shared, &scale)?;
        }
        Ok(sum.into_tensor()?)
    }

    /// `down(act(gate(x)) · up(x))` of the gated MLP `module`, whose three
    /// linear layers (no biases) are named by `[gate, up, down]`.
    fn gated(
        &self,
        src: &dyn WeightSource,
        module: &str,
        [gate, up, down]: [&str; 3],
        width: usize,
        x: &Tensor,
    ) -> Result<Tensor, Error> {
        let hidden = self.config().hidden_size;
        let weight = |name: &str, shape: [usize; 2]| -> Result<LinearWeight, Error> {
            fetch_linear(
                src,
                &format!("{module}.{name}.weight"),
                shape,
                WeightLayout::Linear,
            )
        };
        let g = weight(gate, [width, hidden])?.forward(x, None)?;
        let u = weight(up, [width, hidden])?.forward(x, None)?;
        let act = self.config().activation.apply(&g)?;
        weight(down, [hidden, width])?.forward(&ops::mul(&act, &u)?, None)
    }
}
