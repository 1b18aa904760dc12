#!/usr/bin/env python3
"""Checks `bigmodel convert` against transformers: a PyTorch checkpoint
converted to safetensors loads in transformers with logits equal to the
original model's, bit for bit.

For a tiny random LlamaForCausalLM with tied embeddings and one without,
each saved as transformers 4.x saved `.bin` checkpoints (a single
`pytorch_model.bin`, and shards with `pytorch_model.bin.index.json`), it runs
`bigmodel convert` (default shard size, a small one that forces several
shards, and `--dtype bf16`), loads each output with `from_pretrained` and
compares logits with the original model's (for the bf16 output, with the
`.bin` loaded by transformers with dtype=bfloat16). It also checks that transformers reads the `.bin` folders
themselves, so the comparison starts from what a user has.

Not run by CI (it needs torch); run it after touching the reader or the
writer:

    cargo build -p bigmodel-cli
    /work/pyenv/bin/python tools/torch_bin_parity.py [path/to/bigmodel]

Written for torch 2.15.0 and transformers 5.23.0.
"""
import json
import subprocess
import sys
import tempfile
from collections import OrderedDict
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

ROOT = Path(__file__).resolve().parent.parent
BIGMODEL = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "target/debug/bigmodel"


def model(tied: bool) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(1 if tied else 2)
    return LlamaForCausalLM(config).eval()


def save_bin(m: LlamaForCausalLM, folder: Path, shards: int):
    """As transformers 4.x's save_pretrained(safe_serialization=False) did."""
    folder.mkdir(parents=True)
    m.config.save_pretrained(folder)
    state = m.state_dict()
    if shards == 1:
        torch.save(state, folder / "pytorch_model.bin")
        return
    names = list(state)
    size = -(-len(names) // shards)
    weight_map = {}
    for k in range(shards):
        file = f"pytorch_model-{k + 1:05}-of-{shards:05}.bin"
        part = names[k * size:(k + 1) * size]
        torch.save(OrderedDict((n, state[n]) for n in part), folder / file)
        weight_map.update({n: file for n in part})
    total = sum(t.numel() * t.element_size() for t in state.values())
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))


def logits(m: LlamaForCausalLM) -> torch.Tensor:
    ids = torch.tensor([[1, 17, 42, 99, 3, 250, 7]])
    with torch.no_grad():
        return m(ids).logits


def convert(src: Path, out: Path, *flags: str) -> dict:
    run = subprocess.run([BIGMODEL, "convert", src, out, "--json", *flags],
                         capture_output=True, text=True)
    if run.returncode != 0:
        sys.exit(f"bigmodel convert {src} failed:\n{run.stderr}")
    return json.loads(run.stdout)


def main():
    failures = 0
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for tied in (True, False):
            original = model(tied)
            expected = logits(original)
            for shards in (1, 3):
                src = tmp / f"bin-tied{tied}-{shards}"
                save_bin(original, src, shards)
                from_bin = LlamaForCausalLM.from_pretrained(src).eval()
                assert torch.equal(logits(from_bin), expected), "transformers reads the .bin"
                for flags in ((), ("--max-shard-size", "40KB"), ("--dtype", "bf16")):
                    out = tmp / f"st-{src.name}-{len(flags) and flags[0].strip('-')}"
                    report = convert(src, out, *flags)
                    files = sorted(p.name for p in out.iterdir())
                    assert not any(f.endswith(".bin") for f in files), files
                    loaded = LlamaForCausalLM.from_pretrained(out).eval()
                    if "--dtype" in flags:
                        assert all(p.dtype == torch.bfloat16 for p in loaded.parameters())
                        # transformers' own cast of the .bin on load.
                        want = logits(LlamaForCausalLM.from_pretrained(
                            src, dtype=torch.bfloat16).eval())
                    else:
                        want = expected
                    got = logits(loaded)
                    ok = torch.equal(got, want)
                    failures += not ok
                    print(f"{'ok  ' if ok else 'FAIL'} tied={tied} shards={shards} "
                          f"flags={' '.join(flags) or '-'}: {len(report['files'])} file(s), "
                          f"dropped ties {report['dropped_ties']}, "
                          f"max |diff| {(got.float() - want.float()).abs().max().item():.3g}")
    if failures:
        sys.exit(f"{failures} comparison(s) failed")
    print("all logits equal")


if __name__ == "__main__":
    main()
