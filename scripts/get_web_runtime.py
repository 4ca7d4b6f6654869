"""Put onnxruntime-web's WebAssembly build where `attnmt export --format web` takes it from
(attnmt/interop/web/runtime/, so that a wheel built afterwards carries it), from the npm
registry (`npm pack`) or from a folder or .tgz already here (--from):
python scripts/get_web_runtime.py [--from DIR_OR_TGZ]. Without it, the first web export fetches
it into the cache folder (attnmt.interop.web_runtime)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run before attnmt is installed: its standard-library module

from attnmt.interop.web_runtime import VERSION, FetchError, install  # noqa: E402

TARGET = ROOT / "attnmt" / "interop" / "web" / "runtime"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--from", dest="source", type=Path, help="a .tgz or a folder")
    args = parser.parse_args()
    try:
        size = install(TARGET, args.source)
    except FetchError as error:
        sys.exit(f"get_web_runtime: {error}")
    print(f"{TARGET}: onnxruntime-web {VERSION}, {size / 1e6:.1f} MB (the module gzipped)")


if __name__ == "__main__":
    main()
