#!/usr/bin/env python3
"""Makes the tiny random model fixtures of bm-models' family parity tests.

Made with torch 2.15.0, transformers 5.23.0, safetensors 0.8.0 (CPU);
other versions may give other random weights or (for transformers) other
config keys, so pin them when regenerating.

Each entry of FAMILIES builds a small random model with transformers, saves
it with save_pretrained (safetensors; some sharded, to exercise index.json
loading) into crates/bm-models/tests/fixtures/<name>/ and writes
`reference.safetensors` beside it, in the layout of tools/make_tiny_llama.py:

* `prompt.N`     I64 [len]          token-id prompts (one longer than every
                                    sliding window and past Phi-3's LongRoPE
                                    switch-over length)
* `logits.N`     F32 [len, vocab]   transformers' logits in float32
* `logits_bf16.N`, `logits_f16.N`   the same model run in bfloat16 / float16
                                    (stored as F32)
* `generated.N`  I64 [new]          greedy continuation (KV cache, no EOS stop)

Models are kept to tens of KB: a vocabulary of 128 and widths of 16.
To add a family, add an entry to FAMILIES: a builder returning the model,
an optional shard size, and the spread of the random weight matrices (wide
enough that the activation's nonlinearity shows in the logits).

The mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE) have 8
experts of which each token takes 2, run with transformers' eager experts
loop (`experts_implementation="eager"`, the reference semantics); the
script checks that the prompts' tokens spread over most experts of every
sparse layer, so a wrong router shows. Their references also hold
`experts.N` (I64 [layers, len, top_k]): the experts each prompt token
picked in each layer (-1 rows for dense layers), in the router's order.

Usage: /work/pyenv/bin/python tools/make_family_fixtures.py [OUT_DIR] [NAME...]
(default crates/bm-models/tests/fixtures, every family). Deterministic:
each family is seeded on its own, so adding one leaves the others as they are.
"""
import copy
import os
import sys
import zlib
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_tiny_llama import greedy  # noqa: E402

VOCAB = 128
PROMPTS = [
    [1, 15, 27, 100, 3],
    [7],
    [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12],
]
COMMON = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)


def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel
    return GPT2LMHeadModel(GPT2Config(
        vocab_size=VOCAB, n_embd=16, n_layer=3, n_head=2, n_positions=32,
        activation_function="gelu_new", **COMMON))


def qwen3():
    # head_dim 12 with 2 heads over a width of 16: the explicit head_dim is
    # not hidden / heads. Layers from 1 on slide (use_sliding_window with
    # max_window_layers 1); the window is shorter than the longest prompt.
    from transformers import Qwen3Config, Qwen3ForCausalLM
    return Qwen3ForCausalLM(Qwen3Config(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=3,
        num_attention_heads=2, num_key_value_heads=1, head_dim=12, max_position_embeddings=64,
        rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False,
        use_sliding_window=True, sliding_window=4, max_window_layers=1,
        attn_implementation="eager", **COMMON))


def qwen2_sliding():
    # Qwen2 with sliding-window layers (bigmodel used to refuse them).
    from transformers import Qwen2Config, Qwen2ForCausalLM
    return Qwen2ForCausalLM(Qwen2Config(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
        rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=True,
        use_sliding_window=True, sliding_window=4, max_window_layers=2,
        attn_implementation="eager", **COMMON))


def gemma2():
    # Small soft-capping bounds so that random weights reach them; a
    # query_pre_attn_scalar other than head_dim; layers 0 and 2 slide.
    from transformers import Gemma2Config, Gemma2ForCausalLM
    return Gemma2ForCausalLM(Gemma2Config(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=3,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=64,
        rms_norm_eps=1e-6, rope_theta=10000.0, query_pre_attn_scalar=12,
        attn_logit_softcapping=5.0, final_logit_softcapping=3.0, sliding_window=4,
        hidden_activation="gelu_pytorch_tanh", attn_implementation="eager", **COMMON))


def phi3():
    # LongRoPE with partial rotary: the short factors up to 8 positions,
    # the long ones beyond (the 12-token prompt); attention scaled by the
    # factor 32 / 8. A sliding window of 6, as Phi-3-mini-4k has one.
    from transformers import Phi3Config, Phi3ForCausalLM
    rotary_half = int(8 * 0.75) // 2  # head_dim 16 / 2 heads, partial factor 0.75
    return Phi3ForCausalLM(Phi3Config(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=3,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
        original_max_position_embeddings=8, rms_norm_eps=1e-5, sliding_window=6,
        rope_parameters={
            "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
            "short_factor": [1.0 + 0.1 * i for i in range(rotary_half)],
            "long_factor": [2.0 + 0.5 * i for i in range(rotary_half)],
        },
        tie_word_embeddings=False, attn_implementation="eager", **COMMON))


def mixtral():
    # Every layer sparse; routing weights always renormalised; a sliding
    # window shorter than the longest prompt, as Mixtral's Mistral layers.
    from transformers import MixtralConfig, MixtralForCausalLM
    return MixtralForCausalLM(MixtralConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=12, num_hidden_layers=3,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
        num_local_experts=8, num_experts_per_tok=2, sliding_window=6, rms_norm_eps=1e-5,
        tie_word_embeddings=False, attn_implementation="eager", experts_implementation="eager",
        **COMMON))


def qwen2_moe():
    # Layer 1 dense (mlp_only_layers); a sigmoid-gated shared expert beside
    # the routed ones; top-k weights not renormalised; q/k/v biases.
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM
    return Qwen2MoeForCausalLM(Qwen2MoeConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=24, moe_intermediate_size=12,
        shared_expert_intermediate_size=20, num_hidden_layers=3, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=64, num_experts=8, num_experts_per_tok=2,
        decoder_sparse_step=1, mlp_only_layers=[1], norm_topk_prob=False, rms_norm_eps=1e-6,
        tie_word_embeddings=False, attn_implementation="eager", experts_implementation="eager",
        **COMMON))


def qwen3_moe():
    # Every other layer sparse (decoder_sparse_step 2: layers 1 and 3);
    # top-k weights renormalised; q/k norms; an explicit head_dim.
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=24, moe_intermediate_size=12,
        num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1, head_dim=12,
        max_position_embeddings=64, num_experts=8, num_experts_per_tok=2, decoder_sparse_step=2,
        norm_topk_prob=True, rms_norm_eps=1e-6, tie_word_embeddings=False,
        attn_implementation="eager", experts_implementation="eager", **COMMON))


# name -> (builder, max_shard_size or None, std of the weight matrices)
FAMILIES = {
    "tiny-gpt2": (gpt2, None, 0.3),
    "tiny-qwen3": (qwen3, "12KB", 0.08),
    "tiny-qwen2-swa": (qwen2_sliding, None, 0.08),
    "tiny-gemma2": (gemma2, None, 0.2),
    "tiny-phi3": (phi3, None, 0.08),
    "tiny-mixtral": (mixtral, None, 0.3),
    "tiny-qwen2-moe": (qwen2_moe, "24KB", 0.2),
    "tiny-qwen3-moe": (qwen3_moe, None, 0.3),
}


def routed_experts(model, ids):
    """The experts each token of `ids` picks in each layer ([layers, len,
    top_k], -1 for dense layers), read from the routers' outputs."""
    layers = model.model.layers
    picks = []
    hooks = []
    for layer in layers:
        gate = getattr(layer.mlp, "gate", None)
        if gate is None or not hasattr(gate, "top_k"):
            picks.append(None)
            continue
        index = len(picks)
        picks.append(None)

        def hook(module, args, out, index=index):
            picks[index] = out[2].detach().clone()
        hooks.append(gate.register_forward_hook(hook))
    with torch.no_grad():
        model(torch.tensor([ids]))
    for h in hooks:
        h.remove()
    top_k = model.config.num_experts_per_tok
    rows = [p if p is not None else torch.full((len(ids), top_k), -1) for p in picks]
    return torch.stack(rows).to(torch.int64)


def check_spread(name, model, experts):
    """More than half of every sparse layer's experts serve the prompts' tokens."""
    n = model.config.num_local_experts if hasattr(model.config, "num_local_experts") else None
    n = n or model.config.num_experts
    for layer in range(experts[0].shape[0]):
        used = set()
        for e in experts:
            used |= {int(v) for v in e[layer].flatten() if v >= 0}
        if used and len(used) <= n // 2:
            raise SystemExit(f"{name}: layer {layer} uses only experts {sorted(used)} of {n}")


MOE = {"tiny-mixtral", "tiny-qwen2-moe", "tiny-qwen3-moe"}


def randomise(model, std):
    # Default init leaves norms at 1 (Gemma's at 0) and biases at 0: perturb
    # every tensor so that a wrongly applied norm weight or bias shows.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(p + 0.1 * torch.randn_like(p) if "norm" in name or ".ln_" in name
                        else 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, std)


def write(out, name, build, shard, std):
    torch.manual_seed(zlib.crc32(name.encode()))
    model = build()
    randomise(model, std)
    model.eval()
    folder = out / name
    kw = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(folder, safe_serialization=True, **kw)
    ref = {}
    # Copies: casting the model itself back and forth would round its weights.
    halves = {tag: copy.deepcopy(model).to(dt)
              for tag, dt in [("bf16", torch.bfloat16), ("f16", torch.float16)]}
    for i, ids in enumerate(PROMPTS):
        x = torch.tensor([ids])
        ref[f"prompt.{i}"] = x[0].clone()
        with torch.no_grad():
            ref[f"logits.{i}"] = model(x).logits[0].float().contiguous()
            for tag, half_model in halves.items():
                ref[f"logits_{tag}.{i}"] = half_model(x).logits[0].float().contiguous()
        ref[f"generated.{i}"] = greedy(model, x)
        if name in MOE:
            ref[f"experts.{i}"] = routed_experts(model, ids)
    if name in MOE:
        check_spread(name, model, [ref[f"experts.{i}"] for i in range(len(PROMPTS))])
    save_file(ref, folder / "reference.safetensors")
    size = sum(f.stat().st_size for f in folder.iterdir())
    print(f"wrote {folder} ({size // 1024} KiB)")


def main():
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "crates/bm-models/tests/fixtures")
    names = sys.argv[2:] or list(FAMILIES)
    for name in names:
        write(out, name, *FAMILIES[name])


if __name__ == "__main__":
    main()
