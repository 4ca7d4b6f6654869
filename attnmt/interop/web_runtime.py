"""onnxruntime-web's WebAssembly build, which the web export's page runs: fetched from the npm
registry (`npm pack`) or read from a package folder or .tgz already here, and written to a
runtime folder (the module gzipped: the page inflates it). Standard library only:
scripts/get_web_runtime.py runs it before attnmt is installed (attnmt's own copy), and the
first web export without a copy runs it into the cache folder (interop.web.runtime_files).
"""

from __future__ import annotations

import gzip
import os
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

VERSION = "1.30.0"  # tested with attnmt's exports (opset 18)
WASM = "ort-wasm-simd-threaded.wasm"
FILES = ("ort.wasm.min.js", "ort-wasm-simd-threaded.mjs", WASM)
LICENSE = f"""onnxruntime-web {VERSION} (https://www.npmjs.com/package/onnxruntime-web), MIT License

Copyright (c) Microsoft Corporation

Permission is hereby granted, free of charge, to any person obtaining a copy of this software
and associated documentation files (the "Software"), to deal in the Software without
restriction, including without limitation the rights to use, copy, modify, merge, publish,
distribute, sublicense, and/or sell copies of the Software, and to permit persons to whom the
Software is furnished to do so, subject to the following conditions:

The above copyright notice and this permission notice shall be included in all copies or
substantial portions of the Software.

THE SOFTWARE IS PROVIDED "AS IS", WITHOUT WARRANTY OF ANY KIND, EXPRESS OR IMPLIED, INCLUDING
BUT NOT LIMITED TO THE WARRANTIES OF MERCHANTABILITY, FITNESS FOR A PARTICULAR PURPOSE AND
NONINFRINGEMENT. IN NO EVENT SHALL THE AUTHORS OR COPYRIGHT HOLDERS BE LIABLE FOR ANY CLAIM,
DAMAGES OR OTHER LIABILITY, WHETHER IN AN ACTION OF CONTRACT, TORT OR OTHERWISE, ARISING FROM,
OUT OF OR IN CONNECTION WITH THE SOFTWARE OR THE USE OR OTHER DEALINGS IN THE SOFTWARE.
"""


class FetchError(Exception):
    """The runtime could not be had (no npm, the registry out of reach, a folder lacking a
    file): one line saying why."""


def cache_folder() -> Path:
    """Where a fetched runtime is kept: $ATTNMT_CACHE/web-runtime/VERSION, else
    ~/.cache/attnmt/web-runtime/VERSION."""
    root = os.environ.get("ATTNMT_CACHE") or Path.home() / ".cache" / "attnmt"
    return Path(root) / "web-runtime" / VERSION


def npm_pack(tmp: Path) -> Path:
    """onnxruntime-web's package from the npm registry, as a .tgz in tmp."""
    if shutil.which("npm") is None:
        raise FetchError("npm is not installed (Node.js's package manager)")
    done = subprocess.run(
        ["npm", "pack", f"onnxruntime-web@{VERSION}", "--silent"],
        cwd=tmp, capture_output=True, text=True, check=False, timeout=600,
    )  # fmt: skip
    if done.returncode:
        raise FetchError(f"npm pack failed: {done.stderr.strip()[-300:]}")
    return tmp / done.stdout.strip().splitlines()[-1]


def read_files(source: Path) -> dict[str, bytes]:
    """FILES from a package folder (or its dist/) or from the package's .tgz; only those
    members are read, by name (nothing else of the archive is unpacked)."""
    if source.is_dir():
        dist = source / "dist" if (source / "dist").is_dir() else source
        missing = [name for name in FILES if not (dist / name).is_file()]
        if missing:
            raise FetchError(f"{dist} lacks {', '.join(missing)}")
        return {name: (dist / name).read_bytes() for name in FILES}
    found = {}
    with tarfile.open(source) as tgz:
        for name in FILES:
            try:
                member = tgz.extractfile(f"package/dist/{name}")
            except KeyError:
                member = None
            if member is None:
                raise FetchError(f"{source} lacks package/dist/{name}")
            found[name] = member.read()
    return found


def install(target: Path, source: Path | None = None) -> int:
    """The runtime (from `source`, else the npm registry) written into `target`, whole or
    not at all; returns its size in bytes."""
    with tempfile.TemporaryDirectory() as tmp:
        files = read_files(source or npm_pack(Path(tmp)))
    files[WASM + ".gz"] = gzip_bytes(files.pop(WASM))  # the page inflates it
    files["LICENSE"] = LICENSE.encode()
    target.mkdir(parents=True, exist_ok=True)
    (target / WASM).unlink(missing_ok=True)  # an older copy kept the module uncompressed
    with tempfile.TemporaryDirectory(dir=target) as work:
        for name, data in files.items():
            (Path(work) / name).write_bytes(data)
        for name in files:
            os.replace(Path(work) / name, target / name)
    return sum(map(len, files.values()))


def gzip_bytes(data: bytes) -> bytes:
    """data gzipped at the highest level, with no time stamp (the same bytes every time)."""
    return gzip.compress(data, compresslevel=9, mtime=0)
