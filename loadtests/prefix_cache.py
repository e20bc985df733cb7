"""The prefix cache on and off under multi-turn chats: prompt tokens computed, hit rate, TTFT.

Serves one Serve config twice, ``prefix_caching: true`` then ``false`` in its args (all
else equal), and runs the same Locust load on each (``loadtests/chat_locustfile.py``:
``--users`` closed-loop users holding 4-turn chats over a shared ~500-token system
prompt, for ``--duration`` seconds; conversations in flight are let finish). From
``/metrics`` before and after each run (``loadtests.multiturn.prefix_cache_summary``):
prompt tokens received, looked up, found cached and computed, the hit rate, and computed
over received; from the per-turn records: TTFT quantiles (all turns, first turns, later
turns) and end-to-end time.

    python -m loadtests.prefix_cache --config configs/load-default.yaml --users 2 \\
        --duration 150 --out docs/load/prefix-cache

Writes ``prefix-cache.csv`` (one row per side) and ``prefix-cache.md`` (the table, the
ratios and the issue's goals); configs, logs and per-turn records under ``--work``.
"""

from __future__ import annotations

import argparse
import copy
import csv
import sys
from pathlib import Path

import requests
import yaml

from loadtests.common import (
    ROOT,
    log,
    percentile,
    read_records,
    run_locust,
    serve_process,
    wait_idle,
)
from loadtests.multiturn import TURNS, prefix_cache_summary

COUNTERS = ("prefix_cache_queries", "prefix_cache_hits", "prompt_tokens", "num_preemptions")
# goals of the issue: computed <= this share of received with the cache on; TTFT p50 this much lower
COMPUTED_GOAL = 0.35
TTFT_GOAL = 2.0


def read_counters(url: str) -> dict[str, float]:
    """The cluster's ``COUNTERS`` from ``/metrics`` (summed over their labels)."""
    from prometheus_client.parser import text_string_to_metric_families

    out = dict.fromkeys(COUNTERS, 0.0)
    for fam in text_string_to_metric_families(requests.get(f"{url}/metrics", timeout=10).text):
        for s in fam.samples:
            name = s.name.removeprefix("treespark:").removesuffix("_total")
            if s.name.endswith("_total") and name in out:
                out[name] += s.value
    return out


def side_config(config: Path, caching: bool, port: int) -> dict:
    """``config`` with ``prefix_caching`` set in its application's args."""
    cfg = copy.deepcopy(yaml.safe_load(config.read_text()))
    cfg["applications"][0]["args"]["prefix_caching"] = caching
    cfg.setdefault("http_options", {}).update(host="127.0.0.1", port=port)
    return cfg


def ttft_stats(records: list[dict]) -> dict[str, float]:
    ok = [r for r in records if r["ok"] and r["ttft"] is not None]
    first = [r["ttft"] for r in ok if r["turn"] == 0]
    later = [r["ttft"] for r in ok if r["turn"] > 0]
    every = first + later
    return {
        "turns_ok": len(ok), "turns_failed": sum(1 for r in records if not r["ok"]),
        "conversations_done": len({r["conversation"] for r in ok if r["turn"] == TURNS - 1}),
        "ttft_p50_s": percentile(every, 0.5), "ttft_p95_s": percentile(every, 0.95),
        "ttft_first_turn_p50_s": percentile(first, 0.5), "ttft_later_turns_p50_s": percentile(later, 0.5),
        "e2e_p50_s": percentile([r["t1"] - r["t0"] for r in ok], 0.5),
        "mean_prompt_tokens": sum(r["prompt_tokens"] or 0 for r in ok) / max(len(ok), 1),
    }


def run_side(a: argparse.Namespace, caching: bool) -> dict:
    name = "on" if caching else "off"
    raw = a.work
    cfg_path = raw / f"config-cache-{name}.yaml"
    cfg_path.write_text(yaml.safe_dump(side_config(a.config, caching, a.port), sort_keys=False))
    prefix = raw / f"locust-cache-{name}"
    Path(f"{prefix}-records.jsonl").unlink(missing_ok=True)
    with serve_process(cfg_path, raw, port=a.port) as url:
        model = requests.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
        wait_idle(url)
        before = read_counters(url)
        cmd = [sys.executable, "-m", "locust", "-f", str(ROOT / "loadtests" / "chat_locustfile.py"), "--headless",
               "--host", url, "--shape", f"const:{a.users}:{a.duration}", "--model", model,
               "--max-tokens", str(a.max_tokens), "--records", f"{prefix}-records.jsonl", "--csv", str(prefix),
               "--only-summary", "--exit-code-on-error", "0", "--stop-timeout", str(a.stop_timeout),
               "--loglevel", "WARNING"]
        log(" ".join(cmd[2:]))
        rc, wall = run_locust(cmd, Path(f"{prefix}-locust.log"), a.duration + a.stop_timeout + 120)
        wait_idle(url, 120)
        after = read_counters(url)
    row = {"prefix_caching": name, "users": a.users, "duration_s": a.duration, "max_tokens": a.max_tokens,
           "locust_rc": rc, "locust_wall_s": round(wall, 1),
           **prefix_cache_summary(before, after), "preemptions": after["num_preemptions"] - before["num_preemptions"],
           **ttft_stats(read_records(Path(f"{prefix}-records.jsonl")))}
    log(f"cache {name}: {row}")
    return row


def _fmt(v: object) -> str:
    if isinstance(v, float):
        return str(int(v)) if v.is_integer() else f"{v:.3f}"
    return str(v)


def write_report(rows: list[dict], a: argparse.Namespace, command: str) -> None:
    with open(a.out / "prefix-cache.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows({k: _fmt(v) for k, v in r.items()} for r in rows)
    on, off = rows
    keys = ("prompt_tokens_received", "prompt_tokens_computed", "computed_over_received", "hit_rate", "preemptions",
            "conversations_done", "turns_ok", "turns_failed", "mean_prompt_tokens", "ttft_p50_s", "ttft_p95_s",
            "ttft_first_turn_p50_s", "ttft_later_turns_p50_s", "e2e_p50_s")
    ttft_ratio = off["ttft_p50_s"] / on["ttft_p50_s"]
    lines = [
        "# Prefix cache on and off: multi-turn chats over a shared system prompt", "",
        "```bash", command, "```", "",
        f"{a.users} users, {a.duration} s of load per side (conversations in flight then get up to "
        f"{a.stop_timeout} s to finish), 4-turn greedy chats "
        f"(answers up to {a.max_tokens} tokens) over one ~500-token system prompt, `{a.config}` with "
        "`prefix_caching` on, then off. Token counts from `/metrics` (computed = `prefix_cache_queries` - "
        "`prefix_cache_hits`; received = `prompt_tokens`); TTFT from the clients' streams.", "",
        "| | cache on | cache off |", "|---|---|---|",
        *(f"| {k} | {_fmt(on[k])} | {_fmt(off[k])} |" for k in keys), "",
        f"* computed / received with the cache on: **{on['computed_over_received']:.3f}** "
        f"(goal <= {COMPUTED_GOAL}: {'met' if on['computed_over_received'] <= COMPUTED_GOAL else 'missed'})",
        f"* TTFT p50, off / on: **{ttft_ratio:.2f}x** (goal >= {TTFT_GOAL}x: "
        f"{'met' if ttft_ratio >= TTFT_GOAL else 'missed'}); later turns: "
        f"{off['ttft_later_turns_p50_s'] / on['ttft_later_turns_p50_s']:.2f}x", "",
    ]
    (a.out / "prefix-cache.md").write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=ROOT / "configs" / "load-default.yaml")
    ap.add_argument("--users", type=int, default=2)
    ap.add_argument("--duration", type=int, default=150, help="seconds of load per side")
    ap.add_argument("--max-tokens", type=int, default=48, help="per answer")
    ap.add_argument("--stop-timeout", type=int, default=120, help="seconds to let conversations finish")
    ap.add_argument("--port", type=int, default=8013)
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "load" / "prefix-cache")
    ap.add_argument("--work", type=Path, default=ROOT / "docs" / "load" / "raw" / "prefix-cache",
                    help="configs, logs and per-turn records (not committed)")
    a = ap.parse_args(argv)
    a.config = a.config.resolve()
    a.work.mkdir(parents=True, exist_ok=True)
    a.out.mkdir(parents=True, exist_ok=True)
    command = "python -m loadtests.prefix_cache " + " ".join(argv if argv is not None else sys.argv[1:])
    rows = [run_side(a, caching) for caching in (True, False)]
    a.config = a.config.relative_to(ROOT) if a.config.is_relative_to(ROOT) else a.config
    write_report(rows, a, command)
    print((a.out / "prefix-cache.md").read_text())


if __name__ == "__main__":
    main()
