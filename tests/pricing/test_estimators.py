"""The (a, b) acceptance fit the controller refits online."""

import math
import random

from treespark.pricing.estimators import fit_ab


def test_fit_ab_recovers_parameters():
    rng = random.Random(0)
    a, b = 1.7, -0.4
    recs = []
    for _ in range(4000):
        x, o = rng.uniform(-4, 3), rng.choice((0.0, -1.2))
        recs.append((x, rng.random() < 1 / (1 + math.exp(-(a * x + b + o))), o))
    fa, fb = fit_ab(recs)
    assert abs(fa - a) < 0.2 and abs(fb - b) < 0.2
    # the offsets matter: dropping them biases b
    _, fb0 = fit_ab([(x, y, 0.0) for x, y, _ in recs])
    assert fb0 < b - 0.3


def test_fit_ab_converges_when_acceptance_depends_weakly_on_q():
    rng = random.Random(3)
    recs = []
    for _ in range(4000):
        q = rng.random() ** 3 * 0.98 + 1e-5
        x = math.log(q / (1 - q))
        recs.append((x, rng.random() < 1 / (1 + math.exp(-(0.2 * x - 1.0))), 0.0))
    fa, fb = fit_ab(recs)
    assert abs(fa - 0.2) < 0.05 and abs(fb + 1.0) < 0.1
