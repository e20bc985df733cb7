"""Prometheus text exposition of the controller's view of the cluster, named after
vLLM's metrics (``vllm:spec_decode_num_draft_tokens_total`` -> ``treespark:...``)."""

from __future__ import annotations

from typing import Any

# counter key -> (metric name, help)
COUNTER_METRICS = {
    "requests": ("treespark:request_success_total", "Finished requests."),
    "requests_aborted": ("treespark:request_aborted_total", "Requests aborted (client went away)."),
    "prompt_tokens": ("treespark:prompt_tokens_total", "Prompt tokens processed."),
    "generation_tokens": ("treespark:generation_tokens_total", "Tokens generated."),
    "rounds": ("treespark:spec_decode_num_drafts_total", "Speculative rounds (one draft tree verified per request per step)."),
    "draft_tokens": ("treespark:spec_decode_num_draft_tokens_total", "Draft tree nodes verified."),
    "accepted_tokens": ("treespark:spec_decode_num_accepted_tokens_total", "Draft tokens accepted."),
    "steps": ("treespark:engine_steps_total", "Engine steps."),
}

# per-replica gauge -> (metric name, help, key in the replica status)
GAUGE_METRICS = (
    ("treespark:num_requests_running", "Requests in the engine batch.", "active"),
    ("treespark:num_requests_waiting", "Requests waiting for a batch slot.", "queued"),
    ("treespark:kv_slots_in_use", "Engine KV cache rows holding a request.", "kv_slots_in_use"),
    ("treespark:replica_resident_memory_bytes", "Resident memory of the replica process.", "rss_bytes"),
    ("treespark:spec_decode_theta", "Current budget theta (price of one verified node).", ("budget", "theta")),
    ("treespark:spec_decode_node_cap", "Current budget node cap.", ("budget", "node_cap")),
    ("treespark:spec_decode_branch_cap", "Current budget branch cap.", ("budget", "branch_cap")),
    ("treespark:spec_decode_mean_tree_size", "Mean draft tree size per round (recent steps).", "mean_tree_size"),
    ("treespark:spec_decode_mean_tree_width", "Mean draft tree width (recent steps).", "mean_width"),
    ("treespark:spec_decode_accepted_per_round", "Mean accepted draft tokens per round (recent steps).", "accepted_per_round"),
    ("treespark:batch_size", "Mean engine batch size (recent steps).", "batch_size"),
    ("treespark:step_time_seconds", "Mean engine step time (recent steps).", "step_s"),
    ("treespark:generation_tokens_per_second", "Generated tokens per second.", "tokens_per_s"),
)


def _fmt(v: Any) -> str:
    return repr(float(v)) if v is not None else "NaN"


def _esc(s: str) -> str:
    return s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def render(status: dict[str, Any], model: str) -> str:
    lines: list[str] = []
    lab = f'model_name="{_esc(model)}"'
    counters = status.get("counters", {})
    for key, (name, help_) in COUNTER_METRICS.items():
        lines += [f"# HELP {name} {help_}", f"# TYPE {name} counter", f"{name}{{{lab}}} {_fmt(counters.get(key, 0.0))}"]
    replicas = status.get("replicas", {})
    lines += ["# HELP treespark:num_replicas Replicas reporting to the controller.", "# TYPE treespark:num_replicas gauge",
              f"treespark:num_replicas{{{lab}}} {len(replicas)}"]
    for name, help_, key in GAUGE_METRICS:
        lines += [f"# HELP {name} {help_}", f"# TYPE {name} gauge"]
        for rid, r in replicas.items():
            v = r[key[0]][key[1]] if isinstance(key, tuple) else r.get(key)
            lines.append(f'{name}{{{lab},replica="{_esc(rid)}"}} {_fmt(v)}')
    return "\n".join(lines) + "\n"
