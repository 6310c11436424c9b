"""What quantization cost in accuracy. Library (imported by `quantkit eval` and `lm-eval`):
`perplexity`, `compare` (reference vs checkpoints), `lm_eval_model` (the lm-eval adapter)
with `continuations`, `harness` and `task_data` (offline task files in
`tasks/`)."""
