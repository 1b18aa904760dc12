#!/usr/bin/env python3
"""Makes the PyTorch `.bin` fixtures of bm-shard's and the CLI's tests.

Written with torch 2.15.0 (CPU) and transformers 5.23.0 on Python 3.11; the
bytes torch.save writes depend on the torch version, so re-run this only on
purpose and commit the result together with `expected.json`.

Into crates/bm-shard/tests/fixtures/torch/ (each file a few KB at most):

* `plain.bin`      every dtype bigmodel reads (f64 f32 f16 bf16 i64 i32 i16 i8
                   u8 bool), a scalar and an empty tensor, an nn.Parameter,
                   saved as transformers saves a state dict (an OrderedDict
                   with `_metadata`)
* `shared.bin`     tied names (one tensor under two keys), views of one
                   storage: a transpose, a slice with an offset and strides,
                   a contiguous row, all sharing the storage of `w`
* `float8.bin`     float8 tensors, which torch pickles with _rebuild_tensor_v3
* `protocol4.bin`  torch.save(pickle_protocol=4): FRAME, MEMOIZE, STACK_GLOBAL
                   (which torch's own weights_only loader does not read)
* `legacy.bin`     the pre-1.6 format (_use_new_zipfile_serialization=False)
* `sharded/`       pytorch_model-0000k-of-00002.bin + pytorch_model.bin.index.json,
                   as transformers 4.x wrote them
* `tiny-llama/`    a tiny random LlamaForCausalLM (tied embeddings) as
                   config.json + pytorch_model.bin, with `reference.json`:
                   a prompt, transformers' logits for it and its greedy
                   continuation
* `u8_5gib.pkl`    the data.pkl of one 5 GiB uint8 tensor, for the sparse
                   zip64 test (the test writes the archive around it)
* `expected.json`  {file: {tensor: {dtype, shape, fnv1a64}}}: every tensor's
                   contiguous bytes as torch.load returns them
* `bad/`           inputs that must be refused with a clear error: malicious
                   pickles (each verified here to create a file when loaded
                   by plain pickle), a missing storage record, short storages,
                   unknown dtypes, an unsupported opcode, memo and recursion
                   abuse, huge declared sizes, a deflated archive, big-endian
                   storages, a tar-format file, a nested dict.

Usage: /work/pyenv/bin/python tools/make_torch_bin_fixtures.py [OUT_DIR]
Deterministic: seeded, and no timestamps reach the files that tests hash.
"""
import io
import json
import os
import pickle
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from collections import OrderedDict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
OUT = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "crates/bm-shard/tests/fixtures/torch"
MARKER = "bigmodel-pickle-was-run"
SAFETENSORS_DTYPE = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16",
    torch.bfloat16: "BF16", torch.int64: "I64", torch.int32: "I32",
    torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}


def fnv1a64(data: bytes) -> str:
    h = 0xCBF29CE484222325
    for b in data:
        h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return f"{h:016x}"


def tensor_bytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def describe(state: dict) -> dict:
    return {
        name: {
            "dtype": SAFETENSORS_DTYPE[t.dtype],
            "shape": list(t.shape),
            "fnv1a64": fnv1a64(tensor_bytes(t)),
        }
        for name, t in state.items()
    }


def plain() -> OrderedDict:
    g = torch.Generator().manual_seed(0)
    sd = OrderedDict()
    sd["f64"] = torch.randn(2, 3, generator=g, dtype=torch.float64)
    sd["f32"] = torch.randn(3, 4, generator=g)
    sd["f16"] = torch.randn(5, generator=g).half()
    sd["bf16"] = torch.randn(2, 3, generator=g).bfloat16()
    sd["i64"] = torch.tensor([1, -2, 3, 2**40])
    sd["i32"] = torch.tensor([7, -8], dtype=torch.int32)
    sd["i16"] = torch.tensor([300, -300], dtype=torch.int16)
    sd["i8"] = torch.tensor([-5, 6, 7], dtype=torch.int8)
    sd["u8"] = torch.tensor([0, 255], dtype=torch.uint8)
    sd["bool"] = torch.tensor([True, False, True])
    sd["scalar"] = torch.tensor(2.5)
    sd["empty"] = torch.zeros(0, 3)
    sd["param"] = torch.nn.Parameter(torch.randn(4, generator=g))
    # What nn.Module.state_dict() attaches, and transformers saves with it.
    sd._metadata = OrderedDict({"": {"version": 1}})
    return sd


def shared() -> OrderedDict:
    w = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    sd = OrderedDict()
    sd["embed.weight"] = w
    sd["lm_head.weight"] = w  # tied: the same tensor under two names
    sd["transposed"] = w.t()  # strides (1, 6)
    sd["window"] = w[1:3, 2:5]  # offset 8, strides (6, 1)
    sd["row"] = w[2]  # contiguous, offset 12
    sd["column"] = w[:, 3]  # offset 3, stride 6
    return sd


def float8() -> OrderedDict:
    x = torch.tensor([0.5, -1.0, 448.0, 0.0])
    return OrderedDict(e4m3=x.to(torch.float8_e4m3fn), e5m2=x.to(torch.float8_e5m2))


class Evil:
    """An object whose unpickling runs `call(*args)`."""

    def __init__(self, call, args):
        self.call, self.args = call, args

    def __reduce__(self):
        return (self.call, self.args)


MALICIOUS = {
    "malicious_system.bin": Evil(os.system, (f"touch {MARKER}",)),
    "malicious_exec.bin": Evil(exec, (f"open({MARKER!r}, 'w').close()",)),
    "malicious_eval.bin": Evil(eval, (f"open({MARKER!r}, 'w').close()",)),
    "malicious_popen.bin": Evil(subprocess.Popen, (["touch", MARKER],)),
}


def check_malicious(path: Path):
    """The fixture is live: plain unpickling runs its code (in a scratch
    folder), and torch's own safe loader refuses it."""
    with tempfile.TemporaryDirectory() as scratch:
        cwd = os.getcwd()
        os.chdir(scratch)
        try:
            torch.load(path, weights_only=False)
            for _ in range(50):
                if os.path.exists(MARKER):
                    break
                time.sleep(0.1)
            assert os.path.exists(MARKER), f"{path} did not run its payload"
        finally:
            os.chdir(cwd)
    try:
        torch.load(path, weights_only=True)
    except pickle.UnpicklingError:
        pass
    else:
        raise AssertionError(f"torch loaded {path} with weights_only=True")


# Hand-made archives for bad input: a pickle written by Python's pickler
# with torch's persistent ids, and records laid out as torch lays them.

class Storage:
    def __init__(self, key, numel, ty=torch.FloatStorage):
        self.key, self.numel, self.ty = key, numel, ty


class Rebuild:
    def __init__(self, storage, offset, shape, stride):
        self.args = (storage, offset, tuple(shape), tuple(stride), False, OrderedDict())

    def __reduce__(self):
        return (torch._utils._rebuild_tensor_v2, self.args)


class TorchPickler(pickle.Pickler):
    def persistent_id(self, obj):
        if isinstance(obj, Storage):
            return ("storage", obj.ty, obj.key, "cpu", obj.numel)
        return None


def crafted_pickle(obj) -> bytes:
    buf = io.BytesIO()
    TorchPickler(buf, protocol=2).dump(obj)
    return buf.getvalue()


def write_archive(path: Path, pkl: bytes, storages: dict, byteorder=b"little",
                  compression=zipfile.ZIP_STORED):
    with zipfile.ZipFile(path, "w", compression=compression) as z:
        for name, data in [("data.pkl", pkl), ("byteorder", byteorder), ("version", b"3\n")] + [
            (f"data/{k}", v) for k, v in storages.items()
        ]:
            info = zipfile.ZipInfo(f"archive/{name}", date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = compression
            z.writestr(info, data)


def repack(src: Path, dst: Path, compression=zipfile.ZIP_STORED, replace=None):
    replace = replace or {}
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        for info in zin.infolist():
            data = zin.read(info)
            for suffix, new in replace.items():
                if info.filename.endswith(suffix):
                    data = new
            out = zipfile.ZipInfo(info.filename, date_time=(1980, 1, 1, 0, 0, 0))
            out.compress_type = compression
            zout.writestr(out, data)


def bad_inputs(bad: Path):
    for name, evil in MALICIOUS.items():
        w = torch.ones(2)
        torch.save(OrderedDict(weight=w, evil=evil), bad / name)
        check_malicious(bad / name)

    floats = torch.arange(12, dtype=torch.float32).numpy().tobytes()
    s0 = Storage("0", 12)
    # The baseline the others break: torch itself loads it.
    ok = OrderedDict(w=Rebuild(s0, 0, (3, 4), (4, 1)))
    with tempfile.TemporaryDirectory() as scratch:
        write_archive(Path(scratch) / "ok.bin", crafted_pickle(ok), {"0": floats})
        loaded = torch.load(Path(scratch) / "ok.bin", weights_only=True)
        assert torch.equal(loaded["w"], torch.arange(12, dtype=torch.float32).reshape(3, 4))

    write_archive(bad / "missing_record.bin",
                  crafted_pickle(OrderedDict(w=Rebuild(Storage("7", 12), 0, (3, 4), (4, 1)))),
                  {"0": floats})
    write_archive(bad / "short_storage.bin", crafted_pickle(ok), {"0": floats[:32]})
    write_archive(bad / "past_storage.bin",
                  crafted_pickle(OrderedDict(w=Rebuild(s0, 4, (3, 4), (4, 1)))),
                  {"0": floats})
    write_archive(bad / "huge_shape.bin",
                  crafted_pickle(OrderedDict(w=Rebuild(s0, 0, (2**40, 2**40), (1, 1)))),
                  {"0": floats})
    write_archive(bad / "huge_storage.bin",
                  crafted_pickle(OrderedDict(w=Rebuild(Storage("0", 2**62), 0, (3, 4), (4, 1)))),
                  {"0": floats})
    write_archive(bad / "big_endian.bin", crafted_pickle(ok), {"0": floats}, byteorder=b"big")
    write_archive(bad / "deflated.bin", crafted_pickle(ok), {"0": floats},
                  compression=zipfile.ZIP_DEFLATED)
    write_archive(bad / "unsupported_opcode.bin", b"\x80\x02\x8f.", {})  # EMPTY_SET
    write_archive(bad / "deep_tuples.bin", b"\x80\x02)" + b"\x85" * 1000 + b".", {})
    write_archive(bad / "memo_missing.bin", b"\x80\x02h\x07.", {})
    write_archive(bad / "self_list.bin", b"\x80\x02]q\x00h\x00a.", {})  # a list holding itself

    torch.save({"z": torch.zeros(2, dtype=torch.complex64)}, bad / "complex64.bin")
    torch.save({"u": torch.zeros(2, dtype=torch.uint16)}, bad / "uint16.bin")
    torch.save({"e": torch.zeros(1).expand(1000)}, bad / "expanded.bin")
    torch.save({"model": {"w": torch.ones(2)}}, bad / "nested.bin")
    (bad / "bare_pickle.bin").write_bytes(b"\x80\x02}q\x00.")
    with tarfile.open(bad / "tar_format.bin", "w", format=tarfile.USTAR_FORMAT) as tar:
        info = tarfile.TarInfo("pickle")
        info.size, info.mtime = 2, 0
        tar.addfile(info, io.BytesIO(b"\x80\x02"))
    # The header and one data block are all a reader looks at.
    with open(bad / "tar_format.bin", "r+b") as f:
        f.truncate(1024)


def tiny_llama(out: Path) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=32, hidden_size=8, intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=True,
        initializer_range=0.5,  # wide enough that greedy decoding wanders
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out)
    state = model.state_dict()
    torch.save(state, out / "pytorch_model.bin")
    prompt = [1, 5, 9, 3]
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0]
        generated = model.generate(
            torch.tensor([prompt]), max_new_tokens=6, do_sample=False,
            eos_token_id=None, pad_token_id=0,
        )[0, len(prompt):].tolist()
    reference = {"prompt": prompt, "generated": generated,
                 "logits": [[round(v, 6) for v in row] for row in logits.tolist()]}
    (out / "reference.json").write_text(json.dumps(reference, indent=2) + "\n")
    return describe(state)


def main():
    shutil.rmtree(OUT, ignore_errors=True)
    (OUT / "bad").mkdir(parents=True)
    expected = {}

    for name, state, kwargs in [
        ("plain.bin", plain(), {}),
        ("shared.bin", shared(), {}),
        ("float8.bin", float8(), {}),
        ("protocol4.bin", OrderedDict(a=torch.ones(2, 2), b=torch.arange(3)), {"pickle_protocol": 4}),
        ("legacy.bin", shared(), {"_use_new_zipfile_serialization": False}),
    ]:
        torch.save(state, OUT / name, **kwargs)
        # torch's weights-only loader reads protocol 2 only; this file is ours.
        loaded = torch.load(OUT / name, weights_only="pickle_protocol" not in kwargs)
        expected[name] = describe(loaded)

    sharded = OUT / "sharded"
    sharded.mkdir()
    state = plain()
    names = list(state)
    parts = [names[:6], names[6:]]
    weight_map = {}
    for k, part in enumerate(parts, 1):
        file = f"pytorch_model-{k:05}-of-{len(parts):05}.bin"
        torch.save(OrderedDict((n, state[n]) for n in part), sharded / file)
        weight_map.update({n: file for n in part})
    total = sum(t.numel() * t.element_size() for t in state.values())
    (sharded / "pytorch_model.bin.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2, sort_keys=True) + "\n")
    expected["sharded"] = describe(state)

    expected["tiny-llama"] = tiny_llama(OUT / "tiny-llama")

    # One 5 GiB uint8 tensor over storage "0" (written around by the test).
    big = OrderedDict(big=Rebuild(Storage("0", 5 << 30, torch.ByteStorage), 0, (5 << 30,), (1,)))
    (OUT / "u8_5gib.pkl").write_bytes(crafted_pickle(big))

    bad_inputs(OUT / "bad")
    (OUT / "expected.json").write_text(json.dumps(expected, indent=1) + "\n")
    for p in sorted(OUT.rglob("*")):
        if p.is_file():
            print(f"{p.stat().st_size:8d}  {p.relative_to(OUT)}")


if __name__ == "__main__":
    main()
