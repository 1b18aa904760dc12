#!/usr/bin/env python3
"""Makes the tiny random T5 fixtures of bm-models' T5 parity tests.

Made with torch 2.15.0, transformers 5.23.0, safetensors 0.8.0 (CPU);
other versions may give other random weights or other config keys, so pin
them when regenerating.

Two T5ForConditionalGeneration models, saved with save_pretrained into
crates/bm-models/tests/fixtures/<name>/:

* tiny-t5: T5 v1.1 style: gated-gelu feed-forward, 2 encoder and 2
  decoder blocks, d_model 16, 4 heads of d_kv 6 (d_kv * heads is not
  d_model's business), its own lm_head (not tied to `shared`, so the
  decoder output is not scaled), 8 relative buckets up to distance 16 so
  the prompts reach the logarithmic and the last buckets.
* tiny-t5-relu: original T5 style: relu feed-forward, 2 encoder and 3
  decoder blocks, the head tied to `shared` and the decoder output scaled
  by d_model^-0.5.

Beside each, `reference.safetensors`:

* `prompt.N`     I64 [len]       encoder inputs (token ids)
* `logits.N`     F32 [1, vocab]  the first decoder step's logits (decoder
                                 input: decoder_start_token_id), float32
* `generated.N`  I64 [8]         greedy tokens, each step recomputed from
                                 scratch (no cache, no stop at EOS), so the
                                 Rust KV cache is checked against a run
                                 without one
* `logits_f16.N` F32 [1, vocab]  the same logits with the model loaded in
                                 float16 (`dtype=torch.float16`), which keeps
                                 the feed-forward output `wo` in float32
                                 (T5's `_keep_in_fp32_modules`)

Usage: /work/pyenv/bin/python tools/make_t5_fixtures.py [OUT_DIR]
(default crates/bm-models/tests/fixtures). Deterministic: each model is
seeded from its name.
"""
import sys
import zlib
from pathlib import Path

import torch
from safetensors.torch import save_file

VOCAB = 96
PROMPTS = [
    [5, 17, 33, 80, 1],
    [9],
    [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14],
    [(7 * i + 3) % VOCAB for i in range(40)],
]
NEW_TOKENS = 8
COMMON = dict(vocab_size=VOCAB, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
              dropout_rate=0.0)


def gated():
    from transformers import T5Config, T5ForConditionalGeneration
    model = T5ForConditionalGeneration(T5Config(
        d_model=16, d_kv=6, d_ff=32, num_layers=2, num_decoder_layers=2, num_heads=4,
        relative_attention_num_buckets=8, relative_attention_max_distance=16,
        feed_forward_proj="gated-gelu", tie_word_embeddings=False, **COMMON))
    # transformers 5 ties the head to `shared` at construction; a v1.1
    # checkpoint has its own, which transformers keeps when loading it.
    model.lm_head.weight = torch.nn.Parameter(torch.empty(VOCAB, 16))
    return model


def relu():
    from transformers import T5Config, T5ForConditionalGeneration
    return T5ForConditionalGeneration(T5Config(
        d_model=16, d_kv=6, d_ff=32, num_layers=2, num_decoder_layers=3, num_heads=4,
        feed_forward_proj="relu", **COMMON))


FAMILIES = {"tiny-t5": gated, "tiny-t5-relu": relu}


def randomise(model):
    # Perturb every tensor: the norms away from 1, the weights wide enough
    # that the activations' nonlinearity shows in the logits.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(p + 0.1 * torch.randn_like(p))
            elif "relative_attention_bias" in name:
                p.normal_(0.0, 1.0)
            else:
                p.normal_(0.0, 0.3)


def greedy(model, x, start):
    ids = torch.tensor([[start]])
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            logits = model(input_ids=x, decoder_input_ids=ids, use_cache=False).logits
            ids = torch.cat([ids, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[0, 1:].clone()


def write(out, name, build):
    from transformers import T5ForConditionalGeneration
    torch.manual_seed(zlib.crc32(name.encode()))
    model = build()
    randomise(model)
    model.eval()
    folder = out / name
    model.save_pretrained(folder, safe_serialization=True)
    # Run what was saved, as loaded back: the head tied or not as the
    # checkpoint says.
    model = T5ForConditionalGeneration.from_pretrained(folder).eval()
    start = model.config.decoder_start_token_id
    half = T5ForConditionalGeneration.from_pretrained(folder, dtype=torch.float16).eval()
    kept = {n for n, p in half.named_parameters() if p.dtype == torch.float32}
    assert kept and all(".wo." in n for n in kept), kept
    ref = {}
    for i, ids in enumerate(PROMPTS):
        x = torch.tensor([ids])
        ref[f"prompt.{i}"] = x[0].clone()
        with torch.no_grad():
            logits = model(input_ids=x, decoder_input_ids=torch.tensor([[start]])).logits
        ref[f"logits.{i}"] = logits[0].float().contiguous()
        ref[f"generated.{i}"] = greedy(model, x, start)
        with torch.no_grad():
            logits = half(input_ids=x, decoder_input_ids=torch.tensor([[start]])).logits
        ref[f"logits_f16.{i}"] = logits[0].float().contiguous()
    save_file(ref, folder / "reference.safetensors")
    size = sum(f.stat().st_size for f in folder.iterdir())
    print(f"wrote {folder} ({size // 1024} KiB)")


def main():
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "crates/bm-models/tests/fixtures")
    for name, build in FAMILIES.items():
        write(out, name, build)


if __name__ == "__main__":
    main()
