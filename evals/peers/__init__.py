"""Side-by-side numbers against other engines: `llamacpp` (decode, prefill, long context),
`build` (builds llama.cpp from the llama-cpp-python sdist). Peers are benchmarks, never test
dependencies."""
