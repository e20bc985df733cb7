"""``POST /v1/speculation/pricing`` in-process (``serving.inprocess``, no Ray): the switch
between the cluster's price and each replica's own reaches the controller, and
``GET /v1/speculation`` shows it."""

import pytest
from serving.inprocess import LocalApi

from deployments.config import AppArgs, ControllerArgs

MODEL = "treespark-random"


def _args(**kw):
    return AppArgs(model="random", engine_factory="serving.fake_engine:build_fake_engine", max_context=256,
                   max_batch_size=2, **kw)


@pytest.fixture(scope="module")
def api():
    a = LocalApi(_args())
    yield a
    a.close()


def test_the_switch_reaches_the_controller_and_the_status_shows_it(api):
    state = api.api._controller.state
    api.beat()
    try:
        assert api.get("/v1/speculation").json()["price_source"] == "cluster"
        r = api.post("/v1/speculation/pricing", {"cluster": False})
        assert r.status == 200 and r.json() == {"cluster": False}
        assert not state.cluster_pricing and api.get("/v1/speculation").json()["price_source"] == "local"
        r = api.post("/v1/speculation/pricing", {"cluster": True})
        assert r.status == 200 and r.json() == {"cluster": True}
        assert state.cluster_pricing and api.get("/v1/speculation").json()["price_source"] == "cluster"
    finally:
        state.set_pricing(True)


@pytest.mark.parametrize("body", [{"cluster": "false"}, {"cluster": 0}, {}, ["cluster"], None])
def test_a_body_that_is_not_one_boolean_is_refused(api, body):
    r = api.post("/v1/speculation/pricing", body)
    assert r.status == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert api.api._controller.state.cluster_pricing


def test_a_config_without_controller_pricing_refuses_the_switch():
    a = LocalApi(_args(controller=ControllerArgs(pricing=False)))
    try:
        assert a.get("/v1/speculation").json()["price_source"] == "local"
        for cluster in (True, False):
            r = a.post("/v1/speculation/pricing", {"cluster": cluster})
            assert r.status == 409 and r.json()["error"]["code"] == "pricing_disabled"
        assert not a.api._controller.state.cluster_pricing
    finally:
        a.close()
