#!/usr/bin/env python3
"""Run Accelerate's planner (get_balanced_memory + infer_auto_device_map, as
load_checkpoint_and_dispatch(device_map=MODE) does) on a module-tree JSON or a
transformers config.json, and print {"device_map": ..., "max_memory": ...}.

  python tools/accelerate_plan.py --config config.json --max-memory '{"0": "10GiB", "cpu": "30GiB"}' --mode balanced
  python tools/accelerate_plan.py --tree tree.json --max-memory '{"0": 1000}' --no-split Block --mode sequential

Used to make the golden device maps of crates/bm-plan/tests/fixtures/goldens:

  python tools/accelerate_plan.py --cases crates/bm-plan/tests/fixtures/goldens/cases.json \
      -o crates/bm-plan/tests/fixtures/goldens/goldens.json

where each case is {"config": path relative to the cases file, "max_memory": {...},
"mode": ..., "dtype": optional}; the output repeats each case with "expect".
"""
import argparse
import json
import os
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from export_module_tree import model_from_config  # noqa: E402

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
_classes = {}


def _class(name):
    if name not in _classes:
        _classes[name] = type(name, (nn.Module,), {})
    return _classes[name]


def _build(node):
    module = _class(node["class"])()
    for p in node.get("params", []):
        t = torch.empty(p["shape"], dtype=DTYPES[p["dtype"]], device="meta")
        module.register_parameter(p["name"], nn.Parameter(t, requires_grad=False))
    for child in node.get("children", []):
        module.add_module(child["name"], _build(child))
    for b in node.get("buffers", []):
        t = torch.empty(b["shape"], dtype=DTYPES[b["dtype"]], device="meta")
        module.register_buffer(b["name"], t, persistent=b.get("persistent", True))
    return module


def model_from_tree(doc):
    """A meta-device nn.Module with the tree's structure; tied names share one Parameter."""
    model = _build(doc["root"])
    for group in doc.get("tied", []):
        first = model.get_parameter(group[0])
        for name in group[1:]:
            owner, _, local = name.rpartition(".")
            setattr(model.get_submodule(owner) if owner else model, local, first)
    return model


def _key(k):
    return int(k) if isinstance(k, str) and k.isdigit() else k


def plan(model, max_memory, no_split, mode, dtype=None, offload_buffers=False):
    from accelerate.utils import get_balanced_memory, infer_auto_device_map

    max_memory = {_key(k): v for k, v in max_memory.items()}
    if mode != "sequential":
        max_memory = get_balanced_memory(
            model, max_memory=max_memory, no_split_module_classes=no_split, dtype=dtype,
            low_zero=(mode == "balanced_low_0"),
        )
    device_map = infer_auto_device_map(
        model, max_memory=max_memory, no_split_module_classes=no_split, dtype=dtype,
        offload_buffers=offload_buffers,
    )
    return {
        "device_map": dict(device_map),
        "max_memory": {str(k): int(v) for k, v in max_memory.items()},
    }


def run_cases(cases_path, output):
    base = os.path.dirname(os.path.abspath(cases_path))
    with open(cases_path) as f:
        cases = json.load(f)
    models = {}
    out = []
    for case in cases:
        path = os.path.join(base, case["config"])
        if path not in models:
            models[path] = model_from_config(path)
        model = models[path]
        no_split = case.get("no_split", list(model._no_split_modules or []))
        dtype = getattr(torch, case["dtype"]) if case.get("dtype") else None
        result = plan(model, dict(case["max_memory"]), no_split, case["mode"], dtype)
        out.append(dict(case, expect=result))
        print(case["config"], case["mode"], "->", len(result["device_map"]), "keys", file=sys.stderr)
    with open(output, "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--config", help="transformers config.json")
    src.add_argument("--tree", help="bigmodel-module-tree/1 JSON")
    src.add_argument("--cases", help="a JSON list of cases to answer (see above)")
    parser.add_argument("-o", "--output", help="output file for --cases")
    parser.add_argument("--max-memory", help="JSON object {device: size}")
    parser.add_argument("--no-split", action="append", help="class name (default for configs: _no_split_modules)")
    parser.add_argument("--mode", default="auto", choices=["auto", "balanced", "balanced_low_0", "sequential"])
    parser.add_argument("--dtype", help="float32, float16 or bfloat16 (Accelerate's dtype argument)")
    parser.add_argument("--offload-buffers", action="store_true")
    args = parser.parse_args()
    if args.cases:
        run_cases(args.cases, args.output)
        return
    if not args.max_memory:
        parser.error("--max-memory is required")
    if args.config:
        model = model_from_config(args.config)
        no_split = args.no_split if args.no_split is not None else list(model._no_split_modules or [])
    else:
        with open(args.tree) as f:
            model = model_from_tree(json.load(f))
        no_split = args.no_split or []
    dtype = getattr(torch, args.dtype) if args.dtype else None
    result = plan(model, json.loads(args.max_memory), no_split, args.mode, dtype, args.offload_buffers)
    json.dump(result, sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
