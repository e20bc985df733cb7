"""Position-keyed Gumbel noise (``treespark.spec.gumbel``): the hash is lowbias32 to the
bit, its uniforms are uniform and independent across seeds, indices and tokens, and the
Gumbel-max draw of fixed logits over many seeds follows the target's distribution (with
temperature and top-p); Gumbel-top-k draws without replacement; slicing the vocabulary
changes nothing."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare, kstest

from treespark.spec import gumbel
from treespark.spec.gumbel import (
    keyed_argmax,
    keyed_gumbel,
    keyed_top_k,
    keyed_uniforms,
    mix32,
    position_keys,
    seed_words,
)
from treespark.spec.sampling import target_probs


def lowbias32(x: int) -> int:
    """Wellons' lowbias32 in Python integers: the reference."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def keys_of(seeds, index) -> torch.Tensor:
    """[N, 2] keys of (seed_i, index_i)."""
    words = torch.tensor([seed_words(s) for s in seeds], dtype=torch.long)
    return position_keys(words[:, 0], words[:, 1], torch.as_tensor(index, dtype=torch.long).expand(len(seeds)))


def chi2(samples: torch.Tensor, p: torch.Tensor) -> float:
    """The chi-square p-value of ``samples`` (ids) against the distribution ``p`` (bins
    below 5 expected pooled)."""
    n = samples.numel()
    observed = torch.bincount(samples, minlength=p.numel()).double()
    expected = p.double() * n
    big = expected >= 5
    obs = torch.cat([observed[big], observed[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    if exp[-1] < 5:
        obs, exp = obs[:-1], exp[:-1]
    return float(chisquare(obs.numpy(), (exp * obs.sum() / exp.sum()).numpy()).pvalue)


def test_mix32_is_lowbias32_to_the_bit():
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.tensor([0, 1, 2**31 - 1, 2**31, 2**32 - 1]), torch.randint(0, 2**32, (2000,), generator=g)])
    assert mix32(x).tolist() == [lowbias32(v) for v in x.tolist()]
    assert int(mix32(x).max()) < 2**32 and int(mix32(x).min()) >= 0


def test_uniforms_are_uniform_in_the_open_interval_and_the_same_on_a_second_call():
    keys = keys_of(range(50), 7)
    u = keyed_uniforms(keys, torch.arange(4000))                      # 200,000 values
    assert u.dtype == torch.float64 and 0 < float(u.min()) and float(u.max()) < 1
    assert kstest(u.flatten().numpy(), "uniform").pvalue > 1e-3
    assert torch.equal(u, keyed_uniforms(keys_of(range(50), 7), torch.arange(4000)))
    # 52 bits: no two of them equal (a 32-bit uniform would repeat ~5 times in 200,000)
    assert u.unique().numel() == u.numel()


@pytest.mark.parametrize("other", ["seed", "high seed word", "index", "token"])
def test_neighbouring_seeds_indices_and_tokens_draw_independent_uniforms(other):
    """U(seed, n, v) against its neighbour along one coordinate: uncorrelated, and the
    pair uniform on the unit square (a 10 x 10 chi-square)."""
    seeds, n, tokens = list(range(100)), 1000, torch.arange(1000)
    a = keyed_uniforms(keys_of(seeds, n), tokens)
    if other == "token":
        b = keyed_uniforms(keys_of(seeds, n), tokens + 1)
    else:
        shift = {"seed": 1, "high seed word": 2**32, "index": 0}[other]
        b = keyed_uniforms(keys_of([s + shift for s in seeds], n + (other == "index")), tokens)
    a, b = a.flatten().numpy(), b.flatten().numpy()                  # 100,000 pairs
    assert abs(np.corrcoef(a, b)[0, 1]) < 5 / np.sqrt(a.size)
    cells = np.bincount((a * 10).astype(int) * 10 + (b * 10).astype(int), minlength=100)
    assert chisquare(cells).pvalue > 1e-3


def test_seeds_are_taken_modulo_2_64():
    assert seed_words(-1) == seed_words(2**64 - 1) == (2**32 - 1, 2**32 - 1)
    assert seed_words(2**32 + 5) == (5, 1)
    assert not torch.equal(keys_of([5], 3), keys_of([2**32 + 5], 3))


LOGITS = torch.tensor([1.2, -0.3, 0.4, 2.0, -1.5, 0.9])


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.5, 1.0), (2.0, 1.0), (1.0, 0.7)])
def test_the_keyed_draw_over_many_seeds_follows_the_target(temperature, top_p):
    n = 20_000
    keys = keys_of(range(n), 12)
    x = keyed_argmax(LOGITS.expand(n, -1), torch.full((n,), temperature, dtype=torch.float64),
                     None if top_p == 1 else torch.full((n,), top_p, dtype=torch.float64), keys, torch.arange(n))
    p = target_probs(LOGITS, temperature, top_p)
    assert chi2(x, p) > 1e-3
    if top_p < 1:
        assert set(x.unique().tolist()) == set(torch.nonzero(p).flatten().tolist())   # the nucleus, all of it
    # the check has teeth: the same draws against the distribution at another temperature
    assert chi2(x, target_probs(LOGITS, 1.3 * temperature, top_p)) < 1e-6


def test_two_positions_of_one_seed_draw_independently():
    """x_3 from fixed logits, then x_4 from a table of logits indexed by x_3 (a bigram
    model), over 200,000 seeds: the joint law of (x_3, x_4) is the model's."""
    n, v = 200_000, 16
    g = torch.Generator().manual_seed(0)
    first, table = torch.randn(v, generator=g) * 1.5, torch.randn(v, v, generator=g) * 1.5
    seeds, t, rows = torch.arange(n), torch.ones(n, dtype=torch.float64), torch.arange(n)
    x3 = keyed_argmax(first.expand(n, -1), t, None, position_keys(seeds, 0 * seeds, 3 + 0 * seeds), rows)
    x4 = keyed_argmax(table[x3], t, None, position_keys(seeds, 0 * seeds, 4 + 0 * seeds), rows)
    joint = torch.softmax(first.double(), -1)[:, None] * torch.softmax(table.double(), -1)
    assert chi2(x3 * v + x4, joint.flatten()) > 1e-3


def test_gumbel_top_k_draws_without_replacement():
    """The first two of Gumbel-top-2 over many seeds: P(a, b) = q_a q_b / (1 - q_a)."""
    n, v = 20_000, 5
    log_q = torch.log_softmax(LOGITS[:v], -1)
    ids = keyed_top_k(log_q.expand(n, -1), keys_of(range(n), 3), torch.arange(v), 2)
    q = log_q.exp().double()
    pairs = (q[:, None] * q[None, :] / (1 - q[:, None])).fill_diagonal_(0).flatten()
    assert (ids[:, 0] != ids[:, 1]).all()
    assert chi2(ids[:, 0] * v + ids[:, 1], pairs) > 1e-3


def test_the_noise_of_a_draft_token_is_its_target_tokens():
    """keyed_top_k takes each draft index's noise at its target token id: a reduced draft
    vocabulary ranks its tokens as the full one does."""
    keys = keys_of(range(40), 9)
    log_q = torch.randn(40, 64, generator=torch.Generator().manual_seed(1))
    d2t = torch.tensor([3, 10, 17, 30, 41, 63])
    full = torch.full((40, 64), float("-inf"))
    full[:, d2t] = log_q[:, d2t]
    assert torch.equal(d2t[keyed_top_k(log_q[:, d2t], keys, d2t, 3)], keyed_top_k(full, keys, torch.arange(64), 3))


def test_slices_of_the_vocabulary_change_nothing(monkeypatch):
    g = torch.Generator().manual_seed(2)
    n, vocab = 12, 3000
    logits = torch.randn(n, vocab, generator=g) * 3
    t = torch.rand(n, generator=g, dtype=torch.float64) + 0.3
    top_p = torch.where(torch.arange(n) % 3 == 0, 0.8, 1.0).double()
    keys = keys_of(range(4), torch.tensor([5, 6, 7, 8]))
    key_of = torch.arange(n) % 4
    whole = keyed_argmax(logits, t, top_p, keys, key_of)
    top = keyed_top_k(logits, keys[key_of], torch.arange(vocab), 4)
    monkeypatch.setattr(gumbel, "CACHE_ELEMENTS", 64 * n)         # the narrowest slices: 512 tokens
    assert len(gumbel._vocab_slices(n, vocab, logits.device)) == 6
    assert torch.equal(keyed_argmax(logits, t, top_p, keys, key_of), whole)
    assert torch.equal(keyed_top_k(logits, keys[key_of], torch.arange(vocab), 4), top)
    # the definition written out: argmax over the nucleus of logits / T + G
    scores = logits.double() / t[:, None] + keyed_gumbel(keys, torch.arange(vocab))[key_of]
    outside = torch.stack([target_probs(logits[i], float(t[i]), float(top_p[i])) == 0 for i in range(n)])
    assert torch.equal(whole, scores.masked_fill(outside, float("-inf")).argmax(-1))


def test_a_rows_draw_does_not_depend_on_its_neighbours_top_p_and_a_tiny_temperature_is_argmax():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 500, generator=g)
    keys = keys_of([1, 2], 4)
    t = torch.tensor([1.0, 1.0], dtype=torch.float64)
    alone = keyed_argmax(logits[:1], t[:1], None, keys[:1], torch.arange(1))
    mixed = keyed_argmax(logits, t, torch.tensor([1.0, 0.5], dtype=torch.float64), keys, torch.arange(2))
    assert mixed[0] == alone[0]
    tiny = torch.tensor([5e-324, 5e-324], dtype=torch.float64)
    assert torch.equal(keyed_argmax(logits, tiny, None, keys, torch.arange(2)), logits.argmax(-1))
