"""Glue between this project's models and torchtitan 0.3.0 (specs, data, tokenizer, CPU support)."""
