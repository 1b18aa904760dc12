#!/usr/bin/env python3
"""Makes the tiny random decoder fixtures of bm-models' parity tests.

For each architecture (llama, qwen2, mistral) it builds a small random model
with transformers, saves it with save_pretrained (safetensors; qwen2 sharded,
to exercise index.json loading) and writes `reference.safetensors` beside it:

* `prompt.N`     I64 [len]          token-id prompts
* `logits.N`     F32 [len, vocab]   transformers' logits in float32
* `logits_bf16.N`, `logits_f16.N`   the same model run in bfloat16 / float16
                                    (stored as F32)
* `generated.N`  I64 [new]          greedy continuation (KV cache, no EOS stop)
* tiny-llama only: `tokenizer.json` (byte-level BPE, 256 tokens),
  `text_prompt` (its ids for TEXT_PROMPT) and `text_generated`

It also makes `tiny-bert`: a random BertForSequenceClassification (so its
weights carry the `bert.` prefix) with a WordPiece tokenizer.json, and a
`reference.safetensors` holding `ids.N` (the tokenizer's ids for SENTENCES),
`hidden.N` (last hidden state) and `embedding.N` (mean-pooled, L2-normalised).

Usage: /work/pyenv/bin/python tools/make_tiny_llama.py [OUT_DIR]
(default crates/bm-models/tests/fixtures). Deterministic: seeded.
"""
import copy
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig,
                          MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM)

PROMPTS = [
    [1, 15, 27, 200, 3],
    [7],
    [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12],
]
NEW_TOKENS = 8
TEXT_PROMPT = "Hello, wörld!"


def models():
    common = dict(
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,  # grouped-query attention
        max_position_embeddings=128,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    yield "tiny-llama", LlamaForCausalLM(LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128,
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
        **common)), None
    yield "tiny-qwen2", Qwen2ForCausalLM(Qwen2Config(
        vocab_size=256, hidden_size=32, intermediate_size=64,
        rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True,
        **common)), "20KB"
    # A window shorter than the longest prompt, so the test sees it bite.
    yield "tiny-mistral", MistralForCausalLM(MistralConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, head_dim=16,
        rms_norm_eps=1e-5, rope_theta=10000.0, sliding_window=6,
        tie_word_embeddings=False, attn_implementation="eager", **common)), None


def randomise(model):
    # Default init leaves norms at 1 and biases at 0: perturb every tensor so
    # a wrongly applied norm weight or bias shows in the logits.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.08)


def greedy(model, x):
    """Greedy decoding with the KV cache, never stopping at EOS (what
    generate does, minus its stopping rules)."""
    out, past, new = None, None, []
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            out = model(x, past_key_values=past, use_cache=True)
            past = out.past_key_values
            x = out.logits[:, -1:].argmax(-1)
            new.append(int(x))
    return torch.tensor(new)


def byte_tokenizer():
    """A byte-level BPE over exactly the 256 byte tokens (no merges), so the
    tiny vocabulary covers any text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel
    vocab = {tok: i for i, tok in enumerate(sorted(ByteLevel.alphabet(), key=lambda c: ord(c)))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


SENTENCES = ["hello world", "the big model runs on the small machine", "unknown zebra"]


def tiny_bert(out):
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import BertConfig, BertForSequenceClassification

    words = ("[PAD] [UNK] [CLS] [SEP] [MASK] the a big small model machine runs on hello "
             "world ##s ##ing run un ##known").split()
    vocab = {w: i for i, w in enumerate(words)}
    tok = Tokenizer(models.WordPiece(vocab=vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    tok.decoder = decoders.WordPiece()
    model = BertForSequenceClassification(BertConfig(
        vocab_size=len(words), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=16, type_vocab_size=2))
    randomise(model)
    model.eval()
    folder = out / "tiny-bert"
    model.save_pretrained(folder, safe_serialization=True)
    tok.save(str(folder / "tokenizer.json"))
    ref = {}
    for i, sentence in enumerate(SENTENCES):
        ids = tok.encode(sentence).ids
        with torch.no_grad():
            hidden = model.bert(torch.tensor([ids])).last_hidden_state[0]
        ref[f"ids.{i}"] = torch.tensor(ids)
        ref[f"hidden.{i}"] = hidden.contiguous()
        ref[f"embedding.{i}"] = torch.nn.functional.normalize(hidden.mean(0), dim=0)
    save_file(ref, folder / "reference.safetensors")
    print(f"wrote {folder}")


def main():
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "crates/bm-models/tests/fixtures")
    torch.manual_seed(0)
    for name, model, shard in models():
        randomise(model)
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
            ref[f"generated.{i}"] = greedy(model, x)
            for tag, half_model in halves.items():
                with torch.no_grad():
                    ref[f"logits_{tag}.{i}"] = half_model(x).logits[0].float().contiguous()
        if name == "tiny-llama":
            tok = byte_tokenizer()
            tok.save(str(folder / "tokenizer.json"))
            ids = tok.encode(TEXT_PROMPT).ids
            ref["text_prompt"] = torch.tensor(ids)
            ref["text_generated"] = greedy(model, torch.tensor([ids]))
        save_file(ref, folder / "reference.safetensors")
        print(f"wrote {folder}")
    tiny_bert(out)


if __name__ == "__main__":
    main()
