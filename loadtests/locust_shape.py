"""``SpecShape``: the Locust load shape both locustfiles run (``--shape``, a
``loadtests.shapes`` spec), stepped at once: the spawn rate is high, so users join within
a tick. Kept apart from ``loadtests.shapes``, which imports no Locust."""

from __future__ import annotations

from locust import LoadTestShape

from loadtests.shapes import parse_shape, users_at


class SpecShape(LoadTestShape):
    """The ``--shape`` spec, stepped at once."""

    _stages = None

    def tick(self):
        if self._stages is None:
            self._stages = parse_shape(self.runner.environment.parsed_options.shape)
        users = users_at(self._stages, self.get_run_time())
        return None if users is None else (users, 100)
