"""Pretrained decoder backbones that load Hugging Face checkpoints (Llama, Qwen3)."""
