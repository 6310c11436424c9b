"""Accuracy checks: perplexity, quantized-vs-reference comparison, the lm-eval adapter and its
offline tasks, end-to-end benchmarks.

Importing this package registers `QuantkitLM` with lm-eval under the name "quantkit" (when
lm-eval is installed), so `lm_eval.simple_evaluate(model="quantkit", ...)` finds it. The
registration is a lazy "module:Class" placeholder: neither lm-eval's evaluator nor the adapter
module is imported until lm-eval asks for the model, and without lm-eval nothing happens, so
`quantkit.evals.perplexity` keeps working on a core install.
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
        model_registry.register("quantkit", target="quantkit.evals.lm_eval_model:QuantkitLM")


_register_with_lm_eval()
