#!/usr/bin/env python3
"""Makes the generation fixtures of bm-models' tests from transformers' own code.

Made with torch 2.15.0, transformers 5.23.0, tokenizers 0.23.3, jinja2 3.1.6,
safetensors 0.8.0 (CPU); pin them when regenerating.

Writes, under crates/bm-models/tests/fixtures/ (the decoder folders
themselves come from make_tiny_llama.py and make_family_fixtures.py):

* generation/batch.safetensors: transformers' greedy `generate` of the three
  reference prompts of every decoder fixture as one left-padded batch
  (`padding_side="left"`, the attention mask and the position ids
  `generate` derives from it), 10 new tokens at most, stopping each
  sequence at an end token. I64 tensors, per MODEL:
    MODEL.prompt.N     the prompt
    MODEL.eos          the end tokens: 2, and the first token that some
                       sequence, run without stopping, makes for the first
                       time three or more steps in (so it stops while the
                       others run on)
    MODEL.generated.N  the new tokens of sequence N, up to and including its
                       end token (transformers pads the rest)
* generation/processors.safetensors: transformers' logits processors on a
  batch of scores. F32 `scores` [4, 64] and I64 `input_ids` [4, 12] (each
  row's tokens so far), then one F32 [4, 64] tensor per case, named by its
  settings: `repetition_penalty=1.3`, `temperature=0.7`, `top_k=5`,
  `top_k=1`, `top_p=0.8`, `top_p=0.3`, and `chain` (the processors
  `generate` builds for do_sample=True, repetition_penalty=1.2,
  temperature=0.8, top_k=10, top_p=0.9, in its order).
* chat/llama3 and chat/qwen2: tokenizer_config.json (a real chat template:
  Meta-Llama-3-8B-Instruct's, and Qwen2.5-Instruct's with tools) and a
  small tokenizer.json, and chat/rendered.json: for each conversation,
  `apply_chat_template(..., tokenize=False)` as transformers renders it.

Usage: /work/pyenv/bin/python tools/make_generation_fixtures.py [FIXTURES_DIR]
"""
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

DECODERS = ["tiny-llama", "tiny-qwen2", "tiny-mistral", "tiny-gpt2", "tiny-qwen3",
            "tiny-qwen2-swa", "tiny-gemma2", "tiny-phi3"]
MAX_NEW = 10


def batch_references(fixtures):
    from transformers import AutoModelForCausalLM

    out = {}
    for name in DECODERS:
        folder = fixtures / name
        reference = load_file(str(folder / "reference.safetensors"))
        prompts = [reference[f"prompt.{i}"].tolist() for i in range(3)]
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                     attn_implementation="eager")
        model.eval()
        longest = max(len(p) for p in prompts)
        ids = torch.tensor([[0] * (longest - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts])

        def generate(eos):
            with torch.no_grad():
                return model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                                      max_new_tokens=MAX_NEW, eos_token_id=eos,
                                      pad_token_id=0)[:, longest:]

        # A token some sequence first makes a few steps in, so it ends
        # before the others.
        free = generate([model.config.vocab_size + 7]).tolist()
        late = [row[k] for row in free for k in range(2, MAX_NEW) if row[k] not in row[:k]]
        eos = [2] + late[:1]
        stopped = generate(eos)
        for i, p in enumerate(prompts):
            out[f"{name}.prompt.{i}"] = torch.tensor(p)
            row = stopped[i].tolist()
            end = next((k + 1 for k, t in enumerate(row) if t in eos), len(row))
            out[f"{name}.generated.{i}"] = torch.tensor(row[:end])
        out[f"{name}.eos"] = torch.tensor(eos)
        print(name, eos, [out[f"{name}.generated.{i}"].tolist() for i in range(3)])
    return out


def processor_references():
    from transformers import (GenerationConfig, LogitsProcessorList, RepetitionPenaltyLogitsProcessor,
                              TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)
    from transformers.generation.utils import GenerationMixin

    g = torch.Generator().manual_seed(1234)
    scores = torch.randn(4, 64, generator=g) * 3
    # A few ties, so top-k's rule for them shows.
    scores[1, 10] = scores[1, 20] = scores[1, 30] = scores[1].max()
    input_ids = torch.randint(0, 64, (4, 12), generator=g)
    out = {"scores": scores.clone(), "input_ids": input_ids}
    cases = {
        "repetition_penalty=1.3": RepetitionPenaltyLogitsProcessor(1.3),
        "temperature=0.7": TemperatureLogitsWarper(0.7),
        "top_k=5": TopKLogitsWarper(5),
        "top_k=1": TopKLogitsWarper(1),
        "top_p=0.8": TopPLogitsWarper(0.8),
        "top_p=0.3": TopPLogitsWarper(0.3),
    }
    for key, processor in cases.items():
        out[key] = processor(input_ids, scores.clone()).contiguous()

    # The processors generate() itself builds, in its order.
    class Stub(GenerationMixin):
        class config:
            is_encoder_decoder = False

    config = GenerationConfig(do_sample=True, repetition_penalty=1.2, temperature=0.8, top_k=10,
                              top_p=0.9)
    chain = Stub()._get_logits_processor(generation_config=config, input_ids_seq_length=12,
                                         encoder_input_ids=input_ids, prefix_allowed_tokens_fn=None,
                                         logits_processor=LogitsProcessorList(), device="cpu",
                                         model_kwargs={})
    kinds = [type(p).__name__ for p in chain]
    assert kinds == ["RepetitionPenaltyLogitsProcessor", "TemperatureLogitsWarper",
                     "TopKLogitsWarper", "TopPLogitsWarper"], kinds
    out["chain"] = chain(input_ids, scores.clone()).contiguous()
    return out


LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

QWEN2 = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

TEMPLATES = {
    "llama3": (LLAMA3, {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}),
    "qwen2": (QWEN2, {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}),
}

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city, in «°C»",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}

CONVERSATIONS = [
    {"messages": [{"role": "user", "content": "Hello!"}], "add_generation_prompt": True},
    {"messages": [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "  Capital of France? \n"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of Japan — 日本?"},
    ], "add_generation_prompt": True},
    {"messages": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello, how can I help?"},
    ], "add_generation_prompt": False},
    {"messages": [
        {"role": "user", "content": "Weather in Paris for 2 days?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather",
                                              "arguments": {"city": "Paris", "days": 2}}}]},
        {"role": "tool", "content": "{\"temp\": 21}"},
        {"role": "tool", "content": "{\"temp\": 19}"},
    ], "tools": [WEATHER_TOOL], "add_generation_prompt": True},
]


def tiny_tokenizer(specials):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = sorted(ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(sorted(set(specials.values())))
    return tok


def chat_fixtures(fixtures):
    from transformers import AutoTokenizer

    rendered = []
    for name, (template, specials) in TEMPLATES.items():
        folder = fixtures / "chat" / name
        folder.mkdir(parents=True, exist_ok=True)
        tiny_tokenizer(specials).save(str(folder / "tokenizer.json"))
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": template, **specials}
        (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
        tokenizer = AutoTokenizer.from_pretrained(folder)
        for conversation in CONVERSATIONS:
            if name == "llama3" and "tools" in conversation:
                continue  # Llama 3's first template has no tool messages
            text = tokenizer.apply_chat_template(
                conversation["messages"], tools=conversation.get("tools"), tokenize=False,
                add_generation_prompt=conversation["add_generation_prompt"])
            rendered.append({"template": name, **conversation, "rendered": text})
    (fixtures / "chat" / "rendered.json").write_text(
        json.dumps(rendered, indent=2, ensure_ascii=False) + "\n")


def main():
    fixtures = Path(sys.argv[1] if len(sys.argv) > 1 else "crates/bm-models/tests/fixtures")
    (fixtures / "generation").mkdir(parents=True, exist_ok=True)
    save_file(batch_references(fixtures), str(fixtures / "generation" / "batch.safetensors"))
    save_file(processor_references(), str(fixtures / "generation" / "processors.safetensors"))
    chat_fixtures(fixtures)


if __name__ == "__main__":
    main()
