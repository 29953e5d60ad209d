"""The wheel as a user gets it: `pip install` of the built wheel into a fresh venv, on a PATH with
no cargo or rustc, then the `shardline` module imported from that venv's site-packages."""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


class NoWheel(Exception):
    pass


@dataclass
class Installed:
    venv: Path
    site_packages: Path
    cli: Path
    python: Path

    def import_module(self):
        """`shardline`, from the venv's site-packages: put first on sys.path, and checked."""
        sys.path.insert(0, str(self.site_packages))
        module = importlib.import_module("shardline")
        where = Path(module.__file__).resolve()
        assert where.is_relative_to(self.site_packages.resolve()), f"shardline imported from {where}"
        return module


def rustless_path() -> str:
    """PATH without any directory holding cargo or rustc."""
    keep = [d for d in os.environ.get("PATH", "").split(os.pathsep)
            if d and not any((Path(d) / tool).exists() for tool in ("cargo", "rustc", "rustup"))]
    return os.pathsep.join(keep)


def install(where: Path) -> Installed:
    wheel = os.environ.get("SHARDLINE_WHEEL")
    if not wheel or not Path(wheel).is_file():
        raise NoWheel(f"SHARDLINE_WHEEL={wheel!r} names no wheel: build one with `scripts/build-wheel --dev` "
                      "and set SHARDLINE_WHEEL to the path it prints (scripts/test does both)")
    venv = where / "venv"
    # A venv with nothing in it, not even pip: the suite's pip installs into it from outside.
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CARGO", "RUSTUP", "RUSTC"))}
    env["PATH"] = rustless_path()
    assert shutil.which("cargo", path=env["PATH"]) is None and shutil.which("rustc", path=env["PATH"]) is None
    r = subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install",
                        "--no-index", "--no-deps", "--no-cache-dir", wheel],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, f"pip install {wheel} failed:\n{r.stdout}\n{r.stderr}"
    python = venv / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True, timeout=60).stdout.strip()
    return Installed(venv=venv, site_packages=Path(site), cli=venv / "bin" / "shardline", python=python)
