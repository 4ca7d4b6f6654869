"""Put onnxruntime-web's WebAssembly build where `attnmt export --format web` takes it from
(attnmt/interop/web/runtime/), from the npm registry (`npm pack`) or from a folder or .tgz
already here (--from): python scripts/get_web_runtime.py [--from DIR_OR_TGZ]."""

from __future__ import annotations

import argparse
import gzip
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

VERSION = "1.30.0"  # tested with attnmt's exports (opset 18)
TARGET = Path(__file__).resolve().parent.parent / "attnmt" / "interop" / "web" / "runtime"
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


def npm_pack(tmp: Path) -> Path:
    """onnxruntime-web's package from the npm registry, as a .tgz in tmp."""
    if shutil.which("npm") is None:
        sys.exit("get_web_runtime: npm is not installed; use --from a .tgz or a folder")
    done = subprocess.run(
        ["npm", "pack", f"onnxruntime-web@{VERSION}", "--silent"],
        cwd=tmp, capture_output=True, text=True, check=False,
    )  # fmt: skip
    if done.returncode:
        sys.exit(f"get_web_runtime: npm pack failed: {done.stderr.strip()[-300:]}")
    return tmp / done.stdout.strip().splitlines()[-1]


def read_files(source: Path) -> dict[str, bytes]:
    """FILES from a package folder (or its dist/) or from the package's .tgz; only those
    members are read, by name (nothing else of the archive is unpacked)."""
    if source.is_dir():
        dist = source / "dist" if (source / "dist").is_dir() else source
        missing = [name for name in FILES if not (dist / name).is_file()]
        if missing:
            sys.exit(f"get_web_runtime: {dist} lacks {', '.join(missing)}")
        return {name: (dist / name).read_bytes() for name in FILES}
    found = {}
    with tarfile.open(source) as tgz:
        for name in FILES:
            try:
                member = tgz.extractfile(f"package/dist/{name}")
            except KeyError:
                member = None
            if member is None:
                sys.exit(f"get_web_runtime: {source} lacks package/dist/{name}")
            found[name] = member.read()
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--from", dest="source", type=Path, help="a .tgz or a folder")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        files = read_files(args.source or npm_pack(Path(tmp)))
    TARGET.mkdir(parents=True, exist_ok=True)
    raw = TARGET / WASM
    if raw.is_file():  # an older copy kept the module uncompressed
        raw.unlink()
    files[WASM + ".gz"] = gzip_bytes(files.pop(WASM))  # the page inflates it
    for name, data in files.items():
        (TARGET / name).write_bytes(data)
    (TARGET / "LICENSE").write_text(LICENSE)
    size = sum(map(len, files.values()))
    print(f"{TARGET}: onnxruntime-web {VERSION}, {size / 1e6:.1f} MB (the module gzipped)")


def gzip_bytes(data: bytes) -> bytes:
    """As attnmt.interop.web.gzip_bytes (this script runs before attnmt is installed)."""
    return gzip.compress(data, compresslevel=9, mtime=0)


if __name__ == "__main__":
    main()
