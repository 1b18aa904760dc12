//! Mixture-of-experts routing and combining, as transformers' eager
//! experts loop does them (Mixtral, Qwen2-MoE, Qwen3-MoE):
//!
//! * [`Routing`]: softmax over each token's router logits in f32, the `k`
//!   most probable experts (ties to the lower index), optionally divided
//!   by their sum;
//! * [`gather_rows`]: the rows (tokens) one expert computes;
//! * [`ExpertSum`]: the output, zero, to which each expert adds its
//!   weighted rows, `out[t] = round(out[t] + round(y · w))` in the compute
//!   dtype, experts in increasing index order as `index_add_` adds them.
//!
//! The routing decisions need the logits on the host, and the sum is
//! accumulated there: operands on a GPU are copied to the host first (a
//! token's row is small next to the experts' weights, which stay where the
//! matmuls run).

use bm_tensor::DType;

use crate::ops::{bad, rounding, rows_cols};
use crate::{Error, Tensor};

/// Which experts each token goes to, and with what weight.
#[derive(Clone, Debug, PartialEq)]
pub struct Routing {
    experts: usize,
    top_k: usize,
    /// `[tokens, top_k]` expert indices, most probable first.
    picks: Vec<usize>,
    /// `[tokens, top_k]` routing weights (f32).
    weights: Vec<f32>,
}

impl Routing {
    /// Routes each row of `logits` (`[tokens, experts]`, a router's
    /// output): the softmax computed in f32, the `top_k` largest
    /// probabilities (equal ones in index order), divided by their sum when
    /// `renormalize`.
    pub fn new(logits: &Tensor, top_k: usize, renormalize: bool) -> Result<Routing, Error> {
        let (tokens, experts) = rows_cols(logits);
        if logits.shape().len() != 2 || top_k == 0 || top_k > experts {
            return Err(bad(
                "routing",
                format!(
                    "cannot pick {top_k} experts from router logits of shape {:?}",
                    logits.shape()
                ),
            ));
        }
        let host = logits.to_host()?;
        let values = host.f32_values();
        let mut picks = Vec::with_capacity(tokens * top_k);
        let mut weights = Vec::with_capacity(tokens * top_k);
        let mut probs = vec![0f32; experts];
        let mut order: Vec<usize> = Vec::with_capacity(experts);
        for row in values.chunks_exact(experts) {
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let mut sum = 0f32;
            for (p, v) in probs.iter_mut().zip(row) {
                *p = (v - max).exp();
                sum += *p;
            }
            probs.iter_mut().for_each(|p| *p /= sum);
            order.clear();
            order.extend(0..experts);
            // Stable: equal probabilities keep index order.
            order.sort_by(|&a, &b| probs[b].total_cmp(&probs[a]));
            let top = &order[..top_k];
            let total: f32 = top.iter().map(|&e| probs[e]).sum();
            for &e in top {
                picks.push(e);
                weights.push(if renormalize {
                    probs[e] / total
                } else {
                    probs[e]
                });
            }
        }
        Ok(Routing {
            experts,
            top_k,
            picks,
            weights,
        })
    }

    /// Rounds the routing weights to `dtype` (Qwen's routers hand them out
    /// in the model's dtype; Mixtral's stay f32).
    pub fn round_weights(&mut self, dtype: DType) {
        let round = rounding(dtype);
        self.weights.iter_mut().for_each(|w| *w = round(*w));
    }

    /// Tokens routed.
    pub fn tokens(&self) -> usize {
        self.picks.len() / self.top_k
    }

    /// The experts token `token` goes to, most probable first.
    pub fn experts_of(&self, token: usize) -> &[usize] {
        &self.picks[token * self.top_k..(token + 1) * self.top_k]
    }

    /// The experts at least one token goes to, in increasing index order.
    pub fn selected(&self) -> Vec<usize> {
        let mut hit = vec![false; self.experts];
        self.picks.iter().for_each(|&e| hit[e] = true);
        (0..self.experts).filter(|&e| hit[e]).collect()
    }

    /// The tokens routed to `expert`, in increasing order, with their
    /// weights for it.
    pub fn assignments(&self, expert: usize) -> (Vec<usize>, Vec<f32>) {
        let mut tokens = Vec::new();
        let mut weights = Vec::new();
        for (i, (&e, &w)) in self.picks.iter().zip(&self.weights).enumerate() {
            if e == expert {
                tokens.push(i / self.top_k);
                weights.push(w);
            }
        }
        (tokens, weights)
    }
}

/// Rows `rows` of `x` (`[tokens, width]`), in that order, as a host tensor
/// of `x`'s dtype.
pub fn gather_rows(x: &Tensor, rows: &[usize]) -> Result<Tensor, Error> {
    let (tokens, width) = rows_cols(x);
    if let Some(&r) = rows.iter().find(|&&r| r >= tokens) {
        return Err(bad(
            "gather_rows",
            format!("row {r} of a tensor of shape {:?}", x.shape()),
        ));
    }
    let host = x.to_host()?;
    let values = host.f32_values();
    Tensor::build(x.dtype(), &[rows.len(), width], |out| {
        for (o, &r) in out.chunks_exact_mut(width.max(1)).zip(rows) {
            o.copy_from_slice(&values[r * width..(r + 1) * width]);
        }
    })
}

/// The logistic function `1 / (1 + e^-x)` of each element, rounded to
/// `x`'s dtype, as host values (Qwen2-MoE's shared-expert gate).
pub fn sigmoid_values(x: &Tensor) -> Result<Vec<f32>, Error> {
    let round = rounding(x.dtype());
    let host = x.to_host()?;
    Ok(host
        .f32_values()
        .iter()
        .map(|v| round(1.0 / (1.0 + (-v).exp())))
        .collect())
}

/// The combined output of a MoE layer, `[tokens, width]`, to which experts
/// add their weighted rows.
#[derive(Debug)]
pub struct ExpertSum {
    dtype: DType,
    width: usize,
    values: Vec<f32>,
}

impl ExpertSum {
    /// Zeros in `dtype` for `tokens` rows of `width`.
    pub fn new(dtype: DType, tokens: usize, width: usize) -> ExpertSum {
        ExpertSum {
            dtype,
            width,
            values: vec![0.0; tokens * width],
        }
    }

    /// Adds `y` (`[rows.len(), width]`, row i for token `rows[i]`) scaled
    /// by `weights[i]`: each product and each sum rounded to the dtype.
    pub fn add(&mut self, rows: &[usize], y: &Tensor, weights: &[f32]) -> Result<(), Error> {
        let tokens = self.values.len() / self.width.max(1);
        if y.shape() != [rows.len(), self.width]
            || weights.len() != rows.len()
            || rows.iter().any(|&r| r >= tokens)
        {
            return Err(bad(
                "expert sum",
                format!(
                    "{} rows of shape {:?} with {} weights into [{tokens}, {}]",
                    rows.len(),
                    y.shape(),
                    weights.len(),
                    self.width
                ),
            ));
        }
        let round = rounding(self.dtype);
        let host = y.to_host()?;
        let ys = host.f32_values();
        for ((&r, &w), row) in rows.iter().zip(weights).zip(ys.chunks_exact(self.width)) {
            let out = &mut self.values[r * self.width..(r + 1) * self.width];
            for (o, v) in out.iter_mut().zip(row) {
                *o = round(*o + round(v * w));
            }
        }
        Ok(())
    }

    /// The sum as a host tensor.
    pub fn into_tensor(self) -> Result<Tensor, Error> {
        let tokens = self.values.len() / self.width.max(1);
        Tensor::from_f32(self.dtype, &[tokens, self.width], &self.values)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routing_picks_the_most_probable_experts_and_renormalises() {
        let logits = Tensor::from_f32(
            DType::F32,
            &[2, 4],
            &[0.0, 2.0, 1.0, 2.0, 3.0, 0.0, 1.0, 0.0],
        )
        .unwrap();
        let r = Routing::new(&logits, 2, true).unwrap();
        // Equal logits 1 and 3: index order.
        assert_eq!(r.experts_of(0), [1, 3]);
        assert_eq!(r.experts_of(1), [0, 2]);
        assert_eq!(r.selected(), [0, 1, 2, 3]);
        let (tokens, weights) = r.assignments(1);
        assert_eq!(tokens, [0]);
        assert!((weights[0] - 0.5).abs() < 1e-7);
        let plain = Routing::new(&logits, 2, false).unwrap();
        let (_, w) = plain.assignments(1);
        let e = std::f32::consts::E;
        let p = e * e / (1.0 + 2.0 * e * e + e);
        assert!((w[0] - p).abs() < 1e-6, "{} vs {p}", w[0]);
        assert!(Routing::new(&logits, 5, true).is_err());
    }

    #[test]
    fn expert_sums_round_products_and_sums_to_the_dtype() {
        let mut sum = ExpertSum::new(DType::BF16, 2, 2);
        let y = Tensor::from_f32(DType::BF16, &[1, 2], &[1.0, 3.0]).unwrap();
        sum.add(&[1], &y, &[1.0 / 3.0]).unwrap();
        sum.add(&[1], &y, &[1.0]).unwrap();
        let out = sum.into_tensor().unwrap().to_f32_vec();
        let third = half::bf16::from_f32(1.0 / 3.0).to_f32();
        let want = half::bf16::from_f32(third + 1.0).to_f32();
        assert_eq!(out, [0.0, 0.0, want, 4.0]);
        let mut sum = ExpertSum::new(DType::F32, 2, 2);
        assert!(sum.add(&[2], &y, &[1.0]).is_err());
        let x = Tensor::from_f32(DType::F32, &[3, 1], &[1.0, 2.0, 3.0]).unwrap();
        assert_eq!(gather_rows(&x, &[2, 0]).unwrap().to_f32_vec(), [3.0, 1.0]);
        assert!(gather_rows(&x, &[3]).is_err());
    }
}
