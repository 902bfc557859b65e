"""Every op's argument list is declared once, in its schema (csrc/ops.cpp, as torch parses it), and
every other place that spells it is checked against that declaration here: the fake kernel
(fp8kv._ops), the typed wrapper and its tensor checks (fp8kv.ops, where a KVCacheLayer stands for
the schema's cache, scale and recipe arguments), the validation that builds the
kernels' operands (csrc/op_params.h and .cpp, and the calls of it in the bindings), the CPU and GPU
bindings (csrc/cpu/bindings.cpp, csrc/gpu/bindings.cpp) and the signatures in docs/ops.md. A name,
order, type, default or mutability that differs in any of them fails, naming the place."""

from __future__ import annotations

import inspect
import pathlib
import re

import pytest
import torch

import fp8kv
from fp8kv import _ops

ROOT = pathlib.Path(__file__).resolve().parents[2]
# The ops with kernels per backend, and the function of op_params.h that validates their arguments.
KERNEL_OPS = {"reshape_and_cache": "cache_write_params", "paged_attention": "paged_attention_params",
              "plan_paged_attention": "plan_params", "kv_amax": "amax_params",
              "merge_attention_states": "merge_states_params"}
# Schema arguments the validation does not take: the bindings check them against the backend's plan.
NOT_VALIDATED = {"paged_attention": ("plan", "workspace"), "plan_paged_attention": ("lse", "kernel")}
WRAPPED_OPS = [*KERNEL_OPS, "check_cache_write_indices", "check_paged_attention_indices"]
PYTHON_TYPES = {"Tensor": torch.Tensor, "Tensor?": torch.Tensor | None, "float": float, "int": int, "bool": bool,
                "str": str}
CPP_TYPES = {"Tensor": ("const at::Tensor&", "at::Tensor&"), "Tensor?": ("const std::optional<at::Tensor>&",),
             "float": ("double",), "int": ("int64_t",), "bool": ("bool",), "int[]?": ("at::OptionalIntArrayRef",),
             "str": ("c10::string_view",)}


def schema_arguments(op: str) -> list[tuple[str, str, bool, object]]:
    """(name, type, mutated, default or inspect.Parameter.empty) of each argument, as torch parsed the schema."""
    arguments = []
    for argument in getattr(torch.ops.fp8kv, op).default._schema.arguments:
        kind = str(argument.type).replace("Optional[Tensor]", "Tensor?").replace("Optional[List[int]]", "int[]?")
        mutated = argument.alias_info is not None and argument.alias_info.is_write
        default = argument.default_value if argument.has_default_value() else inspect.Parameter.empty
        arguments.append((argument.name, kind, mutated, default))
    return arguments


def python_parameters(fn) -> list[tuple[str, object]]:
    return [(name, p.default) for name, p in inspect.signature(fn).parameters.items()]


@pytest.mark.parametrize("op", WRAPPED_OPS)
def test_fake_matches_the_schema(op):
    fake = getattr(_ops, f"_{op}_fake")
    want = [(name, default) for name, _, _, default in schema_arguments(op)]
    assert python_parameters(fake) == want, f"fp8kv._ops._{op}_fake"


# The schema arguments a KVCacheLayer holds: the wrappers take `layer` in their place (at the first one's);
# and those an AttentionPlan holds: `plan` in their place.
LAYER_ARGUMENTS = ("key_cache", "value_cache", "k_scale", "v_scale", "hadamard", "k_offset")
PLAN_ARGUMENTS = ("plan", "workspace")
WRAPPER_OBJECTS = {"layer": ("KVCacheLayer", inspect.Parameter.empty), "plan": ("AttentionPlan | None", None)}


def wrapper_arguments(op: str) -> list[tuple[str, str, bool, object]]:
    """The schema's arguments as fp8kv.ops' wrapper takes them: the layer's replaced by `layer`, the
    plan's by `plan`. The plan wrapper takes its sizes and options by keyword after the tensors."""
    arguments = []
    for argument in schema_arguments(op):
        name = argument[0]
        held_by = "layer" if name in LAYER_ARGUMENTS else "plan" if name in PLAN_ARGUMENTS else None
        if held_by is None:
            arguments.append(argument)
        elif held_by not in [a[0] for a in arguments]:
            arguments.append((held_by, WRAPPER_OBJECTS[held_by][0], False, WRAPPER_OBJECTS[held_by][1]))
    return arguments


@pytest.mark.parametrize("op", WRAPPED_OPS)
def test_wrapper_matches_the_schema(op):
    wrapper = getattr(fp8kv.ops, op)
    want = [(name, default) for name, _, _, default in wrapper_arguments(op)]
    assert python_parameters(wrapper) == want, f"fp8kv.ops.{op}: names and defaults"
    annotations = {name: p.annotation for name, p in inspect.signature(wrapper).parameters.items()}
    types = {**PYTHON_TYPES, "KVCacheLayer": fp8kv.KVCacheLayer, "AttentionPlan | None": fp8kv.ops.AttentionPlan | None}
    for name, kind, _, _ in wrapper_arguments(op):
        assert annotations[name] == types[kind], f"fp8kv.ops.{op}: `{name}` is {kind} in the schema"


def test_a_layer_holds_every_argument_the_wrappers_take_from_it():
    layer = fp8kv.PagedKVCache("fp8_e4m3fn", num_layers=1, num_kv_heads=1, head_size=16, num_blocks=1).layer(0)
    for op in WRAPPED_OPS:
        for name, _, _, _ in schema_arguments(op):
            assert name not in LAYER_ARGUMENTS or hasattr(layer, name), f"KVCacheLayer has no `{name}` ({op})"


def test_wrapper_tensor_checks_match_the_schemas():
    """fp8kv.ops names every tensor argument it takes in its TypeError (_TENSORS) and lets exactly the
    optional ones be None (the names tuple in _check_arguments)."""
    arguments = [a for op in KERNEL_OPS for a in wrapper_arguments(op)]
    tensors = {name for name, kind, _, _ in arguments if kind.startswith("Tensor")} | {"plan"}
    optional = {name for name, kind, _, _ in arguments if kind == "Tensor?"} | {"plan"}
    assert tensors <= set(fp8kv.ops._TENSORS), f"missing from fp8kv.ops._TENSORS: {tensors - set(fp8kv.ops._TENSORS)}"
    allowed_none = [c for c in fp8kv.ops._check_arguments.__code__.co_consts
                    if isinstance(c, tuple) and c and all(isinstance(x, str) for x in c)]
    assert len(allowed_none) == 1 and set(allowed_none[0]) == optional, "fp8kv.ops._check_arguments: optional tensors"


def cpp_parameters(path: pathlib.Path, function: str) -> list[list[tuple[str, str]]]:
    """(type, name) of the parameters of every definition or declaration of `function` in a C++ file."""
    text = re.sub(r"//[^\n]*", "", path.read_text())
    found = []
    for match in re.finditer(rf"\b[\w:<>]+\s+{function}\(([^()]*)\)\s*[{{;]", text):
        parameters = []
        for parameter in filter(None, (p.strip() for p in match.group(1).split(","))):
            kind, name = re.fullmatch(r"(.*?)\s*\b(\w+)", " ".join(parameter.split())).groups()
            parameters.append((kind.replace(" &", "&"), name))
        found.append(parameters)
    return found


def cpp_calls(path: pathlib.Path, function: str) -> list[list[str]]:
    """The argument names of every call `function(a, b, ...)` whose arguments are plain names."""
    text = re.sub(r"//[^\n]*", "", path.read_text())
    calls = []
    for match in re.finditer(rf"(?<![\w:] ){function}\(([^()]*)\)(?!\s*{{)", text):
        arguments = [a.strip() for a in match.group(1).split(",")]
        if all(re.fullmatch(r"\w+", a) for a in arguments):
            calls.append(arguments)
    return calls


def validated_arguments(op: str) -> list[tuple[str, str, bool, object]]:
    return [a for a in schema_arguments(op) if a[0] not in NOT_VALIDATED.get(op, ())]


def check_cpp_parameters(where: str, parameters: list[tuple[str, str]], want: list[tuple[str, str, bool, object]],
                         mutable_outputs: bool) -> None:
    assert [name for _, name in parameters] == [name for name, _, _, _ in want], f"{where}: argument names"
    for (kind, name), (_, schema_kind, mutated, _) in zip(parameters, want):
        allowed = CPP_TYPES[schema_kind]
        if schema_kind == "Tensor" and mutable_outputs:
            allowed = ("at::Tensor&",) if mutated else ("const at::Tensor&",)
        assert kind in allowed, f"{where}: `{name}` is {kind}, the schema's {schema_kind} needs {' or '.join(allowed)}"


# Ops whose kernel every backend shares: the file that defines it, and the function there (each backend
# registers it with its own run as the template argument).
SHARED_KERNELS = {"paged_attention": ("paged_attention_kernel.h", "paged_attention_kernel")}


@pytest.mark.parametrize("backend", ["cpu", "gpu"])
@pytest.mark.parametrize("op", KERNEL_OPS)
def test_bindings_match_the_schema(op, backend):
    """The kernel registered for the op takes the schema's arguments (outputs as mutable references) and
    passes them, in the schema's order, to the validation."""
    bindings = ROOT / "csrc" / backend / "bindings.cpp"
    file, function = SHARED_KERNELS.get(op, (f"{backend}/bindings.cpp", f"{op}_{backend}"))
    path = ROOT / "csrc" / file
    definitions = cpp_parameters(path, function)
    assert len(definitions) == 1, f"csrc/{file}: one definition of {function}"
    check_cpp_parameters(f"csrc/{file} {function}", definitions[0], schema_arguments(op), mutable_outputs=True)
    calls = cpp_calls(path, KERNEL_OPS[op])
    want = [name for name, _, _, _ in validated_arguments(op)]
    assert want in calls, f"csrc/{file}: {KERNEL_OPS[op]} called with {calls}, not {want}"
    registered = rf'm\.impl\("{op}", &{function}(<\w+>)?\);'
    assert re.search(registered, bindings.read_text()), f"csrc/{backend}/bindings.cpp registers {op}"


@pytest.mark.parametrize("op", KERNEL_OPS)
def test_validation_matches_the_schema(op):
    for name in ("op_params.h", "op_params.cpp"):
        found = cpp_parameters(ROOT / "csrc" / name, KERNEL_OPS[op])
        assert len(found) == 1, f"csrc/{name}: one {KERNEL_OPS[op]}"
        check_cpp_parameters(f"csrc/{name} {KERNEL_OPS[op]}", found[0], validated_arguments(op), mutable_outputs=False)


def documented_signatures() -> dict[str, list[tuple[str, str | None]]]:
    """docs/ops.md's signature block: op -> [(name, default text or None)]; `!` (written) and `?`
    (optional) marks dropped."""
    text = (ROOT / "docs" / "ops.md").read_text()
    block = re.search(r"```\n(.*?)```", text, re.S).group(1)
    signatures = {}
    for op, arguments in re.findall(r"(\w+)\(([^()]*)\)", block):
        parsed = []
        for argument in (" ".join(a.split()) for a in arguments.split(",")):
            name, _, default = argument.partition("=")
            parsed.append((name.rstrip("!?"), default or None))
        signatures[op] = parsed
    return signatures


@pytest.mark.parametrize("op", KERNEL_OPS)
def test_documented_signature_matches_the_schema(op):
    want = [(name, None if default is inspect.Parameter.empty else repr(default))
            for name, _, _, default in schema_arguments(op)]
    assert documented_signatures().get(op) == want, f"docs/ops.md: {op}"


def test_every_op_has_a_fake_and_its_checks():
    """Every fp8kv op with tensors has a fake (torch.compile, meta tensors); the checked ops are all of them."""
    ops = {name for name in dir(torch.ops.fp8kv) if isinstance(getattr(torch.ops.fp8kv, name), torch._ops.OpOverloadPacket)}
    with_tensors = {op for op in ops if any(kind.startswith("Tensor") for _, kind, _, _ in schema_arguments(op))}
    assert with_tensors == set(WRAPPED_OPS), "every op with tensors is checked here"
    for op in with_tensors:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"fp8kv::{op}", "Meta"), f"{op} has no fake"
