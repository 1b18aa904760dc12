#!/usr/bin/env python3
"""Make the small transformers checkpoint the bm-shard interop tests read.

Usage (with a Python that has torch + transformers + accelerate):

    python tools/make_hf_fixture.py                      # (re)write the fixtures
    python tools/make_hf_fixture.py --check-reshard DIR  # check transformers loads DIR

Writes, under crates/bm-shard/tests/fixtures/:

* hf_llama_tiny/: a randomly initialised LlamaForCausalLM (hidden 32, 2
  layers, vocab 64) saved in bfloat16 by `save_pretrained(max_shard_size=
  "20KB")`, so it is sharded with a `model.safetensors.index.json`;
* hf_llama_tiny.expected.json: for every tensor its dtype (safetensors
  spelling), shape and the FNV-1a 64-bit hash of its raw little-endian bytes,
  computed here from the torch tensors of the model (not from the files);
* accelerate_offload/: an offload folder written by Accelerate's
  `offload_state_dict` (bf16, f16, f32, int64 scalar, bool, fp8), whose
  bytes the Rust writer must reproduce exactly.

`--check-reshard DIR` loads DIR (e.g. the output of `bigmodel shard` run on
hf_llama_tiny) with `from_pretrained` and checks every tensor is equal to the
fixture's, and that both models give the same logits.
"""

import argparse
import json
import os
import shutil
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(ROOT, "crates", "bm-shard", "tests", "fixtures")
MODEL_DIR = os.path.join(FIXTURES, "hf_llama_tiny")

ST_DTYPES = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def fnv1a64(data: bytes) -> str:
    h = 0xCBF29CE484222325
    for b in data:
        h ^= b
        h = (h * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return f"{h:016x}"


def raw_bytes(t: torch.Tensor) -> bytes:
    t = t.detach().contiguous().cpu()
    return t.reshape(-1).view(torch.uint8).numpy().tobytes()


def tiny_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config).to(torch.bfloat16).eval()


def make_model_fixture():
    model = tiny_model()
    shutil.rmtree(MODEL_DIR, ignore_errors=True)
    model.save_pretrained(MODEL_DIR, max_shard_size="20KB", safe_serialization=True)
    # Only the weights matter to the tests; generation_config is noise.
    gen = os.path.join(MODEL_DIR, "generation_config.json")
    if os.path.exists(gen):
        os.remove(gen)
    expected = {}
    for name, t in model.state_dict().items():
        expected[name] = {
            "dtype": ST_DTYPES[t.dtype],
            "shape": list(t.shape),
            "fnv1a64": fnv1a64(raw_bytes(t)),
        }
    with open(os.path.join(FIXTURES, "hf_llama_tiny.expected.json"), "w") as f:
        json.dump(expected, f, indent=2, sort_keys=True)
        f.write("\n")
    print(f"wrote {MODEL_DIR} ({len(expected)} tensors)")


def make_offload_fixture():
    from accelerate.utils import offload_state_dict

    torch.manual_seed(0)
    state = {
        "w_bf16": torch.randn(2, 3).to(torch.bfloat16),
        "w_fp16": torch.randn(2, 3).to(torch.float16),
        "w_f32": torch.randn(4),
        "i64": torch.tensor(7, dtype=torch.int64),
        "b": torch.tensor([True, False]),
        "f8": torch.tensor([0.5, -1.0, 2.0]).to(torch.float8_e4m3fn),
    }
    folder = os.path.join(FIXTURES, "accelerate_offload")
    shutil.rmtree(folder, ignore_errors=True)
    offload_state_dict(folder, state)
    print(f"wrote {folder}")


def check_reshard(folder):
    from transformers import LlamaForCausalLM

    ours = LlamaForCausalLM.from_pretrained(folder, torch_dtype=torch.bfloat16).eval()
    ref = LlamaForCausalLM.from_pretrained(MODEL_DIR, torch_dtype=torch.bfloat16).eval()
    a, b = ours.state_dict(), ref.state_dict()
    assert a.keys() == b.keys(), set(a) ^ set(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    ids = torch.tensor([[1, 5, 9, 3]])
    with torch.no_grad():
        assert torch.equal(ours(ids).logits, ref(ids).logits)
    print(f"ok: transformers loads {folder}: {len(a)} tensors equal, logits equal")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--check-reshard", metavar="DIR")
    args = p.parse_args()
    if args.check_reshard:
        check_reshard(args.check_reshard)
        return 0
    make_model_fixture()
    make_offload_fixture()
    return 0


if __name__ == "__main__":
    sys.exit(main())
