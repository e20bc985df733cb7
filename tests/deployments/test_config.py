"""The app's arguments: the shipped configs validate, and budgets the engines would clip are refused."""

from pathlib import Path

import pytest
import yaml

from deployments.config import AppArgs


def test_configs_validate():
    for path in ("configs/cluster.yaml", "configs/gpu-cluster.yaml"):
        cfg = yaml.safe_load(open(path))
        from ray.serve.schema import ServeDeploySchema

        ServeDeploySchema.model_validate(cfg)
        (app,) = cfg["applications"]
        args = AppArgs.model_validate(app["args"])
        assert app["import_path"] == "deployments.app:build_app"
        assert cfg["http_options"]["host"] == "127.0.0.1"
        from deployments.app import build_app, replica_options

        build_app(args)  # builds the graph; nothing runs
        opts = replica_options(args)
        assert set(opts["ray_actor_options"]) == {"num_cpus", "num_gpus"}
        assert opts["autoscaling_config"]["max_replicas"] >= 2
        if "gpu" in path:
            assert args.model == "Qwen/Qwen3-4B" and args.drafter == "deepseek-ai/dspark_qwen3_4b_block7"
            assert opts["ray_actor_options"]["num_gpus"] == 1
        else:
            assert opts["ray_actor_options"]["num_gpus"] == 0


def test_budgets_the_engines_would_clip_are_refused():
    from pydantic import ValidationError

    fixed = {"kind": "fixed", "budget": {"theta": 0.0, "node_cap": 48, "branch_cap": 4}}
    assert AppArgs(policy=fixed, max_tree_nodes=48).policy.budget.node_cap == 48
    with pytest.raises(ValidationError, match=r"policy.budget.node_cap is 48 but max_tree_nodes is 32"):
        AppArgs(policy=fixed, max_tree_nodes=32)
    with pytest.raises(ValidationError, match=r"policy.budgets\[0\].node_cap is 24 but max_tree_nodes is 16"):
        AppArgs(max_tree_nodes=16, policy={"kind": "ladder", "thresholds": [2.0], "budgets": [
            {"theta": 0.0, "node_cap": 24, "branch_cap": 4}, {"theta": 1.0, "node_cap": 0, "branch_cap": 1}]})
    with pytest.raises(ValidationError, match=r"policy.max_nodes is 32 but max_tree_nodes is 8"):
        AppArgs(max_tree_nodes=8, policy={"kind": "costmodel", "cost_model": "configs/costmodel-smollm2.json"})
    shipped = sorted(Path(__file__).resolve().parents[2].joinpath("configs").glob("*.yaml"))
    assert len(shipped) >= 5
    for path in shipped:
        (app,) = yaml.safe_load(path.read_text())["applications"]
        AppArgs.model_validate(app["args"])  # the shipped configs stay valid
