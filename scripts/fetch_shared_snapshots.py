"""Fetch the real GPU memory snapshots the fidelity tests read (``../shared/snapshots`` beside a checkout).

They are other people's files: ``torch.cuda.memory._dump_snapshot()`` pickles recorded on their GPUs and committed
to their public GitHub repositories, never to this one. :data:`SNAPSHOTS` is their provenance: the repository, the
path, the git blob id of the file there (which is its checksum: the download is held to it) and the SHA-256 of the
file as the tests read it. One of them is cut from its source (devices 0 and 2 of a 3-GPU snapshot kept): the cut is
done here and held to its SHA-256 too.

    python scripts/fetch_shared_snapshots.py                  # fetch what is missing into ../shared/snapshots
    python scripts/fetch_shared_snapshots.py --check          # verify what is there (no network)
    python scripts/fetch_shared_snapshots.py --dest DIR       # elsewhere (then RLHFMEM_SNAPSHOTS_DIR=DIR for the tests)
    python scripts/fetch_shared_snapshots.py --table          # the provenance table of docs/shared-snapshots.md

Downloads go through GitHub's REST API (``/repos/OWNER/NAME/git/blobs/SHA``, 60 requests an hour without a token;
``$GITHUB_TOKEN`` is sent when set); ``--url TEMPLATE`` takes another source with ``{repo}`` and ``{blob}`` in it (a
mirror, or ``file:///dir/{blob}``). Without the network, nothing is written and each file is named with its reason;
the tests that read a missing snapshot skip, naming it. Standard library only: runs before anything is installed.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import os
import pickle
import sys
import urllib.request
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_URL = "https://api.github.com/repos/{repo}/git/blobs/{blob}"


@dataclass(frozen=True)
class Snapshot:
    name: str  # the file under shared/snapshots
    repo: str  # owner/name on GitHub
    path: str  # the file in that repository
    blob: str  # its git blob id (sha1 of "blob <size>\0" + content)
    sha256: str  # of the file as the tests read it
    size: int
    cut: str = ""  # how the file is derived from the blob ("" = unchanged)


SNAPSHOTS = (
    Snapshot("eor_nn.pickle", "JasperSolt/EoR_NN", "snapshot.pickle",
             "6720e24954435398d66f13cb8652dbb0d6d53f5e",
             "fa856e8deaadbe78d683fa1a2045a2884c072c5c5c069e0d21001c7491f471d4", 984472),
    Snapshot("select_n_a.pickle", "Maphsge4/select_n", "snapshot.pickle",
             "5a6010133de8ad776566da3c4d587e18aea564bd",
             "d516373c42e8681f6eda6477795651e79b8dc9a9fc566e49edeb6ba104a56b4d", 1204114),
    Snapshot("cs336_ctx256_fwd.pickle", "kkaitlyn111/cs336-a2-systems", "memory_files/memory_ctx256_forward_.pickle",
             "019e70b35a1c239c4dcac6c023e340d0f3665a6f",
             "b9a3d7bcfa9673cd40b12756579f4867029ea3ccd56c6c51988287ac52126ca1", 1078166),
    Snapshot("codeloc_expandable_dev0_dev2.pickle", "Constructor-Sun/code_location", "memory_snapshot.pickle",
             "b5ef67ce29e4966bbc8d6c7f069be95b699b82d2",
             "1ec211e90aa089b6fed4116ef9d047b820ece714aa28b6810ae598fc6486a6b2", 2492465, cut="drop-device-1"),
    Snapshot("slime_init_b.pickle", "zlH518/slime", "scripts/0804/3/shapshot/init_model.pickle",
             "dc9e311201037013dc5a1f8756854595f2b284c9",
             "69e4a51dc7dce9907cfca52add26d11c0a4aa557a9ca65714bc8eac0d2cf1387", 660473),
    Snapshot("llminf_1p3b_a.pickle", "Yiyi-philosophy/LLM-inference", "1.3b_snapshot.pickle",
             "66f06b4334c0c0b4e0157a7b2294a1488f4e8283",
             "bd18e93fb62aaa8ed0af5618170fd255dd3efa09fc1093c06ce8f89570d92d95", 242309),
    Snapshot("wedson_medium_128_inference.pickle", "Wedsonlin/assignment2-systems",
             "results/medium_128_inference_memory_snapshot.pickle", "77da8fefe3f3623700a41d2d3ce7ea27090f146a",
             "f8db6a7626da4c459c255de540c9983246049ef8c3f69141c7c70c98ef9b56d8", 1203466),
    Snapshot("wedson_medium_256_training.pickle", "Wedsonlin/assignment2-systems",
             "results/medium_256_training_memory_snapshot.pickle", "8a4284c43e024b2f98ba4a5f77b57ea16bd8c035",
             "bf5a87e51ec534f0eb643bf310cf5b6153de7a79f35741ca0e20af15253acb25", 3269814),
)


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class _Builtins(pickle.Unpickler):
    """A memory snapshot holds only builtins: any global is refused, so loading runs no code."""

    def find_class(self, module: str, name: str):  # noqa: ANN201
        raise pickle.UnpicklingError(f"refused global {module}.{name}")


def cut(snapshot: Snapshot, data: bytes) -> bytes:
    """The file the tests read, from the blob's bytes."""
    if not snapshot.cut:
        return data
    if snapshot.cut == "drop-device-1":  # a 3-GPU run: device 1's segments and trace removed, its slot left empty
        snap = _Builtins(io.BytesIO(data)).load()
        snap["segments"] = [s for s in snap["segments"] if s.get("device") != 1]
        snap["device_traces"] = [[] if i == 1 else t for i, t in enumerate(snap["device_traces"])]
        return pickle.dumps(snap, protocol=4)
    raise ValueError(f"{snapshot.name}: unknown cut {snapshot.cut!r}")


def default_dest() -> Path:
    """Where the tests look: ``$RLHFMEM_SNAPSHOTS_DIR``, else ``../shared/snapshots`` beside the checkout."""
    return Path(os.environ.get("RLHFMEM_SNAPSHOTS_DIR") or ROOT.parent / "shared" / "snapshots")


def problem(snapshot: Snapshot, path: Path) -> str | None:
    """``None`` when ``path`` is the snapshot (its SHA-256), else why not."""
    if not path.is_file():
        return "missing"
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    return None if digest == snapshot.sha256 else f"SHA-256 {digest[:12]}..., expected {snapshot.sha256[:12]}..."


def download(snapshot: Snapshot, url: str, timeout: float) -> bytes:
    """The blob's bytes, held to its git blob id. Raises ``OSError`` / ``ValueError`` with the reason."""
    req = urllib.request.Request(url.format(repo=snapshot.repo, blob=snapshot.blob),
                                 headers={"Accept": "application/vnd.github.raw+json",
                                          "User-Agent": "pytest-rlhfmem-fetch-shared-snapshots"})
    if os.environ.get("GITHUB_TOKEN") and req.full_url.startswith("https://api.github.com/"):
        req.add_header("Authorization", f"Bearer {os.environ['GITHUB_TOKEN']}")
    with urllib.request.urlopen(req, timeout=timeout) as r:  # noqa: S310 - the URL template is the user's
        data = r.read()
    if git_blob_id(data) != snapshot.blob:
        raise ValueError(f"the download is not blob {snapshot.blob[:12]} (got {git_blob_id(data)[:12]})")
    return data


def fetch(dest: Path, url: str = DEFAULT_URL, timeout: float = 60.0, names: list[str] | None = None,
          out=None) -> int:  # noqa: ANN001
    """Fetch every missing or wrong snapshot into ``dest`` (lines to ``out``, default stdout); returns how many
    could not be had."""
    out = out or sys.stdout
    failed = 0
    for s in SNAPSHOTS:
        if names and s.name not in names:
            continue
        target = dest / s.name
        if problem(s, target) is None:
            print(f"ok       {s.name}", file=out)
            continue
        try:
            data = cut(s, download(s, url, timeout))
            if hashlib.sha256(data).hexdigest() != s.sha256:
                raise ValueError(f"the file cut from the blob has another SHA-256 than {s.sha256[:12]}...")
            dest.mkdir(parents=True, exist_ok=True)
            tmp = target.with_suffix(".part")
            tmp.write_bytes(data)
            tmp.replace(target)
            print(f"fetched  {s.name} ({len(data):,} bytes) from {s.repo}/{s.path}", file=out)
        except (OSError, ValueError, pickle.UnpicklingError) as exc:
            failed += 1
            print(f"FAILED   {s.name} from {s.repo}/{s.path}: {exc}", file=out)
    return failed


def table() -> list[str]:
    rows = ["| file | repository, path | git blob | SHA-256 of the file | bytes |", "|---|---|---|---|---|"]
    for s in SNAPSHOTS:
        how = f" (cut: {s.cut})" if s.cut else ""
        rows.append(f"| `{s.name}` | [{s.repo}](https://github.com/{s.repo}) `{s.path}`{how} | `{s.blob[:12]}` | "
                    f"`{s.sha256[:16]}...` | {s.size:,} |")
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dest", type=Path, default=None, help="target directory (default: $RLHFMEM_SNAPSHOTS_DIR, "
                                                            "else ../shared/snapshots beside the checkout)")
    p.add_argument("--check", action="store_true", help="verify the files in DEST, fetch nothing")
    p.add_argument("--table", action="store_true", help="print the provenance table (markdown)")
    p.add_argument("--url", default=DEFAULT_URL, help="source template with {repo} and {blob} (default: %(default)s)")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds per download (default 60)")
    p.add_argument("names", nargs="*", help="only these files")
    args = p.parse_args(argv)
    if args.table:
        print("\n".join(table()))
        return 0
    dest = args.dest or default_dest()
    if args.check:
        bad = [(s.name, why) for s in SNAPSHOTS if (why := problem(s, dest / s.name))]
        for name, why in bad:
            print(f"{name}: {why}")
        print(f"{dest}: {len(SNAPSHOTS) - len(bad)} of {len(SNAPSHOTS)} snapshots as recorded")
        return 1 if bad else 0
    failed = fetch(dest, args.url, args.timeout, args.names)
    print(f"{dest}: {failed} snapshot(s) could not be fetched" if failed else f"{dest}: every snapshot as recorded")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
