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
//! own; the layers, alike in size and cost, are counted per *kind* and
//! placed in order (in the cost model a pass costs the same whichever
//! layers stream, up to the first block's unhidden transfer). A layer's
//! kinds are: whole on one tier, and, for a mixture-of-experts model, the
//! rest of it (attention, norms, router, shared expert) on the first tier
//! with its experts on a later tier. On the CPU that means the rest of the
//! layer resident and only the experts the router picks read from disk;
//! with a GPU, the rest resident on it and the picked experts uploaded
//! from RAM or disk when used, instead of every expert of an offloaded
//! layer streamed with it. The layers take the kinds in this order: whole
//! on the first tier, apart with the experts on each later tier in turn,
//! whole on each later tier.
//!
//! A block without weights (Llama's `rotary_emb`) rests on the execution
//! device: it needs no room and streams nothing, and only decides whether a
//! GPU executes when no block with weights rests on it, so it takes the
//! first tier, and the next too when the first is a GPU left empty.
//!
//! So the search enumerates every `(tiers ^ other blocks with weights) ×
//! (layer counts per kind)` combination: `tiers` kinds without experts,
//! `2 · tiers − 1` with them. For a 3-tier, 80-layer dense model with three other blocks,
//! 27 × C(82, 2) = 27 × 3321 placements; on the CPU alone (two tiers) a
//! 48-layer MoE has 8 × C(50, 2) = 8 × 1225; with a GPU a 32-layer one
//! has C(36, 4) = 58,905 layer placements. Each is costed in microseconds
//! from the blocks sized once. Past a million placements the blocks that
//! are not layers keep the default plan's tier (many such blocks, as an
//! encoder–decoder's encoder; a 32-layer MoE with a GPU), and where the
//! layer counts alone pass it, the experts of all the layers apart share
//! one tier, each tier in turn (an 80-layer MoE with a GPU: 2 × C(83, 3)
//! = 183,762 layer placements instead of C(84, 4) = 1,929,501).
//!
//! A placement is kept when its weights, and on the execution device the
//! streaming room it needs, fit each tier's budget less what the default
//! plan's ledger charges there besides both (KV cache, activations,
//! overheads); the fastest of those are then checked, in order, against
//! the full ledger ([`crate::auto::ledger`], counting experts apart as
//! `--experts-on` does), and the first that fits is compared with the
//! default plan and with the default planner at prefetch depths 0 to 3.
//! Ties go to the default plan. With a GPU the placements are searched at
//! the plan's prefetch depth and at 1 and 0 below it (the only depths the
//! cost model tells apart, [`depths`]); the plan found carries its depth.

use crate::Error;
use crate::auto::ledger;
use crate::device::Device;
use crate::experts::split;
use crate::hf::HfModel;
use crate::ledger::{LedgerItem, Workload};
use crate::plan::{Compat, DeviceMap, Plan, PlanOptions, check_device_map};
use crate::plan_with;
use crate::predict::{Block, BlockKind, Calibration, Pass, Prediction};
use crate::sizes::SizeRule;
use crate::tree::{ModuleTree, Node};

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
    // Room for weights and streaming: what each placement changes.
    let room: Vec<u64> = tiers
        .iter()
        .map(|&d| {
            let budget = default.max_memory.get(d).unwrap_or(u64::MAX);
            let charged = default.ledger.total(d)
                - default.ledger.get(d, LedgerItem::Weights)
                - default.ledger.get(d, LedgerItem::Streaming);
            budget.saturating_sub(charged)
        })
        .collect();
    let default_tiers: Vec<Option<usize>> = pass
        .placement(&default.device_map)?
        .iter()
        .map(|d| tiers.iter().position(|t| t == d))
        .collect();
    // A layer's experts may rest on any later tier than the rest of it.
    let has_experts = pass
        .blocks()
        .iter()
        .any(|b| matches!(b.kind, BlockKind::Experts { .. }));
    let experts_tiers: Vec<usize> = match has_experts {
        true => (1..tiers.len()).collect(),
        false => Vec::new(),
    };
    let mut ranked: Vec<(f64, usize, Vec<Device>)> = Vec::new();
    for depth in depths(&tiers, options.prefetch_depth) {
        let space = Space {
            tiers: &tiers,
            experts_tiers: &experts_tiers,
            room: &room,
            default_tiers: &default_tiers,
            prefetch_depth: depth,
        };
        let found = rank_placements(&pass, &space, |placement| {
            searched += 1;
            pass.predict(&model.shape, placement, depth, workload, calibration)
                .map(|p| p.seconds_per_token)
        })?;
        ranked.extend(found.into_iter().map(|(s, p)| (s, depth, p)));
    }
    // Stable: a tie goes to the depth searched first, the plan's.
    ranked.sort_by(|a, b| a.0.total_cmp(&b.0));
    for (seconds, depth, placement) in ranked {
        if seconds >= best.1.seconds_per_token {
            break;
        }
        let Ok(map) = map_of(tree, &pass, &placement) else {
            continue;
        };
        if check_device_map(tree, &map).is_err() {
            continue;
        }
        let at_depth = PlanOptions {
            prefetch_depth: depth,
            ..options.clone()
        };
        let Ok(ledger) = ledger(tree, &map, &ledger_options(&at_depth, &pass, &placement)) else {
            continue;
        };
        if !ledger.shortfalls(&default.max_memory).is_empty() {
            continue;
        }
        let prediction = pass.predict(&model.shape, &placement, depth, workload, calibration)?;
        let plan = Plan {
            device_bytes: device_bytes(tree, &map, &options),
            device_map: map,
            max_memory: default.max_memory.clone(),
            ledger,
            prefetch_depth: depth,
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

/// The prefetch depths placements on `tiers` are searched at, `asked` (the
/// plan's) first. With a GPU first, also 1 and 0 where below it: the cost
/// model overlaps a streamed block's transfer with the compute of the
/// block before it, so any depth from 1 predicts the same time and a
/// deeper one only holds more streaming room, and no prefetch (0) holds
/// the room of one offloaded unit instead of two, room a block may stay
/// resident in, at the price of every transfer in the open. On the CPU
/// the depth changes neither: offloaded weights are used in place.
fn depths(tiers: &[Device], asked: usize) -> Vec<usize> {
    let mut depths = vec![asked];
    if tiers.first().is_some_and(|t| t.is_gpu()) {
        depths.extend([1, 0].into_iter().filter(|&d| d < asked));
    }
    depths
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

/// The device map of `placement` (a device per block of `pass`): a key per
/// block, and a layer whose experts rest apart from the rest of it split
/// around them as [`crate::experts`] splits it (the search puts all the
/// experts lists of a layer on one device).
fn map_of(tree: &ModuleTree, pass: &Pass, placement: &[Device]) -> Result<DeviceMap, Error> {
    let blocks = pass.blocks();
    let module = |name: &str| match tree.find(name) {
        Some(Node::Module(m)) => Ok(m),
        _ => Err(Error::BadDeviceMap(format!("{name:?} is not a module"))),
    };
    let mut entries = Vec::with_capacity(blocks.len());
    for (i, (b, &on)) in blocks.iter().zip(placement).enumerate() {
        if matches!(b.kind, BlockKind::Experts { .. }) {
            continue;
        }
        let apart: Vec<usize> = (i + 1..blocks.len())
            .take_while(|&j| matches!(blocks[j].kind, BlockKind::Experts { .. }))
            .filter(|&j| placement[j] != on)
            .collect();
        match apart.first() {
            Some(&j) => {
                let lists = apart
                    .iter()
                    .map(|&l| module(&blocks[l].name))
                    .collect::<Result<Vec<_>, _>>()?;
                let layer = module(&b.name)?;
                split(tree, layer, on, &lists, placement[j], &mut entries);
            }
            None => entries.push((b.name.clone(), on)),
        }
    }
    Ok(DeviceMap::from_entries(entries))
}

/// `options` for the ledger of `placement`: where a layer's experts rest
/// apart from the rest of it, the experts are units of their own (as
/// `--experts-on` makes them), so the ledger counts each part where it
/// rests and streams an expert, not the whole layer, at a time.
fn ledger_options(options: &PlanOptions, pass: &Pass, placement: &[Device]) -> PlanOptions {
    let blocks = pass.blocks();
    let apart = (1..blocks.len()).find(|&i| {
        matches!(blocks[i].kind, BlockKind::Experts { .. }) && placement[i] != placement[i - 1]
    });
    let mut options = options.clone();
    if let Some(i) = apart {
        options.experts_on = Some(placement[i]);
    }
    options
}

/// What [`rank_placements`] searches.
struct Space<'a> {
    /// The tiers, fastest first.
    tiers: &'a [Device],
    /// The tiers (indices into `tiers`) a layer's experts may rest on
    /// while the rest of it stays on the first tier; none for a model
    /// without experts.
    experts_tiers: &'a [usize],
    /// Bytes of weights and streaming room each tier has room for.
    room: &'a [u64],
    /// The default plan's tier of each block, where it has one.
    default_tiers: &'a [Option<usize>],
    /// Offloaded blocks prefetched ahead of the one running.
    prefetch_depth: usize,
}

/// The streaming room `placement` needs and where, as the ledger charges
/// it ([`crate::auto::ledger`]): on a GPU that executes, the
/// `1 + prefetch_depth` largest offloaded groups, a group being a block
/// that is not an experts list with the experts lists after it; nothing on
/// the CPU, which runs offloaded weights in place.
fn streaming_room(blocks: &[Block], placement: &[Device], prefetch_depth: usize) -> (Device, u64) {
    let exec = Device::execution(placement.iter().copied());
    let mut groups: Vec<u64> = Vec::new();
    for (b, &on) in blocks.iter().zip(placement) {
        let bytes = if on == exec || on.is_gpu() {
            0
        } else {
            b.bytes
        };
        match (b.kind, groups.last_mut()) {
            (BlockKind::Experts { .. }, Some(group)) => *group += bytes,
            _ => groups.push(bytes),
        }
    }
    if !exec.is_gpu() {
        return (exec, 0);
    }
    groups.sort_unstable_by(|a, b| b.cmp(a));
    (exec, groups.iter().take(prefetch_depth + 1).sum())
}

/// Every placement of `pass`'s blocks in `space` whose weights fit its
/// room, costed by `cost`; the [`CHECKED`] cheapest, cheapest first. Blocks
/// with weights that are neither layers nor experts pick a tier each (or,
/// past [`MAX_PLACEMENTS`], keep the default plan's where it has one),
/// blocks without rest on the execution device; the
/// layers are counted per kind and placed in order: whole on the first
/// tier, then (for each experts tier X) the rest of the layer on the first
/// tier with its experts on X, then whole on each further tier.
fn rank_placements(
    pass: &Pass,
    space: &Space<'_>,
    mut cost: impl FnMut(&[Device]) -> Result<f64, Error>,
) -> Result<Vec<(f64, Vec<Device>)>, Error> {
    let Space {
        tiers,
        experts_tiers,
        room,
        default_tiers,
        prefetch_depth,
    } = *space;
    let blocks = pass.blocks();
    let is_experts = |i: usize| matches!(blocks[i].kind, BlockKind::Experts { .. });
    // Each layer, with the experts lists that follow it.
    let layers: Vec<(usize, Vec<usize>)> = (0..blocks.len())
        .filter(|&i| blocks[i].kind == BlockKind::Layer)
        .map(|i| {
            let lists = (i + 1..blocks.len()).take_while(|&j| is_experts(j));
            (i, lists.collect())
        })
        .collect();
    let (others, weightless): (Vec<usize>, Vec<usize>) = (0..blocks.len())
        .filter(|&i| blocks[i].kind != BlockKind::Layer && !is_experts(i))
        .partition(|&i| blocks[i].bytes > 0 || blocks[i].tensors > 0);
    let mut ranked: Vec<(f64, Vec<Device>)> = Vec::new();
    if tiers.is_empty() {
        return Ok(ranked);
    }
    // A block without weights (Llama's `rotary_emb`) takes no room and
    // streams nothing: where it rests matters only in that the lowest GPU
    // any block rests on executes. So they all rest on the execution
    // device: the first tier, and, when that is a GPU no block with weights
    // rests on, also the next tier (the CPU executing), instead of every
    // tier each.
    let exec_choices: u128 = match weightless.is_empty() {
        false if tiers[0].is_gpu() && tiers.len() > 1 => 2,
        _ => 1,
    };
    // What a layer may be, in the order the layers take them, as (the
    // tier of the rest of it, the tier of its experts): whole on the first
    // tier, apart with its experts on each of `xs`, whole on each further
    // tier.
    let kinds_with = |xs: &[usize]| -> Vec<(usize, usize)> {
        let mut kinds = vec![(0, 0)];
        kinds.extend(xs.iter().map(|&x| (0, x)));
        kinds.extend((1..tiers.len()).map(|t| (t, t)));
        kinds
    };
    // Layer counts per kind: C(layers + kinds - 1, kinds - 1).
    let counts_of = |kinds: usize| {
        (1..kinds as u128).fold(1u128, |c, i| c.saturating_mul(layers.len() as u128 + i) / i)
    };
    // Past MAX_PLACEMENTS, the experts of the layers apart share one tier
    // (each in turn).
    let mut kind_sets = vec![kinds_with(experts_tiers)];
    if experts_tiers.len() > 1 && counts_of(kind_sets[0].len()) > MAX_PLACEMENTS {
        kind_sets = experts_tiers.iter().map(|&x| kinds_with(&[x])).collect();
    }
    let compositions = kind_sets
        .iter()
        .map(|kinds| counts_of(kinds.len()))
        .fold(0u128, u128::saturating_add);
    let all_choices = (tiers.len() as u128)
        .checked_pow(others.len() as u32)
        .unwrap_or(u128::MAX)
        .saturating_mul(exec_choices);
    // The tiers each other block may take.
    let options: Vec<Vec<usize>> = others
        .iter()
        .map(|&b| match default_tiers[b] {
            Some(t) if all_choices.saturating_mul(compositions) > MAX_PLACEMENTS => vec![t],
            _ => (0..tiers.len()).collect(),
        })
        .collect();
    let mut placement = vec![tiers[0]; blocks.len()];
    for kinds in &kind_sets {
        let mut choice = vec![0usize; others.len()];
        loop {
            for ((&block, &pick), allowed) in others.iter().zip(&choice).zip(&options) {
                placement[block] = tiers[allowed[pick]];
            }
            let mut counts = vec![0usize; kinds.len()];
            counts[kinds.len() - 1] = layers.len();
            loop {
                let mut next = 0;
                for (&(rest, experts), &count) in kinds.iter().zip(&counts) {
                    for (layer, lists) in &layers[next..next + count] {
                        placement[*layer] = tiers[rest];
                        for &list in lists {
                            placement[list] = tiers[experts];
                        }
                    }
                    next += count;
                }
                let first_used =
                    (0..blocks.len()).any(|i| placement[i] == tiers[0] && !weightless.contains(&i));
                let execs = if first_used { 1 } else { exec_choices };
                for exec_tier in &tiers[..execs as usize] {
                    for &block in &weightless {
                        placement[block] = *exec_tier;
                    }
                    let (exec, streaming) = streaming_room(blocks, &placement, prefetch_depth);
                    let fits = tiers.iter().zip(room).all(|(&tier, &room)| {
                        let used: u64 = blocks
                            .iter()
                            .zip(&placement)
                            .filter(|(_, d)| **d == tier)
                            .map(|(b, _)| b.bytes)
                            .sum();
                        let streamed = if tier == exec { streaming } else { 0 };
                        used.saturating_add(streamed) <= room
                    });
                    if fits {
                        let seconds = cost(&placement)?;
                        let at = ranked.partition_point(|(s, _)| *s <= seconds);
                        if at < CHECKED {
                            ranked.insert(at, (seconds, placement.clone()));
                            ranked.truncate(CHECKED);
                        }
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
                bf16_gemm_flops: None,
                bf16_gemm_weight_bytes_per_second: None,
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

    /// `budgets` at prefetch depth 1, the dispatcher's default.
    fn options(model: &HfModel, budgets: &str) -> PlanOptions {
        let mut options = PlanOptions {
            max_memory: MaxMemory::parse(budgets).unwrap(),
            max_memory_from_user: true,
            no_split: model.no_split.clone(),
            prefetch_depth: 1,
            ..PlanOptions::default()
        };
        let on_gpu = options.max_memory.gpus().any(|(_, b)| b > 0);
        model
            .runtime_charges(&workload(), on_gpu, model.dtype)
            .apply(&mut options);
        options
    }

    /// The predicted seconds per token of `placement` (as `map`) when it
    /// fits the full ledger.
    fn if_it_fits(
        model: &HfModel,
        options: &PlanOptions,
        pass: &Pass,
        placement: &[Device],
        map: &DeviceMap,
        calibration: &Calibration,
    ) -> Option<f64> {
        let ledger = ledger(&model.tree, map, &ledger_options(options, pass, placement)).unwrap();
        ledger.shortfalls(&options.max_memory).is_empty().then(|| {
            pass.predict(
                &model.shape,
                placement,
                options.prefetch_depth,
                &workload(),
                calibration,
            )
            .unwrap()
            .seconds_per_token
        })
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
            if let Some(seconds) = if_it_fits(model, options, &pass, &placement, &map, calibration)
            {
                fitting += 1;
                best = best.min(seconds);
            }
            if !next_choice(&mut choice, &allowed) {
                return (best, fitting);
            }
        }
    }

    /// `options` at prefetch depth `depth`.
    fn at(options: &PlanOptions, depth: usize) -> PlanOptions {
        PlanOptions {
            prefetch_depth: depth,
            ..options.clone()
        }
    }

    fn check(budgets: &str, tiers: &[Device], calibration: &Calibration) -> Fastest {
        let model = model();
        let options = options(&model, budgets);
        let default = plan_with(&model.tree, &options, Compat::Auto).unwrap();
        // The best of every placement at every depth searched.
        let (mut optimum, mut fitting) = (f64::INFINITY, 0);
        for depth in depths(tiers, default.prefetch_depth) {
            let (best, fit) = enumerated_optimum(&model, &at(&options, depth), tiers, calibration);
            optimum = optimum.min(best);
            fitting += fit;
        }
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
        // What it found fits and predicts as reported at its depth.
        assert!(found.plan.ledger.shortfalls(&options.max_memory).is_empty());
        let again = crate::predict::predict(
            &model,
            &found.plan.device_map,
            &at(&options, found.plan.prefetch_depth),
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

    /// The placements costed for the Llama with room for everything:
    /// rotary's `rotary_emb`, which has no weights, is not placed on every
    /// tier but on the execution device (the first tier, or the CPU when
    /// no block with weights is on the GPU).
    #[test]
    fn blocks_without_weights_rest_on_the_execution_device() {
        let model = model();
        let pass = Pass::of(&model, &options(&model, "cpu=10MB"));
        let blocks = pass.blocks();
        let weightless: Vec<usize> = (0..blocks.len())
            .filter(|&i| blocks[i].bytes == 0)
            .collect();
        assert_eq!(weightless.len(), 1, "{blocks:?}");
        let rotary = weightless[0];
        assert_eq!(blocks[rotary].name, "model.rotary_emb");
        let layers = blocks.iter().filter(|b| b.kind == BlockKind::Layer).count();
        let others = blocks.len() - layers - 1;
        // Compositions of the layers into `parts` ordered counts.
        let compositions = |parts: usize| (1..parts).fold(1, |c, i| c * (layers + i) / i);
        for (tiers, costed) in [
            (
                &[Device::Cpu, Device::Disk][..],
                2usize.pow(others as u32) * compositions(2),
            ),
            (
                &[Device::Gpu(0), Device::Cpu, Device::Disk][..],
                // Every placement, and again with the CPU executing those
                // that leave the GPU empty.
                3usize.pow(others as u32) * compositions(3)
                    + 2usize.pow(others as u32) * compositions(2),
            ),
        ] {
            let room = vec![u64::MAX; tiers.len()];
            let default_tiers = vec![None; blocks.len()];
            let space = Space {
                tiers,
                experts_tiers: &[],
                room: &room,
                default_tiers: &default_tiers,
                prefetch_depth: 1,
            };
            let mut seen = Vec::new();
            rank_placements(&pass, &space, |placement| {
                seen.push(placement.to_vec());
                Ok(0.0)
            })
            .unwrap();
            // Rotary on every tier multiplied these by the tiers: 80
            // instead of 40 placements on the CPU and disk, 1215 instead of
            // 445 with a GPU.
            assert_eq!(seen.len(), costed, "{tiers:?}");
            for placement in &seen {
                let exec = Device::execution(placement.iter().copied());
                assert_eq!(placement[rotary], exec, "{placement:?}");
            }
            seen.sort();
            let all = seen.len();
            seen.dedup();
            assert_eq!(seen.len(), all, "a placement costed twice");
        }
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

    /// Asked for prefetch depth 1 with a GPU: no prefetch holds the room of
    /// one offloaded layer instead of two, room that keeps another block
    /// resident, and in the cost model that beats hiding each transfer
    /// behind a decode step's short compute. The search finds a placement
    /// at depth 0 faster than any at depth 1 and than the default planner's
    /// at any depth (all that a search at the asked depth could find).
    #[test]
    fn with_a_gpu_the_search_weighs_prefetching_against_its_room() {
        let model = model();
        let gpu = calibration(false, true);
        let tiers = [Device::Gpu(0), Device::Cpu, Device::Disk];
        let options = options(&model, "0=700KB,cpu=300KB,disk=10MB");
        let default = plan_with(&model.tree, &options, Compat::Auto).unwrap();
        assert_eq!(default.prefetch_depth, 1);
        let found = fastest(&model, &model.tree, &options, &default, &workload(), &gpu).unwrap();
        assert_eq!(found.plan.prefetch_depth, 0);
        let seconds = found.prediction.seconds_per_token;
        let (at_one, _) = enumerated_optimum(&model, &at(&options, 1), &tiers, &gpu);
        assert!(seconds < at_one, "{seconds} against {at_one} at depth 1");
        for depth in 0..=3 {
            let plan = plan_with(&model.tree, &at(&options, depth), Compat::Auto).unwrap();
            let planned = crate::predict::predict(
                &model,
                &plan.device_map,
                &at(&options, plan.prefetch_depth),
                &workload(),
                &gpu,
            )
            .unwrap()
            .seconds_per_token;
            assert!(
                seconds < planned,
                "{seconds} against {planned} planned at {depth}"
            );
        }
    }

    /// A Mixtral of `layers` layers, each of eight experts of which a
    /// token runs two: 98 KB an expert, 51 KB the rest of a layer, the
    /// embedding and the head 131 KB each.
    fn mixtral(layers: usize) -> HfModel {
        let config = serde_json::json!({
            "model_type": "mixtral",
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": layers,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "vocab_size": 512,
            "max_position_embeddings": 128,
            "torch_dtype": "float32",
        });
        tree_from_config(&HfConfig::from_value(config, "config.json").unwrap()).unwrap()
    }

    /// The fastest placement of the search's space by brute force, each
    /// layer on its own (not counted in order): every block that is not a
    /// layer on every tier, every layer whole on a tier or, with its
    /// experts on a later tier, the rest of it on the first; and how many
    /// fit the full ledger.
    fn enumerated_moe_optimum(
        model: &HfModel,
        options: &PlanOptions,
        tiers: &[Device],
        calibration: &Calibration,
    ) -> (f64, usize) {
        let pass = Pass::of(model, options);
        let blocks = pass.blocks();
        let layers: Vec<usize> = (0..blocks.len())
            .filter(|&i| blocks[i].kind == BlockKind::Layer)
            .collect();
        let others: Vec<usize> = (0..blocks.len())
            .filter(|&i| blocks[i].kind != BlockKind::Layer)
            .filter(|&i| !matches!(blocks[i].kind, BlockKind::Experts { .. }))
            .collect();
        let mut kinds: Vec<(usize, usize)> = (0..tiers.len()).map(|t| (t, t)).collect();
        kinds.extend((1..tiers.len()).map(|x| (0, x)));
        let mut allowed = vec![(0..tiers.len()).collect::<Vec<_>>(); others.len()];
        allowed.extend(vec![(0..kinds.len()).collect(); layers.len()]);
        let mut choice = vec![0usize; allowed.len()];
        let (mut best, mut fitting) = (f64::INFINITY, 0);
        loop {
            let mut placement = vec![tiers[0]; blocks.len()];
            for (&b, &t) in others.iter().zip(&choice) {
                placement[b] = tiers[t];
            }
            for (&layer, &k) in layers.iter().zip(&choice[others.len()..]) {
                placement[layer] = tiers[kinds[k].0];
                placement[layer + 1] = tiers[kinds[k].1];
            }
            let map = map_of(&model.tree, &pass, &placement).unwrap();
            check_device_map(&model.tree, &map).unwrap();
            if let Some(seconds) = if_it_fits(model, options, &pass, &placement, &map, calibration)
            {
                fitting += 1;
                best = best.min(seconds);
            }
            if !next_choice(&mut choice, &allowed) {
                return (best, fitting);
            }
        }
    }

    /// The layers of `map` whose experts rest apart from the rest of them.
    fn split_layers(map: &DeviceMap) -> Vec<String> {
        map.iter()
            .filter_map(|(key, on)| {
                let layer = key.strip_suffix(".block_sparse_moe.experts")?;
                let rest = map.device_of(&format!("{layer}.self_attn"));
                (rest != Some(on)).then(|| layer.to_string())
            })
            .collect()
    }

    fn check_moe(
        model: &HfModel,
        budgets: &str,
        tiers: &[Device],
        calibration: &Calibration,
    ) -> Fastest {
        let options = options(model, budgets);
        let default = plan_with(&model.tree, &options, Compat::Auto).unwrap();
        let mut at_depth = options.clone();
        at_depth.prefetch_depth = default.prefetch_depth;
        let (optimum, fitting) = enumerated_moe_optimum(model, &at_depth, tiers, calibration);
        assert!(fitting > 1, "{budgets}: {fitting} placements fit");
        let found = fastest(
            model,
            &model.tree,
            &options,
            &default,
            &workload(),
            calibration,
        )
        .unwrap();
        let seconds = found.prediction.seconds_per_token;
        // The default planner at another prefetch depth may beat the
        // space searched; nothing in the space beats what was found.
        assert!(
            seconds <= optimum * (1.0 + 1e-12),
            "{budgets}: found {seconds}, the optimum is {optimum}"
        );
        assert!(found.plan.ledger.shortfalls(&options.max_memory).is_empty());
        check_device_map(&model.tree, &found.plan.device_map).unwrap();
        let again = crate::predict::predict(
            model,
            &found.plan.device_map,
            &at(&options, found.plan.prefetch_depth),
            &workload(),
            calibration,
        )
        .unwrap();
        assert_eq!(again, found.prediction, "{budgets}");
        assert!(seconds <= found.default.seconds_per_token);
        found
    }

    #[test]
    fn the_search_puts_experts_apart_from_their_layers_when_that_is_faster() {
        let model = mixtral(3);
        let tiers = [Device::Cpu, Device::Disk];
        // Room for the rest of every layer but not for one whole layer
        // besides the embedding and the head: the
        // default plan streams whole layers from disk, the search keeps
        // the rest of each layer resident and only the experts on disk,
        // of which a token reads two in eight.
        let budgets = "cpu=800KB,disk=10MB";
        let default = plan_with(&model.tree, &options(&model, budgets), Compat::Auto).unwrap();
        assert!(split_layers(&default.device_map).is_empty());
        for calibration in [calibration(true, false), calibration(false, false)] {
            let found = check_moe(&model, budgets, &tiers, &calibration);
            assert_eq!(
                split_layers(&found.plan.device_map).len(),
                3,
                "{:?}",
                found.plan.device_map
            );
            assert!(found.prediction.seconds_per_token < found.default.seconds_per_token);
            assert!(
                found.prediction.bytes_streamed_per_token < found.default.bytes_streamed_per_token
            );
        }
        // Room for two whole layers: some stay whole, others split.
        check_moe(
            &model,
            "cpu=3000KB,disk=10MB",
            &tiers,
            &calibration(true, false),
        );
        // Everything fits: nothing splits.
        let found = check_moe(
            &model,
            "cpu=10MB,disk=10MB",
            &tiers,
            &calibration(true, false),
        );
        assert!(split_layers(&found.plan.device_map).is_empty());
    }

    #[test]
    fn with_a_gpu_the_experts_may_rest_in_ram_or_on_disk() {
        let model = mixtral(2);
        let tiers = [Device::Gpu(0), Device::Cpu, Device::Disk];
        // Room on the GPU for the rest of both layers, not for their
        // experts: those stay apart, in RAM while it has room, then on
        // disk, instead of whole layers streaming every expert.
        for cold in [false, true] {
            let found = check_moe(
                &model,
                "0=1200KB,cpu=1MB,disk=10MB",
                &tiers,
                &calibration(cold, true),
            );
            assert_eq!(split_layers(&found.plan.device_map).len(), 2);
            assert!(found.prediction.seconds_per_token < found.default.seconds_per_token);
        }
        // Everything fits on the GPU.
        let found = check_moe(
            &model,
            "0=2500KB,cpu=2MB,disk=10MB",
            &tiers,
            &calibration(false, true),
        );
        assert!(split_layers(&found.plan.device_map).is_empty());
    }
}
