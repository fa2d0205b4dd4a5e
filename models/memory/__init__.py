"""Test-time memories: the neural long-term memory (Titans; Mela's HMM blocks)."""
