#!/usr/bin/env python3
"""How many times faster the whole `bigmodel plan` process is than Accelerate's
`infer_auto_device_map` call alone, on one module-tree file, paired in time.

On a shared VM both sides drift by tens of percent within an hour, so a ratio of
two medians taken minutes apart says little. Each round here times one
Accelerate call (`bench_accelerate.py plan --repeats 1 --moe-tree FILE`, the call
alone, the model built before the clock starts) and then the median of N whole
`bigmodel plan FILE --json` processes (spawned from Python, start to exit), and
takes their ratio; the median of the rounds' ratios is the figure.

  paired_plan_ratio.py BIGMODEL FILE [--budget BYTES] [--rounds R] [--runs N]
                       [--compat accelerate|auto]

BYTES goes to GPU 0, GPU 1 and the CPU (`--mode sequential`), as in
`cargo xtask bench`. Prints one line per round, then one JSON document:
{"ratio_median", "ratio_min", "ratio_max", "accelerate_seconds_median",
 "bigmodel_seconds_median", "rounds"}.
"""

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("bigmodel", help="the bigmodel binary")
    parser.add_argument("file", help="a bigmodel-module-tree/1 file")
    parser.add_argument("--budget", type=int, default=122683392)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--runs", type=int, default=9)
    parser.add_argument("--compat", default="accelerate", choices=["accelerate", "auto"])
    args = parser.parse_args()

    b = args.budget
    ours = [args.bigmodel, "plan", args.file, "--max-memory", f"0={b},1={b},cpu={b}",
            "--mode", "sequential", "--json"]
    if args.compat == "accelerate":
        ours += ["--compat", "accelerate"]
    accelerate = [sys.executable, str(Path(__file__).with_name("bench_accelerate.py")),
                  "plan", "--repeats", "1", "--moe-tree", args.file]

    rounds = []
    for r in range(args.rounds):
        out = subprocess.run(accelerate, capture_output=True, text=True, check=True).stdout
        call = json.loads(out)["trees"]["moe_100k"]["seconds"]
        times = []
        for _ in range(args.runs):
            start = time.perf_counter()
            subprocess.run(ours, stdout=subprocess.DEVNULL, check=True)
            times.append(time.perf_counter() - start)
        process = statistics.median(times)
        rounds.append({"accelerate_seconds": call, "bigmodel_seconds": process,
                       "ratio": call / process})
        print(f"round {r}: Accelerate's call {call:.3f} s, bigmodel's process "
              f"{process * 1e3:.1f} ms (median of {args.runs}), ratio {call / process:.0f}",
              file=sys.stderr, flush=True)
    ratios = [x["ratio"] for x in rounds]
    print(json.dumps({
        "ratio_median": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "accelerate_seconds_median": statistics.median(x["accelerate_seconds"] for x in rounds),
        "bigmodel_seconds_median": statistics.median(x["bigmodel_seconds"] for x in rounds),
        "rounds": rounds,
    }))


if __name__ == "__main__":
    main()
