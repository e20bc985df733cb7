"""Schemathesis against the served stack: ``serve run`` (proxy, API replica, handles,
engine replica, controller; the tiny random pair), fuzzed from its own ``/openapi.json``
with positive and negative cases, by the schemathesis CLI.

Checks: no 5xx, every status and content type documented, every JSON body valid
against its documented schema, schema-violating bodies rejected. Valid generation bodies
are steered to the engine (``steer``: the served model's name, no field the API refuses,
``n`` and ``max_tokens`` within the limits), as in ``tests/deployments/test_openapi.py``, which runs
the same cases in-process in CI. The CLI loads ``loadtests.openapi_hooks`` as its hooks
module (``SCHEMATHESIS_HOOKS``), which registers ``steer``.

    python -m loadtests.fuzz_openapi --examples 60 --out docs/reliability/openapi-served.json

Counts every case the CLI sent (its HAR report) by operation and status.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from collections import Counter
from pathlib import Path
from typing import Any

import yaml

MODEL = "treespark-random"
MAX_N, MAX_TOKENS = 2, 8
LIMITS = {"max_tokens": MAX_TOKENS, "max_n": MAX_N, "max_body_bytes": 8192, "max_prompt_chars": 2000,
          "queue_timeout_s": 10}
REFUSED = ("echo", "best_of", "suffix", "presence_penalty", "frequency_penalty", "logit_bias", "tools", "tool_choice",
           "response_format")
CHECKS = "not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance," \
         "negative_data_rejection"


def steer(path: str, body: Any, model: str = MODEL, max_n: int = MAX_N, max_tokens: int = MAX_TOKENS) -> Any:
    """A *valid* generation body (for ``path``) steered to the engine; anything else as it is."""
    from pydantic import ValidationError

    from deployments.http.schemas import ChatRequest, CompletionRequest

    schema = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatRequest}.get(path)
    if schema is None or not isinstance(body, dict):
        return body
    try:
        schema.model_validate(body)
    except ValidationError:
        return body
    body = {k: v for k, v in body.items() if k not in REFUSED}
    body["model"] = model
    body["n"] = min(body.get("n", 1), max_n)
    body["max_tokens"] = min(body.get("max_tokens") or max_tokens, max_tokens)
    if body.get("max_completion_tokens") is not None:
        body["max_completion_tokens"] = min(body["max_completion_tokens"], max_tokens)
    return body


def served_config(port: int) -> dict:
    from loadtests.common import ROOT

    cfg = yaml.safe_load((ROOT / "configs" / "load-random.yaml").read_text())
    cfg["http_options"]["port"] = port
    args = cfg["applications"][0]["args"]
    args.update(max_batch_size=4, max_context=256, limits=LIMITS)
    return cfg


def har_statuses(har: Path) -> Counter:
    entries = json.loads(har.read_text())["log"]["entries"]
    return Counter((e["request"]["method"] + " " + e["request"]["url"].split("//", 1)[1].split("/", 1)[1].split("?")[0],
                    e["response"]["status"]) for e in entries)


def main(argv: list[str] | None = None) -> None:
    from loadtests.common import BIN, ROOT, env, log, serve_process

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--examples", type=int, default=60, help="per operation and phase")
    ap.add_argument("--port", type=int, default=8230)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--work", type=Path, default=Path("/tmp/treespark-fuzz-openapi"))
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "reliability" / "openapi-served.json")
    a = ap.parse_args(argv)
    a.work.mkdir(parents=True, exist_ok=True)
    cfg_path = a.work / "config.yaml"
    cfg_path.write_text(yaml.safe_dump(served_config(a.port), sort_keys=False))
    har = a.work / "cases.har"
    har.unlink(missing_ok=True)
    with serve_process(cfg_path, a.work, port=a.port) as url:
        toml = a.work / "schemathesis.toml"   # a negative case may also exceed max_body_bytes: 413 rejects it too
        toml.write_text('[checks.negative_data_rejection]\nexpected-statuses = ["400", "401", "403", "404", "405", '
                        '"406", "409", "413", "415", "422", "428", "429", "5xx"]\n')
        cmd = [str(BIN / "schemathesis"), "--config-file", str(toml), "run", f"{url}/openapi.json", "--checks", CHECKS, "--mode", "all",
               "--phases", "examples,coverage,fuzzing", "-n", str(a.examples), "--seed", str(a.seed),
               "--generation-deterministic", "--workers", "1",
               "--request-timeout", "60", "--suppress-health-check", "all", "--continue-on-failure",
               "--report", "har", "--report-har-path", str(har), "--no-color"]
        log(" ".join(cmd[3:]))
        t0 = time.time()
        proc = subprocess.run(cmd, cwd=ROOT, env={**env(), "SCHEMATHESIS_HOOKS": "loadtests.openapi_hooks"},
                              capture_output=True, text=True, timeout=3600)
        wall = time.time() - t0
    (a.work / "schemathesis.log").write_text(proc.stdout + proc.stderr)
    seen = har_statuses(har)
    statuses = Counter()
    for (_, status), n in seen.items():
        statuses[status] += n
    summary = {"command": "python -m loadtests.fuzz_openapi --examples " + str(a.examples), "examples": a.examples,
               "seed": a.seed, "exit_code": proc.returncode, "wall_s": round(wall, 1),
               "cases": sum(seen.values()), "statuses": {str(k): v for k, v in sorted(statuses.items())},
               "server_errors": sum(n for s, n in statuses.items() if s >= 500),
               "by_operation": {f"{op} {s}": n for (op, s), n in sorted(seen.items())},
               "schemathesis_summary": (proc.stdout.strip().splitlines() or [""])[-12:]}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
