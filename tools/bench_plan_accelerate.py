#!/usr/bin/env python3
"""Time Accelerate's infer_auto_device_map on the trees of benches/benches/plan.rs
and report the ratio against bigmodel's planners measured by criterion.

  python tools/bench_plan_accelerate.py            # runs `cargo bench --bench plan` first
  python tools/bench_plan_accelerate.py --no-cargo # reuse target/criterion results

The trees are built exactly as in the Rust bench (same names, shapes, budgets:
one fifth of the model on each of GPU 0, GPU 1 and the CPU, sequential mode).
The 1,000,000-tensor tree is skipped unless --million is given (Accelerate
takes minutes on it).
"""
import argparse
import json
import os
import subprocess
import sys
import time

import torch
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Block(nn.Module):
    pass


class Expert(nn.Module):
    pass


class Attention(nn.Module):
    pass


class SparseMoe(nn.Module):
    pass


class MoeDecoderLayer(nn.Module):
    pass


class MoeForCausalLM(nn.Module):
    pass


def meta_linear(i, o, bias=True):
    with torch.device("meta"):
        return nn.Linear(i, o, bias=bias)


def million_tensors():
    model = nn.Sequential()
    for i in range(1000):
        block = Block()
        for j in range(500):
            block.add_module(str(j), meta_linear(16, 16))
        model.add_module(str(i), block)
    return model


def hundred_billion():
    return nn.Sequential(*[meta_linear(10000, 10000) for _ in range(1000)])


def moe():
    model = MoeForCausalLM()
    model.layers = nn.ModuleList()
    for _ in range(48):
        layer = MoeDecoderLayer()
        layer.self_attn = Attention()
        for p in ["q_proj", "k_proj", "v_proj", "o_proj"]:
            layer.self_attn.add_module(p, meta_linear(64, 64, bias=False))
        layer.mlp = SparseMoe()
        layer.mlp.gate = meta_linear(64, 512, bias=False)
        layer.mlp.experts = nn.ModuleList()
        for _ in range(512):
            expert = Expert()
            for p in ["gate_proj", "up_proj", "down_proj"]:
                expert.add_module(p, meta_linear(64, 32, bias=False))
            layer.mlp.experts.append(expert)
        model.layers.append(layer)
    return model


def time_accelerate(model, repeats):
    from accelerate.utils import compute_module_sizes, infer_auto_device_map

    total = compute_module_sizes(model)[""]
    max_memory = {0: total // 5, 1: total // 5, "cpu": total // 5}
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        infer_auto_device_map(model, max_memory=dict(max_memory))
        best = min(best, time.perf_counter() - start)
    return best


def criterion_seconds(tree, planner):
    path = os.path.join(ROOT, "target", "criterion", "plan_" + tree, planner, "new", "estimates.json")
    if not os.path.exists(path):
        path = os.path.join(ROOT, "target", "criterion", "plan", tree, planner, "new", "estimates.json")
    with open(path) as f:
        return json.load(f)["median"]["point_estimate"] / 1e9


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-cargo", action="store_true", help="reuse existing criterion results")
    parser.add_argument("--million", action="store_true", help="also time Accelerate on the 1M-tensor tree")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if not args.no_cargo:
        subprocess.run(
            ["cargo", "bench", "-p", "bigmodel-benches", "--bench", "plan", "--", "--noplot"], cwd=ROOT, check=True
        )
    trees = [("100b_sequential", hundred_billion), ("moe_100k", moe)]
    if args.million:
        trees.insert(0, ("million_tensors", million_tensors))
    print(f"{'tree':<18} {'accelerate':>12} {'compat':>12} {'auto':>12} {'ratio compat':>13} {'ratio auto':>11}")
    for name, build in trees:
        model = build()
        acc = time_accelerate(model, args.repeats)
        compat = criterion_seconds(name, "accelerate_compat")
        auto = criterion_seconds(name, "bigmodel_auto")
        print(f"{name:<18} {acc:>11.4f}s {compat:>11.6f}s {auto:>11.6f}s {acc / compat:>12.0f}x {acc / auto:>10.0f}x")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
