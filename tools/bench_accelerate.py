#!/usr/bin/env python3
"""The Python baseline of `cargo xtask bench`: the same work done with Accelerate,
transformers and safetensors, timed in this process. Each subcommand prints one
JSON document on stdout (and nothing else there).

  bench_accelerate.py plan [--million] [--repeats N] [--moe-tree FILE]
      Accelerate's infer_auto_device_map on the trees of benches/benches/plan.rs
      (built by tools/bench_plan_accelerate.py, so the trees stay identical; with
      --moe-tree the MoE tree is built from that bigmodel-module-tree/1 file, the
      one `bigmodel plan` reads, and its device map is returned too):
      {"trees": {name: {"seconds": median, "repeats": N[, "device_map": {...}]}}}
  bench_accelerate.py plan-file FILE --budget BYTES
      The whole job `bigmodel plan FILE` does, once, for timing this process from
      start to exit: read the bigmodel-module-tree/1 FILE, build its model on the
      meta device and run infer_auto_device_map with BYTES on GPU 0, GPU 1 and CPU:
      {"device_map": {...}}
  bench_accelerate.py inspect FILE [--repeats N]
      safetensors.safe_open listing every tensor's name, dtype and shape:
      {"seconds": median, "tensors": n, "total_bytes": b}
  bench_accelerate.py load MODEL_DIR --device-map MAP.json [--offload-folder D]
                      --prompt-ids 1,2,3 [--new-tokens N]
      init_empty_weights + from_config + load_checkpoint_and_dispatch with the
      given map, then the first forward of the prompt and N-1 cached decode steps:
      {"load_seconds", "first_forward_seconds", "seconds_per_token" (null when
      N < 2), "bytes_streamed_per_token", "next_token", "peak_host_bytes",
      "host_bytes_after_imports", "execution_device", "device_map"}

  bench_accelerate.py decode MODEL_DIR --prompt-ids 1,2,3 --new-tokens N --threads T
      PyTorch alone on the CPU: from_pretrained (F32, eager attention) with T
      intra-op threads, the prompt's forward, then N-1 cached greedy decode steps:
      {"seconds_per_token" (median step), "generated_ids", "threads"}

Run it in a fresh process per measurement: peak_host_bytes is this process's
peak resident set (VmHWM), as bigmodel's `peak_host_bytes`.
"""
import argparse
import json
import os
import statistics
import sys
import time

TOOLS = os.path.dirname(os.path.abspath(__file__))

# Bytes per element of the safetensors dtypes.
DTYPE_BYTES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
    "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8,
}


def peak_rss_bytes():
    """VmHWM of this process, in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def median_seconds(repeats, work):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


TORCH_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
    "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
}


def module_from_tree(path):
    """A torch module on the meta device with the structure of a
    bigmodel-module-tree/1 file: one nn.Module subclass per class name,
    parameters and buffers in registration order, tied names sharing one
    Parameter."""
    import torch
    from torch import nn

    with open(path) as f:
        doc = json.load(f)
    classes = {}

    def tensor(entry):
        dtype = getattr(torch, TORCH_DTYPES[entry["dtype"]])
        return torch.empty(entry["shape"], dtype=dtype, device="meta")

    def build(node):
        cls = classes.setdefault(node["class"], type(node["class"], (nn.Module,), {}))
        module = cls()
        for p in node.get("params", []):
            module.register_parameter(p["name"], nn.Parameter(tensor(p), requires_grad=False))
        for b in node.get("buffers", []):
            module.register_buffer(b["name"], tensor(b), persistent=b.get("persistent", True))
        for child in node.get("children", []):
            module.add_module(child["name"], build(child))
        return module

    model = build(doc["root"])
    for group in doc.get("tied", []):
        first = model.get_parameter(group[0])
        for name in group[1:]:
            owner, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(owner), leaf, first)
    return model


def cmd_plan_file(args):
    from accelerate.utils import infer_auto_device_map

    model = module_from_tree(args.file)
    budget = {0: args.budget, 1: args.budget, "cpu": args.budget}
    return {"device_map": infer_auto_device_map(model, max_memory=budget)}


def cmd_plan(args):
    sys.path.insert(0, TOOLS)
    import bench_plan_accelerate as trees_of_the_bench
    from accelerate.utils import compute_module_sizes, infer_auto_device_map

    moe = trees_of_the_bench.moe if args.moe_tree is None else (lambda: module_from_tree(args.moe_tree))
    builders = [("100b_sequential", trees_of_the_bench.hundred_billion), ("moe_100k", moe)]
    if args.million:
        builders.insert(0, ("million_tensors", trees_of_the_bench.million_tensors))
    result = {}
    for name, build in builders:
        model = build()
        # The budgets of benches/benches/plan.rs: a fifth of the model on each
        # of GPU 0, GPU 1 and the CPU.
        total = compute_module_sizes(model)[""]
        max_memory = {0: total // 5, 1: total // 5, "cpu": total // 5}
        maps = []

        def plan():
            maps.append(infer_auto_device_map(model, max_memory=dict(max_memory)))

        seconds = median_seconds(args.repeats, plan)
        result[name] = {"seconds": seconds, "repeats": args.repeats}
        if name == "moe_100k" and args.moe_tree is not None:
            result[name]["device_map"] = maps[-1]
    return {"trees": result}


def cmd_inspect(args):
    from safetensors import safe_open

    summary = {}

    def list_headers():
        tensors = 0
        total = 0
        with safe_open(args.file, framework="numpy") as f:
            for name in f.keys():
                sl = f.get_slice(name)
                count = 1
                for dim in sl.get_shape():
                    count *= dim
                total += count * DTYPE_BYTES[sl.get_dtype()]
                tensors += 1
        summary["tensors"] = tensors
        summary["total_bytes"] = total

    seconds = median_seconds(args.repeats, list_headers)
    return {"seconds": seconds, **summary}


def offloaded_bytes(model, device_map, offloaded_devices):
    """Bytes of the parameters whose map entry is one of `offloaded_devices`:
    what the hooks bring onto the execution device in each forward."""
    total = 0
    for name, tensor in model.state_dict().items():
        placed = None
        for module, device in device_map.items():
            if module == "" or name == module or name.startswith(module + "."):
                placed = device
        if placed in offloaded_devices:
            total += tensor.numel() * tensor.element_size()
    return total


def cmd_load(args):
    import torch
    from accelerate import init_empty_weights, load_checkpoint_and_dispatch
    from transformers import AutoConfig, AutoModelForCausalLM

    after_imports = peak_rss_bytes()
    with open(args.device_map) as f:
        device_map = json.load(f)
    prompt = [int(t) for t in args.prompt_ids.split(",")]
    on_gpu = any(isinstance(d, int) for d in device_map.values())
    if on_gpu and not torch.cuda.is_available():
        raise SystemExit("the device map names a GPU but this torch has no CUDA device")

    def sync():
        if on_gpu:
            torch.cuda.synchronize()

    start = time.perf_counter()
    config = AutoConfig.from_pretrained(args.model_dir)
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config)
    model = load_checkpoint_and_dispatch(model, args.model_dir, device_map=device_map, offload_folder=args.offload_folder)
    model.eval()
    sync()
    load_seconds = time.perf_counter() - start

    # Accelerate's rule (dispatch_model): the main device is the first GPU of
    # the map, else the CPU; with a GPU main device both CPU and disk entries
    # are offloaded, with the CPU only disk entries are.
    gpus = [d for d in device_map.values() if isinstance(d, int)]
    execution_device = f"cuda:{gpus[0]}" if gpus else "cpu"
    streamed = offloaded_bytes(model, device_map, {"cpu", "disk"} if gpus else {"disk"})

    ids = torch.tensor([prompt], device=execution_device)
    with torch.no_grad():
        start = time.perf_counter()
        out = model(ids, use_cache=True)
        sync()
        first_forward_seconds = time.perf_counter() - start
        next_token = int(out.logits[0, -1].argmax())
        past = out.past_key_values
        token = next_token
        step_times = []
        for _ in range(args.new_tokens - 1):
            start = time.perf_counter()
            out = model(torch.tensor([[token]], device=execution_device), past_key_values=past, use_cache=True)
            sync()
            step_times.append(time.perf_counter() - start)
            past = out.past_key_values
            token = int(out.logits[0, -1].argmax())
    return {
        "load_seconds": load_seconds,
        "first_forward_seconds": first_forward_seconds,
        "seconds_per_token": statistics.median(step_times) if step_times else None,
        "bytes_streamed_per_token": streamed,
        "next_token": next_token,
        "peak_host_bytes": peak_rss_bytes(),
        "host_bytes_after_imports": after_imports,
        "execution_device": execution_device,
        "device_map": device_map,
    }


def cmd_decode(args):
    import torch

    # Before the first op: torch reads its thread count once.
    torch.set_num_threads(args.threads)
    torch.set_num_interop_threads(1)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    prompt = [int(t) for t in args.prompt_ids.split(",")]
    with torch.no_grad():
        out = model(torch.tensor([prompt]), use_cache=True)
        past = out.past_key_values
        token = int(out.logits[0, -1].argmax())
        generated = [token]
        step_times = []
        for _ in range(args.new_tokens - 1):
            start = time.perf_counter()
            out = model(torch.tensor([[token]]), past_key_values=past, use_cache=True)
            step_times.append(time.perf_counter() - start)
            past = out.past_key_values
            token = int(out.logits[0, -1].argmax())
            generated.append(token)
    return {
        "seconds_per_token": statistics.median(step_times) if step_times else None,
        "generated_ids": generated,
        "threads": torch.get_num_threads(),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    plan = sub.add_parser("plan", help="Accelerate's planner on the bench trees")
    plan.add_argument("--million", action="store_true", help="also the 1M-tensor tree (takes minutes)")
    plan.add_argument("--repeats", type=int, default=3)
    plan.add_argument("--moe-tree", help="build the MoE tree from this bigmodel-module-tree/1 file")
    plan_file = sub.add_parser("plan-file", help="one whole planning job on a module-tree file")
    plan_file.add_argument("file")
    plan_file.add_argument("--budget", type=int, required=True, help="bytes on GPU 0, GPU 1 and CPU each")
    inspect = sub.add_parser("inspect", help="safe_open listing every header entry")
    inspect.add_argument("file")
    inspect.add_argument("--repeats", type=int, default=5)
    load = sub.add_parser("load", help="load_checkpoint_and_dispatch and the first forward")
    load.add_argument("model_dir")
    load.add_argument("--device-map", required=True, help="JSON file {module: 0 | 'cpu' | 'disk'}")
    load.add_argument("--offload-folder")
    load.add_argument("--prompt-ids", required=True, help="comma-separated token ids")
    load.add_argument("--new-tokens", type=int, default=1, help="tokens to generate (>= 2 times decode steps)")
    decode = sub.add_parser("decode", help="PyTorch's time per generated token on the CPU")
    decode.add_argument("model_dir")
    decode.add_argument("--prompt-ids", required=True, help="comma-separated token ids")
    decode.add_argument("--new-tokens", type=int, default=8, help="tokens to generate (>= 2 times decode steps)")
    decode.add_argument("--threads", type=int, required=True, help="intra-op threads")
    args = parser.parse_args()
    if getattr(args, "repeats", 1) < 1 or getattr(args, "new_tokens", 1) < 1:
        parser.error("--repeats and --new-tokens must be at least 1")
    if getattr(args, "threads", 1) < 1:
        parser.error("--threads must be at least 1")
    commands = {"plan": cmd_plan, "plan-file": cmd_plan_file, "inspect": cmd_inspect, "load": cmd_load, "decode": cmd_decode}
    result = commands[args.command](args)
    json.dump(result, sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
