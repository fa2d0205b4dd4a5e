"""Model and memory code. Single-device, imports only torch and `kernels`, so it can ship
inside a Hugging Face export and run without torchtitan.

- `layers/`: shared building blocks (attention, RoPE, FFN, decoder block);
- `memory/`: test-time memories (the neural long-term memory);
- `lms/`: language models trained from scratch (Titans, Mela, MLP-FFN LM);
- `backbones/`: pretrained decoders that load Hugging Face checkpoints (Llama, Qwen3);
- `grafts/`: what is grafted onto a backbone (GraftConfig, LoRA; the memories next).
"""
