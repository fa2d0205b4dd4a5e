"""Model and memory code. Single-device, imports only torch and `kernels`, so it can ship
inside a Hugging Face export and run without torchtitan.

- `layers/`: shared building blocks: attention masks (`attention.py`), RoPE in both layouts
  (`rope.py`), FFNs (`ffn.py`), the one grouped-query attention, pre-norm block and plain
  decoder-LM base (`decoder.py`), which blocks a layer spec names (`graft_layers.py`), and the
  FLOP-count primitives every model's count is written with (`flops.py`);
- `memory/`: test-time memories: the neural long-term memory (Titans, Mela, MemoryLlama),
  Locas' sideways FFN memories (`locas.py`, `nl_svd.py`, `swiglu_memory.py`) and GradMem's
  gradient write (`gradmem.py`);
- `lms/`: language models trained from scratch (Titans, Mela, the MLP-FFN LM);
- `backbones/`: the pretrained decoder that loads Hugging Face Llama, Qwen2 and Qwen3 checkpoints;
- `grafts/`: what is grafted onto a backbone: `GraftConfig` and the `GRAFT_KINDS` table
  (`graft.py`), LoRA, MemoryLlama's and MoNe's memory blocks, and GradMem's prefix memory on
  the backbone decoder (`gradmem.py`: trained from scratch or onto a pretrained backbone).
"""
