"""The ctypes declarations of the CPU kernels (`quantkit.fused_kernels.cpu.abi`) against the C
header that declares them (`fused_kernels/csrc/quantkit_kernels.h`).

ctypes trusts whatever argtypes it is given: an int64_t declared c_int, or two int64_t parameters
swapped, is silent memory corruption or a wrong result, not an error. So the header is parsed here
(a small parser for its plain style: typedef'd structs and one prototype per declaration) and
every prototype is checked against its binding, parameter by parameter (name and type), and every
struct against its `ctypes.Structure`, field by field. gcc checks the other half: each library's
translation unit includes the header, so a definition that differs from its prototype does not
compile, and `-Werror=missing-prototypes` (below) refuses an exported function the header lacks.
"""

from __future__ import annotations

import ctypes
import importlib.resources
import os
import re
import shutil
import subprocess
from ctypes import POINTER, c_double, c_float, c_int, c_int64, c_void_p
from pathlib import Path

import pytest

from quantkit.fused_kernels.cpu import abi as cpu_abi
from quantkit.fused_kernels.cpu.build import _VARIANTS, _build, kernel_sources

HEADER = "quantkit_kernels.h"

# A C type: (base name without const, pointer depth).
CType = tuple[str, int]

_SCALARS: dict[str, type | None] = {
    "int": c_int,
    "int64_t": c_int64,
    "double": c_double,
    "float": c_float,
    "void": None,  # return type only
}


def header_text() -> str:
    root = importlib.resources.files("quantkit.fused_kernels.cpu").joinpath("csrc")
    return root.joinpath(HEADER).read_text(encoding="utf-8")


# ------------------------------------------------------------------------------------- the parser


def _ctype(decl: str) -> CType:
    """'const qk_w4_layer *' -> ('qk_w4_layer', 1)."""
    words = decl.replace("*", " ").split()
    words = [w for w in words if w != "const"]
    if len(words) != 1:
        raise ValueError(f"unsupported C type {decl!r}: expected one base type name")
    return words[0], decl.count("*")


def _declarator(decl: str) -> tuple[str, CType]:
    """'const float *x' -> ('x', ('float', 1))."""
    m = re.fullmatch(r"(.*?[\s*])(\w+)", decl.strip())
    if not m:
        raise ValueError(f"unsupported declaration {decl!r}: expected a type and a name")
    return m.group(2), _ctype(m.group(1))


def parse_header(text: str) -> tuple[dict[str, list], dict[str, tuple]]:
    """(structs, functions) of the header: {struct: [(field, ctype)]}, and
    {function: (return ctype, [(param, ctype)])}. Raises ValueError on anything else."""
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    text = re.sub(r"//[^\n]*", " ", text)
    text = re.sub(r"^[ \t]*#[^\n]*", " ", text, flags=re.M)  # include guard, includes
    structs: dict[str, list[tuple[str, CType]]] = {}
    for m in re.finditer(r"typedef\s+struct\s*\{(.*?)\}\s*(\w+)\s*;", text, flags=re.S):
        fields = []
        for decl in filter(str.strip, m.group(1).split(";")):
            # 'int64_t N, K' or 'const float *a, *b': the base type, then declarators
            head, *rest = decl.split(",")
            name, (base, depth) = _declarator(head)
            fields.append((name, (base, depth)))
            for d in rest:
                dm = re.fullmatch(r"\s*(\**)\s*(\w+)\s*", d)
                if not dm:
                    raise ValueError(f"struct {m.group(2)}: unsupported declarator {d!r}")
                fields.append((dm.group(2), (base, len(dm.group(1)))))
        structs[m.group(2)] = fields
    text = re.sub(r"typedef\s+struct\s*\{.*?\}\s*\w+\s*;", " ", text, flags=re.S)
    functions: dict[str, tuple[CType, list[tuple[str, CType]]]] = {}
    for decl in filter(str.strip, text.split(";")):
        m = re.fullmatch(r"\s*([\w\s*]+?[\s*])(\w+)\s*\(([^()]*)\)\s*", decl)
        if not m:
            raise ValueError(f"unsupported declaration {' '.join(decl.split())!r}")
        params = m.group(3).strip()
        args = [] if params == "void" else [_declarator(p) for p in params.split(",")]
        functions[m.group(2)] = (_ctype(m.group(1)), args)
    return structs, functions


# ------------------------------------------------------------------------------------ the checker


def _name(t: type | None) -> str:
    if t is None:
        return "void"
    if hasattr(t, "_type_") and issubclass(t, ctypes._Pointer):
        return f"POINTER({t._type_.__name__})"
    return t.__name__


def _want(ct: CType, structs: dict[str, type]) -> type | None:
    """The ctypes type a C type is declared as: see `cpu.abi`'s docstring."""
    base, depth = ct
    if depth == 0:
        if base in _SCALARS:
            return _SCALARS[base]
        if base in structs:
            return structs[base]
    elif depth == 1 and base in structs:
        return POINTER(structs[base])
    elif depth >= 1:
        return c_void_p
    raise ValueError(f"C type {base}{' *' * depth}: expected a scalar or a mirrored struct")


def abi_mismatches(header: str, functions: dict, structs: dict[str, type]) -> list[str]:
    """Every difference between the header and the bindings, one message each ([] if none)."""
    c_structs, c_functions = parse_header(header)
    problems = []
    for s in sorted(c_structs.keys() ^ structs.keys()):
        where = "in the header but has no ctypes mirror" if s in c_structs else "not in the header"
        problems.append(f"struct {s}: {where}")
    for s in sorted(c_structs.keys() & structs.keys()):
        got = list(structs[s]._fields_)
        want = [(f, _want(ct, structs)) for f, ct in c_structs[s]]
        if len(got) != len(want):
            problems.append(f"struct {s}: C has {len(want)} fields, ctypes {len(got)}")
        for i, ((gn, gt), (wn, wt)) in enumerate(zip(got, want, strict=False)):
            if gn != wn or gt is not wt:
                problems.append(
                    f"struct {s} field {i}: C {wn} wants {_name(wt)}, ctypes has {gn} {_name(gt)}"
                )
    for f in sorted(c_functions.keys() ^ functions.keys()):
        where = "prototype without a binding" if f in c_functions else "binding without a prototype"
        problems.append(f"{f}: {where}")
    for f in sorted(c_functions.keys() & functions.keys()):
        c_ret, c_params = c_functions[f]
        spec = functions[f]
        if spec.restype is not _want(c_ret, structs):
            problems.append(
                f"{f}: returns {_name(_want(c_ret, structs))}, binding has {_name(spec.restype)}"
            )
        if len(spec.params) != len(c_params):
            problems.append(f"{f}: C takes {len(c_params)} parameters, binding {len(spec.params)}")
        for i, ((gn, gt), (wn, ct)) in enumerate(zip(spec.params, c_params, strict=False)):
            wt = _want(ct, structs)
            if gn != wn or gt is not wt:
                problems.append(
                    f"{f} parameter {i}: C {wn} wants {_name(wt)}, binding has {gn} {_name(gt)}"
                )
    return problems


# -------------------------------------------------------------------------------------- the tests


def test_bindings_match_the_header() -> None:
    assert abi_mismatches(header_text(), cpu_abi.FUNCTIONS, cpu_abi.STRUCTS) == []


def test_parser_reads_every_declaration() -> None:
    structs, functions = parse_header(header_text())
    assert len(functions) == len(cpu_abi.FUNCTIONS) >= 13
    assert functions["qk_w4a16_gemv"][1][2] == ("M", ("int64_t", 0))
    assert functions["qk_w4a16_gemv_layer"][1][0] == ("L", ("qk_w4_layer", 1))
    assert structs["qk_decoder_layer"][0] == ("qkv", ("qk_w4_layer", 0))
    assert structs["qk_decoder_layer"][5] == ("post_norm", ("float", 1))
    assert structs["qk_decoder_dims"][8] == ("eps", ("double", 0))
    assert structs["qk_decoder_dims"][-1] == ("expert_inter", ("int64_t", 0))
    assert structs["qk_decoder_layer"][-1] == ("experts", ("qk_w4_layer", 1))


def _with_fields(cls: type, edit) -> type:
    return type(cls.__name__, (ctypes.Structure,), {"_fields_": edit(list(cls._fields_))})


def _replace(fn: str, **change) -> dict:
    """cpu_abi.FUNCTIONS with `fn`'s restype or params replaced."""
    return {**cpu_abi.FUNCTIONS, fn: cpu_abi.FUNCTIONS[fn]._replace(**change)}


def _set_param(fn: str, i: int, value: tuple[str, type]) -> dict:
    params = list(cpu_abi.FUNCTIONS[fn].params)
    params[i] = value
    return _replace(fn, params=tuple(params))


def _swap_fields(fields: list) -> list:
    fields[1], fields[2] = fields[2], fields[1]  # N <-> K: same type, other meaning
    return fields


# Deliberately wrong declarations, each with the text its report must contain.
WRONG = {
    "int64 declared int": (
        _set_param("qk_w4a16_gemv", 2, ("M", c_int)),
        None,
        "qk_w4a16_gemv parameter 2: C M",
    ),
    "two int64 swapped": (
        _set_param("qk_w4_dequant", 1, ("n1", c_int64)),
        None,
        "qk_w4_dequant parameter 1: C n0",
    ),
    "pointer to the wrong struct": (
        _set_param("qk_w4a16_gemv_layer", 0, ("L", POINTER(cpu_abi.Fp8Layer))),
        None,
        "wants POINTER(W4Layer), binding has L POINTER(Fp8Layer)",
    ),
    "parameter missing": (
        _replace("qk_bf16_gemv", params=cpu_abi.FUNCTIONS["qk_bf16_gemv"].params[:-1]),
        None,
        "qk_bf16_gemv: C takes 10 parameters, binding 9",
    ),
    "wrong return type": (
        _replace("qk_fp8_nan_rows", restype=c_int),
        None,
        "qk_fp8_nan_rows: returns c_long, binding has c_int",
    ),
    "binding without prototype": (
        {**cpu_abi.FUNCTIONS, "qk_extra": cpu_abi.fn(c_int)},
        None,
        "qk_extra: binding without a prototype",
    ),
    "prototype without binding": (
        {k: v for k, v in cpu_abi.FUNCTIONS.items() if k != "qk_decode_work"},
        None,
        "qk_decode_work: prototype without a binding",
    ),
    "struct field type": (
        None,
        {"qk_fp8_layer": _with_fields(cpu_abi.Fp8Layer, lambda f: [*f[:-1], ("act_quant", c_int)])},
        "struct qk_fp8_layer field 9: C act_quant wants c_long, ctypes has act_quant c_int",
    ),
    "struct fields swapped": (
        None,
        {"qk_w4_layer": _with_fields(cpu_abi.W4Layer, _swap_fields)},
        "struct qk_w4_layer field 1: C N",
    ),
}


@pytest.mark.parametrize("case", list(WRONG))
def test_checker_reports_a_wrong_declaration(case: str) -> None:
    functions, structs, expected = WRONG[case]
    problems = abi_mismatches(
        header_text(), functions or cpu_abi.FUNCTIONS, {**cpu_abi.STRUCTS, **(structs or {})}
    )
    assert any(expected in p for p in problems), problems


def test_parser_refuses_what_it_cannot_read() -> None:
    with pytest.raises(ValueError, match="unsupported"):
        parse_header("#define QK(x) x\nint QK(qk_f)(int a, unsigned long b);\n")


def test_every_function_is_in_one_library_that_defines_it() -> None:
    listed = [f for lib in cpu_abi.LIBRARIES.values() for f in lib.functions]
    assert sorted(listed) == sorted(cpu_abi.FUNCTIONS)  # each once
    for name, lib in cpu_abi.LIBRARIES.items():
        c_files = {n: t for n, t in kernel_sources(lib.entry).items() if n.endswith(".c")}
        defined = {
            m.group(1)
            for text in c_files.values()
            for m in re.finditer(r"^(?!static\b)[A-Za-z_][\w \t*]*?\b(qk_\w+)\s*\(", text, re.M)
        }
        assert defined == set(lib.functions), name


def _syntax_check(
    tmp: Path, files: dict[str, str], flags: list[str]
) -> subprocess.CompletedProcess:
    for rel, text in files.items():
        (tmp / rel).write_text(text)
    cmd = ["gcc", "-fsyntax-only", "-std=gnu11", "-Werror=missing-prototypes", *flags]
    return subprocess.run([*cmd, str(tmp / next(iter(files)))], capture_output=True, text=True)


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")
def test_every_definition_matches_its_prototype(tmp_path: Path) -> None:
    """Each library's translation unit, for every instruction-set variant (compiling needs no
    CPU support): definitions agree with the header and each exported function has a prototype."""
    flag_sets = [flags for _, flags in _VARIANTS.values()]
    flag_sets.append(_VARIANTS["avx512"][1] + ["-mavx512bf16", "-mavx512vnni"])
    for lib in cpu_abi.LIBRARIES.values():
        for flags in flag_sets:
            proc = _syntax_check(tmp_path, kernel_sources(lib.entry), flags)
            assert proc.returncode == 0, (lib.entry, flags, proc.stderr[-2000:])


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")
def test_an_exported_function_without_prototype_does_not_compile(tmp_path: Path) -> None:
    files = {"extra.c": '#include "quantkit_kernels.h"\nint qk_extra(void) { return 0; }\n'}
    files |= {HEADER: header_text()}
    proc = _syntax_check(tmp_path, files, [])
    assert proc.returncode != 0 and "qk_extra" in proc.stderr


def test_a_library_is_its_entry_and_every_file_it_includes() -> None:
    assert list(kernel_sources("decode.c")) == [
        "decode.c",
        "w4a16.c",
        "attend.c",
        "common.h",
        HEADER,
    ]
    assert list(kernel_sources("fp8.c")) == ["fp8.c", "common.h", HEADER]


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")
def test_the_cache_key_covers_included_files(monkeypatch, tmp_path: Path) -> None:
    """Changing only an included header builds (and loads) another library."""
    monkeypatch.setenv("QUANTKIT_HOME", str(tmp_path))
    unit = '#include "b.h"\nint qk_b(void);\nint qk_b(void) { return B; }\n'
    one = _build("qk_key", {"a.c": unit, "b.h": "#define B 1\n"}, "generic")
    two = _build("qk_key", {"a.c": unit, "b.h": "#define B 2\n"}, "generic")
    assert one != two
    assert [ctypes.CDLL(str(p)).qk_b() for p in (one, two)] == [1, 2]


@pytest.mark.skipif(shutil.which(os.environ.get("CC", "gcc")) is None, reason="needs gcc")
def test_every_library_builds_and_loads_here() -> None:
    """Where a compiler is, the kernels build for this CPU: the tests that run them skip only
    where none is, never because a change stopped them compiling."""
    for name in cpu_abi.LIBRARIES:
        assert cpu_abi.load(name) is not None, name


def test_the_kept_best_tokens_count_is_one_number() -> None:
    """The head GEMVs' `best` rows are QK_TOP long: common.h's define and `cpu_abi.QK_TOP`."""
    root = importlib.resources.files("quantkit.fused_kernels.cpu").joinpath("csrc")
    found = re.findall(r"^#define QK_TOP (\d+)$", root.joinpath("common.h").read_text(), re.M)
    assert found == [str(cpu_abi.QK_TOP)]
