"""The training path: the launcher entry (`python -m torchtitan_ext.training.train`), preflight, the trainer, CPU support (and torchtitan llama3's CPU attention), checkpoints, run logs."""
