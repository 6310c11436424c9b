"""Where a model comes from: a Hugging Face directory, a .gguf file or the embedded default."""
