//! Choosing the next token from a row of logits: transformers' logits
//! processors (repetition penalty, temperature, top-k, top-p, in that
//! order), then the most likely token (greedy) or a draw from the
//! distribution with a seeded generator.
//!
//! The generator is PCG32 (O'Neill's `pcg32_random_r`, seeded as the
//! reference `pcg32_srandom_r(seed, stream)` does): small, well known and
//! the same on every platform, so a seed gives the same tokens everywhere.
//! Sequence i of a generation draws from stream i, so a prompt samples the
//! same tokens whichever batch it runs in. PyTorch's generator is another,
//! so a seed does not give transformers' tokens (docs/compat.md).

use crate::Error;

/// How the next token is chosen, with transformers' `GenerationConfig`
/// names and meanings. The default is greedy decoding.
#[derive(Clone, Debug, PartialEq)]
pub struct Sampling {
    /// Draw the token from the processed distribution (`do_sample`);
    /// otherwise take the most likely one.
    pub do_sample: bool,
    /// Logits are divided by it before sampling (`temperature`, > 0).
    pub temperature: f32,
    /// Only the `top_k` most likely tokens may be drawn; 0 for all.
    pub top_k: usize,
    /// Only the smallest set of most likely tokens whose probabilities add
    /// up to `top_p` may be drawn (`top_p`, in (0, 1]; 1 for all).
    pub top_p: f32,
    /// Logits of tokens already in the sequence (prompt included) are
    /// divided by it when positive, multiplied when negative
    /// (`repetition_penalty`, > 0; 1 for none). Applies to greedy decoding
    /// too, as in transformers.
    pub repetition_penalty: f32,
    /// The generator's seed.
    pub seed: u64,
}

impl Default for Sampling {
    fn default() -> Sampling {
        Sampling {
            do_sample: false,
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            repetition_penalty: 1.0,
            seed: 0,
        }
    }
}

impl Sampling {
    /// Checks every setting against its range, as transformers' processors
    /// do when built (sampling settings only when sampling).
    pub fn check(&self) -> Result<(), Error> {
        let bad = |option, message: &str| {
            Err(Error::BadGenerateOption {
                option,
                message: message.to_string(),
            })
        };
        let p = self.repetition_penalty;
        if !(p.is_finite() && p > 0.0) {
            return bad(
                "repetition_penalty",
                &format!("{p} is not a positive number"),
            );
        }
        if !self.do_sample {
            return Ok(());
        }
        let t = self.temperature;
        if !(t.is_finite() && t > 0.0) {
            return bad(
                "temperature",
                &format!("{t} is not a positive number (for greedy decoding, do not sample)"),
            );
        }
        let top_p = self.top_p;
        if !(top_p > 0.0 && top_p <= 1.0) {
            return bad("top_p", &format!("{top_p} is not in (0, 1]"));
        }
        Ok(())
    }

    /// transformers' logits processors on `logits`, the last position's
    /// row of a sequence whose tokens so far (prompt and generated) are
    /// `history`, in `generate`'s order: the repetition penalty, then, when
    /// sampling, temperature, top-k and top-p. Removed tokens become -inf.
    pub fn process(&self, logits: &mut [f32], history: &[u32]) {
        if self.repetition_penalty != 1.0 {
            repetition_penalty(logits, history, self.repetition_penalty);
        }
        if !self.do_sample {
            return;
        }
        if self.temperature != 1.0 {
            temperature(logits, self.temperature);
        }
        if self.top_k != 0 {
            top_k(logits, self.top_k);
        }
        if self.top_p < 1.0 {
            top_p(logits, self.top_p);
        }
    }

    /// The next token: [`Sampling::process`] on `logits` (in place), then
    /// the most likely token, or a draw from their softmax with `rng`.
    pub(crate) fn choose(&self, logits: &mut [f32], history: &[u32], rng: &mut Pcg32) -> u32 {
        self.process(logits, history);
        if self.do_sample {
            draw(logits, rng)
        } else {
            argmax(logits)
        }
    }
}

/// First index of the largest value (as `torch.argmax`).
fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, v) in row.iter().enumerate() {
        if *v > row[best] {
            best = i;
        }
    }
    best as u32
}

/// transformers' `RepetitionPenaltyLogitsProcessor`: the logit of every
/// token in `history` is divided by `penalty` when positive and multiplied
/// by it when negative (once per token, however often it occurs). Ids past
/// the row (a vocabulary larger than the head) are ignored, as there.
fn repetition_penalty(row: &mut [f32], history: &[u32], penalty: f32) {
    let mut seen = vec![false; row.len()];
    for &id in history {
        let i = id as usize;
        if i < row.len() && !seen[i] {
            seen[i] = true;
            let s = row[i];
            row[i] = if s < 0.0 { s * penalty } else { s / penalty };
        }
    }
}

/// transformers' `TemperatureLogitsWarper`: every logit divided by `t`.
fn temperature(row: &mut [f32], t: f32) {
    row.iter_mut().for_each(|v| *v /= t);
}

/// transformers' `TopKLogitsWarper`: logits below the k-th largest become
/// -inf (ties with it are kept).
fn top_k(row: &mut [f32], k: usize) {
    let k = k.clamp(1, row.len().max(1));
    let mut sorted = row.to_vec();
    sorted.sort_unstable_by(|a, b| b.total_cmp(a));
    let Some(&kth) = sorted.get(k - 1) else {
        return;
    };
    row.iter_mut()
        .filter(|v| **v < kth)
        .for_each(|v| *v = f32::NEG_INFINITY);
}

/// transformers' `TopPLogitsWarper`: with the logits sorted ascending and
/// their softmax summed from the least likely up, tokens whose running sum
/// is at most `1 - p` become -inf; the most likely token always stays.
/// The running sum is kept in f64 and stored in f32, as PyTorch's CPU
/// `cumsum` does.
fn top_p(row: &mut [f32], p: f32) {
    let mut order: Vec<usize> = (0..row.len()).collect();
    order.sort_by(|&a, &b| row[a].total_cmp(&row[b]));
    let sorted: Vec<f32> = order.iter().map(|&i| row[i]).collect();
    let probs = softmax(&sorted);
    let cut = 1.0 - p;
    let mut sum = 0f64;
    let last = order.len().saturating_sub(1);
    let mut remove = Vec::new();
    for (rank, (&i, q)) in order.iter().zip(&probs).enumerate() {
        sum += f64::from(*q);
        if (sum as f32) <= cut && rank < last {
            remove.push(i);
        }
    }
    for i in remove {
        row[i] = f32::NEG_INFINITY;
    }
}

/// Softmax in f32 (max subtracted first); -inf entries get 0.
fn softmax(row: &[f32]) -> Vec<f32> {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let exps: Vec<f32> = row.iter().map(|v| (v - max).exp()).collect();
    let sum: f32 = exps.iter().sum();
    exps.iter().map(|e| e / sum).collect()
}

/// A token drawn from `softmax(row)`: the first whose cumulative
/// probability passes a uniform draw in [0, 1).
fn draw(row: &[f32], rng: &mut Pcg32) -> u32 {
    let probs = softmax(row);
    let total: f64 = probs.iter().map(|&q| f64::from(q)).sum();
    let target = rng.uniform() * total;
    let mut sum = 0f64;
    let mut last_possible = 0;
    for (i, &q) in probs.iter().enumerate() {
        if q > 0.0 {
            sum += f64::from(q);
            last_possible = i;
            if sum > target {
                return i as u32;
            }
        }
    }
    // Rounding left the draw just past the last sum.
    last_possible as u32
}

/// PCG32 (PCG-XSH-RR, 64-bit state, 32-bit output): the reference
/// implementation's generator and seeding.
#[derive(Clone, Debug)]
pub(crate) struct Pcg32 {
    state: u64,
    increment: u64,
}

impl Pcg32 {
    const MULTIPLIER: u64 = 6_364_136_223_846_793_005;

    /// `pcg32_srandom_r(seed, stream)`.
    pub(crate) fn new(seed: u64, stream: u64) -> Pcg32 {
        let mut rng = Pcg32 {
            state: 0,
            increment: (stream << 1) | 1,
        };
        rng.next_u32();
        rng.state = rng.state.wrapping_add(seed);
        rng.next_u32();
        rng
    }

    /// `pcg32_random_r`.
    pub(crate) fn next_u32(&mut self) -> u32 {
        let old = self.state;
        self.state = old
            .wrapping_mul(Self::MULTIPLIER)
            .wrapping_add(self.increment);
        let xorshifted = (((old >> 18) ^ old) >> 27) as u32;
        xorshifted.rotate_right((old >> 59) as u32)
    }

    /// A uniform draw in [0, 1) from 53 random bits (two outputs).
    pub(crate) fn uniform(&mut self) -> f64 {
        let bits = (u64::from(self.next_u32()) << 32) | u64::from(self.next_u32());
        (bits >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pcg32_gives_the_reference_implementations_numbers() {
        // pcg32-demo's first outputs for pcg32_srandom_r(42, 54).
        let mut rng = Pcg32::new(42, 54);
        let got: Vec<u32> = (0..6).map(|_| rng.next_u32()).collect();
        assert_eq!(
            got,
            [
                0xa15c02b7, 0x7b47f409, 0xba1d3330, 0x83d2f293, 0xbfa4784b, 0xcbed606e
            ]
        );
        let u = Pcg32::new(7, 0).uniform();
        assert!((0.0..1.0).contains(&u));
    }

    #[test]
    fn greedy_is_argmax_after_the_repetition_penalty() {
        let sampling = Sampling::default();
        let mut rng = Pcg32::new(0, 0);
        assert_eq!(sampling.choose(&mut [0.1, 3.0, 2.0], &[], &mut rng), 1);
        let penalised = Sampling {
            repetition_penalty: 2.0,
            ..Sampling::default()
        };
        // 3.0 / 2 falls below 2.0; -1.0 * 2 stays negative.
        assert_eq!(penalised.choose(&mut [0.1, 3.0, 2.0], &[1, 1], &mut rng), 2);
        let mut row = [1.0, -1.0, 4.0];
        repetition_penalty(&mut row, &[0, 1, 1, 9], 2.0);
        assert_eq!(row, [0.5, -2.0, 4.0]);
    }

    #[test]
    fn top_k_keeps_ties_and_top_p_keeps_the_most_likely() {
        let mut row = [1.0, 3.0, 3.0, 2.0, 0.0];
        top_k(&mut row, 2);
        assert_eq!(
            row,
            [
                f32::NEG_INFINITY,
                3.0,
                3.0,
                f32::NEG_INFINITY,
                f32::NEG_INFINITY
            ]
        );
        let mut row = [0.0, 5.0, 1.0];
        top_p(&mut row, 0.01);
        assert_eq!(row, [f32::NEG_INFINITY, 5.0, f32::NEG_INFINITY]);
        let mut all = [0.0, 5.0, 1.0];
        top_p(&mut all, 1.0);
        assert_eq!(all, [0.0, 5.0, 1.0]);
    }

    #[test]
    fn draws_follow_the_distribution_and_never_pick_removed_tokens() {
        let mut rng = Pcg32::new(3, 1);
        let mut counts = [0usize; 3];
        for _ in 0..4000 {
            counts[draw(&[0.0, f32::NEG_INFINITY, 2f32.ln()], &mut rng) as usize] += 1;
        }
        assert_eq!(counts[1], 0);
        // Probabilities 1/3 and 2/3.
        let share = counts[2] as f64 / 4000.0;
        assert!((share - 2.0 / 3.0).abs() < 0.03, "{counts:?}");
    }

    #[test]
    fn out_of_range_settings_are_named() {
        let check = |s: Sampling| s.check().unwrap_err().to_string();
        let sampling = Sampling {
            do_sample: true,
            ..Sampling::default()
        };
        assert!(
            check(Sampling {
                temperature: 0.0,
                ..sampling.clone()
            })
            .starts_with("temperature: 0 is not a positive number")
        );
        assert!(
            check(Sampling {
                top_p: 1.5,
                ..sampling.clone()
            })
            .starts_with("top_p: 1.5")
        );
        assert!(
            check(Sampling {
                repetition_penalty: -1.0,
                ..Sampling::default()
            })
            .starts_with("repetition_penalty")
        );
        // Greedy decoding ignores the sampling settings, as transformers.
        Sampling {
            temperature: 0.0,
            ..Sampling::default()
        }
        .check()
        .unwrap();
    }
}
