//! Scaled dot-product attention on the CPU.

use rayon::prelude::*;

use super::{soft_cap, softmax_row};
use crate::ops::{Heads, Mask, Scores};

/// Multiply-adds of attention's scores (queries × keys × head width ×
/// heads) below which its heads run on the calling thread.
const SERIAL_ATTENTION_WORK: usize = 1 << 20;

/// Scaled dot-product attention for `s` queries of each of `batch`
/// sequences against `t` cached keys/values of each; the queries are the
/// last `s` positions. Rows are time-major (row `i * batch + b` is
/// sequence b at position i), and sequence b attends to no position before
/// `first[b]` (its left padding). Grouped-query attention: query head h
/// reads kv head h / (heads / kv_heads). Scores are `q · k` times
/// `scores.scale`, soft-capped when asked, plus, when a bias is given, its
/// value for head h and the relative position `key - query`, at
/// `bias[h * (t + s - 1) + key - query + t - 1]`. A query that sees no key
/// (a padding row) gets zeros.
pub(crate) fn attention(
    q: &[f32],
    keys: &[f32],
    values: &[f32],
    heads: Heads,
    (mask, scores, bias): (Mask, Scores, Option<&[f32]>),
    first: &[usize],
    out: &mut [f32],
) {
    let Heads {
        heads: nh,
        kv_heads: nkv,
        head_dim: hd,
    } = heads;
    let batch = first.len();
    let (q_width, kv_width) = (nh * hd, nkv * hd);
    let rows = q.len() / q_width;
    let s = rows / batch;
    let t = keys.len() / (kv_width * batch);
    // Only causal masks look at positions, and they have s <= t.
    let past = t.saturating_sub(s);
    let group = nh / nkv;
    let Scores { scale, softcap } = scores;
    let head = |h: usize| {
        let g = h / group;
        let mut o = vec![0f32; rows * hd];
        let mut row = Vec::with_capacity(t);
        for r in 0..rows {
            let (i, b) = (r / batch, r % batch);
            let pos = past + i;
            let (lo, hi) = match mask {
                Mask::Bidirectional => (0, t),
                Mask::Causal => (0, pos + 1),
                Mask::SlidingWindow(w) => ((pos + 1).saturating_sub(w), pos + 1),
            };
            let lo = lo.max(first[b]);
            if lo >= hi {
                continue;
            }
            let key = |j: usize| (j * batch + b) * kv_width + g * hd;
            let qi = &q[r * q_width + h * hd..][..hd];
            row.clear();
            row.extend((lo..hi).map(|j| {
                let kj = &keys[key(j)..][..hd];
                let score = qi.iter().zip(kj).map(|(a, b)| a * b).sum::<f32>() * scale;
                let score = match softcap {
                    Some(cap) => soft_cap(score, cap),
                    None => score,
                };
                // key - query + t - 1 = j - (past + i) + t - 1.
                match bias {
                    Some(bias) => score + bias[h * (t + s - 1) + j + s - 1 - i],
                    None => score,
                }
            }));
            softmax_row(&mut row);
            let oi = &mut o[r * hd..][..hd];
            for (p, j) in row.iter().zip(lo..hi) {
                let vj = &values[key(j)..][..hd];
                for (acc, v) in oi.iter_mut().zip(vj) {
                    *acc += p * v;
                }
            }
        }
        o
    };
    // A decode step over a short cache is a few microseconds of work per
    // layer: less than waking and joining the threads costs.
    let per_head: Vec<Vec<f32>> = if rows * t * hd * nh < SERIAL_ATTENTION_WORK {
        (0..nh).map(head).collect()
    } else {
        (0..nh).into_par_iter().map(head).collect()
    };
    for (h, o) in per_head.iter().enumerate() {
        for r in 0..rows {
            out[r * q_width + h * hd..][..hd].copy_from_slice(&o[r * hd..][..hd]);
        }
    }
}
