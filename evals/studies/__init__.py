"""One-off experiments behind a design decision, each `python -m` runnable and cited by the comment
or note it justified: `act_precision`, `head_quality`, `kv_quality` (what a
narrower dtype costs in perplexity), `awq_quality`, `gptq_quality` (algorithm
variants), `reuse` (prefix cache and speculation on repeated prompts)."""
