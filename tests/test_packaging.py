"""What ``pip install`` of the project carries: every file of the package, not only the Python modules.

A plain ``pip install <checkout>`` lost the simulated CUDA device's C++ (``fakecuda/csrc/*.cpp``): the package data
listed only ``memory/csrc/*.cpp``, so ``rlhfmem capture --device cuda-sim`` ended in ``FileNotFoundError`` for every
pip user (issue 37, item 1). Checked on a real wheel, built by setuptools from this checkout."""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_wheel_carries_every_file_of_the_package(tmp_path):
    tracked = subprocess.run(["git", "ls-files", "pytest_rlhfmem"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.split()
    if not tracked:  # not a git checkout (an sdist): the files on disk are the package
        tracked = [str(p.relative_to(ROOT)) for p in (ROOT / "pytest_rlhfmem").rglob("*") if p.is_file()
                   and "__pycache__" not in p.parts]
    src = tmp_path / "src"  # a copy of the tracked files: setuptools' build/ stays out of the checkout
    for f in tracked + ["pyproject.toml", "README.md"]:
        (src / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, src / f)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path), str(src)], check=True, capture_output=True, timeout=300)
    (wheel,) = tmp_path.glob("pytest_rlhfmem-*.whl")
    carried = set(zipfile.ZipFile(wheel).namelist())
    missing = sorted(f for f in tracked if f not in carried)
    assert not missing, f"the wheel lacks {missing}: add them to [tool.setuptools.package-data] in pyproject.toml"
