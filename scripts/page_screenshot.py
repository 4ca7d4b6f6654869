#!/usr/bin/env python
"""The README's screenshot of `attnmt serve`'s page (docs/page.png), made with the browser test's
own code (tests/serve/test_page.py) against a real model:

    python scripts/page_screenshot.py --model runs/transformer_30m --output docs/page.png
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "serve"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from test_page import png_size, translate_on_the_page

from attnmt import Translator
from attnmt.serve.schema import Limits

from helpers import start_server


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--output", type=Path, default=Path("docs/page.png"))
    parser.add_argument("--sentence", default="Ein Mann fährt mit dem Fahrrad über eine Brücke.")
    args = parser.parse_args()
    from selenium import webdriver

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium") or "chromium"
    for arg in ("--headless=new", "--no-sandbox", "--window-size=1000,1250"):
        options.add_argument(arg)
    service = webdriver.ChromeService(shutil.which("chromedriver"))
    browser = webdriver.Chrome(options=options, service=service)
    server = start_server(Translator.load(args.model, device="cpu"), Limits(), args.model.name)
    try:
        translate_on_the_page(browser, next(server), args.sentence)
        browser.save_screenshot(str(args.output))
    finally:
        browser.quit()
    print(f"{args.output}: {png_size(args.output)} pixels")
    return 0


if __name__ == "__main__":
    sys.exit(main())
