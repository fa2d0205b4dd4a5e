"""Summarise a training log: first and last loss, throughput, and the latest checkpoint.

    python scripts/summarize_run.py LOG DUMP_FOLDER
"""

import re
import sys
from pathlib import Path

ANSI = re.compile(r"\x1b\[[0-9;]*m")
STEP = re.compile(r"step:\s*(\d+)\s+loss:\s*([0-9.]+).*?tps:\s*([0-9,]+)")


def main() -> None:
    log, dump = Path(sys.argv[1]), Path(sys.argv[2])
    steps = [(int(s), float(loss), int(tps.replace(",", ""))) for s, loss, tps in STEP.findall(ANSI.sub("", log.read_text()))]
    if not steps:
        sys.exit(f"error: no training steps found in {log}")
    (s0, l0, _), (s1, l1, _) = steps[0], steps[-1]
    tps = sorted(t for _, _, t in steps[1:]) or [steps[0][2]]
    checkpoints = sorted((dump / "checkpoint").glob("step-*"), key=lambda p: int(p.name.split("-")[1]))
    print(f"loss: step {s0} {l0:.3f} -> step {s1} {l1:.3f} ({l0 - l1:+.3f} nats fall)")
    print(f"throughput: median {tps[len(tps) // 2]:,} tokens/s")
    print(f"checkpoint: {checkpoints[-1] if checkpoints else 'none written'}")


if __name__ == "__main__":
    main()
