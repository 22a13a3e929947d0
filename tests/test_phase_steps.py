"""The recipes' phase step (rlhf/common.py ``PhaseSteps``): the phase opens, the body runs, the fault hook fires
inside the phase, the phase closes, then the flush policy; nothing after a body that raises. A fake recorder
logs what the step asks of it; one test reads the marks a real (unstarted) CPU recorder puts in its trace."""

import contextlib

import pytest

from pytest_rlhfmem.memory.events import FLUSH, PHASE, PHASE_END
from pytest_rlhfmem.record.recorder import Recorder
from pytest_rlhfmem.rlhf.common import PhaseSteps
from pytest_rlhfmem.rlhf.scenario import INFERENCE_PHASES, TRAINING_PHASES, Scenario


class FakeRecorder:
    """Logs phase opens, closes (with the exception that closed it, if any) and flushes, in order."""

    def __init__(self) -> None:
        self.events: list[tuple] = []

    @contextlib.contextmanager
    def phase(self, name: str):
        self.events.append(("open", name))
        try:
            yield name
        except BaseException as exc:
            self.events.append(("close", name, type(exc).__name__))
            raise
        self.events.append(("close", name))

    def flush(self, point: str) -> None:
        self.events.append(("flush", point))


class SpyHooks:
    """Stands in for FaultHooks: logs where the hook fires into the recorder's log."""

    def __init__(self, rec: FakeRecorder) -> None:
        self.rec = rec

    def at(self, phase: str) -> None:
        self.rec.events.append(("hook", phase))


def scenario(flush: str = "after-both", algorithm: str = "ppo", **overrides) -> Scenario:
    return Scenario("deepspeed-chat", "tiny-opt", "zero2", flush, 1, overrides, algorithm)


def spied(sc: Scenario) -> tuple[PhaseSteps, FakeRecorder]:
    rec = FakeRecorder()
    steps = PhaseSteps(sc, rec, rank=0)
    steps.hooks = SpyHooks(rec)
    return steps, rec


def test_hook_fires_inside_the_phase_and_the_flush_follows_its_close():
    steps, rec = spied(scenario("after-inference"))
    with steps("infer_actor") as record:
        rec.events.append(("body", record))
    assert rec.events == [("open", "infer_actor"), ("body", "infer_actor"), ("hook", "infer_actor"),
                          ("close", "infer_actor"), ("flush", "after-infer_actor")]


@pytest.mark.parametrize("flush, phase", [("after-inference", "train_actor"), ("after-training", "generate"),
                                          ("none", "infer_critic"), ("after-both", "init")])
def test_a_phase_the_policy_does_not_flush_after_still_gets_its_hook(flush, phase):
    steps, rec = spied(scenario(flush))
    with steps(phase):
        pass
    assert rec.events == [("open", phase), ("hook", phase), ("close", phase)]


def test_a_body_that_raises_closes_the_phase_with_the_error_and_skips_hook_and_flush():
    steps, rec = spied(scenario("after-both"))
    with pytest.raises(ValueError, match="body failed"), steps("train_actor"):
        rec.events.append(("body",))
        raise ValueError("body failed")
    assert rec.events == [("open", "train_actor"), ("body",), ("close", "train_actor", "ValueError")]


def test_an_injected_crash_is_an_error_of_its_phase_and_nothing_is_flushed():
    rec = FakeRecorder()
    steps = PhaseSteps(scenario("after-both", inject_crash="infer_reward"), rec, rank=0)
    with steps("infer_actor"):
        pass
    with pytest.raises(RuntimeError, match="injected crash in phase infer_reward"), steps("infer_reward"):
        rec.events.append(("body",))
    assert rec.events == [("open", "infer_actor"), ("close", "infer_actor"), ("flush", "after-infer_actor"),
                          ("open", "infer_reward"), ("body",), ("close", "infer_reward", "RuntimeError")]


def test_a_crash_injected_for_another_rank_does_not_fire():
    rec = FakeRecorder()
    steps = PhaseSteps(scenario("none", inject_crash="generate:1"), rec, rank=0)
    with steps("generate"):
        pass
    assert rec.events == [("open", "generate"), ("close", "generate")]


@pytest.mark.parametrize("flush, algorithm, expected", [
    ("none", "ppo", set()),
    ("after-inference", "ppo", set(INFERENCE_PHASES)),
    ("after-training", "ppo", set(TRAINING_PHASES)),
    ("after-both", "ppo", set(INFERENCE_PHASES + TRAINING_PHASES)),
    ("after-inference", "remax", {"generate", "generate_greedy", "infer_actor", "infer_reference", "infer_reward"}),
    ("after-training", "grpo", {"train_actor"}),
])
def test_the_policy_is_read_once_as_the_phases_it_flushes_after(flush, algorithm, expected):
    sc = scenario(flush, algorithm)
    steps = PhaseSteps(sc, FakeRecorder(), rank=0)
    assert steps.flush_after == expected
    assert steps.flush_after == {p for p in sc.phases if sc.flush_after(p)}


def test_a_real_recorder_gets_phase_end_before_the_flush_mark():
    rec = Recorder("cpu")  # not started: the marks are kept in order, nothing is recorded
    steps = PhaseSteps(scenario("after-inference"), rec, rank=0)
    with steps("generate"):
        pass
    with steps("train_actor"):
        pass
    assert rec._marks == [(PHASE, "generate"), (PHASE_END, "generate"), (FLUSH, "after-generate"),
                          (PHASE, "train_actor"), (PHASE_END, "train_actor")]
    with pytest.raises(RuntimeError), PhaseSteps(scenario(inject_crash="infer_actor"), rec, rank=0)("infer_actor"):
        pass
    assert rec.current_phase == "infer_actor" and rec._marks[-1] == (PHASE_END, "infer_actor")
