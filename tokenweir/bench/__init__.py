"""Benchmarking tools: `tokenweir bench serve` drives an OpenAI-compatible server with load."""
