#!/usr/bin/env python3
"""Export a torch.nn.Module's structure (no weights) as a `bigmodel-module-tree/1`
document, so that `bigmodel plan` can plan a PyTorch model.

Usage:
  # any model: in your own code
  from export_module_tree import export
  json.dump(export(model), open("tree.json", "w"))

  # a transformers model from a config.json (built under init_empty_weights,
  # tied the way from_pretrained ties it):
  python tools/export_module_tree.py --config path/to/config.json -o tree.json

Every module is listed with its class name, its parameters and buffers in
registration order (shape, dtype, persistence), and tied parameters (one
Parameter object under several names) as sorted groups.
"""
import argparse
import json
import sys

import torch

DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}


def _dtype(tensor, name):
    try:
        return DTYPES[tensor.dtype]
    except KeyError:
        raise SystemExit(f"{name}: dtype {tensor.dtype} has no safetensors spelling")


def _node(module, prefix, name=None):
    node = {}
    if name is not None:
        node["name"] = name
    node["class"] = type(module).__name__
    params = []
    for pname, p in module.named_parameters(recurse=False, remove_duplicate=False):
        params.append({"name": pname, "shape": list(p.shape), "dtype": _dtype(p, prefix + pname)})
    buffers = []
    non_persistent = getattr(module, "_non_persistent_buffers_set", set())
    for bname, b in module.named_buffers(recurse=False, remove_duplicate=False):
        if b is None:
            continue
        entry = {"name": bname, "shape": list(b.shape), "dtype": _dtype(b, prefix + bname)}
        if bname in non_persistent:
            entry["persistent"] = False
        buffers.append(entry)
    if params:
        node["params"] = params
    if buffers:
        node["buffers"] = buffers
    children = [_node(child, f"{prefix}{cname}.", cname) for cname, child in module.named_children()]
    if children:
        node["children"] = children
    return node


def tied_groups(model):
    """Names sharing one Parameter object, each group sorted."""
    by_id = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return [sorted(names) for names in by_id.values() if len(names) > 1]


def export(model):
    """The `bigmodel-module-tree/1` document of `model`."""
    return {"format": "bigmodel-module-tree/1", "root": _node(model, ""), "tied": tied_groups(model)}


def model_from_config(path, dtype=None):
    """A transformers model from a config.json, on the meta device, tied."""
    import transformers
    from accelerate import init_empty_weights

    config = transformers.AutoConfig.from_pretrained(path)
    archs = getattr(config, "architectures", None) or []
    kwargs = {}
    torch_dtype = dtype or getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(torch_dtype, str):
        torch_dtype = getattr(torch, torch_dtype)
    if torch_dtype is not None:
        kwargs["dtype"] = torch_dtype
    with init_empty_weights():
        if archs and hasattr(transformers, archs[0]):
            model = getattr(transformers, archs[0])._from_config(config, **kwargs)
        else:
            model = transformers.AutoModel.from_config(config, **kwargs)
    model.tie_weights()
    return model


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="a transformers config.json (or its folder)")
    parser.add_argument("--dtype", help="float32, float16 or bfloat16 (default: the config's)")
    parser.add_argument("-o", "--output", help="output file (default: stdout)")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype) if args.dtype else None
    doc = export(model_from_config(args.config, dtype))
    text = json.dumps(doc, indent=1) + "\n"
    if args.output:
        with open(args.output, "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)


if __name__ == "__main__":
    main()
