"""``rlhfmem advise``: from ONE recorded trace, the flush points and allocator settings that cut the peak.

Premise (issue 13): ``torch.cuda.empty_cache()`` changes the caching allocator's state, not the program's
allocations. So one trace of the program (its ``alloc``/``free`` events and phase marks) can be replayed
through the allocator model (``memory/allocator.py``, after ``c10/cuda/CUDACachingAllocator.cpp``) with
FLUSH events inserted at other places, or under another ``PYTORCH_CUDA_ALLOC_CONF``, instead of rerunning
the iteration once per policy and setting. The premise holds for this project's recipes (the tests replay
a flush-none run's trace under each of the study's four policies and get the policy runs' measured peak
reserved and fragmentation to the byte); it does NOT hold for a program that reads
``memory_allocated()``/``memory_reserved()`` or catches an OOM to change what it allocates: for such a
program every figure is what the *same allocations* would do.

The parts, each readable alone, in the order data flows (each imports only those before it):

- ``inputs.py``: INPUT (a result JSON naming its ranks' traces, or a snapshot pickle) read into
  scenarios and ranks, and where a flush can go in each rank's program (its boundaries);
- ``candidates.py``: the flush placements and allocator settings worth a replay;
- ``evaluation.py``: every candidate replayed on every rank (both cores, traces shared by fork);
- ``ranking.py``: the sweep (with the greedy search for a set of flushes), the ranking by cost, the
  recommendation, the cheapest change that fits a budget; :func:`advise`, the whole advisor;
- ``rendering.py``: the text table, the markdown report, the plugin's one line;
- ``cli.py``: ``rlhfmem advise``.

A flush's own cost (:func:`flush_cost`, computed by every run's capture) and the program's events without
flushes (:func:`program_events`) live below the advisor, in ``memory/flushes.py``: a run never reaches up
into the advisor. Every name is importable from ``pytest_rlhfmem.advise``, as before the split. All sizes
are bytes; the JSON schema (:data:`SCHEMA`) is documented in ``docs/advise.md``.
"""

from ..memory.flushes import RECORDED_FLUSH, flush_cost, program_events
from .candidates import (
    DEFAULT_MAX_FLUSHES, GC_THRESHOLDS, INFERENCE_PHASES, ROUNDUP_DIVISIONS, STUDY_POLICIES, TRAINING_PHASES, Spec,
    check_settings, policy_boundaries,
)
from .cli import add_advise_parser
from .evaluation import Evaluator
from .inputs import (
    MARKS_HINT, WINDOWS, AdviseInputError, Boundaries, RankInput, ScenarioInput, find_boundaries, is_unmarked,
    load_inputs,
)
from .ranking import SCHEMA, advise, advise_scenario
from .rendering import markdown, one_line, text_lines

__all__ = [
    "DEFAULT_MAX_FLUSHES", "GC_THRESHOLDS", "INFERENCE_PHASES", "MARKS_HINT", "RECORDED_FLUSH", "ROUNDUP_DIVISIONS",
    "SCHEMA", "STUDY_POLICIES", "TRAINING_PHASES", "WINDOWS", "AdviseInputError", "Boundaries", "Evaluator",
    "RankInput", "ScenarioInput", "Spec", "add_advise_parser", "advise", "advise_scenario", "check_settings",
    "find_boundaries", "flush_cost", "is_unmarked", "load_inputs", "markdown", "one_line", "policy_boundaries",
    "program_events", "text_lines",
]
