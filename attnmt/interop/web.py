"""Export a model as a folder whose index.html translates in the browser, offline: the page
(interop/web/: tokenizer.js, search.js, page.js), the model as ONNX (model/, interop.onnx) and
onnxruntime-web's WebAssembly build (runtime/). The runtime is not downloaded at export time:
it comes from the copy installed beside this module (`python scripts/get_web_runtime.py`
puts it there, from the npm registry or a folder) or from --runtime DIR. The WebAssembly module
is shipped gzipped (14.2 -> 3.7 MB) and the page inflates it (DecompressionStream), so that a
plain static server needs no compression settings.
"""

from __future__ import annotations

import gzip
import shutil
from pathlib import Path

from attnmt.data.files import atomic_directory
from attnmt.errors import AttnmtError
from attnmt.interop.onnx import check_onnx_export, write_onnx

PAGE = Path(__file__).parent / "web"
PAGE_FILES = ("index.html", "page.js", "search.js", "tokenizer.js", "constraints.js")
RUNTIME = PAGE / "runtime"  # scripts/get_web_runtime.py fills it
# onnxruntime-web's WebAssembly (CPU) build: the API, the wasm module's loader and the module.
WASM = "ort-wasm-simd-threaded.wasm"
RUNTIME_FILES = ("ort.wasm.min.js", "ort-wasm-simd-threaded.mjs", WASM + ".gz")


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
        for name, path in found.items():
            if path.name == WASM:  # an npm dist/ folder's module, not yet compressed
                (tmp / "runtime" / name).write_bytes(gzip_bytes(path.read_bytes()))
            else:
                shutil.copyfile(path, tmp / "runtime" / name)
        (tmp / "model").mkdir()
        write_onnx(model_dir, tmp / "model", weights, quantization, spm=False)
    return sorted(p.name for p in out.iterdir())


def runtime_files(runtime: Path | None) -> dict[str, Path]:
    """The runtime's files (and its licence, where there is one) from `runtime` or from the
    installed copy, by their names in the page's runtime/ (the module may be given as
    onnxruntime-web's own .wasm); one clear error when they are missing."""
    folder = runtime or RUNTIME
    found = {name: folder / name for name in RUNTIME_FILES}
    if not found[WASM + ".gz"].is_file() and (folder / WASM).is_file():
        found[WASM + ".gz"] = folder / WASM
    missing = [name for name, path in found.items() if not path.is_file()]
    if missing:
        where = f"--runtime {runtime}" if runtime else "attnmt's copy"
        raise AttnmtError(
            f"onnxruntime-web is missing from {where} ({', '.join(missing)}): run "
            "`python scripts/get_web_runtime.py` (the npm registry, once) or pass --runtime DIR "
            "(a folder with onnxruntime-web's dist/ files)"
        )
    if (folder / "LICENSE").is_file():
        found["LICENSE"] = folder / "LICENSE"
    return found


def gzip_bytes(data: bytes) -> bytes:
    """data gzipped at the highest level, with no time stamp (the same bytes every export)."""
    return gzip.compress(data, compresslevel=9, mtime=0)
