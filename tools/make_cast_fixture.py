"""Writes crates/bm-tensor/tests/fixtures/casts.safetensors: PyTorch's CPU
conversions between F64, F32, F16 and BF16 on special and random values, as
raw bits, so that bm-tensor's casts can be checked bit for bit without torch.

Tensor `in.<SRC>` holds the source bits; `out.<SRC>.<DST>` what
`x.to(dst)` gives in torch. Bits are stored as integer tensors of the
same width (F64/I64, F32/I32, F16 and BF16/I16).

Usage: python tools/make_cast_fixture.py   (needs torch and safetensors)
"""
import math
import pathlib

import torch
from safetensors.torch import save_file

torch.manual_seed(0)
OUT = pathlib.Path(__file__).resolve().parent.parent / "crates/bm-tensor/tests/fixtures/casts.safetensors"
DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
BITS = {torch.float64: torch.int64, torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def specials(dtype):
    v = [0.0, -0.0, 1.0, -1.0, math.inf, -math.inf, math.nan, 65504.0, 65520.0, 3.4e38, 1e-40, 6e-8,
         1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-11, 1 + 2**-30, 1e300, -1e-300]
    return torch.tensor(v, dtype=torch.float64).to(dtype)


def random_bits(dtype, n):
    width = torch.finfo(dtype).bits
    if width == 64:
        hi_half = torch.randint(-(2**31), 2**31, (n,), dtype=torch.int64)
        lo_half = torch.randint(0, 2**32, (n,), dtype=torch.int64)
        bits = (hi_half << 32) | lo_half
    else:
        bits = torch.randint(-(2 ** (width - 1)), 2 ** (width - 1), (n,), dtype=torch.int64)
    return bits.to(BITS[dtype]).view(dtype)


def nan_payloads(dtype):
    # Signalling and quiet NaNs with assorted payloads, both signs.
    width = torch.finfo(dtype).bits
    mant = {64: 52, 32: 23, 16: 10 if dtype == torch.float16 else 7}[width]
    exp = (2 ** width - 1) >> (mant + 1) << mant  # all-ones exponent in place
    vals = []
    for payload in [1, 2 ** (mant - 1), 2 ** (mant - 1) + 1, 2 ** (mant - 2), 2 ** mant - 1]:
        for sign in [0, 1 << (width - 1)]:
            u = sign | exp | payload
            vals.append(u - (1 << width) if u >= 1 << (width - 1) else u)
    return torch.tensor(vals, dtype=torch.int64).to(BITS[dtype]).view(dtype)


def main():
    tensors = {}
    for src_name, src in DTYPES.items():
        x = torch.cat([specials(src), nan_payloads(src), random_bits(src, 2000)])
        tensors[f"in.{src_name}"] = x.view(BITS[src]).clone()
        for dst_name, dst in DTYPES.items():
            if dst is not src:
                tensors[f"out.{src_name}.{dst_name}"] = x.to(dst).view(BITS[dst]).clone()
    save_file(tensors, str(OUT), metadata={"torch": torch.__version__})
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes) with torch {torch.__version__}")


if __name__ == "__main__":
    main()
