"""Model and memory code. Single-device, imports only torch and `kernels`, so it can ship
inside a Hugging Face export and run without torchtitan."""
