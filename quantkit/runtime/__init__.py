"""Running a model: QuantLinear, projection fusion, the lm_head, the C fast path, loading, sampling
and generate."""
