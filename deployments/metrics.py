"""Prometheus metrics: a registry per replica, and the cluster's exposition at ``/metrics``.

Names follow vLLM's where the concept matches (``vllm:time_to_first_token_seconds`` ->
``treespark:time_to_first_token_seconds``). Each engine replica counts and times its
requests and steps in its own ``prometheus_client`` registry (``ReplicaMetrics``); its
heartbeat carries a snapshot of the samples (``ReplicaMetrics.snapshot``) to the
controller, which keeps the latest one per replica and folds a dropped replica's into a
running total (``merge``), so counters stay monotone while replicas come and go. The
API's ``/metrics`` renders the controller's view (``render``):

* counters and histograms summed over the cluster, labelled ``model_name``, the engines'
  prefix-cache queries and hits (prompt tokens) and preemptions among them: the heartbeat
  reads the engine's cumulative counts and adds what they grew (``engine_counts``);
* per-replica gauges (label ``replica``) from the replicas' last heartbeats: running and
  waiting requests, KV cache usage (the fraction of blocks held), the budget each replica runs (price ``theta``, caps and
  ``mode`` tree / chain / plain), the age of the controller's last budget broadcast to
  it, its time to its first budget, and its recent tree statistics;
* the ingress's own counters (``IngressMetrics``): engine requests re-issued after their
  replica failed, streams resumed on another replica, streams that ended with an error
  event, and the pause a resume costs. Each API replica pushes its snapshot to the
  controller, which keeps the latest per API replica (they are never dropped, so the
  sums stay monotone).

Terms: a *draft* is one request's tree in one engine step (vLLM: one proposal); its
*draft tokens* are the tree's nodes; *accepted tokens* are the draft tokens on the
accepted path, which is as long as the number accepted, so position ``p`` (0-based depth)
was accepted in every draft that accepted more than ``p`` tokens. Inter-token latency is
observed once per engine step that emitted tokens for a request (as vLLM does; with
speculation one step may emit several); ``request_time_per_output_token_seconds`` is the
per-request mean. Queue time ends when the engine schedules the request, which an engine
reports through an optional ``on_schedule`` hook (``deployments.replica.engine_loop``); engines
without the hook leave that histogram empty.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                   120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
RESUME_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)


@dataclass(frozen=True)
class Family:
    name: str                       # without the _total of a counter
    kind: str                       # "counter" | "histogram"
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()


P = "treespark:"
FAMILIES = (
    Family(P + "request_success", "counter", "Finished requests, by finish reason.", ("finished_reason",)),
    Family(P + "request_aborted", "counter", "Requests aborted (the client went away)."),
    Family(P + "prompt_tokens", "counter", "Prompt tokens processed."),
    Family(P + "generation_tokens", "counter", "Tokens generated."),
    Family(P + "engine_steps", "counter", "Engine steps (one target forward over the running batch)."),
    Family(P + "prefix_cache_queries", "counter",
           "Prompt tokens looked up in the prefix cache (a preempted request's recomputation counts again)."),
    Family(P + "prefix_cache_hits", "counter", "Prompt tokens found in the prefix cache (not computed)."),
    Family(P + "num_preemptions", "counter", "Requests preempted (their KV freed, recomputed later)."),
    Family(P + "spec_decode_num_drafts", "counter", "Draft trees verified (one per request per step with a non-empty tree)."),
    Family(P + "spec_decode_num_draft_tokens", "counter", "Draft tree nodes verified."),
    Family(P + "spec_decode_num_accepted_tokens", "counter", "Draft tokens accepted."),
    Family(P + "spec_decode_num_accepted_tokens_per_pos", "counter",
           "Drafts whose accepted path reached this depth (0-based position).", ("position",)),
    Family(P + "time_to_first_token_seconds", "histogram", "Time from arrival at the replica to the first token.",
           buckets=LATENCY_BUCKETS),
    Family(P + "inter_token_latency_seconds", "histogram",
           "Time between two engine steps that emitted tokens for a request (one or more tokens each).",
           buckets=TOKEN_BUCKETS),
    Family(P + "request_time_per_output_token_seconds", "histogram",
           "Per request: (end-to-end - time to first token) / (generated tokens - 1).", buckets=TOKEN_BUCKETS),
    Family(P + "e2e_request_latency_seconds", "histogram", "Time from arrival at the replica to the last token.",
           buckets=REQUEST_BUCKETS),
    Family(P + "request_queue_time_seconds", "histogram",
           "Time from arrival at the replica until the engine scheduled the request.", buckets=QUEUE_BUCKETS),
)
# the ingress's (``IngressMetrics``): what the API did when an engine replica failed under a request
STREAM_FAILURE_CODES = ("replica_failed", "engine_error")
INGRESS_FAMILIES = (
    Family(P + "request_retries", "counter",
           "Engine requests re-issued to another replica after theirs died or drained (before or after their "
           "first token, streamed or not)."),
    Family(P + "stream_resumes", "counter",
           "Streamed responses continued on another replica after tokens had been sent."),
    Family(P + "stream_failures", "counter",
           "Streamed responses that ended with an error event after they began, by error code.", ("code",)),
    Family(P + "stream_resume_seconds", "histogram",
           "Pause a resumed stream's client saw: from the replica's failure to the first new token after it.",
           buckets=RESUME_BUCKETS),
)
_BY_NAME = {f.name: f for f in FAMILIES + INGRESS_FAMILIES}

# (metric name, help, key in the controller's per-replica status)
REPLICA_GAUGES = (
    (P + "num_requests_running", "Requests in the engine batch.", "active"),
    (P + "num_requests_waiting", "Requests waiting for a batch slot.", "queued"),
    (P + "kv_cache_usage_perc", "Fraction of the engine's KV cache blocks held by requests (0-1).", "kv_cache_usage"),
    (P + "replica_resident_memory_bytes", "Resident memory of the replica process.", "rss_bytes"),
    (P + "spec_decode_mean_tree_size", "Mean draft tree size per round (recent steps).", "mean_tree_size"),
    (P + "spec_decode_mean_tree_width", "Mean draft tree width (recent steps).", "mean_width"),
    (P + "spec_decode_accepted_per_round", "Mean accepted draft tokens per round (recent steps).", "accepted_per_round"),
    (P + "batch_size", "Mean engine batch size (recent steps).", "batch_size"),
    (P + "step_time_seconds", "Mean engine step time (recent steps).", "step_s"),
    (P + "generation_tokens_per_second", "Generated tokens per second.", "tokens_per_s"),
    (P + "controller_broadcast_age_seconds",
     "Seconds since the controller last sent this replica its budget (answered its heartbeat).", "last_seen_s"),
    (P + "step_cost_correction",
     "Online step-cost correction: mean step seconds on the corrected table over the startup table's "
     "(recent steps; NaN without online_costs).", "cost_correction"),
    (P + "step_time_over_table",
     "Mean measured step seconds over the startup table's for the same steps (recent steps; NaN without "
     "online_costs).", "step_time_over_table"),
    (P + "replica_first_budget_seconds",
     "Seconds from the replica's first heartbeat to its first budget from a controller (NaN until then).",
     "first_budget_s"),
)
# the budget each replica runs (as it reported it): name, help, key
BUDGET_GAUGES = (
    (P + "spec_decode_theta", "The price of one verified node (theta) in the budget the replica runs.", "theta"),
    (P + "spec_decode_node_cap", "Node cap of the budget the replica runs.", "node_cap"),
    (P + "spec_decode_branch_cap", "Branch cap of the budget the replica runs.", "branch_cap"),
)
MODES = ("tree", "chain", "plain")


def budget_mode(b: Mapping[str, Any]) -> str:
    """tree / chain / plain, as ``Budget.kind`` names them (its 'off' is plain decoding)."""
    if int(b["node_cap"]) <= 0:
        return "plain"
    return "chain" if int(b["branch_cap"]) == 1 else "tree"


# -- the replica side ------------------------------------------------------------------------

Sample = tuple[str, tuple[tuple[str, str], ...], float]   # (sample name, sorted labels, value)


class _Registry:
    """Counters and histograms of ``families`` in a registry of their own (several replicas
    may share a process in tests). Thread-safe."""

    def __init__(self, families: tuple[Family, ...]) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self._m: dict[str, Any] = {}
        for f in families:
            if f.kind == "counter":
                self._m[f.name] = Counter(f.name, f.help, f.labels, registry=self.registry)
            else:
                self._m[f.name] = Histogram(f.name, f.help, f.labels, buckets=f.buckets, registry=self.registry)

    def _inc(self, name: str, amount: float = 1.0, **labels: str) -> None:
        m = self._m[P + name]
        (m.labels(**labels) if labels else m).inc(amount)

    def _observe(self, name: str, value: float) -> None:
        self._m[P + name].observe(max(value, 0.0))

    def snapshot(self) -> list[Sample]:
        """Every counter and histogram sample (no ``_created``), for the controller."""
        out: list[Sample] = []
        for fam in self.registry.collect():
            for s in fam.samples:
                if not s.name.endswith("_created"):
                    out.append((s.name, tuple(sorted(s.labels.items())), float(s.value)))
        return out


class ReplicaMetrics(_Registry):
    """One replica's counters and histograms; request handlers and the heartbeat both
    observe."""

    def __init__(self) -> None:
        super().__init__(FAMILIES)
        self._engine_seen = {"prefix_cache_queries": 0, "prefix_cache_hits": 0, "num_preemptions": 0}

    # -- observations ----------------------------------------------------------------------
    def steps(self, stats: Iterable[Any]) -> None:
        """The engine's ``StepStats`` since the last heartbeat."""
        steps = drafts = nodes = accepted = 0
        reached: list[int] = []   # reached[p]: drafts whose accepted path reached depth p
        for s in stats:
            steps += 1
            for n, a in zip(s.tree_sizes, s.accepted, strict=True):
                if n <= 0:   # an empty tree (plain decoding) is no draft
                    continue
                drafts, nodes, accepted = drafts + 1, nodes + n, accepted + a
                reached += [0] * (a - len(reached))
                for p in range(a):
                    reached[p] += 1
        if steps:
            self._inc("engine_steps", steps)
        if drafts:
            self._inc("spec_decode_num_drafts", drafts)
            self._inc("spec_decode_num_draft_tokens", nodes)
            self._inc("spec_decode_num_accepted_tokens", accepted)
        for p, count in enumerate(reached):
            self._inc("spec_decode_num_accepted_tokens_per_pos", count, position=str(p))

    def engine_counts(self, prefix_cache_queries: int, prefix_cache_hits: int, preemptions: int) -> None:
        """The engine's cumulative counters (``engine_loop.LoopLoad``), counted by what
        they grew since the last call."""
        now = {"prefix_cache_queries": prefix_cache_queries, "prefix_cache_hits": prefix_cache_hits,
               "num_preemptions": preemptions}
        for name, value in now.items():
            grown = value - self._engine_seen[name]
            if grown > 0:
                self._inc(name, grown)
        self._engine_seen = now

    def request(self) -> RequestClock:
        return RequestClock(self)


class IngressMetrics(_Registry):
    """One API replica's counters of what it did when an engine replica failed under a
    request (``deployments.http.resume``). ``changes`` counts observations, and
    ``on_change`` (if set) is called after each, so the API can push them to the controller."""

    def __init__(self) -> None:
        super().__init__(INGRESS_FAMILIES)
        for code in STREAM_FAILURE_CODES:  # read 0 before any failure (dashboards, rate())
            self._m[P + "stream_failures"].labels(code=code)
        self.changes = 0
        self.on_change: Callable[[], None] | None = None

    def _changed(self) -> None:
        self.changes += 1
        if self.on_change is not None:
            self.on_change()

    def retried(self) -> None:
        self._inc("request_retries")
        self._changed()

    def resumed(self, pause_s: float) -> None:
        self._inc("stream_resumes")
        self._observe("stream_resume_seconds", pause_s)
        self._changed()

    def stream_failed(self, code: str) -> None:
        self._inc("stream_failures", code=code)
        self._changed()


class RequestClock:
    """The times of one request at the replica (``time.monotonic``), observed as they come."""

    def __init__(self, metrics: ReplicaMetrics) -> None:
        self.m = metrics
        self.arrival = time.monotonic()
        self.first: float | None = None
        self.last: float | None = None
        self.tokens = 0

    def scheduled(self) -> None:
        self.m._observe("request_queue_time_seconds", time.monotonic() - self.arrival)

    def emitted(self, n: int) -> None:
        if n <= 0:
            return
        now = time.monotonic()
        if self.first is None:
            self.first = now
            self.m._observe("time_to_first_token_seconds", now - self.arrival)
        else:
            self.m._observe("inter_token_latency_seconds", now - self.last)
        self.last = now
        self.tokens += n
        self.m._inc("generation_tokens", n)

    def finished(self, reason: str, prompt_tokens: int) -> None:
        self.m._inc("request_success", finished_reason=reason)
        self.m._inc("prompt_tokens", prompt_tokens)
        if self.last is not None:
            self.m._observe("e2e_request_latency_seconds", self.last - self.arrival)
            if self.tokens > 1:
                self.m._observe("request_time_per_output_token_seconds", (self.last - self.first) / (self.tokens - 1))

    def aborted(self, prompt_tokens: int) -> None:
        self.m._inc("request_aborted")
        self.m._inc("prompt_tokens", prompt_tokens)


# -- the controller side --------------------------------------------------------------------

def merge(*snapshots: Iterable[Sample | list]) -> list[Sample]:
    """Samples summed by (name, labels): counters and histogram buckets, sums and counts
    of several replicas add up (buckets stay cumulative)."""
    total: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for snap in snapshots:
        for name, labels, value in snap:
            key = (name, tuple(tuple(x) for x in labels))
            total[key] = total.get(key, 0.0) + float(value)
    return [(n, lab, v) for (n, lab), v in total.items()]


# -- the exposition -----------------------------------------------------------------------------

def _family_of(sample_name: str) -> Family | None:
    for suffix in ("_total", "_bucket", "_sum", "_count"):
        if sample_name.endswith(suffix) and sample_name[: -len(suffix)] in _BY_NAME:
            return _BY_NAME[sample_name[: -len(suffix)]]
    return None


def _le_key(labels: tuple[tuple[str, str], ...]) -> float:
    le = dict(labels).get("le")
    return float("inf") if le in (None, "+Inf") else float(le)


def families(view: Mapping[str, Any], model: str) -> Iterator[Metric]:
    """The metric families of the controller's ``metrics_view()``."""
    base = {"model_name": model}
    grouped: dict[str, list[Sample]] = {f.name: [] for f in FAMILIES + INGRESS_FAMILIES}
    for name, labels, value in view.get("samples", ()):
        fam = _family_of(name)
        if fam is not None:
            grouped[fam.name].append((name, tuple(tuple(x) for x in labels), value))
    for f in FAMILIES + INGRESS_FAMILIES:
        m = Metric(f.name, f.help, f.kind)
        samples = grouped[f.name]
        if f.kind == "counter" and not f.labels and not samples:
            samples = [(f.name + "_total", (), 0.0)]  # an unlabelled counter reads 0 before any event
        order = {"_bucket": 0, "_count": 1, "_sum": 2}
        samples.sort(key=lambda s: (tuple(x for x in s[1] if x[0] != "le"), order.get(s[0][len(f.name):], 0),
                                    _le_key(s[1])))
        for name, labels, value in samples:
            m.add_sample(name, {**base, **dict(labels)}, value)
        yield m
    replicas: Mapping[str, Mapping[str, Any]] = view.get("replicas", {})
    n = Metric(P + "num_replicas", "Replicas reporting to the controller.", "gauge")
    n.add_sample(P + "num_replicas", base, float(len(replicas)))
    yield n
    for name, help_, key in REPLICA_GAUGES:
        g = Metric(name, help_, "gauge")
        for rid, r in replicas.items():
            v = r.get(key)
            g.add_sample(name, {**base, "replica": rid}, float("nan") if v is None else float(v))
        yield g
    for name, help_, key in BUDGET_GAUGES:
        g = Metric(name, help_, "gauge")
        for rid, r in replicas.items():
            g.add_sample(name, {**base, "replica": rid}, float(_applied(r)[key]))
        yield g
    mode = Metric(P + "spec_decode_mode", "1 for the mode of the budget the replica runs (tree, chain or plain), "
                                          "0 for the others.", "gauge")
    for rid, r in replicas.items():
        current = budget_mode(_applied(r))
        for m_ in MODES:
            mode.add_sample(mode.name, {**base, "replica": rid, "mode": m_}, float(m_ == current))
    yield mode


def _applied(r: Mapping[str, Any]) -> Mapping[str, Any]:
    """The budget the replica reported running (the assigned one if it did not say)."""
    return r.get("applied_budget") or r["budget"]


class _View(Collector):
    def __init__(self, view: Mapping[str, Any], model: str) -> None:
        self.args = (view, model)

    def collect(self) -> Iterator[Metric]:
        return families(*self.args)


def render(view: Mapping[str, Any], model: str) -> bytes:
    """Prometheus text (format 0.0.4) of the controller's ``metrics_view()``."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_View(view, model))
    return generate_latest(registry)
