"""Log-probabilities of emitted tokens (``treespark.spec.logprobs``) and the engine's
``on_schedule`` hook: the numbers are the target's own (a full forward over prompt +
output agrees), one per emitted token, and asking for them changes no token."""

from __future__ import annotations

import pytest
import torch

from treespark import Budget
from treespark.engine.config import EngineConfig
from treespark.engine.core import Engine
from treespark.spec.logprobs import token_logprobs, unpack
from treespark.spec.params import SamplingParams


def run(engine: Engine, requests: list[tuple[str, list[int], SamplingParams]]):
    tokens = {rid: [] for rid, _, _ in requests}
    lps = {rid: [] for rid, _, _ in requests}
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            if out.logprobs is None:
                lps[out.request_id] = None
            else:
                assert len(out.logprobs) == len(out.new_token_ids)
                lps[out.request_id] += list(out.logprobs)
    return tokens, lps


def reference(pair, prompt: list[int], output: list[int]) -> torch.Tensor:
    """log p(output[j] | prompt + output[:j]) from one full forward, no KV cache: [len(output), V]."""
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = pair.target(ids).logits[0].float()
    return torch.log_softmax(logits[len(prompt) - 1: len(prompt) - 1 + len(output)], -1)


def test_token_logprobs_shapes_and_unpack():
    logits = torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 0.0]])
    host = token_logprobs(logits, torch.tensor([2, 0]), 2).tolist()
    (a, b) = unpack(host, [2, 0], 2)
    lp = torch.log_softmax(logits, -1)
    assert a.token_id == 2 and a.logprob == pytest.approx(lp[0, 2].item())
    assert [t for t, _ in a.top] == [1, 2] and a.top[0][1] == pytest.approx(lp[0, 1].item())
    assert [t for t, _ in b.top] == [0, 1] or [t for t, _ in b.top] == [0, 2]
    assert token_logprobs(logits, torch.tensor([2, 0]), 0).shape == (2, 1)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_engine_logprobs_are_the_targets_and_change_no_token(mimic16, temperature):
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9]]
    def reqs(k):
        return [(f"r{i}", p, SamplingParams(temperature=temperature, max_tokens=24, seed=7 + i,
                                            logprobs=k if i != 1 else None))
                for i, p in enumerate(prompts)]
    engine = Engine(mimic16, EngineConfig(max_batch_size=4, max_context=64), budget=Budget(0.0, 8, 2))
    accepted = []
    engine.on_step = lambda s: accepted.extend(s.accepted)
    base, none = run(engine, reqs(None))
    assert all(v is None for v in none.values())
    assert max(accepted) >= 2, "trees must accept draft tokens for the test to mean anything"
    tokens, lps = run(Engine(mimic16, EngineConfig(max_batch_size=4, max_context=64), budget=Budget(0.0, 8, 2)),
                      reqs(3))
    assert tokens == base                                            # lossless: the same tokens
    assert lps["r1"] is None                                         # only who asked gets them
    for i in (0, 2):
        out, got = tokens[f"r{i}"], lps[f"r{i}"]
        assert [x.token_id for x in got] == out and len(got) == 24  # one entry per token
        ref = reference(mimic16, prompts[i], out)
        for j, x in enumerate(got):
            assert x.logprob == pytest.approx(ref[j, out[j]].item(), abs=1e-4)
            top_v, top_i = ref[j].topk(3)
            assert [t for t, _ in x.top] == top_i.tolist()
            assert [v for _, v in x.top] == pytest.approx(top_v.tolist(), abs=1e-4)
            if temperature == 0:
                assert x.top[0][0] == x.token_id                      # greedy emits the argmax


def test_logprobs_equal_under_plain_decoding(mimic16):
    params = SamplingParams(max_tokens=16, logprobs=2)
    out = {}
    for name, budget in (("plain", Budget.off()), ("tree", Budget(0.0, 8, 2))):
        out[name] = run(Engine(mimic16, EngineConfig(max_batch_size=2, max_context=64), budget=budget),
                        [("x", [3, 1, 4], params)])
    (t_plain, l_plain), (t_tree, l_tree) = out["plain"], out["tree"]
    assert t_plain == t_tree
    assert [x.logprob for x in l_tree["x"]] == pytest.approx([x.logprob for x in l_plain["x"]], abs=1e-4)


def test_logprobs_bounds():
    for bad in (-1, 21, True, 1.5):
        with pytest.raises(ValueError, match="logprobs"):
            SamplingParams(logprobs=bad)
    assert SamplingParams(logprobs=0).logprobs == 0


def test_on_schedule_reports_each_request_once_before_its_first_token(pair64):
    engine = Engine(pair64, EngineConfig(max_batch_size=1, max_context=64))
    events: list[tuple[str, str]] = []
    engine.on_schedule = lambda rid: events.append(("scheduled", rid))
    for rid in ("a", "b", "c"):
        engine.add_request(rid, [1, 2, 3], SamplingParams(max_tokens=3))
    while engine.has_unfinished():
        for out in engine.step():
            if out.new_token_ids and ("first", out.request_id) not in events:
                events.append(("first", out.request_id))
    # max_batch_size 1: each leaves the queue only when the one before has finished
    assert events == [("scheduled", "a"), ("first", "a"), ("scheduled", "b"), ("first", "b"),
                      ("scheduled", "c"), ("first", "c")]


@pytest.mark.parametrize("budget", [Budget.off(), Budget(0.0, 8, 2)])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_captured_taps_are_the_targets_and_change_no_token(mimic16, budget, temperature):
    """``capture_taps``: the finished output holds the tapped states of every position but
    the last (prompt chunks, plain steps, accepted tree nodes, a round cut by max_tokens or
    a stop token), equal to one teacher-forced forward; the tokens are those without it."""
    from treespark.training.train import target_features
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [9]]
    def reqs():
        return [(f"r{i}", p, SamplingParams(temperature=temperature, max_tokens=11 + 3 * i, seed=3 + i,
                                            stop_token_ids=(5,) if i == 2 else ()))
                for i, p in enumerate(prompts)]
    def run_capture(capture: bool):
        engine = Engine(mimic16, EngineConfig(max_batch_size=2, max_context=64, prefill_chunk=4), budget=budget)
        tokens, taps = {rid: [] for rid, _, _ in reqs()}, {}
        for rid, prompt, params in reqs():
            engine.add_request(rid, prompt, params, capture_taps=capture)
        while engine.has_unfinished():
            for out in engine.step():
                tokens[out.request_id] += out.new_token_ids
                assert (out.taps is not None) == (capture and out.finished)
                if out.taps is not None:
                    taps[out.request_id] = out.taps
        return tokens, taps
    plain, none = run_capture(False)
    tokens, taps = run_capture(True)
    assert tokens == plain and none == {}
    layers = mimic16.drafter.config.target_layer_ids
    for rid, prompt, _ in reqs():
        seq = prompt + tokens[rid]
        ref = target_features(mimic16.target, layers, [seq], progress=False).taps
        assert taps[rid].dtype == torch.float16 and taps[rid].shape == (len(seq) - 1, ref.shape[1])
        torch.testing.assert_close(taps[rid].float(), ref[:-1].float(), atol=2e-3, rtol=2e-3)
