#!/usr/bin/env python3
"""Checks that `bigmodel shard --quantize` writes what transformers +
bitsandbytes save, and that transformers loads it and computes what it
computes with its own folder.

Pinned versions (what it was run with): bitsandbytes 0.50.2,
transformers 5.23.0, torch 2.15.0 (CPU), safetensors 0.8.0.

For each format (nf4, fp4, int8), it runs
`bigmodel shard BASE OUT --max-shard-size 1GB --dtype f32 --quantize FMT`
on the tiny Llama of tools/make_bnb_fixtures.py
(crates/bm-models/tests/fixtures/tiny-llama-bnb/base); loads BASE in
float32 with the BitsAndBytesConfig `--quantize FMT` stands for (nf4 and
fp4 without double quantization, int8 with threshold 6.0; compute dtype
float32) and saves it with `save_pretrained`; checks that every tensor of
OUT equals the saved one; loads both folders with `from_pretrained` (the
quantization config read from config.json) and checks that their logits on
three prompts are equal.

Usage: /work/pyenv/bin/python tools/check_bnb_shard.py BIGMODEL_BINARY [REPO_ROOT]
Exits non-zero and says which format differs when one does.
"""
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import BitsAndBytesConfig, LlamaForCausalLM

CONFIGS = {
    "nf4": BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                              bnb_4bit_compute_dtype=torch.float32),
    "fp4": BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="fp4",
                              bnb_4bit_compute_dtype=torch.float32),
    "int8": BitsAndBytesConfig(load_in_8bit=True),
}
PROMPTS = [[1, 5, 9, 33, 2], [7], [60, 3, 3, 3, 12, 40, 41, 8]]


def logits(model):
    with torch.no_grad():
        return [model(torch.tensor([p])).logits[0].float() for p in PROMPTS]


def main():
    binary = Path(sys.argv[1]).resolve()
    root = Path(sys.argv[2]) if len(sys.argv) > 2 else Path(__file__).resolve().parent.parent
    base = root / "crates/bm-models/tests/fixtures/tiny-llama-bnb/base"
    failed = []
    with tempfile.TemporaryDirectory() as tmp:
        for fmt, config in CONFIGS.items():
            out = Path(tmp) / fmt
            subprocess.run([str(binary), "shard", str(base), str(out), "--max-shard-size", "1GB",
                            "--dtype", "f32", "--quantize", fmt], check=True)
            theirs = Path(tmp) / f"{fmt}-transformers"
            LlamaForCausalLM.from_pretrained(base, device_map="cpu", dtype=torch.float32,
                                             quantization_config=config).save_pretrained(theirs)
            a = load_file(out / "model.safetensors")
            b = load_file(theirs / "model.safetensors")
            differ = sorted(set(a) ^ set(b)) + [k for k in b if k in a and not torch.equal(a[k], b[k])]
            ours_model = LlamaForCausalLM.from_pretrained(out, device_map="cpu", dtype=torch.float32)
            theirs_model = LlamaForCausalLM.from_pretrained(theirs, device_map="cpu",
                                                            dtype=torch.float32)
            diff = max((x - y).abs().max().item()
                       for x, y in zip(logits(ours_model), logits(theirs_model)))
            print(f"{fmt}: {len(b)} tensors, {len(differ)} differ; transformers loaded "
                  f"bigmodel's folder; max |logits diff| vs its own {diff:.3e}")
            if differ or diff != 0.0:
                failed.append(fmt)
    if failed:
        sys.exit(f"tensors or logits differ for {', '.join(failed)}")


if __name__ == "__main__":
    main()
