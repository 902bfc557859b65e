"""Builds a small FlashInfer wheel with the benchmarks' kernels compiled ahead of time, for a GPU
machine without network access (build it on any x86-64 machine with nvcc; no GPU needed).

The published flashinfer-python wheel (62 MB) JIT-compiles every kernel at first use, which needs
its CUDA sources and a few minutes of nvcc per kernel. This tool makes a wheel that holds only what
the FP8 baseline needs:

- the Python modules reachable by import from `flashinfer`, `flashinfer.decode` and
  `flashinfer.prefill` (an AST scan that follows function-level imports too);
- the headers and templates that FlashInfer's FA2 JIT compiles from (`data/include`, the top-level
  `data/csrc` files, CCCL), so a kernel not built ahead of time can still be JIT-compiled there;
- ahead-of-time builds, for sm_90a, of the kernels the benchmarks call, placed where FlashInfer
  loads them without compiling (`flashinfer/data/aot/<module>/<module>.so`), at each head size:
  bf16 query over an e4m3 cache with bf16 output, for the CUDA-core decode kernel and the FA2
  tensor-core kernel that serves both prefill and tensor-core decode; and FA3 (Hopper) batch
  prefill with e4m3 query, K and V (FP8 tensor-core math) and bf16 output. FA3 modules need
  CUTLASS, which the wheel does not carry: only these are available, none is JIT-compiled there.

Usage (needs nvcc 13.0, g++ and torch on the building machine; the wheel's own runtime dependency
apache-tvm-ffi must be importable by this Python, e.g.
`pip install --target /tmp/fi-host apache-tvm-ffi==0.1.15.post2`). The FA3 sources include CUTLASS
utility headers that include cuRAND's `curand_kernel.h` (no cuRAND call is compiled): where the CUDA
toolkit lacks it, take cuRAND's headers from the `nvidia-curand` wheel and name them with --include-dir:

    python -m pip download --no-deps flashinfer-python==0.7.2.post1 -d /tmp/fi
    python -m pip download --no-deps nvidia-curand==10.4.5.25 -d /tmp/fi
    unzip -q -o /tmp/fi/nvidia_curand-*.whl 'nvidia/cu13/include/*' -d /tmp/fi/curand
    PYTHONPATH=/tmp/fi-host python benchmarks/flashinfer_wheel.py \
        --wheel /tmp/fi/flashinfer_python-0.7.2.post1-py3-none-any.whl --out dist/flashinfer \
        --include-dir /tmp/fi/curand/nvidia/cu13/include
"""

from __future__ import annotations

import argparse
import ast
import base64
import hashlib
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile

LOCAL_VERSION = "fp8kvbench"  # marks the wheel as trimmed: "<upstream version>+fp8kvbench"
IMPORT_ROOTS = ("flashinfer", "flashinfer.decode", "flashinfer.prefill")
# Data directories the FA2 JIT compiles from (checked against nvcc's dependency lists: the decode
# and prefill modules include data/include, data/csrc/*.h and CCCL's libcudacxx, nothing else).
DATA_TREES = ("flashinfer/data/include", "flashinfer/data/cccl/libcudacxx/include",
              "flashinfer/data/cccl/cub/cub", "flashinfer/data/cccl/thrust/thrust")
AOT_DIR = "flashinfer/data/aot"
CURAND_HEADER = "curand_kernel.h"  # included by the CUTLASS utility headers that FA3's sources include


def module_file(root: pathlib.Path, module: str) -> pathlib.Path | None:
    path = root.joinpath(*module.split("."))
    if (path / "__init__.py").exists():
        return path / "__init__.py"
    if path.with_suffix(".py").exists():
        return path.with_suffix(".py")
    return None


def imported_modules(tree: ast.AST, package: str) -> list[str]:
    """Every flashinfer module an AST may import, at any depth (lazy imports included)."""
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = parts[: len(parts) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            names += [module] + [f"{module}.{alias.name}" for alias in node.names]
    return [n for n in names if n.split(".")[0] == "flashinfer"]


def python_closure(root: pathlib.Path) -> set[pathlib.Path]:
    """The .py files reachable from IMPORT_ROOTS, with every parent package's __init__."""
    todo = [module_file(root, m) for m in IMPORT_ROOTS]
    seen: set[pathlib.Path] = set()
    while todo:
        path = todo.pop()
        if path is None or path in seen:
            continue
        seen.add(path)
        dotted = ".".join(path.relative_to(root).with_suffix("").parts)
        is_package = dotted.endswith(".__init__")
        module = dotted[: -len(".__init__")] if is_package else dotted
        package = module if is_package else module.rpartition(".")[0]
        parts = module.split(".")
        todo += [module_file(root, ".".join(parts[:i])) for i in range(1, len(parts))]
        tree = ast.parse(path.read_text(), filename=str(path))
        todo += [module_file(root, name) for name in imported_modules(tree, package)]
    return seen


def selected_files(root: pathlib.Path) -> list[pathlib.Path]:
    files = set(python_closure(root))
    files |= {p for p in (root / "flashinfer/data/csrc").iterdir() if p.is_file()}
    for tree in DATA_TREES + (AOT_DIR,):
        files |= {p for p in (root / tree).rglob("*") if p.is_file()}
    files.add(root / "flashinfer/py.typed")
    return sorted(files)


def make_libcuda_stub(cuda_home: pathlib.Path, scratch: pathlib.Path) -> list[str]:
    """Linker flags that resolve -lcuda where no driver is installed (no symbol of it is used)."""
    if (cuda_home / "lib64/stubs/libcuda.so").exists():
        return []
    stub_dir = scratch / "stubs"
    stub_dir.mkdir()
    (stub_dir / "empty.c").write_text("")
    subprocess.run(["gcc", "-shared", "-Wl,-soname,libcuda.so.1", "-o", str(stub_dir / "libcuda.so"),
                    str(stub_dir / "empty.c")], check=True)
    return [f"-L{stub_dir}"]


def build_aot_modules(root: pathlib.Path, head_dims: list[int], cuda_home: pathlib.Path,
                      include_dirs: list[pathlib.Path], scratch: pathlib.Path) -> None:
    """Compiles the baseline's kernels for sm_90a with FlashInfer's own build specs."""
    os.environ.update({
        "FLASHINFER_CUDA_ARCH_LIST": "9.0a",
        "FLASHINFER_WORKSPACE_BASE": str(scratch / "workspace"),
        "CUDA_HOME": str(cuda_home),
    })
    if include_dirs:
        os.environ["FLASHINFER_EXTRA_CUDAFLAGS"] = " ".join(f"-I{d.resolve()}" for d in include_dirs)
    stub_flags = make_libcuda_stub(cuda_home, scratch)
    if stub_flags:
        os.environ["FLASHINFER_EXTRA_LDFLAGS"] = " ".join(stub_flags)
    sys.path.insert(0, str(root))
    import torch
    from flashinfer.jit.attention.modules import (_gen_batch_prefill_primary_module, gen_batch_decode_module,
                                                  gen_batch_prefill_module)
    from flashinfer.jit.core import build_jit_specs

    # (query, cache, output, index) dtypes, as BatchPrefillWithPagedKVCacheWrapper.plan passes them
    dtypes = (torch.bfloat16, torch.float8_e4m3fn, torch.bfloat16, torch.int32)
    fp8_dtypes = (torch.float8_e4m3fn, torch.float8_e4m3fn, torch.bfloat16, torch.int32)
    no_features = (0, False, False)  # no RoPE, no sliding window, no logits soft cap
    specs = []
    for d in head_dims:
        specs.append(gen_batch_decode_module(*dtypes, d, d, *no_features))
        specs.append(_gen_batch_prefill_primary_module("fa2", *dtypes, d, d, *no_features, False))
        specs.append(gen_batch_prefill_module("fa3", *fp8_dtypes, d, d, *no_features, False))
    start = time.time()
    build_jit_specs(specs, verbose=False, skip_prebuilt=False)
    print(f"built {len(specs)} modules in {time.time() - start:.0f} s on {os.cpu_count()} cores")
    for spec in specs:
        target = root / AOT_DIR / spec.name / f"{spec.name}.so"
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(spec.jit_library_path, target)
        print(f"  {target.stat().st_size / 1e6:5.2f} MB  {spec.name}")


def record_line(arcname: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{arcname},sha256={digest},{len(data)}"


def write_wheel(root: pathlib.Path, files: list[pathlib.Path], out_dir: pathlib.Path) -> pathlib.Path:
    """Writes the selected files plus a dist-info whose version ends in "+LOCAL_VERSION"."""
    (old_info,) = root.glob("flashinfer_python-*.dist-info")
    version = old_info.name[len("flashinfer_python-"): -len(".dist-info")]
    new_version = f"{version}+{LOCAL_VERSION}"
    new_info = f"flashinfer_python-{new_version}.dist-info"
    wheel_path = out_dir / f"flashinfer_python-{new_version}-py3-none-any.whl"
    records = []
    with zipfile.ZipFile(wheel_path, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as wheel:
        def add(arcname: str, data: bytes) -> None:
            wheel.writestr(arcname, data)
            records.append(record_line(arcname, data))

        for path in files:
            add(path.relative_to(root).as_posix(), path.read_bytes())
        for path in sorted(p for p in old_info.rglob("*") if p.is_file() and p.name != "RECORD"):
            data = path.read_bytes()
            if path.name == "METADATA":
                data = data.replace(f"\nVersion: {version}\n".encode(), f"\nVersion: {new_version}\n".encode())
            add(f"{new_info}/{path.relative_to(old_info).as_posix()}", data)
        records.append(f"{new_info}/RECORD,,")
        wheel.writestr(f"{new_info}/RECORD", "\n".join(records) + "\n")
    return wheel_path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--wheel", type=pathlib.Path, required=True, help="the published flashinfer-python wheel")
    parser.add_argument("--out", type=pathlib.Path, required=True, help="directory for the trimmed wheel")
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--cuda-home", type=pathlib.Path, default=pathlib.Path("/usr/local/cuda"))
    parser.add_argument("--include-dir", type=pathlib.Path, action="append", default=[],
                        help="an extra header directory for nvcc (repeatable), e.g. cuRAND's headers")
    args = parser.parse_args()
    if not args.wheel.name.startswith("flashinfer_python-"):
        parser.error(f"--wheel: expected a flashinfer_python-*.whl file, got {args.wheel}")
    header_dirs = [args.cuda_home / "include", *args.include_dir]
    if not any((d / CURAND_HEADER).exists() for d in header_dirs):
        parser.error(f"{CURAND_HEADER} is in none of {', '.join(map(str, header_dirs))}: the FA3 sources include "
                     "it; name cuRAND's headers with --include-dir (see this file's docstring)")
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="flashinfer-wheel-") as scratch_name:
        scratch = pathlib.Path(scratch_name)
        root = scratch / "unpacked"
        with zipfile.ZipFile(args.wheel) as wheel:
            wheel.extractall(root)
        build_aot_modules(root, args.head_dims, args.cuda_home, args.include_dir, scratch)
        wheel_path = write_wheel(root, selected_files(root), args.out)
    print(f"wrote {wheel_path} ({wheel_path.stat().st_size / 1e6:.1f} MB)")


if __name__ == "__main__":
    main()
