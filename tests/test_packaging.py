"""What ``pip install`` of the project carries: every file of the package, not only the Python modules, and a wheel
installed into a fresh virtual environment runs the simulated CUDA device.

A plain ``pip install <checkout>`` lost the simulated CUDA device's C++ (``fakecuda/csrc/*.cpp``): the package data
listed only ``memory/csrc/*.cpp``, so ``rlhfmem capture --device cuda-sim`` ended in ``FileNotFoundError`` for every
pip user (issue 37, item 1). Checked on a real wheel, built by setuptools from this checkout."""

import json
import os
import shutil
import subprocess
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_wheel_carries_every_file_of_the_package(project_wheel, package_files):
    carried = set(zipfile.ZipFile(project_wheel).namelist())
    missing = sorted(f for f in package_files if f not in carried)
    assert not missing, f"the wheel lacks {missing}: add them to [tool.setuptools.package-data] in pyproject.toml"


def test_the_wheel_in_a_fresh_venv_captures_on_the_simulated_device_and_replays(wheel_venv, tmp_path):
    """No editable install and no checkout on the path: a new virtual environment whose only pytest_rlhfmem is the
    wheel's (the root conftest's ``wheel_venv``). Run from a directory outside the checkout: ``rlhfmem capture
    --device cuda-sim`` of the generate + PPO loop written for a GPU runner (the device's C++ is built from the
    wheel's sources; values on: its generation loop stops on EOS), twice with the same figures, then ``rlhfmem
    replay`` of the snapshot it saved."""
    env_dir, py = wheel_venv, wheel_venv / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    script = tmp_path / "hf_generate_ppo.py"  # the generate + PPO loop of tests/test_sim_values.py, unchanged
    shutil.copy2(ROOT / "tests" / "data" / "commands" / "hf_generate_ppo.py", script)
    runs = []
    for k in range(2):
        snaps, out = tmp_path / f"snaps{k}", tmp_path / f"result{k}.json"
        r = subprocess.run([str(env_dir / "bin" / "rlhfmem"), "capture", "--device", "cuda-sim", "--id", "wheel",
                            "--snapshot-dir", str(snaps), "--json", str(out), "--", str(py), str(script)],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, r.stdout + r.stderr
        result = json.loads(out.read_text())
        assert result["capture"] == "sim-cuda-simulated" and result["status"] == "ok"
        runs.append((result["metrics"]["peak_reserved"], result["metrics"]["peak_allocated"], snaps))
    assert runs[0][:2] == runs[1][:2]  # the same figures twice
    (snap,) = runs[0][2].glob("*.pickle")
    r = subprocess.run([str(env_dir / "bin" / "rlhfmem"), "replay", str(snap), "--json"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["simulated"]["peak_allocated"] == runs[0][1]
