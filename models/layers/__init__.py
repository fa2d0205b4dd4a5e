"""Shared layers: attention (document-causal, masked), RoPE, the SwiGLU FFN, the pre-norm
decoder block (Mela's decoder and HMM blocks)."""
