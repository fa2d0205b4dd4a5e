"""Benchmark: peak memory of Mela against context length, streaming vs one pass.

Each (mode, context length) runs in a fresh process that builds mela_debug (random weights),
reads a random token sequence of that length without gradients, and reports its peak
resident memory (ru_maxrss) and time. Streaming reads one chunk per call and carries the
memory state; one pass reads the whole context at once. The baseline row (no tokens) is the
process with the model built, so the growth is peak - baseline.

    python scripts/bench_stream_memory.py [--lengths 4096,8192,16384,32768]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time



def measure(mode: str, length: int) -> dict:
    """In this process: read `length` tokens in `mode`, return peak RSS (MiB) and seconds."""
    import torch

    from models.lms.mela import Mela
    from torchtitan_ext.families.mela import model_config

    torch.manual_seed(0)
    model = Mela(model_config("debug")).eval()
    tokens = torch.randint(0, model.cfg.vocab_size, (1, length))
    start = time.perf_counter()
    with torch.no_grad():
        if mode == "streaming":
            state = None
            for begin in range(0, length, model.cfg.chunk_tokens):
                _, state = model.stream(tokens[:, begin : begin + model.cfg.chunk_tokens], state)
        elif length:
            model(tokens)
    return {"mode": mode, "length": length, "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "seconds": time.perf_counter() - start}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="4096,8192,16384,32768")
    parser.add_argument("--measure", nargs=2, metavar=("MODE", "LENGTH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure[0], int(args.measure[1]))))
        return
    runs = [("baseline", 0)] + [(mode, int(n)) for mode in ("streaming", "one-pass") for n in args.lengths.split(",")]
    baseline = None
    print(f"{'mode':<10} {'tokens':>7} {'peak MiB':>9} {'growth MiB':>11} {'seconds':>8}")
    for mode, length in runs:
        out = subprocess.run([sys.executable, __file__, "--measure", mode, str(length)], capture_output=True, text=True,
                             check=True)
        result = json.loads(out.stdout.strip().splitlines()[-1])
        baseline = baseline or result["peak_mib"]
        print(f"{mode:<10} {length:>7} {result['peak_mib']:>9.0f} {result['peak_mib'] - baseline:>11.0f} "
              f"{result['seconds']:>8.1f}")


if __name__ == "__main__":
    main()
