"""Model and memory code. Single-device, imports only torch and `kernels`, so it can ship
inside a Hugging Face export and run without torchtitan.

- `layers/`: shared building blocks (attention, RoPE, FFN, decoder block);
- `memory/`: test-time memories (the neural long-term memory);
- `lms/`: language models trained from scratch (Titans, Mela, MLP-FFN LM);
pretrained backbones and the memories grafted onto them get sub-packages of their own.
"""
