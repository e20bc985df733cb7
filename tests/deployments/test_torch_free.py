"""The control plane loads no torch: the controller actor, the HTTP ingress and the
pricing maths run in processes that never hold a model (checked in a fresh interpreter,
so what this test process has imported does not count)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

HEAVY = ("torch", "transformers", "safetensors")


def _loaded_after(code: str) -> list[str]:
    probe = code + f"\nimport sys\nprint(','.join(m for m in {HEAVY!r} if m in sys.modules))\n"
    proc = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    last = proc.stdout.rstrip("\n").rpartition("\n")[2]
    return [m for m in last.split(",") if m]


def test_importing_the_control_plane_loads_no_torch():
    assert _loaded_after(textwrap.dedent("""
        import deployments.http.api, deployments.controller.controller, deployments.controller.state
        import deployments.http.errors, deployments.metrics, deployments.http.responses, deployments.http.schemas
        import deployments.http.validation
        import treespark.spec.budget, treespark.spec.calibration, treespark.models.chat
        import treespark.pricing.costmodel, treespark.pricing.estimators, treespark.pricing.policy
        import treespark.pricing.allocate
    """)) == []


def test_the_controller_prices_and_refits_without_torch():
    """Registration, the cost-model policy, the online refit and the status, end to end."""
    assert _loaded_after(textwrap.dedent("""
        import random
        from deployments.config import AppArgs
        from deployments.controller.controller import Controller

        args = AppArgs(policy={"kind": "costmodel", "cost_model": "configs/costmodel-random.json"},
                       controller={"online_calibration": True, "min_calibration_records": 10})
        c = Controller(args.wire())
        rng = random.Random(0)
        report = {"replica_id": "r", "active": 2, "queued": 0, "tokens_per_s": 1.0,
                  "tree": {"steps": 1, "drafting_steps": 1, "drafting_batch": 2, "drafting_nodes": 8},
                  "budget": {"theta": 0.1, "node_cap": 4, "branch_cap": 1}, "budget_source": "local",
                  "counters": {}, "calibration": None, "base_calibration": [1.0, 0.0],
                  "calibration_records": [[rng.uniform(-3, 2), rng.random() < 0.4, 0.0] for _ in range(40)],
                  "round_records": [[4, 1]] * 10}
        reply = c.report(report)
        assert reply["registered"] and reply["calibration"] is not None, reply
        assert c.status()["calibration"]["report"]["records"] == 40
    """)) == []


def test_the_package_resolves_its_public_names_lazily():
    assert _loaded_after("import treespark\nassert 'Budget' in dir(treespark)\ntreespark.Budget.off()") == []
    assert "torch" in _loaded_after("from treespark import random_pair")
