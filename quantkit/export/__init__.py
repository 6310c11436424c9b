"""Checkpoints written in other engines' formats: GGUF for llama.cpp, Ollama and LM Studio."""
