"""scripts/fetch_shared_snapshots.py: the provenance of ``../shared/snapshots`` and the script that fetches it
(docs/shared-snapshots.md). Without the network: each recorded checksum is held to the shared files (git blob id and
SHA-256), a fetch from a local source (``--url file:///...``) writes verified files, the one cut file is cut as
recorded, and a source that is unreachable or serves other bytes writes nothing and names the file."""

import hashlib
import importlib.util
import io
import pickle
import shutil
import sys
from pathlib import Path

import pytest

from pytest_rlhfmem.shared_snapshots import snapshots_dir

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("fetch_shared_snapshots", ROOT / "scripts" / "fetch_shared_snapshots.py")
fetch = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # a dataclass looks itself up there
spec.loader.exec_module(fetch)


def _shared(name: str) -> Path:
    path = snapshots_dir() / name
    if not path.is_file():
        pytest.skip(f"real GPU snapshot {path} not found (docs/shared-snapshots.md)")
    return path


def test_the_provenance_names_every_shared_file_and_its_checksums():
    names = {s.name for s in fetch.SNAPSHOTS}
    assert len(names) == len(fetch.SNAPSHOTS) == 8
    listed = {p.name for p in snapshots_dir().glob("*.pickle")}
    if not listed:
        pytest.skip(f"no real GPU snapshots in {snapshots_dir()}")
    assert listed == names
    for s in fetch.SNAPSHOTS:
        data = _shared(s.name).read_bytes()
        assert len(data) == s.size and hashlib.sha256(data).hexdigest() == s.sha256, s.name
        if not s.cut:  # the file is the blob itself
            assert fetch.git_blob_id(data) == s.blob, s.name
    assert fetch.main(["--check", "--dest", str(snapshots_dir())]) == 0


def test_a_fetch_from_a_local_source_writes_verified_files(tmp_path, capsys):
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    direct = [s for s in fetch.SNAPSHOTS if not s.cut][:3]
    for s in direct:
        shutil.copy2(_shared(s.name), blobs / s.blob)
    dest = tmp_path / "snapshots"
    names = [s.name for s in direct]
    assert fetch.main(["--dest", str(dest), "--url", f"file://{blobs}/{{blob}}", *names]) == 0
    assert sorted(p.name for p in dest.iterdir()) == sorted(names)
    assert fetch.main(["--dest", str(dest), "--url", f"file://{blobs}/{{blob}}", *names]) == 0  # already there
    assert capsys.readouterr().out.count("ok       ") == 3


def test_an_unreachable_or_wrong_source_writes_nothing_and_names_the_file(tmp_path, capsys):
    s = fetch.SNAPSHOTS[0]
    (tmp_path / s.blob).write_bytes(b"not the snapshot")
    dest = tmp_path / "out"
    assert fetch.main(["--dest", str(dest), "--url", f"file://{tmp_path}/{{blob}}", s.name]) == 1
    assert f"FAILED   {s.name}" in capsys.readouterr().out and not dest.exists()
    assert fetch.main(["--dest", str(dest), "--url", f"file://{tmp_path}/missing/{{blob}}", s.name]) == 1
    assert "could not be fetched" in capsys.readouterr().out
    assert fetch.main(["--check", "--dest", str(dest)]) == 1


def test_the_cut_keeps_devices_0_and_2():
    snap = {"segments": [{"device": d, "address": d} for d in (0, 1, 2)], "device_traces": [[1], [2, 3], [4]],
            "allocator_settings": {}}
    (cut,) = [s for s in fetch.SNAPSHOTS if s.cut]
    out = pickle.load(io.BytesIO(fetch.cut(cut, pickle.dumps(snap, protocol=4))))
    assert [s["device"] for s in out["segments"]] == [0, 2] and out["device_traces"] == [[1], [], [4]]
    with pytest.raises(pickle.UnpicklingError, match="refused global"):  # a pickle that would run code is refused
        fetch.cut(cut, pickle.dumps({"segments": [], "device_traces": [], "x": Path("/")}))


def test_the_provenance_table_is_in_the_docs():
    text = (ROOT / "docs" / "shared-snapshots.md").read_text()
    assert "<!-- generated: python scripts/fetch_shared_snapshots.py --table -->" in text
    assert all(s.blob[:12] in text for s in fetch.SNAPSHOTS)
