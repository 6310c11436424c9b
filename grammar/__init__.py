"""Constrained generation, by role.

The public front, at the top: `constraints` (what a user asks for: a JSON Schema, a regex, a
choice, a Lark grammar), `cfg` (Lark and GBNF grammar files, converted and checked),
`compiler` (constraint + tokenizer -> a compiled grammar, cached on disk, compiled in a
worker process with a time limit: `worker_client`, `compile_worker`, `cache_file`), `processor`
(the `LogitsProcessor` the decode loop calls), `budget` (steer to completion before the token
limit), `vocabulary`, `acceptance`, `narrowing`, `prompting`, and `native_threads` (native
builds run under a time limit, and a process end that is safe while one still runs).

The engines, below it, each a sub-package: `llguidance/` (JSON Schema natively, and the
context-free Lark grammars only it takes: `llguidance.lark`) and `outlines/`
(outlines-core's regex index; `outlines/schema_regex/` lowers a JSON Schema to the regex it
takes). An engine imports the front's value modules (constraints, vocabulary), never the
compiler that chooses engines, nor the other engine. Benchmarks live in `quantkit.evals.grammar`,
the CLI's glue in `quantkit.cli`.
"""
