"""Glue between this project's models and torchtitan 0.3.0 (specs, data, tokenizer, CPU support).

Importing it first puts the torch-version mends of `torch_compat` in place (torch 2.11-2.13),
before any torchtitan module binds the names they mend."""

from torchtitan_ext import torch_compat

torch_compat.apply()
