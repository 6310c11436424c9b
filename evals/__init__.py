"""Every measurement, by what it measures: `accuracy/` (perplexity, compare, the lm-eval adapter
and its offline tasks), `speed/` (decode, serving, the per-phase breakdown), `kernels/`,
`grammar/`, `peers/` (llama.cpp side by side) and `studies/` (one-off experiments behind a
decision); `common` holds what they share (commit id, atomic JSON reports). The engine packages
hold no benchmark. A module that commands import is library and has no `__main__`; a benchmark
or study runs with `python -m`.

Importing this package registers `QuantkitLM` with lm-eval under the name "quantkit" (when
lm-eval is installed), so `lm_eval.simple_evaluate(model="quantkit", ...)` finds it. The
registration is a lazy "module:Class" placeholder: neither lm-eval's evaluator nor the adapter
module is imported until lm-eval asks for the model, and without lm-eval nothing happens, so
`quantkit.evals.accuracy.perplexity` keeps working on a core install.
"""

from __future__ import annotations


def _register_with_lm_eval() -> None:
    try:
        # lm-eval registers its own models only while its registry is empty (registry.get_model);
        # importing lm_eval.models first keeps "hf" and the rest findable after ours is added.
        import lm_eval.models  # noqa: F401
        from lm_eval.api.registry import model_registry
    except ImportError:  # lm-eval is the optional [eval] extra
        return
    if "quantkit" not in model_registry:
        model_registry.register(
            "quantkit", target="quantkit.evals.accuracy.lm_eval_model:QuantkitLM"
        )


_register_with_lm_eval()
