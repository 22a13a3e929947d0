"""A long run says where it is: ``rlhf/launch.py``'s ``run_process_group`` calls ``on_progress`` while the command
runs, and ``progress_line`` reads the ranks' progress files (``rlhfmem capture`` prints it every minute)."""

import json
import sys

from pytest_rlhfmem.rlhf.launch import progress_line, run_process_group


def test_a_running_command_reports_progress_until_it_ends(tmp_path):
    ticks: list[float] = []
    rc, timed_out = run_process_group([sys.executable, "-c", "import time; time.sleep(2.2)"], tmp_path / "log",
                                      {}, 30.0, tmp_path, on_progress=ticks.append, progress_every_s=0.5)
    assert (rc, timed_out) == (0, False)
    assert 2 <= len(ticks) <= 6 and ticks == sorted(ticks) and ticks[0] >= 0.5  # about every 0.5 s


def test_the_timeout_still_ends_a_run_that_reports_progress(tmp_path):
    ticks: list[float] = []
    rc, timed_out = run_process_group([sys.executable, "-c", "import time; time.sleep(60)"], tmp_path / "log",
                                      {}, 1.2, tmp_path, on_progress=ticks.append, progress_every_s=0.5)
    assert timed_out and len(ticks) == 2  # at 0.5 and 1.0 s; the timeout at 1.2 s, not a third tick


def test_the_progress_line_names_each_ranks_phase_events_and_rss(tmp_path):
    assert progress_line(tmp_path, 61.4, "capture x") == "capture x: 61 s, no rank has started recording yet"
    (tmp_path / "progress-rank0.json").write_text(json.dumps(
        {"rank": 0, "phase": "generate", "host_rss": 3 * 2**30, "device_rows": 12345}))
    (tmp_path / "progress-rank1.json").write_text(json.dumps({"rank": 1, "phase": "startup"}))
    assert progress_line(tmp_path, 120, "capture x") == (
        "capture x: 120 s, rank 0 in phase 'generate' (12,345 device events recorded by then), host RSS 3.00 GiB; "
        "rank 1 in phase 'startup'")

