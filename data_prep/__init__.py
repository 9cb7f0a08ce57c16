"""Instruction data for fedllm: loaders into one schema, prompts, partitioners, built-in data."""
