"""Export a model as a folder whose index.html translates in the browser, offline: the page
(interop/web/: tokenizer.js, search.js, page.js), the model as ONNX (model/, interop.onnx) and
onnxruntime-web's WebAssembly build (runtime/). The runtime comes from --runtime DIR, else
from the copy installed beside this module (`python scripts/get_web_runtime.py` puts it there,
from the npm registry or a folder), else from the cache folder, where the first export without
either fetches it from the npm registry (interop.web_runtime; one line says so). The module
is shipped gzipped (14.2 -> 3.7 MB) and the page inflates it (DecompressionStream), so that a
plain static server needs no compression settings.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from attnmt.data.files import atomic_directory
from attnmt.errors import AttnmtError
from attnmt.interop import web_runtime
from attnmt.interop.onnx import check_onnx_export, write_onnx
from attnmt.interop.web_runtime import WASM, gzip_bytes

PAGE = Path(__file__).parent / "web"
PAGE_FILES = ("index.html", "page.js", "search.js", "tokenizer.js", "constraints.js")
RUNTIME = PAGE / "runtime"  # scripts/get_web_runtime.py fills it
# onnxruntime-web's WebAssembly (CPU) build: the API, the wasm module's loader and the module.
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
    """The runtime's files (and its licence, where there is one) from `runtime`, else from the
    installed copy, else from the cache folder (fetched there first where it is not), by their
    names in the page's runtime/ (the module may be given as onnxruntime-web's own .wasm); one
    clear error when they cannot be had."""
    if runtime is None:
        found, missing = _files(RUNTIME)
        if not missing:
            return found
        runtime = web_runtime.cache_folder()
        if _files(runtime)[1]:
            _fetch(runtime)
    found, missing = _files(runtime)
    if missing:
        raise AttnmtError(
            f"onnxruntime-web is missing from --runtime {runtime} ({', '.join(missing)}): pass "
            "a folder with onnxruntime-web's dist/ files, or run `python "
            "scripts/get_web_runtime.py`"
        )
    return found


def _files(folder: Path) -> tuple[dict[str, Path], list[str]]:
    """The runtime's files in `folder` by their names in the page's runtime/, and those
    missing."""
    found = {name: folder / name for name in RUNTIME_FILES}
    if not found[WASM + ".gz"].is_file() and (folder / WASM).is_file():
        found[WASM + ".gz"] = folder / WASM
    if (folder / "LICENSE").is_file():
        found["LICENSE"] = folder / "LICENSE"
    return found, [name for name in RUNTIME_FILES if not found[name].is_file()]


def _fetch(folder: Path) -> None:
    """onnxruntime-web from the npm registry into `folder`, said on stderr."""
    print(
        f"note: onnxruntime-web {web_runtime.VERSION} is not installed with attnmt: fetching it "
        f"from the npm registry (once) into {folder}",
        file=sys.stderr, flush=True,
    )  # fmt: skip
    try:
        web_runtime.install(folder)
    except (web_runtime.FetchError, OSError, TimeoutError) as error:
        raise AttnmtError(
            f"onnxruntime-web could not be fetched ({error}): run `python "
            "scripts/get_web_runtime.py --from FILE.tgz` with its npm package, or pass "
            "--runtime DIR (a folder with onnxruntime-web's dist/ files)"
        ) from None
