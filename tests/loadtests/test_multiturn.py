"""The multi-turn chat workload (``loadtests.multiturn``) and the prefix-cache runner's
arithmetic (``loadtests.prefix_cache``)."""

from pathlib import Path

import pytest

from loadtests.multiturn import (
    SYSTEM_PROMPT,
    TURNS,
    prefix_cache_summary,
    turn_messages,
    user_turns,
)
from loadtests.prefix_cache import side_config, ttft_stats

ROOT = Path(__file__).resolve().parents[2]


def test_a_turn_carries_the_system_prompt_the_history_and_the_new_message():
    msgs = turn_messages("sys", [("q1", "a1"), ("q2", "a2")], "q3")
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert [m["content"] for m in msgs] == ["sys", "q1", "a1", "q2", "a2", "q3"]
    assert len(SYSTEM_PROMPT) > 1500   # ~500 tokens of the default tokenizer


def test_conversations_open_differently_and_have_every_turn():
    convs = [user_turns(i) for i in range(5)]
    assert all(len(c) == TURNS for c in convs)
    assert len({c[0] for c in convs}) == 5


def test_prefix_cache_summary_is_the_difference_of_two_readings():
    before = {"prefix_cache_queries": 100.0, "prefix_cache_hits": 20.0, "prompt_tokens": 100.0}
    after = {"prefix_cache_queries": 1100.0, "prefix_cache_hits": 820.0, "prompt_tokens": 1050.0}
    s = prefix_cache_summary(before, after)
    assert s["prompt_tokens_received"] == 950 and s["prompt_tokens_looked_up"] == 1000
    assert s["prompt_tokens_cached"] == 800 and s["prompt_tokens_computed"] == 200
    assert s["hit_rate"] == pytest.approx(0.8) and s["computed_over_received"] == pytest.approx(200 / 950)


def test_side_config_sets_only_the_switch_and_the_port():
    on = side_config(ROOT / "configs" / "load-default.yaml", True, 8099)
    off = side_config(ROOT / "configs" / "load-default.yaml", False, 8099)
    assert on["applications"][0]["args"]["prefix_caching"] is True
    assert off["applications"][0]["args"]["prefix_caching"] is False
    off["applications"][0]["args"]["prefix_caching"] = True
    assert on == off and on["http_options"]["port"] == 8099


def test_ttft_stats_split_first_and_later_turns():
    rec = [{"ok": True, "ttft": t, "turn": k, "conversation": c, "t0": 0.0, "t1": 1.0, "prompt_tokens": 10}
           for c in range(2) for k, t in enumerate((4.0, 1.0, 1.0, 2.0))]
    rec.append({"ok": False, "ttft": None, "turn": 0, "conversation": 2, "t0": 0.0, "t1": 1.0, "prompt_tokens": None})
    s = ttft_stats(rec)
    assert s["turns_ok"] == 8 and s["turns_failed"] == 1 and s["conversations_done"] == 2
    assert s["ttft_first_turn_p50_s"] == 4.0 and s["ttft_later_turns_p50_s"] == 1.0
