"""Gate examples/tiny_ppo.py's memory with the rlhfmem_command fixture and a YAML budget.

    pytest examples/test_tiny_ppo_memory.py --rlhfmem-update-baselines   # once: writes the budget, commit it
    pytest examples/test_tiny_ppo_memory.py                              # from then on: fails over budget

The budget lives in baselines/<profile>/tiny_ppo_memory.yaml (profile ``cpu`` for simulated figures),
under the entry named by ``id``.
"""

import sys
from pathlib import Path

SCRIPT = Path(__file__).with_name("tiny_ppo.py")


def test_tiny_ppo_step_fits_its_budget(rlhfmem_command, memory_budget):
    result = rlhfmem_command([sys.executable, "-m", "torch.distributed.run", "--standalone",
                              "--nproc-per-node=2", str(SCRIPT)], id="tiny-ppo/x2")
    assert [r["rank"] for r in result["ranks"]] == [0, 1]
    assert {"generate", "score", "train"} <= set(result.phases)
    assert result.metrics["alloc_retries"] == 0
    memory_budget.check(result)
