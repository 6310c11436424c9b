"""Shared fixtures: tiny random Llama-family models saved as HF directories (no network)."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
    "torch_dtype": "float32",
    "bos_token_id": 1,
    "eos_token_id": 2,
}


@pytest.fixture(scope="session", autouse=True)
def ctrl_c_as_from_a_terminal() -> Iterator[None]:
    """SIGINT handled, not ignored, for the whole session. A shell starts a background job
    (`cmd &`, as a CI runner may) with SIGINT ignored, and every process a test starts would
    inherit that: the Ctrl-C cases, which send SIGINT to a `quantkit` process started as from
    a terminal, would meet the CLI's "started with Ctrl-C ignored" branch instead (exit 0)."""
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        yield
        return
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def make_hf_model(path: Path, overrides: dict | None = None, seed: int = 0) -> Path:
    """Save a random transformers model with config TINY_LLAMA (+ overrides) at `path`."""
    import transformers

    cfg = dict(TINY_LLAMA, **(overrides or {}))
    torch.manual_seed(seed)
    config = transformers.AutoConfig.for_model(**cfg)
    model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    # Random init gives near-identity norms; perturb them so folding bugs cannot hide.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(path, safe_serialization=True)
    data = json.loads((path / "config.json").read_text())
    data["model_type"] = cfg["model_type"]
    (path / "config.json").write_text(json.dumps(data))
    return path


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """torch on one thread for a module of tiny models, then the count restored. Tiny matmuls
    gain nothing from a second thread, and on a busy shared machine an OpenMP barrier waiting
    for a descheduled thread made each decode step 100x slower (32 vs 0.3 ms)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def grammar_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh $QUANTKIT_HOME for one test and an empty grammar memory cache: no compiled
    grammar leaks from one test into the next (grammar modules use it for every test)."""
    from quantkit.grammar import compiler

    monkeypatch.setenv("QUANTKIT_HOME", str(tmp_path / "home"))
    compiler.clear_memory_cache()
    return tmp_path / "home"


# $QUANTKIT_HOME as the session found it (`session_home`).
_SESSION_HOME = os.environ.get("QUANTKIT_HOME")


@pytest.fixture
def session_home(monkeypatch: pytest.MonkeyPatch) -> None:
    """$QUANTKIT_HOME put back to what the session began with, after any `grammar_home` (a
    module's `usefixtures` come before a test's own fixtures): for the few end-to-end tests
    that read the real model from the shared cache, where converting it into a temporary home
    would take longer than the test."""
    if _SESSION_HOME is None:
        monkeypatch.delenv("QUANTKIT_HOME", raising=False)
    else:
        monkeypatch.setenv("QUANTKIT_HOME", _SESSION_HOME)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_hf_model(tmp_path_factory.mktemp("tiny-llama"))


def _training_text() -> list[str]:
    import ast
    import codecs
    import importlib.util

    # The Zen of Python: real English shipped with Python. Read, not imported (import prints).
    source = Path(importlib.util.find_spec("this").origin).read_text()
    rot13 = ast.literal_eval(ast.parse(source).body[0].value)
    zen = codecs.decode(rot13, "rot13")
    return [zen] * 4


def make_tokenizer(path: Path, vocab_size: int = 512) -> Path:
    """A small byte-level BPE trained on real English text, saved as HF tokenizer files."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_training_text(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|im_start|>"
    )
    fast.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny random Llama + a real BPE tokenizer: a complete local HF model directory."""
    path = make_hf_model(tmp_path_factory.mktemp("tiny-model"), {"hidden_size": 64})
    return make_tokenizer(path)


def run_cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """Run `quantkit ARGS...` in-process: (exit code, stdout, stderr)."""
    from quantkit.cli.main import main

    try:
        main(list(args))
        code = 0
    except SystemExit as e:
        code = int(e.code or 0)
    out, err = capsys.readouterr()
    return code, out, err
