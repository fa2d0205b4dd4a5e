"""One line for a training run: loss fall, median throughput, latest checkpoint.

    python scripts/summarize_run.py NAME LOG DUMP_FOLDER
Exit 1 (and the log's last line) when the log holds no training step.
"""

import sys
from pathlib import Path

from torchtitan_ext.training.run_log import last_line, parse_steps


def summary(name: str, log: Path, dump: Path) -> str:
    text = log.read_text()
    steps = parse_steps(text)
    if not steps:
        raise SystemExit(f"error: {name}: no training step in {log}: {last_line(text)}")
    first, last = min(steps), max(steps)
    tps = sorted(s["tps"] for n, s in steps.items() if n != first and "tps" in s) or [steps[first].get("tps", 0.0)]
    checkpoints = sorted((dump / "checkpoint").glob("step-*"), key=lambda p: int(p.name.split("-")[1]))
    return (f"{name}: loss {steps[first]['loss']:.3f} -> {steps[last]['loss']:.3f} (steps {first}-{last}), "
            f"{tps[len(tps) // 2]:,.0f} tokens/s, checkpoint {checkpoints[-1] if checkpoints else 'none written'}")


def main(argv: list[str] | None = None) -> None:
    name, log, dump = argv or sys.argv[1:]
    print(summary(name, Path(log), Path(dump)))


if __name__ == "__main__":
    main()
