"""Evaluation library shared by scripts/ (statistics first; the rest moves here with issue 25)."""
