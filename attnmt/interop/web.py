"""Export a model as a folder whose index.html translates in the browser, offline: the page
(interop/web/: tokenizer.js, search.js, page.js), the model as ONNX (model/, interop.onnx) and
onnxruntime-web's WebAssembly build (runtime/). The runtime is not downloaded at export time:
it comes from the copy installed beside this module (`python scripts/get_web_runtime.py`
puts it there, from the npm registry or a folder) or from --runtime DIR.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from attnmt.data.files import atomic_directory
from attnmt.errors import AttnmtError
from attnmt.interop.onnx import check_onnx_export, write_onnx

PAGE = Path(__file__).parent / "web"
PAGE_FILES = ("index.html", "page.js", "search.js", "tokenizer.js")
RUNTIME = PAGE / "runtime"  # scripts/get_web_runtime.py fills it
# onnxruntime-web's WebAssembly (CPU) build: the API, the wasm module's loader and the module.
RUNTIME_FILES = ("ort.wasm.min.js", "ort-wasm-simd-threaded.mjs", "ort-wasm-simd-threaded.wasm")


def export_web(
    model_dir: Path,
    out: Path,
    weights: str = "best",
    quantization: str | None = None,
    force: bool = False,
    runtime: Path | None = None,
) -> list[str]:
    """Write the page folder `out` (whole or not at all); returns its top-level entries."""
    found = runtime_files(runtime)
    check_onnx_export(model_dir, out, quantization, force)
    with atomic_directory(out, "the export") as tmp:
        for name in PAGE_FILES:
            shutil.copyfile(PAGE / name, tmp / name)
        (tmp / "runtime").mkdir()
        for path in found:
            shutil.copyfile(path, tmp / "runtime" / path.name)
        (tmp / "model").mkdir()
        write_onnx(model_dir, tmp / "model", weights, quantization, spm=False)
    return sorted(p.name for p in out.iterdir())


def runtime_files(runtime: Path | None) -> list[Path]:
    """The runtime's files (and its licence, where there is one) from `runtime` or from the
    installed copy; one clear error when they are missing."""
    folder = runtime or RUNTIME
    missing = [name for name in RUNTIME_FILES if not (folder / name).is_file()]
    if missing:
        where = f"--runtime {runtime}" if runtime else "attnmt's copy"
        raise AttnmtError(
            f"onnxruntime-web is missing from {where} ({', '.join(missing)}): run "
            "`python scripts/get_web_runtime.py` (the npm registry, once) or pass --runtime DIR "
            "(a folder with onnxruntime-web's dist/ files)"
        )
    licence = [folder / "LICENSE"] if (folder / "LICENSE").is_file() else []
    return [folder / name for name in RUNTIME_FILES] + licence
