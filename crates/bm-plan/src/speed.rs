//! The speed objective (`bigmodel plan --objective speed`): of the
//! placements that fit the budgets, the one with the lowest predicted
//! seconds per token ([`crate::predict`]).
//!
//! The search places the blocks of a pass ([`Pass`]) on *tiers*: the first
//! GPU with a budget (the execution device when there is one), `cpu` and
//! `disk` (when the budgets or the default plan use it). A tier is where a
//! block's weights rest: on the execution device it stays resident, on
//! another tier it streams from there (RAM or disk) every pass. Every block
//! that is not a layer (embedding, final norm, head) picks its tier on its
//! own; the layers, alike in size and cost, are counted per tier and placed
//! in order, fastest tier first (in the cost model a pass costs the same
//! whichever layers stream, up to the first block's unhidden transfer). So
//! the search enumerates every `(tiers ^ other blocks) × (layer counts)`
//! combination: for a 3-tier, 80-layer model with three other blocks,
//! 27 × 3321 placements, each costed in microseconds from the blocks sized
//! once. Past a million placements (many blocks that are not layers, as an
//! encoder–decoder's encoder) those blocks keep the default plan's tier.
//!
//! A placement is kept when its weights fit each tier's budget less what
//! the default plan's ledger charges there besides weights (KV cache,
//! activations, streaming room, overheads); the fastest of those are then
//! checked, in order, against the full ledger ([`crate::auto::ledger`]),
//! and the first that fits is compared with the default plan and with the
//! default planner at prefetch depths 0 to 3. Ties go to the default plan.

use crate::Error;
use crate::auto::ledger;
use crate::device::Device;
use crate::hf::HfModel;
use crate::ledger::{LedgerItem, Workload};
use crate::plan::{Compat, DeviceMap, Plan, PlanOptions, check_device_map};
use crate::plan_with;
use crate::predict::{BlockKind, Calibration, Pass, Prediction};
use crate::sizes::SizeRule;
use crate::tree::ModuleTree;

/// How many of the fastest placements that fit on paper are checked against
/// the full ledger before the search settles for the default.
const CHECKED: usize = 64;
/// The most placements costed: past it (a model with many blocks that are
/// not layers, such as an encoder–decoder's encoder), those blocks keep the
/// default plan's tier and only the layers are searched.
const MAX_PLACEMENTS: u128 = 1 << 20;

/// What the speed objective chose.
#[derive(Clone, Debug)]
pub struct Fastest {
    /// The plan (the default plan itself when nothing is faster).
    pub plan: Plan,
    /// Its prediction.
    pub prediction: Prediction,
    /// The default plan's prediction, for comparison.
    pub default: Prediction,
    /// Placements costed.
    pub searched: usize,
}

/// Searches placements of `model` (sized as `tree`, which may be a
/// quantized copy of `model.tree`) for the lowest predicted seconds per
/// token under `options`' budgets; `default` is the plan the default
/// planner made with `options`.
pub fn fastest(
    model: &HfModel,
    tree: &ModuleTree,
    options: &PlanOptions,
    default: &Plan,
    workload: &Workload,
    calibration: &Calibration,
) -> Result<Fastest, Error> {
    let mut options = options.clone();
    options.prefetch_depth = default.prefetch_depth;
    let predict_map = |map: &DeviceMap, options: &PlanOptions| {
        crate::predict::predict(model, map, options, workload, calibration)
    };
    let default_prediction = predict_map(&default.device_map, &options)?;
    let mut best = (default.clone(), default_prediction);
    let mut searched = 1;

    // The default planner at other prefetch depths: deeper prefetch hides
    // more transfer but holds more streaming room.
    for depth in 0..=3 {
        if depth == options.prefetch_depth {
            continue;
        }
        let mut candidate = options.clone();
        candidate.prefetch_depth = depth;
        let Ok(plan) = plan_with(tree, &candidate, Compat::Auto) else {
            continue;
        };
        candidate.prefetch_depth = plan.prefetch_depth;
        searched += 1;
        let prediction = predict_map(&plan.device_map, &candidate)?;
        if prediction.seconds_per_token < best.1.seconds_per_token {
            best = (plan, prediction);
        }
    }

    // Placements of the blocks on tiers.
    let pass = Pass::of(model, &options);
    let tiers = tiers(&options, default);
    let room: Vec<u64> = tiers
        .iter()
        .map(|&d| {
            let budget = default.max_memory.get(d).unwrap_or(u64::MAX);
            let charged = default.ledger.total(d) - default.ledger.get(d, LedgerItem::Weights);
            budget.saturating_sub(charged)
        })
        .collect();
    let default_tiers: Vec<Option<usize>> = pass
        .placement(&default.device_map)?
        .iter()
        .map(|d| tiers.iter().position(|t| t == d))
        .collect();
    let ranked = rank_placements(&pass, &tiers, &room, &default_tiers, |placement| {
        searched += 1;
        pass.predict(
            &model.shape,
            placement,
            options.prefetch_depth,
            workload,
            calibration,
        )
        .map(|p| p.seconds_per_token)
    })?;
    for (seconds, placement) in ranked {
        if seconds >= best.1.seconds_per_token {
            break;
        }
        let map = DeviceMap::from_entries(
            pass.blocks()
                .iter()
                .zip(&placement)
                .map(|(b, d)| (b.name.clone(), *d))
                .collect(),
        );
        if check_device_map(tree, &map).is_err() {
            continue;
        }
        let Ok(ledger) = ledger(tree, &map, &options) else {
            continue;
        };
        if !ledger.shortfalls(&default.max_memory).is_empty() {
            continue;
        }
        let prediction = pass.predict(
            &model.shape,
            &placement,
            options.prefetch_depth,
            workload,
            calibration,
        )?;
        let plan = Plan {
            device_bytes: device_bytes(tree, &map, &options),
            device_map: map,
            max_memory: default.max_memory.clone(),
            ledger,
            prefetch_depth: options.prefetch_depth,
            ..Plan::default()
        };
        if prediction.seconds_per_token < best.1.seconds_per_token {
            best = (plan, prediction);
        }
        break;
    }
    let (plan, prediction) = best;
    Ok(Fastest {
        plan,
        prediction,
        default: default_prediction,
        searched,
    })
}

/// The tiers blocks may rest on, fastest first: the first GPU with a
/// budget, `cpu`, and `disk` when the budgets name it or the default plan
/// uses it.
fn tiers(options: &PlanOptions, default: &Plan) -> Vec<Device> {
    let budgets = &options.max_memory;
    let mut tiers: Vec<Device> = budgets
        .gpus()
        .filter(|(_, b)| *b > 0)
        .map(|(i, _)| Device::Gpu(i))
        .take(1)
        .collect();
    if budgets.get(Device::Cpu).is_some_and(|b| b > 0) {
        tiers.push(Device::Cpu);
    }
    let disk_used = default.device_map.iter().any(|(_, d)| d == Device::Disk);
    if budgets.get(Device::Disk).is_some_and(|b| b > 0) || disk_used {
        tiers.push(Device::Disk);
    }
    tiers
}

/// Every placement of `pass`'s blocks on `tiers` whose weights fit `room`
/// (bytes per tier), costed by `cost`; the [`CHECKED`] cheapest, cheapest
/// first. Blocks that are not layers pick a tier each (or, past
/// [`MAX_PLACEMENTS`], keep `default_tiers`' where it has one); the layers
/// are counted per tier and placed in order, the first tier first.
fn rank_placements(
    pass: &Pass,
    tiers: &[Device],
    room: &[u64],
    default_tiers: &[Option<usize>],
    mut cost: impl FnMut(&[Device]) -> Result<f64, Error>,
) -> Result<Vec<(f64, Vec<Device>)>, Error> {
    let blocks = pass.blocks();
    let layers: Vec<usize> = (0..blocks.len())
        .filter(|&i| blocks[i].kind == BlockKind::Layer)
        .collect();
    let others: Vec<usize> = (0..blocks.len())
        .filter(|&i| blocks[i].kind != BlockKind::Layer)
        .collect();
    let mut ranked: Vec<(f64, Vec<Device>)> = Vec::new();
    if tiers.is_empty() {
        return Ok(ranked);
    }
    // Layer counts per tier: C(layers + tiers - 1, tiers - 1).
    let compositions =
        (1..tiers.len() as u128).fold(1u128, |c, i| c.saturating_mul(layers.len() as u128 + i) / i);
    let all_choices = (tiers.len() as u128)
        .checked_pow(others.len() as u32)
        .unwrap_or(u128::MAX);
    // The tiers each other block may take.
    let options: Vec<Vec<usize>> = others
        .iter()
        .map(|&b| match default_tiers[b] {
            Some(t) if all_choices.saturating_mul(compositions) > MAX_PLACEMENTS => vec![t],
            _ => (0..tiers.len()).collect(),
        })
        .collect();
    let mut placement = vec![tiers[0]; blocks.len()];
    let mut choice = vec![0usize; others.len()];
    loop {
        for ((&block, &pick), allowed) in others.iter().zip(&choice).zip(&options) {
            placement[block] = tiers[allowed[pick]];
        }
        let mut counts = vec![0usize; tiers.len()];
        counts[tiers.len() - 1] = layers.len();
        loop {
            let mut next = 0;
            for (tier, &count) in counts.iter().enumerate() {
                for &block in &layers[next..next + count] {
                    placement[block] = tiers[tier];
                }
                next += count;
            }
            let fits = tiers.iter().zip(room).all(|(&tier, &room)| {
                let used: u64 = blocks
                    .iter()
                    .zip(&placement)
                    .filter(|(_, d)| **d == tier)
                    .map(|(b, _)| b.bytes)
                    .sum();
                used <= room
            });
            if fits {
                let seconds = cost(&placement)?;
                let at = ranked.partition_point(|(s, _)| *s <= seconds);
                if at < CHECKED {
                    ranked.insert(at, (seconds, placement.clone()));
                    ranked.truncate(CHECKED);
                }
            }
            if !next_composition(&mut counts) {
                break;
            }
        }
        if !next_choice(&mut choice, &options) {
            break;
        }
    }
    Ok(ranked)
}

/// Steps `counts` (non-negative, fixed sum) to the next composition, from
/// everything in the last part to everything in the first; false after
/// the last.
fn next_composition(counts: &mut [usize]) -> bool {
    // Move one unit from the last non-empty part after the first to the
    // part before it, and everything after that part back to the end.
    let n = counts.len();
    let Some(i) = (1..n).rev().find(|&i| counts[i] > 0) else {
        return false;
    };
    counts[i - 1] += 1;
    let rest: usize = counts[i..].iter().sum::<usize>() - 1;
    for c in &mut counts[i..] {
        *c = 0;
    }
    counts[n - 1] = rest;
    true
}

/// Steps `choice` (digit `i` below `options[i].len()`) to the next one;
/// false after the last.
fn next_choice<T>(choice: &mut [usize], options: &[Vec<T>]) -> bool {
    for (digit, allowed) in choice.iter_mut().zip(options) {
        *digit += 1;
        if *digit < allowed.len() {
            return true;
        }
        *digit = 0;
    }
    false
}

/// Bytes per device under `map`, in device order.
fn device_bytes(tree: &ModuleTree, map: &DeviceMap, options: &PlanOptions) -> Vec<(Device, u64)> {
    let sizes = options.sizes(tree, SizeRule::Loaded);
    map.bytes_per_device(tree, &sizes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::HfConfig;
    use crate::device::MaxMemory;
    use crate::hf::tree_from_config;
    use crate::predict::{CpuRates, DiskRates, GpuRates};

    /// A Llama of four small layers (the embedding and head as large as a
    /// layer, so which of them stays resident matters).
    fn model() -> HfModel {
        let config = serde_json::json!({
            "model_type": "llama",
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "vocab_size": 512,
            "max_position_embeddings": 128,
            "torch_dtype": "float32",
        });
        tree_from_config(&HfConfig::from_value(config, "config.json").unwrap()).unwrap()
    }

    /// A made-up machine: `cold` makes the disk slow and the page cache too
    /// small to hold what is offloaded.
    fn calibration(cold: bool, gpu: bool) -> Calibration {
        Calibration {
            cpu: CpuRates {
                gemm_flops: 20e9,
                gemm_weight_bytes_per_second: 8e9,
                gemv_bytes_per_second: 4e9,
                gemv_cached_bytes_per_second: 8e9,
                last_level_cache_bytes: 0,
                attention_flops: 2e9,
                attention_score_seconds: 5e-9,
                elementwise_seconds: 1e-9,
                activation_seconds: 3e-9,
                op_seconds: 5e-6,
                memory_bytes_per_second: 8e9,
                tensor_seconds: 1e-6,
                startup_seconds: 2e-3,
            },
            host_available_bytes: if cold { 0 } else { 1 << 40 },
            disk: Some(DiskRates {
                cold_bytes_per_second: Some(50e6),
                warm_bytes_per_second: 2e9,
                first_touch_bytes_per_second: 4e9,
                mapped_tensor_seconds: 20e-6,
            }),
            gpus: gpu
                .then_some(GpuRates {
                    ordinal: 0,
                    pinned_h2d_bytes_per_second: 2e9,
                    pageable_h2d_bytes_per_second: 1e9,
                    gemm_flops: Some(1e12),
                    context_bytes: 0,
                })
                .into_iter()
                .collect(),
        }
    }

    fn workload() -> Workload {
        Workload {
            batch: 1,
            prompt_len: 8,
            max_seq_len: 40,
            all_logits: false,
        }
    }

    fn options(model: &HfModel, budgets: &str) -> PlanOptions {
        let mut options = PlanOptions {
            max_memory: MaxMemory::parse(budgets).unwrap(),
            max_memory_from_user: true,
            no_split: model.no_split.clone(),
            ..PlanOptions::default()
        };
        let on_gpu = options.max_memory.gpus().any(|(_, b)| b > 0);
        model
            .runtime_charges(&workload(), on_gpu, model.dtype)
            .apply(&mut options);
        options
    }

    /// The fastest placement of every block on every tier that fits the
    /// full ledger, by brute force, and how many fit.
    fn enumerated_optimum(
        model: &HfModel,
        options: &PlanOptions,
        tiers: &[Device],
        calibration: &Calibration,
    ) -> (f64, usize) {
        let pass = Pass::of(model, options);
        let blocks = pass.blocks();
        let mut choice = vec![0usize; blocks.len()];
        let allowed = vec![tiers.to_vec(); blocks.len()];
        let mut best = f64::INFINITY;
        let mut fitting = 0;
        loop {
            let placement: Vec<Device> = choice.iter().map(|&t| tiers[t]).collect();
            let map = DeviceMap::from_entries(
                blocks
                    .iter()
                    .zip(&placement)
                    .map(|(b, d)| (b.name.clone(), *d))
                    .collect(),
            );
            let ledger = ledger(&model.tree, &map, options).unwrap();
            if ledger.shortfalls(&options.max_memory).is_empty() {
                fitting += 1;
                let p = pass
                    .predict(
                        &model.shape,
                        &placement,
                        options.prefetch_depth,
                        &workload(),
                        calibration,
                    )
                    .unwrap();
                best = best.min(p.seconds_per_token);
            }
            if !next_choice(&mut choice, &allowed) {
                return (best, fitting);
            }
        }
    }

    fn check(budgets: &str, tiers: &[Device], calibration: &Calibration) -> Fastest {
        let model = model();
        let options = options(&model, budgets);
        let default = plan_with(&model.tree, &options, Compat::Auto).unwrap();
        let mut at_depth = options.clone();
        at_depth.prefetch_depth = default.prefetch_depth;
        let (optimum, fitting) = enumerated_optimum(&model, &at_depth, tiers, calibration);
        assert!(fitting > 1, "{budgets}: {fitting} placements fit");
        let found = fastest(
            &model,
            &model.tree,
            &options,
            &default,
            &workload(),
            calibration,
        )
        .unwrap();
        let seconds = found.prediction.seconds_per_token;
        assert!(
            (seconds - optimum).abs() <= 1e-12 * optimum.max(1e-9),
            "{budgets}: found {seconds}, the optimum is {optimum}"
        );
        // What it found fits and predicts as reported.
        assert!(found.plan.ledger.shortfalls(&options.max_memory).is_empty());
        let again = crate::predict::predict(
            &model,
            &found.plan.device_map,
            &at_depth,
            &workload(),
            calibration,
        )
        .unwrap();
        assert_eq!(again, found.prediction);
        assert!(seconds <= found.default.seconds_per_token);
        found
    }

    #[test]
    fn compositions_and_choices_are_enumerated_once_each() {
        let mut counts = vec![0, 0, 3];
        let mut seen = vec![counts.clone()];
        while next_composition(&mut counts) {
            assert_eq!(counts.iter().sum::<usize>(), 3);
            seen.push(counts.clone());
        }
        seen.sort();
        seen.dedup();
        assert_eq!(seen.len(), 10);
        let mut choice = vec![0, 0];
        let options = [vec![0, 1, 2], vec![0, 1]];
        let mut n = 1;
        while next_choice(&mut choice, &options) {
            n += 1;
        }
        assert_eq!(n, 6);
    }

    #[test]
    fn the_search_finds_the_enumerated_optimum_on_the_cpu() {
        let tiers = [Device::Cpu, Device::Disk];
        // Cold disk: what stays resident matters; the embedding, read by
        // rows, is the block to offload first, which the default planner
        // (in order) keeps.
        let cold = calibration(true, false);
        let found = check("cpu=500KB,disk=10MB", &tiers, &cold);
        assert_eq!(
            found.plan.device_map.get("model.embed_tokens"),
            Some(Device::Disk)
        );
        assert!(found.prediction.seconds_per_token < found.default.seconds_per_token);
        check("cpu=300KB,disk=10MB", &tiers, &cold);
        // Warm: only the hand-off of mapped tensors differs.
        check("cpu=500KB,disk=10MB", &tiers, &calibration(false, false));
    }

    #[test]
    fn the_search_finds_the_enumerated_optimum_with_a_gpu() {
        let tiers = [Device::Gpu(0), Device::Cpu, Device::Disk];
        let gpu = calibration(false, true);
        check("0=400KB,cpu=300KB,disk=10MB", &tiers, &gpu);
        check(
            "0=600KB,cpu=200KB,disk=10MB",
            &tiers,
            &calibration(true, true),
        );
    }
}
