"""The package as a user installs it: built into a wheel, installed without -e into a fresh
environment, run from a directory outside the checkout."""

import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Built from a copy of the sources: a build/ folder left in the checkout would fill in
    # what the package configuration misses.
    source, out = tmp_path_factory.mktemp("source"), tmp_path_factory.mktemp("wheel")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(
        ROOT / "attnmt", source / "attnmt", ignore=shutil.ignore_patterns("__pycache__")
    )
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
         "--wheel-dir", str(out), str(source)],
        check=True, capture_output=True, cwd=out,
    )  # fmt: skip
    (found,) = out.glob("attnmt-*.whl")
    return found


def test_the_wheel_holds_every_subpackage(wheel: Path):
    names = zipfile.ZipFile(wheel).namelist()
    modules = {p.relative_to(ROOT).as_posix() for p in (ROOT / "attnmt").rglob("*.py")}
    assert modules <= set(names), sorted(modules - set(names))
    pages = {"attnmt/serve/web/index.html", "attnmt/interop/web/index.html"}
    scripts = {p.relative_to(ROOT).as_posix() for p in (ROOT / "attnmt").rglob("web/*.js")}
    assert pages | scripts <= set(names), sorted((pages | scripts) - set(names))


def test_installed_wheel_translates_from_another_directory(wheel: Path, trained, tmp_path: Path):
    """A fresh environment that sees this one's packages (torch and the rest) but not the
    checkout: attnmt comes from the wheel alone."""
    env = tmp_path / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True)
    bin_dir = env / "bin"
    python = bin_dir / "python"
    site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    # A path line, not a site directory: this environment's own .pth files (the editable
    # install of the checkout among them) are not read.
    (Path(site) / "parent.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet",
         "--no-deps", "--no-index", str(wheel)],
        check=True, capture_output=True,
    )  # fmt: skip
    away = tmp_path / "elsewhere"
    away.mkdir()

    def run(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            args, cwd=away, input=stdin, capture_output=True, text=True, timeout=300,
            env={"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(away)},
        )  # fmt: skip

    where = run(str(python), "-c", "import attnmt.kernels.matmul, attnmt; print(attnmt.__file__)")
    assert where.returncode == 0, where.stderr
    assert where.stdout.strip().startswith(site), where.stdout
    version = run(str(bin_dir / "attnmt"), "--version")
    assert version.returncode == 0 and version.stdout.startswith("attnmt "), version.stderr
    model, _ = trained
    out = run(str(bin_dir / "attnmt"), "translate", "-m", str(model), stdin="w1 w2\nw3\n")
    assert out.returncode == 0, out.stderr
    assert len(out.stdout.splitlines()) == 2
