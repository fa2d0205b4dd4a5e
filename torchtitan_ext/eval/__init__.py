"""Evaluation library (the protocols, their tables and plots); scripts/eval_*.py are its command
lines: `stats` (bootstrap intervals, seeds), `long_ppl` (perplexity against context length),
`whole_book` (whole-book test-time training), `tasks` (synthetic memory tasks, GradMem's
KV-retrieval), `babilong` (BABILong)."""
