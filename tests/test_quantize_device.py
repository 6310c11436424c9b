"""`quantize --device`: each layer calibrated where the user says.

On the CPU the device path is the path: `--device cpu` (and `auto` on a machine without a GPU)
writes the same bytes as before. A GPU that is not there is refused in one line before any work.
On a CUDA machine (tests marked `gpu`), every algorithm runs there and its checkpoint is as good
as the CPU's: a GPU sums in another order, so the codes may differ, but not the error.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from quantkit.format.checkpoint import load_checkpoint
from quantkit.format.scheme import QuantScheme
from quantkit.quantize.awq import AwqConfig
from quantkit.quantize.pipeline import load_dense
from quantkit.quantize.recipe import Calibration, Recipe, quantize_and_save
from quantkit.runtime.loader import load_model
from tests.conftest import run_cli as run

pytestmark = pytest.mark.usefixtures("one_thread")

AWQ = AwqConfig(grid=5, search_tokens=128, clip_tokens=32, batch_sequences=4)


def _digests(out: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(out.iterdir())
        if p.suffix == ".safetensors"
    }


CALIB = "\n\n".join(f"Sentence number {i} of the calibration text." for i in range(400))


def _quantize(src: Path, out: Path, method: str, scheme: QuantScheme, device: str) -> Path:
    calib = out.parent / "calib.txt"
    calib.write_text(CALIB)
    recipe = Recipe(str(src), scheme, method, Calibration(calib, 4, 32), awq=AWQ)
    quantize_and_save(recipe, out, progress=False, device=device)
    return out


def test_device_cpu_writes_what_the_default_writes(
    tiny_model_dir: Path, tmp_path: Path, capsys
) -> None:
    """`--device cpu` and the default (auto: cpu here) through the CLI: the same bytes."""
    src = tiny_model_dir
    calib = tmp_path / "calib.txt"
    calib.write_text(CALIB)
    common = ["--method", "awq", "--calib", str(calib), "--calib-samples", "4"]
    common += ["--calib-seq-len", "32", "--search-tokens", "128", "--eval-tokens", "0"]
    outs = []
    for name, extra in (("default", []), ("cpu", ["--device", "cpu"])):
        out = tmp_path / name
        code, stdout, err = run(capsys, "quantize", str(src), *common, *extra, "-o", str(out))
        assert code == 0, err
        assert "device " not in stdout  # the GPU line is for GPUs
        outs.append(_digests(out))
    assert outs[0] == outs[1] and outs[0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU-only machine's answer")
def test_a_gpu_this_machine_lacks_is_refused_in_one_line(
    tiny_model_dir: Path, tmp_path: Path, capsys
) -> None:
    src = tiny_model_dir
    out = tmp_path / "o"
    code, _, err = run(capsys, "quantize", str(src), "--method", "rtn", "--device", "cuda:1",
                       "-o", str(out))  # fmt: skip
    assert code == 2, err
    last = err.strip().splitlines()[-1]
    assert "--device: expected a device this machine has (0 GPU(s)), got cuda:1" in last
    assert "Traceback" not in err and not out.exists()
    code, _, err = run(capsys, "quantize", str(src), "--device", "gpu", "-o", str(out))
    assert code == 2 and "expected auto, cpu or cuda[:N], got 'gpu'" in err


CASES = {
    "rtn": ("rtn", QuantScheme("int4", 32)),
    "awq": ("awq", QuantScheme("int4", 32)),
    "gptq": ("gptq", QuantScheme("int4", 32)),
    "awq+gptq": ("awq+gptq", QuantScheme("int4", 32)),
    "fp8-gptq": ("gptq", QuantScheme("fp8")),
    "int8-smoothquant+gptq": ("smoothquant+gptq", QuantScheme("int8")),
}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", list(CASES))
def test_every_algorithm_on_the_gpu_is_as_good_as_on_the_cpu(
    case: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The same run on cuda and on cpu: the same tensors (names, shapes, dtypes), and the GPU's
    dequantized weights no further from the source than the CPU's (within 5%)."""
    method, scheme = CASES[case]
    src = tiny_model_dir
    cpu = _quantize(src, tmp_path / "cpu", method, scheme, "cpu")
    gpu = _quantize(src, tmp_path / "gpu", method, scheme, "cuda")
    report = json.loads((gpu / "quantkit.json").read_text())["report"]
    assert report["device"].startswith("cuda") and report["peak_gpu_mb"] > 0
    a, b = load_checkpoint(cpu), load_checkpoint(gpu)
    shapes = {k: (v.shape, v.dtype) for k, v in a.tensors.items()}
    assert shapes == {k: (v.shape, v.dtype) for k, v in b.tensors.items()}
    ids = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = load_dense(src)[1](ids)
        err_cpu = float((_logits(cpu, ids) - want).pow(2).mean())
        err_gpu = float((_logits(gpu, ids) - want).pow(2).mean())
    assert 0 < err_gpu <= 1.25 * err_cpu, (case, err_cpu, err_gpu)


def _logits(ckpt: Path, ids: torch.Tensor) -> torch.Tensor:
    return load_model(ckpt, dtype=torch.float32, tokenizer=False).model(ids)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_compiled_decode_on_the_gpu_gives_the_eager_tokens(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """`generate --compile` on CUDA: CUDA graphs over the Triton INT4 linears (kept opaque to
    Dynamo, `fused_kernels.opaque`), the same greedy tokens as the eager loop."""
    from quantkit.runtime.generate import generate
    from quantkit.runtime.sampling import SamplingParams

    ckpt = _quantize(tiny_model_dir, tmp_path / "q", "rtn", QuantScheme("int4", 32), "cpu")
    model = load_model(ckpt, device="cuda", tokenizer=False).model
    params = SamplingParams(max_new_tokens=12)
    eager = generate(model, [[5, 6, 7, 8, 9]], params)
    compiled = generate(model, [[5, 6, 7, 8, 9]], params, compile=True)
    assert compiled.tokens == eager.tokens
