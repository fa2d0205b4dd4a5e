"""Synthetic long-range task: recall a needle placed beyond the attention window.

Each sequence: BOS, the needle (one of 16 value tokens) repeated 4 times, filler tokens
drawn uniformly from 32 others, and a final QUERY token whose target is the needle. The
needle sits ~T tokens before the query, far outside the sliding window (32 tokens), so
attention alone cannot reach it. Trains, with the same data, steps and optimiser:
- MAC (Titans memory as context), and
- a sliding-window-only control of exactly the same size: the MAG model with its memory
  switched off (theta = 0, no forget gate: nothing is written; tests/test_titans.py shows
  no information then crosses the window);
and reports the needle accuracy on held-out sequences (chance 1/16).

    python scripts/needle_task.py [--steps 300] [--length 256] [--out docs/needle_task.json]
"""

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F


from models.memory.neural_memory import NeuralMemoryConfig
from models.lms.titans import TitansConfig, TitansLM

VALUES, FILLER = 16, 32
BOS, QUERY = VALUES + FILLER, VALUES + FILLER + 1
VOCAB = VALUES + FILLER + 2


def batch(n: int, length: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    needle = torch.randint(0, VALUES, (n,), generator=generator)
    filler = VALUES + torch.randint(0, FILLER, (n, length - 6), generator=generator)
    tokens = torch.cat([torch.full((n, 1), BOS), needle[:, None].expand(n, 4), filler, torch.full((n, 1), QUERY)], 1)
    return tokens, needle


def build(variant: str, memory_on: bool) -> TitansLM:
    torch.manual_seed(0)
    model = TitansLM(TitansConfig(variant=variant, vocab_size=VOCAB, dim=64, n_layers=2, n_heads=2, window=32,
                                  n_persistent=4, memory=NeuralMemoryConfig(chunk_size=8, forget=memory_on)))
    if not memory_on:
        for block in model.layers.values():
            block.memory.cfg.max_lr = 0.0
    return model


def train_and_score(model: TitansLM, steps: int, length: int, batch_size: int) -> dict:
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    generator = torch.Generator().manual_seed(1)
    start = time.perf_counter()
    for _ in range(steps):
        tokens, needle = batch(batch_size, length, generator)
        logits = model(tokens)[:, -1, :VALUES]
        loss = F.cross_entropy(logits, needle)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    seconds = time.perf_counter() - start
    with torch.no_grad():
        tokens, needle = batch(512, length, torch.Generator().manual_seed(2))
        accuracy = (model(tokens)[:, -1, :VALUES].argmax(-1) == needle).float().mean().item()
    return {"accuracy": accuracy, "final_train_loss": loss.item(), "train_seconds": round(seconds, 1),
            "parameters": sum(p.numel() for p in model.parameters())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_flush_denormal(True)
    results = {
        "mac": train_and_score(build("mac", True), args.steps, args.length, args.batch_size),
        "sliding_window_only": train_and_score(build("mag", False), args.steps, args.length, args.batch_size),
    }
    results["setup"] = {"steps": args.steps, "length": args.length, "batch_size": args.batch_size, "window": 32,
                        "chance": 1 / VALUES}
    print(json.dumps(results, indent=2))
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
