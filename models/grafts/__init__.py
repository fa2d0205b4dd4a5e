"""Memories and adapters grafted onto pretrained backbones (`models/backbones/`)."""
