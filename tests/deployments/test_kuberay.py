"""The KubeRay manifests (``deploy/kuberay``): up to date with the Serve configs they are
rendered from, valid against the RayService CRD's OpenAPI schema vendored from kuberay
(closed objects, as ``kubectl apply``'s strict field validation treats them), and
serving the same application args as the config files."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

from deployments.config import AppArgs

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("kuberay_render", ROOT / "deploy/kuberay/render.py")
render = sys.modules["kuberay_render"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(render)

VARIANTS = {v.name: v for v in render.VARIANTS}


def _closed(schema):
    """The schema with unknown fields refused, as the API server's strict field validation
    does: an object with ``properties`` and no ``additionalProperties`` or
    ``x-kubernetes-preserve-unknown-fields`` takes no other keys."""
    if isinstance(schema, dict):
        out = {k: _closed(v) for k, v in schema.items()}
        if ("properties" in schema and "additionalProperties" not in schema
                and not schema.get("x-kubernetes-preserve-unknown-fields")):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_closed(x) for x in schema]
    return schema


@pytest.fixture(scope="module")
def validator():
    schema = json.loads(render.SCHEMA.read_text())
    assert "Apache License" in schema["$comment"] and "kuberay" in schema["$comment"]
    return jsonschema.Draft7Validator(_closed(schema))


def manifest(v):
    return yaml.safe_load((ROOT / v.out).read_text())


@pytest.mark.parametrize("name", VARIANTS)
def test_manifest_is_rendered_from_its_config(name):
    v = VARIANTS[name]
    assert (ROOT / v.out).read_text() == render.render(v), "stale: run python deploy/kuberay/render.py"


@pytest.mark.parametrize("name", VARIANTS)
def test_manifest_valid_against_crd(validator, name):
    doc = manifest(VARIANTS[name])
    errors = sorted(validator.iter_errors(doc), key=lambda e: list(e.path))
    assert not errors, [f"{'.'.join(map(str, e.path))}: {e.message}" for e in errors[:5]]


def test_validator_catches_mistakes(validator):
    doc = manifest(VARIANTS["treespark-cpu"])
    doc["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParms"] = {}          # a typo
    doc["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["maxReplicas"] = "two"  # a wrong type
    assert len(list(validator.iter_errors(doc))) == 2


@pytest.mark.parametrize("name", VARIANTS)
def test_serve_config_has_the_config_files_app_args(name):
    v = VARIANTS[name]
    serve = yaml.safe_load(manifest(v)["spec"]["serveConfigV2"])
    config = yaml.safe_load((ROOT / v.config).read_text())
    assert serve["applications"] == config["applications"]
    for app, ref in zip(serve["applications"], config["applications"], strict=True):
        assert AppArgs.model_validate(app["args"]) == AppArgs.model_validate(ref["args"])
    assert serve["http_options"]["host"] == "0.0.0.0" and serve["proxy_location"] == "EveryNode"


@pytest.mark.parametrize("name", VARIANTS)
def test_cluster_shape(name):
    v = VARIANTS[name]
    cluster = manifest(v)["spec"]["rayClusterConfig"]
    args = AppArgs.model_validate(yaml.safe_load((ROOT / v.config).read_text())["applications"][0]["args"])
    assert cluster["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    assert cluster["enableInTreeAutoscaling"] is True
    pin = re.search(r'"ray\[serve\]==([0-9.]+)"', (ROOT / "pyproject.toml").read_text()).group(1)
    assert cluster["rayVersion"] == render.RAY_VERSION == pin   # the image's Ray is the one we test with
    (group,) = cluster["workerGroupSpecs"]
    (container,) = group["template"]["spec"]["containers"]
    limits = container["resources"]["limits"]
    # a worker pod holds at least one engine replica, and the largest group holds them all
    r = args.replica
    per_pod = int(float(limits["cpu"]) // r.num_cpus) if r.num_cpus else 1 << 30
    if r.num_gpus:
        assert int(limits["nvidia.com/gpu"]) >= r.num_gpus
        per_pod = min(per_pod, int(int(limits["nvidia.com/gpu"]) // r.num_gpus))
    assert per_pod >= 1
    assert group["maxReplicas"] * per_pod >= r.autoscaling.max_replicas
    assert group["minReplicas"] >= 1 and group["minReplicas"] <= group["maxReplicas"]
    assert container["livenessProbe"]["failureThreshold"] * container["livenessProbe"]["periodSeconds"] >= 60


def test_gpu_variant_has_a_gpu_worker_group():
    cluster = manifest(VARIANTS["treespark-gpu"])["spec"]["rayClusterConfig"]
    (group,) = cluster["workerGroupSpecs"]
    assert group["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert "nvidia.com/gpu" not in cluster["headGroupSpec"]["template"]["spec"]["containers"][0]["resources"]["limits"]


def test_check_mode():
    assert render.main(["--check"]) == 0
