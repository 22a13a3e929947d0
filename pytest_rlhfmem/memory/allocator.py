"""A model of PyTorch's CUDA caching allocator, step for step.

Source followed: ``c10/cuda/CUDACachingAllocator.cpp`` and ``c10/cuda/CUDAAllocatorConfig.cpp`` in
pytorch/pytorch (2.5-2.9; expandable segments and private pools read at commit 001074d25084, the
``release_cached_blocks(context, mempool_id)`` form of 2.6+), summarised in
``shared/reference/caching-allocator.md``. Names mirror the C++ (``Block``, ``BlockPool``,
``PrivatePool``, ``ExpandableSegment``, ``round_size``, ``get_allocation_size``, ``get_pool``,
``get_free_block``, ``should_split``, ``alloc_found_block``, ``try_merge_blocks``, ``free_block``,
``alloc_block``, ``find_expandable_block``, ``map_block``, ``try_allocate_expandable_block``,
``unmap_block``, ``release_available_cached_blocks``, ``release_cached_blocks``, ``release_blocks``,
``garbage_collect_cached_blocks``, ``create_or_incref_pool``, ``begin_allocate_to_pool``,
``end_allocate_to_pool``, ``release_pool``) so that the two can be read side by side. Every size is
in bytes.

What is modelled: the small and large pools, size rounding (including ``roundup_power2_divisions``),
segment sizing, best fit by (stream, size, address), splitting, merging on free, ``max_split_size_mb``,
``max_non_split_rounding_mb``, ``garbage_collection_threshold``, the whole miss path with its retry
(``num_alloc_retries``) and OOM (``num_ooms``) against a device capacity; private pools
(``torch.cuda.MemPool`` / ``use_mem_pool`` and CUDA-graph pools: their own BlockPools, never returned by
``empty_cache()`` while a user or graph holds them, no release-and-retry while allocating into one);
and ``expandable_segments:True`` (one growing virtual segment per (stream, pool), mapped and unmapped
in 2 MiB pages for a small pool and 20 MiB pages for a large one).

PyTorch 2.8-2.10 additions, each selected by ``AllocatorConfig.torch_version`` (``None``: the newest
behaviour modelled), read in ``c10/cuda/CUDACachingAllocator.cpp`` and ``CUDAAllocatorConfig.cpp`` of main after
PRs 169699 and 169739 (Dec 2025): ``per_process_memory_fraction`` as an allocator-config key (2.10, PR 161035);
``MemPool(use_on_oom=True)`` pools as a last resort before an OOM (2.8, PR 151487), tried before any cached
block is released from 2.10 (PR 169699); ``MemPool(no_split=True)`` pools (2.10, PR 169739); the innermost
``use_mem_pool`` region taking the allocations (2.10, nested pools, PR 168382); and ``empty_cache()`` inside a
``use_mem_pool`` region scoped to that region's pool in 2.6-2.7 (PR 133602), every pool nobody holds from 2.8
(PR 154042).

Cross-stream ``record_stream`` blocks follow the trace: ``request_free`` at the program's free (the stats
drop), ``free`` at ``free_completed`` (back to the pool); the CUDA events themselves are not modelled, so
``graph_capture_record_stream_reuse`` (PR 158352, which only changes when such blocks are reused during a graph
capture) is parsed and has no effect. Not modelled: custom allocators behind a MemPool (their segments are
modelled as cudaMalloc'd ones).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from collections.abc import Callable

from bisect import bisect_left, insort

from .driver_va import FirstFitAddressSpace, SegmentPlacement

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB

# Constants of CUDACachingAllocator.cpp.
kMinBlockSize = 512  # all sizes are rounded to at least 512 bytes
kSmallSize = 1 * MiB  # largest "small" allocation is 1 MiB
kSmallBuffer = 2 * MiB  # "small" allocations are packed in 2 MiB blocks
kLargeBuffer = 20 * MiB  # "large" allocations may be packed in 20 MiB blocks
kMinLargeAlloc = 10 * MiB  # allocations between 1 and 10 MiB may use kLargeBuffer
kRoundLarge = 2 * MiB  # round up large allocations to 2 MiB
kRoundUpPowerOfTwoIntervals = 16  # buckets 1 MiB .. 32 GiB+ of roundup_power2_divisions

UNLIMITED = 2**63 - 1  # std::numeric_limits<size_t>::max() stand-in for max_split_size
# The replay's bound on bytes (replay_types.py says all the bounds; csrc/replay_core.cpp: kMaxReplayBytes): a
# setting in bytes (max_split_size unless unlimited, max_non_split_rounding_size), a roundup division count
MAX_REPLAY_BYTES = 2**48


# The environment variables the caching allocator reads its settings from. PyTorch 2.9 made PYTORCH_ALLOC_CONF
# the primary name (c10/core/AllocatorConfig.h, PR 149601) and PYTORCH_CUDA_ALLOC_CONF a deprecated alias
# read when the new one is unset ("PYTORCH_CUDA_ALLOC_CONF is deprecated, use PYTORCH_ALLOC_CONF instead",
# AllocatorConfig.cpp); in 2.9.x expandable_segments is read from the alias only (pytorch issue 183387).
ALLOC_CONF_VARIABLES = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")


def alloc_conf_variable(torch_version: str | None, conf: str = "") -> tuple[str, str]:
    """``(variable, why)``: the environment variable a given PyTorch version honours for ``conf``.

    ``torch_version`` like ``"2.13.0+cpu"``; ``None`` (unknown, e.g. a snapshot) answers the alias, which every
    version up to now reads. Before 2.9 only ``PYTORCH_CUDA_ALLOC_CONF`` exists; 2.9.x reads ``PYTORCH_ALLOC_CONF``
    first but takes ``expandable_segments`` from the alias only; from 2.10 ``PYTORCH_ALLOC_CONF``.
    """
    old, new = "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"
    try:
        major, minor = (int(x) for x in (torch_version or "").split("+")[0].split(".")[:2])
    except ValueError:
        return old, "PyTorch version unknown: the alias every version reads (2.9 and later warn it is deprecated)"
    if (major, minor) < (2, 9):
        return old, f"torch {major}.{minor} reads only {old}"
    if (major, minor) == (2, 9) and "expandable_segments" in conf:
        return old, f"torch 2.9 reads expandable_segments from {old} only (pytorch issue 183387)"
    return new, f"torch {major}.{minor} reads {new} first; {old} is its deprecated alias"


def parse_torch_version(torch_version: str | tuple[int, int] | None) -> tuple[int, int] | None:
    """``"2.10.0+cu128"`` -> ``(2, 10)``; a ``(major, minor)`` tuple is returned as is; ``None`` -> ``None``.

    Raises :class:`AllocatorConfigError` for a string that does not start with ``major.minor``."""
    if torch_version is None or isinstance(torch_version, tuple):
        return torch_version
    try:
        major, minor = (int(x) for x in torch_version.split("+")[0].split(".")[:2])
    except ValueError:
        raise AllocatorConfigError(
            f"torch version {torch_version!r}: expected 'major.minor[.patch]', e.g. '2.10' or '2.9.1+cu128'") from None
    return major, minor


# The PyTorch version each modelled behaviour appeared in (the first release containing the PR).
PER_PROCESS_MEMORY_FRACTION_KEY = (2, 10)  # PR 161035, in the 2.10.0 release notes (CUDA improvements)
GRAPH_CAPTURE_RECORD_STREAM_REUSE_KEY = (2, 9)  # PR 158352; 2.9 snapshots carry the key in allocator_settings
USE_ON_OOM_POOLS = (2, 8)  # PR 151487, MemPool(use_on_oom=True)
EMPTY_CACHE_ALL_FREEABLE_POOLS = (2, 8)  # PR 154042 (MemPoolContext removed); 2.6-2.7: PR 133602's scoping
USE_ON_OOM_BEFORE_RELEASE = (2, 10)  # PR 169699 (Dec 2025, with 169739 in the 2.10 cycle)
NO_SPLIT_POOLS = (2, 10)  # PR 169739, MemPool(no_split=True), in the 2.10.0 release notes
NESTED_POOLS_INNERMOST = (2, 10)  # PR 168382 (get_pool searches captures_underway last-in first)


class AllocatorConfigError(ValueError):
    """A ``PYTORCH_CUDA_ALLOC_CONF`` string the model cannot accept; the message names the key."""


class OutOfMemoryError(RuntimeError):
    """The modelled device could not satisfy a request (``torch.OutOfMemoryError``'s twin)."""


def _is_power_of_2(v: int) -> bool:
    return v > 0 and v & (v - 1) == 0


# allocator_settings key of a trace captured under a segment placement other than the default (driver_va.py)
SEGMENT_PLACEMENT_KEY = "rlhfmem_segment_placement"

_ALLOWED_KEYS = (
    "max_split_size_mb",
    "max_non_split_rounding_mb",
    "roundup_power2_divisions",
    "garbage_collection_threshold",
    "expandable_segments",
    "backend",
    "release_lock_on_cudamalloc",
    "pinned_use_cuda_host_register",
    "pinned_num_register_threads",
    "pinned_use_background_threads",
    "pinned_reserve_segment_size_mb",
    "graph_capture_record_stream_reuse",
    "per_process_memory_fraction",
)
# Keys a PyTorch version before the one named here rejects as unknown ("Unrecognized key ... in CUDA allocator
# config").
_KEY_SINCE = {"per_process_memory_fraction": PER_PROCESS_MEMORY_FRACTION_KEY,
              "graph_capture_record_stream_reuse": GRAPH_CAPTURE_RECORD_STREAM_REUSE_KEY}


@dataclass(frozen=True)
class AllocatorConfig:
    """The allocator settings that change device memory (``CUDAAllocatorConfig``), and the PyTorch version.

    ``max_split_size`` and ``max_non_split_rounding_size`` are bytes; ``roundup_power2_divisions`` is
    the 16-bucket table indexed by ``clamp(floor(log2(size)) - 20, 0, 15)``. ``per_process_memory_fraction``
    (0.0-1.0; 1.0 = no cap) caps reserved bytes at that fraction of the device's memory.

    Not from the conf string: ``torch_version`` ``(major, minor)`` selects the behaviours of that release
    (``None``: the newest modelled); ``use_on_oom_pools`` and ``no_split_pools`` are the ids of the
    ``torch.cuda.MemPool`` objects created with ``use_on_oom=True`` / ``no_split=True`` (a snapshot does not
    record them), ``use_on_oom_pools`` in the order they are tried; ``segment_placement`` is the driver's, not
    PyTorch's (``driver_va.py``; a trace carries it as ``allocator_settings[SEGMENT_PLACEMENT_KEY]``). Raises
    :class:`AllocatorConfigError` for a setting the given version does not have.
    """

    max_split_size: int = UNLIMITED
    max_non_split_rounding_size: int = kLargeBuffer
    roundup_power2_divisions: tuple[int, ...] = (0,) * kRoundUpPowerOfTwoIntervals
    garbage_collection_threshold: float = 0.0
    expandable_segments: bool = False
    source: str = ""
    per_process_memory_fraction: float = 1.0
    graph_capture_record_stream_reuse: bool = False
    torch_version: tuple[int, int] | str | None = None  # a string is parsed: parse_torch_version
    use_on_oom_pools: tuple[tuple[int, int], ...] = ()
    no_split_pools: tuple[tuple[int, int], ...] = ()
    # why torch_version is what it is ("given", what the snapshot's settings prove, or "" = unknown)
    torch_version_source: str = field(default="", compare=False)
    # where the driver maps each new segment in a free-running replay (driver_va.py): not PyTorch's setting
    segment_placement: SegmentPlacement = SegmentPlacement()

    def __post_init__(self) -> None:
        # accept "2.10.0+cu128" and lists of ids (normalised: the config is hashable and compares by value)
        object.__setattr__(self, "torch_version", parse_torch_version(self.torch_version))
        for key in ("use_on_oom_pools", "no_split_pools"):
            object.__setattr__(self, key, tuple(tuple(p) for p in getattr(self, key)))
        for name in ("max_split_size", "max_non_split_rounding_size"):
            b = getattr(self, name)
            if not (name == "max_split_size" and b == UNLIMITED) and not 0 <= b <= MAX_REPLAY_BYTES:
                raise AllocatorConfigError(f"{name}={b} bytes: out of range (0 to 2**48 bytes, 256 TiB, the replay's "
                                           f"bound{'; or unlimited' if name == 'max_split_size' else ''})")
        if any(not 0 <= d <= MAX_REPLAY_BYTES for d in self.roundup_power2_divisions):
            raise AllocatorConfigError(f"roundup_power2_divisions={list(self.roundup_power2_divisions)}: each 0 to "
                                       "2**48 (the replay's bound)")
        v = self.torch_version
        if v is None:
            return
        shown = f"{v[0]}.{v[1]}"
        if self.per_process_memory_fraction != 1.0 and v < PER_PROCESS_MEMORY_FRACTION_KEY:
            raise AllocatorConfigError(
                f"per_process_memory_fraction: an allocator-config key from PyTorch 2.10 (PR 161035); torch {shown} "
                "rejects it as unknown (use torch.cuda.set_per_process_memory_fraction, or --device-memory-gib)")
        if self.use_on_oom_pools and v < USE_ON_OOM_POOLS:
            raise AllocatorConfigError(f"MemPool(use_on_oom=True) exists from PyTorch 2.8 (PR 151487), not in {shown}")
        if self.no_split_pools and v < NO_SPLIT_POOLS:
            raise AllocatorConfigError(f"MemPool(no_split=True) exists from PyTorch 2.10 (PR 169739), not in {shown}")

    def since(self, version: tuple[int, int]) -> bool:
        """True when the modelled PyTorch is ``version`` or later (an unknown version is the newest)."""
        return self.torch_version is None or self.torch_version >= version

    def with_options(self, **changes) -> AllocatorConfig:
        """A copy with ``changes`` (``dataclasses.replace``); ``torch_version`` may be a string like
        ``"2.10.0"``. Raises :class:`AllocatorConfigError` as the constructor does."""
        return replace(self, **changes)

    @classmethod
    def parse(cls, conf: str | None, torch_version: str | tuple[int, int] | None = None) -> AllocatorConfig:
        """Parse a ``PYTORCH_CUDA_ALLOC_CONF`` / ``PYTORCH_ALLOC_CONF`` string strictly
        (``CUDAAllocatorConfig::parseArgs``) for ``torch_version`` (``"2.10"``, ``(2, 10)`` or ``None``: the
        newest modelled). A pasted environment assignment (``PYTORCH_ALLOC_CONF=...`` or
        ``PYTORCH_CUDA_ALLOC_CONF=...``) is accepted: its value is parsed.

        Raises :class:`AllocatorConfigError` naming the offending key and the allowed forms for an
        unknown key, a key that version does not have, or a malformed value.
        """
        version = parse_torch_version(torch_version)
        for name in ALLOC_CONF_VARIABLES:
            if conf and conf.strip().startswith(name + "="):
                conf = conf.strip()[len(name) + 1:].strip("'\"")
        if not conf or not conf.strip():
            return cls(torch_version=version)
        kw: dict = {"source": conf, "torch_version": version}
        for item in _split_top_level(conf):
            if ":" not in item:
                raise AllocatorConfigError(
                    f"alloc-conf item {item!r} is not 'key:value'; allowed keys: {', '.join(_ALLOWED_KEYS)}"
                )
            key, value = (s.strip() for s in item.split(":", 1))
            since = _KEY_SINCE.get(key)
            if since is not None and version is not None and version < since:
                raise AllocatorConfigError(
                    f"{key}: an allocator-config key from PyTorch {since[0]}.{since[1]}; torch "
                    f"{version[0]}.{version[1]} rejects it as unknown")
            if key == "max_split_size_mb":
                mb = _parse_int(key, value, "an integer number of MiB > 20")
                if mb <= kLargeBuffer // MiB:
                    raise AllocatorConfigError(f"max_split_size_mb={mb} too small: must be > 20 (MiB)")
                if mb > MAX_REPLAY_BYTES // MiB:
                    raise AllocatorConfigError(f"max_split_size_mb={mb}: out of range; allowed: 21 to "
                                               f"{MAX_REPLAY_BYTES // MiB} (256 TiB, the replay's bound)")
                kw["max_split_size"] = mb * MiB
            elif key == "max_non_split_rounding_mb":
                mb = _parse_int(key, value, "an integer number of MiB >= 0")
                if not 0 <= mb <= MAX_REPLAY_BYTES // MiB:
                    raise AllocatorConfigError(f"max_non_split_rounding_mb={mb}: out of range; allowed: 0 to "
                                               f"{MAX_REPLAY_BYTES // MiB} (256 TiB, the replay's bound)")
                kw["max_non_split_rounding_size"] = mb * MiB
            elif key == "roundup_power2_divisions":
                kw["roundup_power2_divisions"] = _parse_roundup_power2_divisions(value)
            elif key == "garbage_collection_threshold":
                try:
                    thr = float(value)
                except ValueError:
                    thr = -1.0
                if not 0.0 < thr < 1.0:
                    raise AllocatorConfigError(
                        f"garbage_collection_threshold={value!r}: must be a number strictly between 0.0 and 1.0"
                    )
                kw["garbage_collection_threshold"] = thr
            elif key == "expandable_segments":
                if value not in ("True", "False"):
                    raise AllocatorConfigError(f"expandable_segments={value!r}: allowed values are True, False")
                kw["expandable_segments"] = value == "True"
            elif key == "per_process_memory_fraction":
                try:
                    fraction = float(value)
                except ValueError:
                    fraction = -1.0
                if not 0.0 <= fraction <= 1.0:  # CUDAAllocatorConfig::parsePerProcessMemoryFraction
                    raise AllocatorConfigError(
                        f"per_process_memory_fraction={value!r}: allowed values are numbers from 0.0 to 1.0 (the "
                        "fraction of the device's memory the allocator may reserve; 1.0 = no cap)")
                kw["per_process_memory_fraction"] = fraction
            elif key == "graph_capture_record_stream_reuse":
                if value not in ("True", "False"):
                    raise AllocatorConfigError(
                        f"graph_capture_record_stream_reuse={value!r}: allowed values are True, False")
                kw["graph_capture_record_stream_reuse"] = value == "True"
            elif key == "backend":
                if value != "native":
                    raise AllocatorConfigError(
                        f"backend={value!r}: only 'native' (the caching allocator) is modelled; "
                        "cudaMallocAsync is the driver's allocator"
                    )
            elif key in _ALLOWED_KEYS:
                pass  # host-side (pinned memory) or locking options: no effect on device memory
            else:
                raise AllocatorConfigError(
                    f"unknown alloc-conf key {key!r}; allowed keys: {', '.join(_ALLOWED_KEYS)}"
                )
        return cls(**kw)

    @classmethod
    def from_snapshot_settings(cls, settings: dict | None,
                               torch_version: str | tuple[int, int] | None = None) -> AllocatorConfig:
        """Rebuild the config from a snapshot's ``allocator_settings`` (torch >= 2.3); ``None`` -> defaults.

        The conf string (``PYTORCH_ALLOC_CONF``, else ``PYTORCH_CUDA_ALLOC_CONF``) is parsed first; the effective
        values PyTorch writes beside it (``torch/csrc/cuda/Module.cpp``, ``_memory_snapshot``) then win where
        present, since ``torch.cuda.memory._set_allocator_settings`` changes them without the string:
        ``max_split_size`` (bytes; -1 = unlimited), ``garbage_collection_threshold``,
        ``roundup_power2_divisions`` (``{"1": div, ..., "32768": div}``, keys in MiB), ``expandable_segments``
        (only ``True`` is taken: the flag of a trace this project wrote is always ``False``),
        ``per_process_memory_fraction`` and ``graph_capture_record_stream_reuse``. Without ``torch_version``
        the version is the newest the settings allow (:func:`torch_version_from_settings`). Raises
        :class:`AllocatorConfigError` naming the key for a value PyTorch could not have written.
        """
        version = parse_torch_version(torch_version)
        source = "given" if version is not None else ""
        if version is None:
            version, source = torch_version_from_settings(settings)
        if not settings:
            return cls(torch_version=version, torch_version_source=source)
        try:
            placement = SegmentPlacement.parse(settings.get(SEGMENT_PLACEMENT_KEY),
                                               f"allocator_settings[{SEGMENT_PLACEMENT_KEY!r}]")
        except ValueError as exc:
            raise AllocatorConfigError(str(exc)) from None
        # PyTorch >= 2.9 reads PYTORCH_ALLOC_CONF first and PYTORCH_CUDA_ALLOC_CONF as its alias
        conf = settings.get("PYTORCH_ALLOC_CONF") or settings.get("PYTORCH_CUDA_ALLOC_CONF") or ""
        config = cls.parse(conf, version)
        if settings.get("expandable_segments") is True and not config.expandable_segments:
            # set through torch.cuda.memory._set_allocator_settings: the flag is in the settings only
            conf = f"{conf},expandable_segments:True" if conf else "expandable_segments:True"
            config = cls.parse(conf, version)
        return config.with_options(torch_version_source=source, segment_placement=placement,
                                   **_effective_settings(settings, config))

    def roundup_divisions_for(self, size: int) -> int:
        """``CUDAAllocatorConfig::roundup_power2_divisions(size)``."""
        log_size = size.bit_length() - 1
        index = log_size - 20 if log_size > 20 else 0
        return self.roundup_power2_divisions[min(index, kRoundUpPowerOfTwoIntervals - 1)]


def torch_version_from_settings(settings: dict | None) -> tuple[tuple[int, int] | None, str]:
    """``(version, why)``: the PyTorch a trace's ``allocator_settings`` name (``rlhfmem_torch_version``, e.g.
    ``"2.10.0+cpu"``, for a trace captured with a known torch), else the newest they allow, or ``(None, "")``.

    ``torch/csrc/cuda/Module.cpp`` (``_memory_snapshot``) writes ``graph_capture_record_stream_reuse`` beside
    ``max_split_size`` from 2.9 (PR 158352): settings written by PyTorch (they hold ``max_split_size``) without
    it come from 2.8 or before, and the model then replays 2.8's behaviours. Anything else proves no upper
    bound: the version stays ``None`` (the newest modelled behaviour), ``why`` saying what is known."""
    recorded = settings.get("rlhfmem_torch_version") if isinstance(settings, dict) else None
    if isinstance(recorded, str) and recorded:  # a trace this project captured names the torch it ran
        return parse_torch_version(recorded), "recorded: allocator_settings['rlhfmem_torch_version']"
    written_by_torch = isinstance(settings, dict) and "max_split_size" in settings
    if written_by_torch and "graph_capture_record_stream_reuse" not in settings:  # type: ignore[operator]
        return (2, 8), "at most 2.8: allocator_settings lack graph_capture_record_stream_reuse (written from 2.9)"
    if written_by_torch:
        return None, "2.9 or later (allocator_settings hold graph_capture_record_stream_reuse): the newest modelled"
    return None, ""


def _effective_settings(settings: dict, config: AllocatorConfig) -> dict:
    """The effective values of a snapshot's ``allocator_settings`` that differ from ``config``, as
    :meth:`AllocatorConfig.with_options` keywords. Raises :class:`AllocatorConfigError` for a malformed one."""
    out: dict = {}

    def bad(key: str, allowed: str) -> AllocatorConfigError:
        return AllocatorConfigError(f"allocator_settings[{key!r}] = {settings[key]!r}: expected {allowed}")

    if "max_split_size" in settings:
        v = settings["max_split_size"]
        if isinstance(v, bool) or not isinstance(v, int):
            raise bad("max_split_size", "an integer number of bytes (-1: unlimited)")
        ms = UNLIMITED if v < 0 or v >= UNLIMITED else v
        if ms != UNLIMITED and ms <= kLargeBuffer:
            raise bad("max_split_size", "more than 20 MiB, or -1 (unlimited)")
        if ms != config.max_split_size:
            out["max_split_size"] = ms
    if "garbage_collection_threshold" in settings:
        v = settings["garbage_collection_threshold"]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 <= v < 1.0:
            raise bad("garbage_collection_threshold", "a number from 0.0 (off) to below 1.0")
        if float(v) != config.garbage_collection_threshold:
            out["garbage_collection_threshold"] = float(v)
    if "roundup_power2_divisions" in settings:
        v = settings["roundup_power2_divisions"]
        allowed = "a dict of power-of-2 MiB keys ('1' .. '32768') to 0 or a power of 2"
        if not isinstance(v, dict):
            raise bad("roundup_power2_divisions", allowed)
        table = list(config.roundup_power2_divisions)
        for k, div in v.items():
            try:
                mb = int(k)
            except (TypeError, ValueError):
                raise bad("roundup_power2_divisions", allowed) from None
            if (not _is_power_of_2(mb) or isinstance(div, bool) or not isinstance(div, int)
                    or (div != 0 and not _is_power_of_2(div))):
                raise bad("roundup_power2_divisions", allowed)
            table[min(mb.bit_length() - 1, kRoundUpPowerOfTwoIntervals - 1)] = div
        if tuple(table) != config.roundup_power2_divisions:
            out["roundup_power2_divisions"] = tuple(table)
    if "per_process_memory_fraction" in settings:
        v = settings["per_process_memory_fraction"]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 <= v <= 1.0:
            raise bad("per_process_memory_fraction", "a number from 0.0 to 1.0")
        if float(v) != config.per_process_memory_fraction:
            out["per_process_memory_fraction"] = float(v)
    if "graph_capture_record_stream_reuse" in settings:
        v = settings["graph_capture_record_stream_reuse"]
        if not isinstance(v, bool):
            raise bad("graph_capture_record_stream_reuse", "True or False")
        out["graph_capture_record_stream_reuse"] = v
    return out


def _split_top_level(conf: str) -> list[str]:
    """Split on commas that are not inside ``[...]`` (the list form of roundup_power2_divisions)."""
    items, depth, cur = [], 0, []
    for ch in conf:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if ch == "," and depth == 0:
            items.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
    if "".join(cur).strip():
        items.append("".join(cur).strip())
    return [i for i in items if i]


def _parse_int(key: str, value: str, allowed: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise AllocatorConfigError(f"{key}={value!r}: expected {allowed}") from None


def _parse_roundup_power2_divisions(value: str) -> tuple[int, ...]:
    """Both forms: ``N`` (all buckets) or ``[64:8,256:4,>:1]`` (keys in MiB, powers of 2)."""
    allowed = "an integer power of 2 (or 0), or a list like [64:8,256:4,>:1] with power-of-2 MiB keys"
    table = [0] * kRoundUpPowerOfTwoIntervals
    if not value.startswith("["):
        n = _parse_int("roundup_power2_divisions", value, allowed)
        if n != 0 and not _is_power_of_2(n):
            raise AllocatorConfigError(f"roundup_power2_divisions={value!r}: expected {allowed}")
        return (n,) * kRoundUpPowerOfTwoIntervals
    if not value.endswith("]"):
        raise AllocatorConfigError(f"roundup_power2_divisions={value!r}: expected {allowed}")
    first_value, last_index = True, 0
    for pair in (p.strip() for p in value[1:-1].split(",") if p.strip()):
        if ":" not in pair:
            raise AllocatorConfigError(f"roundup_power2_divisions entry {pair!r}: expected {allowed}")
        k, v = (s.strip() for s in pair.split(":", 1))
        div = _parse_int("roundup_power2_divisions", v, allowed)
        if not _is_power_of_2(div):
            raise AllocatorConfigError(f"roundup_power2_divisions entry {pair!r}: divisions must be a power of 2")
        if k == ">":
            # Mirrors the C++: fills from last_index (inclusive) to the end.
            for i in range(last_index, kRoundUpPowerOfTwoIntervals):
                table[i] = div
            continue
        mb = _parse_int("roundup_power2_divisions", k, allowed)
        if not _is_power_of_2(mb):
            raise AllocatorConfigError(f"roundup_power2_divisions entry {pair!r}: interval must be a power of 2 (MiB)")
        index = min(mb.bit_length() - 1, kRoundUpPowerOfTwoIntervals - 1)
        if first_value:
            for i in range(index):
                table[i] = div
            first_value = False
        table[index] = div
        last_index = index
    return tuple(table)


# ---------------------------------------------------------------------------------------------
# Blocks, pools, expandable segments
# ---------------------------------------------------------------------------------------------

DEFAULT_POOL: tuple[int, int] = (0, 0)  # MempoolId_t of the default pools
# ExpandableSegment reserves address space for 1 1/8 of the device's memory; without a known
# capacity the model assumes an 80 GiB device (only the unmapped tail's size depends on it).
DEFAULT_DEVICE_MEMORY = 80 * GiB


def allowed_memory_maximum(config: AllocatorConfig, capacity: int | None) -> int | None:
    """The bytes the allocator may reserve on a device of ``capacity`` bytes (``None``: unlimited) under
    ``config.per_process_memory_fraction`` (``DeviceCachingAllocator::setMemoryFraction``: below 1.0,
    ``int(fraction * total)``; 1.0 leaves the device's own limit). An unknown capacity counts as an 80 GiB
    device (``DEFAULT_DEVICE_MEMORY``) when a fraction is set; a negative one (inferred from an inconsistent
    trace) is kept: nothing fits either way."""
    fraction = config.per_process_memory_fraction
    if fraction >= 1.0 or (capacity is not None and capacity < 0):
        return capacity
    return int(fraction * (capacity if capacity is not None else DEFAULT_DEVICE_MEMORY))


class ExpandableSegment:
    """``struct ExpandableSegment``: a reserved virtual range ``[ptr, ptr + size())`` mapped page by page.

    ``segment_size`` is the page: 2 MiB for a small pool, 20 MiB for a large one. ``handles[i]`` is True
    while page ``i`` is mapped (physical memory behind it). ``map``/``unmap`` return ``(ptr, size)`` of
    the pages actually (un)mapped; size 0 means nothing.
    """

    __slots__ = ("ptr", "segment_size", "max_handles", "stream", "handles")

    def __init__(self, ptr: int, segment_size: int, address_space_size: int, stream: int) -> None:
        self.ptr = ptr
        self.segment_size = segment_size
        self.max_handles = -(-address_space_size // segment_size)  # numSegments
        self.stream = stream
        self.handles: list[bool] = []

    def size(self) -> int:
        return self.max_handles * self.segment_size

    def pages_to_map(self, ptr: int, size: int) -> range:
        """Pages ``map(ptr, size)`` would map: ``[segmentLeft(ptr), segmentRight(ptr + size))``."""
        return range((ptr - self.ptr) // self.segment_size, -(-(ptr + size - self.ptr) // self.segment_size))

    def map(self, ptr: int, size: int) -> tuple[int, int]:
        pages = self.pages_to_map(ptr, size)
        assert self.ptr + pages.start * self.segment_size == ptr, "map() begins on a page boundary"
        while len(self.handles) < pages.stop:
            self.handles.append(False)
        for i in pages:
            assert not self.handles[i], "page already mapped"
            self.handles[i] = True
        return self.ptr + pages.start * self.segment_size, len(pages) * self.segment_size

    def unmap(self, ptr: int, size: int) -> tuple[int, int]:
        """Unmap every page lying wholly inside ``[ptr, ptr + size)``."""
        begin = -(-(ptr - self.ptr) // self.segment_size)  # segmentRight(ptr)
        end = (ptr + size - self.ptr) // self.segment_size  # segmentLeft(ptr + size)
        if begin >= end:
            return ptr, 0
        for i in range(begin, end):
            self.handles[i] = False
        while self.handles and not self.handles[-1]:  # trimHandles
            self.handles.pop()
        return self.ptr + begin * self.segment_size, (end - begin) * self.segment_size

    def mapped_bytes(self) -> int:
        return sum(self.handles) * self.segment_size


class Block:
    """A range of device memory inside one segment (``struct Block``).

    Blocks of a segment form a doubly linked list by address (``prev``/``next``); a segment's first
    block has ``prev is None``. ``size`` is the block's bytes; ``requested_size`` the caller's bytes.
    In an expandable segment the list covers the whole virtual range and ``mapped`` says whether the
    block has physical pages behind it.
    """

    __slots__ = ("stream", "pool", "address", "size", "requested_size", "allocated", "prev", "next",
                 "gc_count_base", "mapped", "expandable_segment", "held")

    def __init__(self, stream: int, size: int, pool: BlockPool, address: int) -> None:
        self.stream = stream
        self.size = size
        self.requested_size = 0
        self.pool = pool
        self.address = address
        self.allocated = False
        self.prev: Block | None = None
        self.next: Block | None = None
        self.gc_count_base = 0
        self.mapped = True
        self.expandable_segment: ExpandableSegment | None = None
        # freed by the program while other streams still use it (request_free): out of the stats, not yet
        # back in its pool (PyTorch: allocated false, event_count > 0); ``allocated`` stays True here so that
        # no merge, reuse or release touches it before free() completes it
        self.held = False

    def is_split(self) -> bool:
        return self.prev is not None or self.next is not None

    def splice(self, before: Block | None, after: Block | None) -> None:
        """``Block::splice``: insert self between ``before`` and ``after``."""
        if before is not None:
            before.next = self
        self.prev = before
        if after is not None:
            after.prev = self
        self.next = after

    def key(self) -> tuple[int, int, int]:
        """The pool's ordering: ``BlockComparatorSize`` (stream, size, address)."""
        return (self.stream, self.size, self.address)

    def __repr__(self) -> str:
        state = "allocated" if self.allocated else ("free" if self.mapped else "unmapped")
        pool = "small" if self.pool.is_small else "large"
        return f"Block(addr=0x{self.address:x}, size={self.size}, {state}, pool={pool})"


class BlockPool:
    """Free blocks of one kind, ordered by (stream, size, address) (``struct BlockPool``).

    ``unmapped`` holds the unmapped blocks of expandable segments by (stream, address)
    (``BlockComparatorAddress``); ``owner_private_pool`` is the :class:`PrivatePool` it belongs to, or
    ``None`` for the default pools.
    """

    __slots__ = ("is_small", "blocks", "by_key", "get_free_blocks_call_count", "unmapped", "unmapped_by_key",
                 "owner_private_pool")

    def __init__(self, is_small: bool, owner_private_pool: PrivatePool | None = None) -> None:
        self.is_small = is_small
        # Sorted lists of keys: bisect in C beats a balanced tree at the few hundred free blocks a pool holds.
        self.blocks: list[tuple[int, int, int]] = []  # keys (stream, size, address), sorted
        self.by_key: dict[tuple[int, int, int], Block] = {}
        self.get_free_blocks_call_count = 0
        self.unmapped: list[tuple[int, int]] = []  # keys (stream, address), sorted
        self.unmapped_by_key: dict[tuple[int, int], Block] = {}
        self.owner_private_pool = owner_private_pool

    def insert_into_blocks(self, block: Block) -> None:
        k = (block.stream, block.size, block.address)
        insort(self.blocks, k)
        self.by_key[k] = block
        block.gc_count_base = self.get_free_blocks_call_count

    def erase(self, block: Block) -> None:
        k = (block.stream, block.size, block.address)
        del self.by_key[k]  # first: a KeyError here, never a wrong deletion below
        del self.blocks[bisect_left(self.blocks, k)]

    def insert_unmapped(self, block: Block) -> None:
        k = (block.stream, block.address)
        insort(self.unmapped, k)
        self.unmapped_by_key[k] = block

    def erase_unmapped(self, block: Block) -> None:
        k = (block.stream, block.address)
        del self.unmapped_by_key[k]
        del self.unmapped[bisect_left(self.unmapped, k)]

    def ordered(self) -> list[Block]:
        """Free blocks in pool order (a copy: callers may mutate the pool)."""
        return [self.by_key[k] for k in self.blocks]

    def pool_id(self) -> tuple[int, int]:
        return self.owner_private_pool.id if self.owner_private_pool is not None else DEFAULT_POOL


class PrivatePool:
    """``struct PrivatePool``: the BlockPools of one ``torch.cuda.MemPool`` or CUDA graph pool.

    ``use_count``: holders (the MemPool object or graph, plus each open ``use_mem_pool`` region); while it
    is above 0 ``empty_cache()`` leaves the pool's segments alone. ``cudaMalloc_count``: its segments
    (or mapped pages) not yet returned.
    """

    __slots__ = ("id", "use_count", "cudaMalloc_count", "large_blocks", "small_blocks")

    def __init__(self, pool_id: tuple[int, int]) -> None:
        self.id = pool_id
        self.use_count = 1
        self.cudaMalloc_count = 0
        self.large_blocks = BlockPool(is_small=False, owner_private_pool=self)
        self.small_blocks = BlockPool(is_small=True, owner_private_pool=self)


@dataclass
class AllocatorStats:
    """The scalars of ``torch.cuda.memory_stats()`` that a replay needs (bytes, counts)."""

    allocated_bytes: int = 0  # sum of allocated blocks' sizes
    requested_bytes: int = 0  # sum of callers' requested sizes
    reserved_bytes: int = 0  # sum of segment sizes (mapped pages for expandable segments)
    inactive_split_bytes: int = 0  # free bytes inside split segments: PyTorch's fragmentation figure
    peak_allocated_bytes: int = 0
    peak_reserved_bytes: int = 0
    num_alloc_retries: int = 0
    num_ooms: int = 0
    num_device_alloc: int = 0  # cudaMalloc calls and page mappings
    num_device_free: int = 0  # cudaFree calls and page unmappings
    num_allocs: int = 0
    num_frees: int = 0


SegmentObserver = Callable[[int, int, int], None]


class CachingAllocatorModel:
    """One device's ``DeviceCachingAllocator``.

    Args:
        config: the allocator settings (see :meth:`AllocatorConfig.parse`).
        capacity: bytes of the device the process may use (its total memory, or its free memory); ``None`` =
            unlimited. A cudaMalloc (or page mapping) past it fails, which drives the retry path and, last,
            :class:`OutOfMemoryError`. A ``per_process_memory_fraction`` below 1.0 lowers it to
            ``int(fraction * capacity)`` (``setMemoryFraction``: ``allowed_memory_maximum``; an unknown capacity
            counts as an 80 GiB device, as for an expandable segment's address space).
        on_segment_alloc / on_segment_free / on_segment_map / on_segment_unmap: observers called as
            ``(address, size, stream)`` right after the model's cudaMalloc / cudaFree / page mapping /
            page unmapping; reserved already includes the change.
    """

    def __init__(
        self,
        config: AllocatorConfig | None = None,
        capacity: int | None = None,
        on_segment_alloc: SegmentObserver | None = None,
        on_segment_free: SegmentObserver | None = None,
        on_segment_map: SegmentObserver | None = None,
        on_segment_unmap: SegmentObserver | None = None,
    ) -> None:
        self.config = config or AllocatorConfig()
        self._power2_rounding = any(d > 1 for d in self.config.roundup_power2_divisions)
        self.device_total = capacity  # an expandable segment reserves 1 1/8 of it
        self.capacity = allowed_memory_maximum(self.config, capacity)
        # setMemoryFraction's allowed_memory_maximum (None: no fraction below 1.0): alloc_block checks it
        # against the cudaMalloc size before it tries an expandable segment's pages
        self.allowed_memory_maximum = self.capacity if self.config.per_process_memory_fraction < 1.0 else None
        self.use_on_oom_pools = self.config.use_on_oom_pools
        self.no_split_pools = frozenset(self.config.no_split_pools)
        self._innermost_pool = self.config.since(NESTED_POOLS_INNERMOST)
        self.small_blocks = BlockPool(is_small=True)
        self.large_blocks = BlockPool(is_small=False)
        self.active_blocks: dict[int, Block] = {}  # address -> allocated block
        # segment base address -> its first block; an expandable segment is keyed by its virtual base
        self.segments: dict[int, Block] = {}
        self.segment_sizes: dict[int, int] = {}  # base -> cudaMalloc size (virtual size if expandable)
        self.expandable_segments: dict[int, ExpandableSegment] = {}  # base -> segment
        self.graph_pools: dict[tuple[int, int], PrivatePool] = {}
        self.graph_pools_freeable: dict[tuple[int, int], PrivatePool] = {}
        self.captures_underway: list[tuple[int, int]] = []  # pools allocations are diverted to
        self.stats = AllocatorStats()
        self.on_segment_alloc = on_segment_alloc
        self.on_segment_free = on_segment_free
        self.on_segment_map = on_segment_map
        self.on_segment_unmap = on_segment_unmap
        # Address source for new segments: replay may anchor them to recorded addresses. Called with the
        # cudaMalloc size, or None for a new expandable segment (its virtual base).
        self._next_synthetic_address = 1 << 56  # far above real CUDA virtual addresses
        self.address_for_new_segment: Callable[[int | None], int | None] | None = None
        # the driver's address ranges under first-fit placement (None: each new segment above the last; always
        # with expandable segments, whose address space is reserved once)
        self.driver: FirstFitAddressSpace | None = (None if self.config.expandable_segments
                                                    else self.config.segment_placement.address_space())
        # Set by an anchored replay when the recorded run's first cudaMalloc for this request failed.
        self.fail_next_cuda_malloc = False
        # bytes of the device mapped outside this allocator (events.py: EXTERNAL_MAP; a colocated rollout engine's
        # CuMemAllocator mappings): physical memory cudaMalloc and cuMemCreate cannot have; never released by it
        self.external_bytes = 0
        self.peak_device_used = 0  # bytes: the peak of reserved + external_bytes, updated where either grows

    @property
    def next_synthetic_address(self) -> int:
        """Where the next segment goes without an anchor or a driver placement (the last one's end + 2 MiB)."""
        return self._next_synthetic_address

    # -- sizes ----------------------------------------------------------------------------------

    def round_size(self, size: int) -> int:
        """``round_size``: the block size a request of ``size`` bytes gets."""
        if size < kMinBlockSize:
            return kMinBlockSize
        if self._power2_rounding:
            divisions = self.config.roundup_divisions_for(size)
            if divisions > 1 and size > kMinBlockSize * divisions:
                return roundup_power2_next_division(size, divisions)
        return kMinBlockSize * ((size + kMinBlockSize - 1) // kMinBlockSize)

    @staticmethod
    def get_allocation_size(size: int) -> int:
        """``get_allocation_size``: the cudaMalloc size for a (rounded) request."""
        if size <= kSmallSize:
            return kSmallBuffer
        if size < kMinLargeAlloc:
            return kLargeBuffer
        return kRoundLarge * ((size + kRoundLarge - 1) // kRoundLarge)

    def get_pool(self, size: int, stream: int = 0) -> BlockPool:
        """``get_pool``: a private pool's BlockPool while allocations are diverted to one, else the default
        small or large pool. Of several open ``use_mem_pool`` regions the C++ loop takes the first matching
        filter: the outermost before 2.10, the innermost from 2.10 (it searches ``captures_underway`` last-in
        first, nested pools, PR 168382)."""
        if self.captures_underway:
            pp = self.graph_pools[self.captures_underway[-1 if self._innermost_pool else 0]]
            return pp.small_blocks if size <= kSmallSize else pp.large_blocks
        return self.small_blocks if size <= kSmallSize else self.large_blocks

    # -- private pools (MemPool, use_mem_pool, CUDA graphs) ----------------------------------------

    def create_or_incref_pool(self, pool_id: tuple[int, int]) -> PrivatePool:
        """``create_or_incref_pool``: a new pool starts at use_count 1 (``MemPool`` construction)."""
        pp = self.graph_pools.get(pool_id)
        if pp is None:
            pp = self.graph_pools[pool_id] = PrivatePool(pool_id)
        else:
            pp.use_count += 1
        return pp

    def begin_allocate_to_pool(self, pool_id: tuple[int, int]) -> None:
        """``beginAllocateToPool`` (``use_mem_pool`` entry, ``CUDAGraph::capture_begin``).

        Raises ``ValueError`` if allocations already go to that pool."""
        if pool_id in self.captures_underway:
            raise ValueError(f"beginAllocateToPool: already recording to mempool_id {pool_id}")
        self.create_or_incref_pool(pool_id)
        self.captures_underway.append(pool_id)

    def end_allocate_to_pool(self, pool_id: tuple[int, int]) -> None:
        """``endAllocateToPool``. Raises ``ValueError`` if allocations do not go to that pool."""
        if pool_id not in self.captures_underway:
            raise ValueError(f"endAllocateToPool: not currently recording to mempool_id {pool_id}")
        self.captures_underway.remove(pool_id)

    def release_pool(self, pool_id: tuple[int, int]) -> None:
        """``releasePool``: drop one holder; at use_count 0 empty_cache may return the pool's memory."""
        pp = self.graph_pools.get(pool_id)
        if pp is None:
            raise ValueError(f"releasePool: no pool with mempool_id {pool_id}")
        pp.use_count -= 1
        if pp.use_count == 0:
            self.graph_pools_freeable[pool_id] = pp

    # -- the allocation path ----------------------------------------------------------------------

    def malloc(self, orig_size: int, stream: int = 0) -> Block:
        """``DeviceCachingAllocator::malloc``: returns the allocated block.

        The miss path: garbage collection, cudaMalloc, ``release_available_cached_blocks`` and retry,
        ``release_cached_blocks`` and retry (not while allocating into a private pool). ``use_on_oom`` pools
        (``try_mempool_fallback``) come last in 2.8-2.9 (PR 151487) and right after the first cudaMalloc fails
        from 2.10 (PR 169699: "reuse optional mempools before expensive releasing cached blocks"). Raises
        :class:`OutOfMemoryError` when nothing gives memory; ``num_ooms`` counts it.
        """
        size = self.round_size(orig_size)
        pool = self.get_pool(size, stream)
        alloc_size = self.get_allocation_size(size)
        block = self.get_free_block(pool, size, stream)
        expandable_rule = None  # should_split's rule: the config's, except for a use_on_oom block from 2.10
        if block is None:
            if self.config.garbage_collection_threshold > 0.0 and self.capacity is not None:
                self.garbage_collect_cached_blocks()
            fallback = self.use_on_oom_pools and not pool.owner_private_pool
            early = fallback and self.config.since(USE_ON_OOM_BEFORE_RELEASE)
            block = self.alloc_block(pool, size, alloc_size, stream, is_retry=False)
            if block is None and early:
                block = self.try_mempool_fallback(size, stream)
                expandable_rule = False if block is not None else None  # mempool_params: expandable off
            block = (
                block
                or (self.release_available_cached_blocks(pool, size, stream)
                    and self.alloc_block(pool, size, alloc_size, stream, is_retry=False))
                or (not self.captures_underway
                    and self.release_cached_blocks()
                    and self.alloc_block(pool, size, alloc_size, stream, is_retry=True))
            )
            if not block and fallback and not early:
                block = self.try_mempool_fallback(size, stream)
            if not block:
                self.stats.num_ooms += 1
                raise OutOfMemoryError(
                    f"model OOM: tried to allocate {orig_size} bytes; reserved {self.stats.reserved_bytes}, "
                    f"allocated {self.stats.allocated_bytes}, capacity {self.capacity}"
                )
        return self.alloc_found_block(block, size, orig_size, self.should_split(block, size, expandable_rule))

    def try_mempool_fallback(self, size: int, stream: int) -> Block | None:
        """``try_mempool_fallback`` (2.10; inline in ``malloc`` in 2.8-2.9): a cached block of ``size`` bytes
        from the first ``use_on_oom`` pool that has one (``get_free_block`` only: never a cudaMalloc into the
        pool), taken out of that pool; ``None`` if none has. A pool not yet created or already destroyed (its
        MemPool released) is skipped: the C++ removes it from ``use_on_oom_pools`` on destruction from 2.10
        (PR 169699) and asserts on it before. The C++ iterates a hash set; the model tries the pools in the
        order ``AllocatorConfig.use_on_oom_pools`` gives."""
        for pool_id in self.use_on_oom_pools:
            pp = self.graph_pools.get(pool_id)
            if pp is None or pool_id in self.graph_pools_freeable:
                continue
            mempool = pp.small_blocks if size <= kSmallSize else pp.large_blocks
            # 2.10: mempool_params with is_expandable_segments_active false (expandable blocks are passed over)
            block = self.get_free_block(mempool, size, stream, False if self.config.since(USE_ON_OOM_BEFORE_RELEASE)
                                        else None)
            if block is not None:
                return block
        return None

    def get_free_block(self, pool: BlockPool, size: int, stream: int,
                       expandable_segments: bool | None = None) -> Block | None:
        """``get_free_block``: the single best-fit candidate, subject to the max_split_size rules.
        ``expandable_segments``: ``AllocParams.is_expandable_segments_active`` (``None``: the config's)."""
        if self.config.garbage_collection_threshold > 0.0 and self.capacity is not None:
            pool.get_free_blocks_call_count += 1
        i = self._find_free_block(pool, size, stream, expandable_segments)
        if i < 0:
            return None
        blocks = pool.blocks
        block = pool.by_key.pop(blocks[i])
        del blocks[i]
        return block

    def _find_free_block(self, pool: BlockPool, size: int, stream: int,
                         expandable_segments: bool | None = None) -> int:
        """Position in ``pool.blocks`` of the block ``get_free_block`` would take, or -1."""
        blocks = pool.blocks
        n = len(blocks)
        i = bisect_left(blocks, (stream, size, 0))
        if i == n:
            return -1
        k = blocks[i]
        if k[0] != stream:
            return -1
        by_key = pool.by_key
        if expandable_segments is None:
            expandable_segments = self.config.expandable_segments
        if self.expandable_segments and by_key[k].expandable_segment is not None:
            if expandable_segments:
                # A free block followed by unmapped space counts as the size it can expand to.
                def expandable_size(b: Block) -> int:
                    nxt = b.next
                    return b.size + (nxt.size if nxt is not None and not nxt.mapped else 0)

                j = i + 1
                while (by_key[blocks[i]].expandable_segment is not None and j < n and blocks[j][0] == stream
                       and expandable_size(by_key[blocks[j]]) < expandable_size(by_key[blocks[i]])):
                    i, j = j, j + 1
            else:  # expandable_segments turned off later (or a 2.10 use_on_oom search): only ordinary blocks
                i += 1
                while i < n and by_key[blocks[i]].expandable_segment is not None and blocks[i][0] == stream:
                    i += 1
                if i == n or blocks[i][0] != stream:
                    return -1
            k = blocks[i]
        ms = self.config.max_split_size
        if size < ms and k[1] >= ms:
            return -1
        if size >= ms and k[1] >= size + self.config.max_non_split_rounding_size:
            return -1
        return i

    def can_serve_from_cache(self, orig_size: int, stream: int = 0) -> bool:
        """Would ``malloc(orig_size)`` find a cached block now (no cudaMalloc)? Changes nothing."""
        size = self.round_size(orig_size)
        return self._find_free_block(self.get_pool(size, stream), size, stream) >= 0

    def should_split(self, block: Block, size: int, expandable_segments: bool | None = None) -> bool:
        """``should_split``: never in a ``no_split`` pool (2.10, PR 169739); else the 512-byte rule in a small
        pool or with expandable segments (``expandable_segments``: ``None`` = the config's), else the
        max_split_size rule with a remainder above 1 MiB."""
        owner = block.pool.owner_private_pool
        if owner is not None and owner.id in self.no_split_pools:
            return False
        remaining = block.size - size
        if expandable_segments is None:
            expandable_segments = self.config.expandable_segments
        if block.pool.is_small or expandable_segments:
            return remaining >= kMinBlockSize
        return size < self.config.max_split_size and remaining > kSmallSize

    def _set_head(self, block: Block) -> None:
        """Record ``block`` as its segment's first block (the C++ walks ``prev``; the model keeps a map)."""
        es = block.expandable_segment
        self.segments[es.ptr if es is not None else block.address] = block

    def alloc_found_block(self, block: Block, size: int, orig_size: int, split_remainder: bool) -> Block:
        """``alloc_found_block``: split off the low ``size`` bytes if asked, mark allocated.

        ``inactive_split_bytes`` leaves expandable segments out, as the C++ does."""
        st = self.stats
        already_split = block.is_split()
        expandable = block.expandable_segment is not None
        if split_remainder:
            remaining = block
            block = Block(remaining.stream, size, remaining.pool, remaining.address)
            block.expandable_segment = remaining.expandable_segment
            block.prev = remaining.prev
            if block.prev is not None:
                block.prev.next = block
            else:
                self._set_head(block)
            block.next = remaining
            remaining.prev = block
            remaining.address += size
            remaining.size -= size
            remaining.pool.insert_into_blocks(remaining)
            if already_split and not expandable:
                st.inactive_split_bytes -= block.size  # the remainder stays an inactive split
            elif not expandable:
                st.inactive_split_bytes += remaining.size
        elif already_split and not expandable:
            st.inactive_split_bytes -= block.size
        block.allocated = True
        block.requested_size = orig_size
        self.active_blocks[block.address] = block
        st.allocated_bytes += block.size
        st.requested_bytes += orig_size
        st.num_allocs += 1
        if st.allocated_bytes > st.peak_allocated_bytes:
            st.peak_allocated_bytes = st.allocated_bytes
        return block

    def _new_address(self, size: int | None, span: int) -> int:
        address = self.address_for_new_segment(size) if self.address_for_new_segment else None
        if address is None and size is not None and self.driver is not None:
            return self.driver.map(size)
        if address is None:
            address = self._next_synthetic_address
            self._next_synthetic_address += span + kRoundLarge
        return address

    def alloc_block(self, pool: BlockPool, size: int, alloc_size: int, stream: int, is_retry: bool) -> Block | None:
        """``alloc_block``: one cudaMalloc of ``alloc_size`` bytes (or, with expandable segments, map
        pages for ``size`` bytes); ``None`` if the device refuses. Under a ``per_process_memory_fraction`` the
        C++ first refuses when reserved + ``alloc_size`` passes ``allowed_memory_maximum``, expandable
        segments included (whose pages alone might have fit)."""
        st = self.stats
        if is_retry:
            st.num_alloc_retries += 1
        if self.fail_next_cuda_malloc:
            self.fail_next_cuda_malloc = False  # anchored replay: the recorded run failed here
            return None
        if self.allowed_memory_maximum is not None and st.reserved_bytes + alloc_size > self.allowed_memory_maximum:
            return None
        if self.config.expandable_segments:
            block = self.try_allocate_expandable_block(stream, pool, size)
            if block is not None and pool.owner_private_pool is not None:
                pool.owner_private_pool.cudaMalloc_count += 1
            return block
        if self.capacity is not None and st.reserved_bytes + alloc_size > self.capacity:
            return None
        if self.external_bytes and not self.device_has_room(alloc_size):
            return None  # cudaMalloc: the other allocator's mappings hold the rest of the device
        if pool.owner_private_pool is not None:
            pool.owner_private_pool.cudaMalloc_count += 1
        address = self._new_address(alloc_size, alloc_size)
        block = Block(stream, alloc_size, pool, address)
        self.segments[address] = block
        self.segment_sizes[address] = alloc_size
        st.reserved_bytes += alloc_size
        st.num_device_alloc += 1
        if st.reserved_bytes > st.peak_reserved_bytes:
            st.peak_reserved_bytes = st.reserved_bytes
        if st.reserved_bytes + self.external_bytes > self.peak_device_used:
            self.peak_device_used = st.reserved_bytes + self.external_bytes
        if self.on_segment_alloc is not None:
            self.on_segment_alloc(address, alloc_size, stream)
        return block

    # -- device memory outside this allocator (events.py: EXTERNAL_MAP) ------------------------------

    def device_has_room(self, size: int) -> bool:
        """Whether the device (``device_total`` bytes; ``None``: unlimited) can back ``size`` more bytes beside
        this allocator's reserved bytes and the ``external_bytes`` another allocator maps."""
        return self.device_total is None or self.stats.reserved_bytes + self.external_bytes + size <= self.device_total

    def map_external(self, size: int) -> bool:
        """Another allocator of the process maps ``size`` bytes (vLLM's ``CuMemAllocator``: ``create_and_map``
        at load and at ``wake_up``, ``vllm/device_allocator/cumem.py``). Nothing of this allocator is released
        for it: the other allocator calls the driver, not ``malloc``. Returns False (nothing mapped; the caller
        counts the OOM) when the device cannot back it."""
        if not self.device_has_room(size):
            return False
        self.external_bytes += size
        used = self.stats.reserved_bytes + self.external_bytes
        if used > self.peak_device_used:
            self.peak_device_used = used
        return True

    def unmap_external(self, size: int) -> None:
        """The other allocator releases ``size`` bytes it mapped (``unmap_and_release`` at ``sleep``). Raises
        ``ValueError`` when more is released than is mapped."""
        if size > self.external_bytes:
            raise ValueError(f"unmap of {size} bytes outside the caching allocator: only {self.external_bytes} mapped")
        self.external_bytes -= size

    # -- expandable segments ---------------------------------------------------------------------

    def find_expandable_block(self, stream: int, pool: BlockPool, size: int) -> Block:
        """``find_expandable_block``: the lowest-address run of free and unmapped blocks with room for
        ``size`` bytes in one of this (stream, pool)'s expandable segments, or a new segment's whole
        unmapped range."""

        def allocatable(b: Block | None) -> bool:
            return b is not None and not b.allocated

        def has_available_address_space(b: Block | None) -> bool:
            total = 0
            while total < size and allocatable(b):
                total += b.size  # type: ignore[union-attr]
                b = b.next  # type: ignore[union-attr]
            return total >= size

        keys = pool.unmapped
        i = bisect_left(keys, (stream, 0))
        while i < len(keys) and keys[i][0] == stream:
            c = pool.unmapped_by_key[keys[i]]
            if allocatable(c.prev):
                c = c.prev  # type: ignore[assignment]
            if has_available_address_space(c):
                return c
            i += 1
        segment_size = kSmallBuffer if pool.is_small else kLargeBuffer
        total = self.device_total if self.device_total is not None else DEFAULT_DEVICE_MEMORY
        address_space_size = total + total // 8
        probe = ExpandableSegment(0, segment_size, address_space_size, stream)
        ptr = self._new_address(None, probe.size())
        es = ExpandableSegment(ptr, segment_size, address_space_size, stream)
        self.expandable_segments[ptr] = es
        candidate = Block(stream, es.size(), pool, ptr)
        candidate.mapped = False
        candidate.expandable_segment = es
        pool.insert_unmapped(candidate)
        self.segments[ptr] = candidate
        self.segment_sizes[ptr] = es.size()
        return candidate

    def map_block(self, to_map: Block, size: int) -> bool:
        """``map_block``: map the pages covering ``[to_map.address, + size)``; False if the device
        (``capacity``) cannot back them."""
        es = to_map.expandable_segment
        assert es is not None and not to_map.mapped and size <= to_map.size
        st = self.stats
        pages = es.pages_to_map(to_map.address, size)
        if self.capacity is not None and st.reserved_bytes + len(pages) * es.segment_size > self.capacity:
            return False  # cuMemCreate: CUDA_ERROR_OUT_OF_MEMORY
        if self.external_bytes and not self.device_has_room(len(pages) * es.segment_size):
            return False  # cuMemCreate: the other allocator's mappings hold the rest of the device
        mapped_ptr, mapped_size = es.map(to_map.address, size)
        pool = to_map.pool
        pool.erase_unmapped(to_map)
        to_map.mapped = True
        if mapped_size < to_map.size:
            remaining = Block(to_map.stream, to_map.size - mapped_size, pool, to_map.address + mapped_size)
            remaining.mapped = False
            remaining.expandable_segment = es
            remaining.splice(to_map, to_map.next)
            pool.insert_unmapped(remaining)
            to_map.size = mapped_size
        self.try_merge_blocks(to_map, to_map.prev, pool)
        self.try_merge_blocks(to_map, to_map.next, pool)
        pool.insert_into_blocks(to_map)
        st.reserved_bytes += mapped_size
        if st.reserved_bytes > st.peak_reserved_bytes:
            st.peak_reserved_bytes = st.reserved_bytes
        if st.reserved_bytes + self.external_bytes > self.peak_device_used:
            self.peak_device_used = st.reserved_bytes + self.external_bytes
        st.num_device_alloc += 1
        if self.on_segment_map is not None:
            self.on_segment_map(mapped_ptr, mapped_size, to_map.stream)
        return True

    def try_allocate_expandable_block(self, stream: int, pool: BlockPool, size: int) -> Block | None:
        """``try_allocate_expandable_block``: a free block of at least ``size`` bytes made by mapping
        pages after (or filling gaps before) free space, taken out of the pool; ``None`` if a map failed."""
        candidate = self.find_expandable_block(stream, pool, size)
        # A request larger than a new segment's whole address space (1 1/8 of the device's memory): PyTorch maps
        # the whole range, which the device cannot back, so the request fails (map_block's capacity check says so
        # where the capacity is known; without one the loop below would run past the segment's last block).
        if candidate.next is None and candidate.size < size:
            return None
        if not candidate.mapped and not self.map_block(candidate, min(candidate.size, size)):
            return None
        while candidate.size < size:
            remaining = size - candidate.size
            new_candidate = candidate.next
            assert new_candidate is not None
            if not self.map_block(new_candidate, min(remaining, new_candidate.size)):
                return None
            candidate = new_candidate
        pool.erase(candidate)
        return candidate

    def unmap_block(self, block: Block) -> None:
        """``unmap_block``: unmap the whole pages inside a free block; the partial pages at either end
        stay mapped as free blocks of their own."""
        es = block.expandable_segment
        assert es is not None
        u_ptr, u_size = es.unmap(block.address, block.size)
        if u_size == 0:
            return
        pool = block.pool
        pool.erase(block)
        before_size = u_ptr - block.address
        if before_size > 0:
            before_free = Block(block.stream, before_size, pool, block.address)
            before_free.expandable_segment = es
            before_free.splice(block.prev, block)
            pool.insert_into_blocks(before_free)
            if before_free.prev is None:
                self._set_head(before_free)
        after_size = block.size - (before_size + u_size)
        if after_size > 0:
            after_free = Block(block.stream, after_size, pool, u_ptr + u_size)
            after_free.expandable_segment = es
            after_free.splice(block, block.next)
            pool.insert_into_blocks(after_free)
        block.address = u_ptr
        block.size = u_size
        block.mapped = False
        self.try_merge_blocks(block, block.prev, pool)
        self.try_merge_blocks(block, block.next, pool)
        pool.insert_unmapped(block)
        st = self.stats
        st.reserved_bytes -= u_size
        if pool.owner_private_pool is not None:
            pool.owner_private_pool.cudaMalloc_count -= 1
        st.num_device_free += 1
        if self.on_segment_unmap is not None:
            self.on_segment_unmap(u_ptr, u_size, block.stream)

    def release_expandable_segment(self, block: Block) -> None:
        """``release_expandable_segment``: give back the virtual range of a fully unmapped segment."""
        es = block.expandable_segment
        assert es is not None and block.size == es.size() and not block.mapped
        block.pool.erase_unmapped(block)
        del self.expandable_segments[es.ptr]
        del self.segments[es.ptr]
        del self.segment_sizes[es.ptr]

    # -- the free path ----------------------------------------------------------------------------

    def free(self, block: Block) -> None:
        """``DeviceCachingAllocator::free`` with no outstanding stream events: ``free_block``. For a block
        :meth:`request_free` held, the completion (``process_events`` -> ``free_block``): the stats dropped
        at the request. Raises ``ValueError`` for a block that is not allocated."""
        if not block.allocated:
            raise ValueError(f"double free of {block!r}")
        del self.active_blocks[block.address]
        if block.held:
            block.held = False
        else:
            self._drop_stats(block)
        block.allocated = False
        self.free_block(block)

    def request_free(self, block: Block) -> None:
        """``DeviceCachingAllocator::free`` of a block other streams still use (``stream_uses`` not empty,
        ``Tensor.record_stream``): ``allocated_bytes`` and ``requested_bytes`` drop now, as PyTorch's do before
        ``insert_events``; the block stays out of its pool (no reuse, no merge, its segment not releasable)
        until :meth:`free` completes it, where ``process_events`` would call ``free_block``. Raises
        ``ValueError`` for a block not allocated or already held."""
        if not block.allocated or block.held:
            raise ValueError(f"double free of {block!r}")
        self._drop_stats(block)
        block.held = True

    def _drop_stats(self, block: Block) -> None:
        st = self.stats
        st.allocated_bytes -= block.size
        st.requested_bytes -= block.requested_size
        st.num_frees += 1

    def free_block(self, block: Block) -> None:
        """``free_block``: merge with free neighbours, reinsert into the pool."""
        st = self.stats
        pool = block.pool
        expandable = block.expandable_segment is not None
        for candidate in (block.prev, block.next):
            subsumed = self.try_merge_blocks(block, candidate, pool)
            if subsumed and not expandable:
                st.inactive_split_bytes -= subsumed
        pool.insert_into_blocks(block)
        if block.is_split() and not expandable:
            st.inactive_split_bytes += block.size

    def try_merge_blocks(self, dst: Block, src: Block | None, pool: BlockPool) -> int:
        """``try_merge_blocks``: fold free ``src`` into ``dst`` (both mapped or both unmapped); returns the
        bytes subsumed (0 if none)."""
        if src is None or src.allocated or dst.mapped != src.mapped:
            return 0
        if dst.prev is src:  # [src dst]
            dst.address = src.address
            dst.prev = src.prev
            if dst.prev is not None:
                dst.prev.next = dst
            else:
                self._set_head(dst)
        else:  # [dst src]
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        subsumed = src.size
        dst.size += subsumed
        if src.mapped:
            pool.erase(src)
        else:
            pool.erase_unmapped(src)
        return subsumed

    # -- releasing cached memory -----------------------------------------------------------------

    def release_block(self, block: Block) -> None:
        """``release_block``: cudaFree a whole free segment."""
        pool = block.pool
        pool.erase(block)
        del self.segments[block.address]
        del self.segment_sizes[block.address]
        if pool.owner_private_pool is not None:
            pool.owner_private_pool.cudaMalloc_count -= 1
        st = self.stats
        st.reserved_bytes -= block.size
        st.num_device_free += 1
        if self.driver is not None:
            self.driver.unmap(block.address)
        if self.on_segment_free is not None:
            self.on_segment_free(block.address, block.size, block.stream)

    def cublas_handle_created(self) -> None:
        """The program created its first cuBLAS handle (the driver's context may give address space back:
        ``driver_va.py``); nothing changes under the default placement."""
        if self.driver is not None:
            self.driver.cublas_handle_created()

    def release_blocks(self, pool: BlockPool) -> None:
        """``release_blocks``: every unsplit free block of ``pool`` in pool order, then the whole free
        pages of its expandable segments (and a segment left with no mapped page)."""
        to_unmap = []
        for block in pool.ordered():
            if block.expandable_segment is not None:
                to_unmap.append(block)
            elif block.prev is None and block.next is None:
                self.release_block(block)
        for block in to_unmap:
            self.unmap_block(block)
            if block.prev is None and block.next is None:
                self.release_expandable_segment(block)

    def release_cached_blocks(self, mempool_id: tuple[int, int] = DEFAULT_POOL) -> bool:
        """``release_cached_blocks(context, mempool_id)`` (2.6+) = ``torch.cuda.empty_cache()``.

        For the default id and no diversion to a pool underway: the default large pool, then the small
        one. Then every private pool nobody holds any more (``use_count`` 0): its small pool, then its
        large pool; a pool with nothing left is forgotten. A non-default id limits the second part to
        that pool. In 2.6-2.7 a call made inside a ``use_mem_pool`` region took the region's pool as its id
        (``MemPoolContext``, PR 133602); from 2.8 the default id means every pool nobody holds (PR 154042,
        which removed ``MemPoolContext``). The retry path's call cannot tell the two apart in one thread: it
        runs only with no pool region open.
        """
        if (mempool_id == DEFAULT_POOL and self.captures_underway
                and not self.config.since(EMPTY_CACHE_ALL_FREEABLE_POOLS)):
            mempool_id = self.captures_underway[-1]  # MemPoolContext::getActiveMemPool(): the innermost region
        if mempool_id == DEFAULT_POOL and not self.captures_underway:
            self.release_blocks(self.large_blocks)
            self.release_blocks(self.small_blocks)
        for pid, pp in list(self.graph_pools_freeable.items()):
            if mempool_id != DEFAULT_POOL and pid != mempool_id:
                continue
            self.release_blocks(pp.small_blocks)
            self.release_blocks(pp.large_blocks)
            if pp.cudaMalloc_count == 0:
                del self.graph_pools[pid]
                del self.graph_pools_freeable[pid]
        return True

    def empty_cache(self, mempool_id: tuple[int, int] = DEFAULT_POOL) -> None:
        """``torch.cuda.empty_cache()`` (``emptyCache(mempool_id)``)."""
        self.release_cached_blocks(mempool_id)

    def release_available_cached_blocks(self, pool: BlockPool, size: int, stream: int) -> bool:
        """``release_available_cached_blocks``: free oversize (>= max_split_size) blocks; only with MS set.
        Blocks of expandable segments are skipped (2.8+)."""
        ms = self.config.max_split_size
        if ms == UNLIMITED:
            return False
        key_size = ms if size < ms else size
        blocks = pool.blocks
        i = bisect_left(blocks, (stream, key_size, 0))
        if i == len(blocks) or blocks[i][0] != stream:
            if i == 0:
                return False
            total_released = 0
            i -= 1
            while total_released < key_size and blocks[i][1] >= ms and blocks[i][0] == stream:
                cur = pool.by_key[blocks[i]]
                is_first = i == 0
                if not is_first:
                    i -= 1
                if cur.expandable_segment is None:
                    total_released += cur.size
                    self.release_block(cur)
                if is_first:
                    break
            if total_released < key_size:
                return False
        else:
            cur = pool.by_key[blocks[i]]
            if cur.expandable_segment is not None:
                return False
            self.release_block(cur)
        return True

    def garbage_collect_cached_blocks(self) -> None:
        """``garbage_collect_cached_blocks``: free unsplit large blocks older than the average age."""
        assert self.capacity is not None
        gc_threshold = int(self.config.garbage_collection_threshold * self.capacity)
        if self.stats.reserved_bytes <= gc_threshold:
            return
        target_size = self.stats.reserved_bytes - gc_threshold
        pool = self.large_blocks

        def gc_count(b: Block) -> int:
            return pool.get_free_blocks_call_count - b.gc_count_base

        freeable = [b for b in pool.ordered() if not b.is_split()]
        if not freeable:
            return
        total_age = sum(gc_count(b) for b in freeable)
        count = len(freeable)
        reclaimed, block_freed = 0, True
        while reclaimed < target_size and block_freed and count > 0:
            age_threshold = total_age / count
            block_freed = False
            for b in pool.ordered():
                if not b.is_split() and gc_count(b) >= age_threshold:
                    block_freed = True
                    reclaimed += b.size
                    total_age -= gc_count(b)
                    count -= 1
                    self.release_block(b)

    # -- state import / export -------------------------------------------------------------------

    def import_segment(
        self, address: int, total_size: int, stream: int, is_small: bool,
        live_blocks: list[tuple[int, int, int]] = (),  # type: ignore[assignment]
        pool_id: tuple[int, int] = DEFAULT_POOL,
    ) -> None:
        """Recreate a (cudaMalloc'd) segment that existed before a trace began.

        ``live_blocks`` are ``(address, size, requested_size)`` of blocks allocated at that moment, inside
        ``[address, address + total_size)``; the gaps between them become free (merged) blocks.
        ``pool_id`` is the segment's ``segment_pool_id`` (a private pool is created, held once).
        Raises ``ValueError`` if a live block lies outside the segment or overlaps another.
        """
        if pool_id == DEFAULT_POOL:
            pool = self.small_blocks if is_small else self.large_blocks
        else:
            pp = self.graph_pools.get(pool_id) or self.create_or_incref_pool(pool_id)
            pool = pp.small_blocks if is_small else pp.large_blocks
            pp.cudaMalloc_count += 1
        st = self.stats
        cursor, prev = address, None
        end = address + total_size
        pieces: list[tuple[int, int, int | None]] = []
        for b_addr, b_size, b_req in sorted(live_blocks):
            if b_addr < cursor or b_addr + b_size > end:
                raise ValueError(f"live block 0x{b_addr:x}+{b_size} does not fit segment 0x{address:x}+{total_size}")
            if b_addr > cursor:
                pieces.append((cursor, b_addr - cursor, None))
            pieces.append((b_addr, b_size, b_req))
            cursor = b_addr + b_size
        if cursor < end:
            pieces.append((cursor, end - cursor, None))
        # new segments must not land on it (a simulated snapshot's segments lie where the model puts new ones)
        self._next_synthetic_address = max(self._next_synthetic_address, end + kRoundLarge)
        if self.driver is not None:
            self.driver.occupy(address, total_size)
        self.segment_sizes[address] = total_size
        st.reserved_bytes += total_size
        st.peak_reserved_bytes = max(st.peak_reserved_bytes, st.reserved_bytes)
        for p_addr, p_size, p_req in pieces:
            b = Block(stream, p_size, pool, p_addr)
            b.prev = prev
            if prev is not None:
                prev.next = b
            else:
                self.segments[address] = b
            prev = b
            if p_req is not None:
                b.allocated = True
                b.requested_size = p_req
                self.active_blocks[p_addr] = b
                st.allocated_bytes += p_size
                st.requested_bytes += p_req
        st.peak_allocated_bytes = max(st.peak_allocated_bytes, st.allocated_bytes)
        for blk in self._segment_blocks(address):
            if not blk.allocated:
                pool.insert_into_blocks(blk)
                if blk.is_split():
                    st.inactive_split_bytes += blk.size

    def _segment_blocks(self, address: int) -> list[Block]:
        out, b = [], self.segments[address]
        while b is not None:
            out.append(b)
            b = b.next
        return out

    def snapshot_segments(self, device: int = 0) -> list[dict]:
        """The device's segments in ``torch.cuda.memory._snapshot()['segments']`` form, by address.

        An expandable segment gives one entry per contiguous mapped range, as ``snapshot()`` does."""
        out = []
        for address in sorted(self.segments):
            blocks = self._segment_blocks(address)
            runs: list[list[Block]] = []
            for b in blocks:
                if not b.mapped:
                    continue
                if runs and b.prev is runs[-1][-1]:
                    runs[-1].append(b)
                else:
                    runs.append([b])
            for run in runs:
                first = run[0]
                out.append({
                    "device": device,
                    "address": first.address,
                    "total_size": sum(b.size for b in run),
                    "allocated_size": sum(b.size for b in run if b.allocated and not b.held),
                    "active_size": sum(b.size for b in run if b.allocated),
                    "requested_size": sum(b.requested_size for b in run if b.allocated),
                    "stream": first.stream,
                    "segment_type": "small" if first.pool.is_small else "large",
                    "segment_pool_id": first.pool.pool_id(),
                    "is_expandable": first.expandable_segment is not None,
                    "frames": [],
                    "blocks": [
                        {"address": b.address, "size": b.size,
                         "requested_size": b.requested_size if b.allocated else 0,
                         "state": _block_state(b), "frames": []}
                        for b in run
                    ],
                })
        return out

    def all_block_pools(self) -> list[BlockPool]:
        pools = [self.large_blocks, self.small_blocks]
        for pp in self.graph_pools.values():
            pools += [pp.large_blocks, pp.small_blocks]
        return pools

    def check_invariants(self) -> None:
        """Assert the structural invariants (used by property tests); raises ``AssertionError``."""
        allocated = 0
        reserved = 0
        inactive_split = 0
        free_mapped = free_unmapped = 0
        for address, first in self.segments.items():
            assert first.prev is None and first.address == address
            es = self.expandable_segments.get(address)
            total, b, prev_free, prev_mapped = 0, first, False, True
            while b is not None:
                assert b.address == address + total, "blocks are contiguous"
                assert b.expandable_segment is es and b.pool is first.pool
                total += b.size
                if b.mapped:
                    reserved += b.size
                if es is not None:  # mapped blocks lie on mapped pages; unmapped ones are whole unmapped pages
                    pages = es.pages_to_map(b.address, b.size)
                    if b.mapped:
                        assert all(i < len(es.handles) and es.handles[i] for i in pages), "mapped block on a page"
                    else:
                        assert (b.address - es.ptr) % es.segment_size == 0 and b.size % es.segment_size == 0
                        assert not any(es.handles[i] for i in pages if i < len(es.handles)), "unmapped pages"
                if b.allocated:
                    allocated += 0 if b.held else b.size
                    prev_free = False
                else:
                    assert not (prev_free and prev_mapped == b.mapped), "two adjacent free blocks"
                    prev_free, prev_mapped = True, b.mapped
                    if b.mapped:
                        free_mapped += 1
                        assert b.pool.by_key.get(b.key()) is b, "free block is in its pool"
                        if b.is_split() and es is None:
                            inactive_split += b.size
                    else:
                        free_unmapped += 1
                        assert b.pool.unmapped_by_key.get((b.stream, b.address)) is b, "unmapped block is listed"
                b = b.next
            assert total == self.segment_sizes[address]
            if es is not None:
                assert es.mapped_bytes() == sum(x.size for x in _iter_chain(first) if x.mapped)
        assert allocated == self.stats.allocated_bytes
        assert reserved == self.stats.reserved_bytes
        assert inactive_split == self.stats.inactive_split_bytes
        pools = self.all_block_pools()
        assert sum(len(p.blocks) for p in pools) == free_mapped
        assert sum(len(p.unmapped) for p in pools) == free_unmapped


def _block_state(b: Block) -> str:
    """A block's ``state`` in ``_snapshot()`` (``torch/cuda/memory.py``; ``active_pending_free``: freed, its
    other streams' events outstanding)."""
    if not b.allocated:
        return "inactive"
    return "active_pending_free" if b.held else "active_allocated"


def _iter_chain(b: Block | None):
    while b is not None:
        yield b
        b = b.next


def roundup_power2_next_division(size: int, divisions: int) -> int:
    """``roundup_power2_next_division``: round up to the next 1/divisions step of size's power-of-2 range."""
    if _is_power_of_2(size):
        return size
    power2_floor = 1 << (size.bit_length() - 1)
    power2_division = power2_floor >> (divisions.bit_length() - 1)
    if power2_division == 0:
        return power2_floor << 1
    round_size_floor = size & ~(power2_division - 1)
    return size if round_size_floor == size else round_size_floor + power2_division
