"""Load shapes: how many concurrent users at each second of an experiment.

A shape is a tuple of ``Stage``s (hold ``users`` for ``duration_s``). ``users_at`` is
the pure function the Locust shape class and the experiment runner share, so the
runner's timeline knows the target user count without asking Locust. No Locust import
here (the runner imports this module next to ``requests``).

Spec strings (the ``--shape`` option):

* ``ramp:1,2,4,8,16:30``   step up through the levels, 30 s each, then back down;
* ``up:1,4,16:30``         step up only;
* ``spike:2,16:30,20,30``  ``base`` for 30 s, ``peak`` for 20 s, ``base`` for 30 s;
* ``const:8:60``           8 users for 60 s.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Stage:
    duration_s: float
    users: int

    def __post_init__(self) -> None:
        if self.duration_s <= 0 or self.users < 0:
            raise ValueError(f"a stage needs duration_s > 0 and users >= 0, got {self}")


def step_ramp(levels: tuple[int, ...], hold_s: float, down: bool = True) -> tuple[Stage, ...]:
    """Up through ``levels`` (each held ``hold_s``), then down again without repeating the top."""
    up = [Stage(hold_s, u) for u in levels]
    return tuple(up + ([Stage(hold_s, u) for u in reversed(levels[:-1])] if down else []))


def spike(base: int, peak: int, before_s: float, peak_s: float, after_s: float) -> tuple[Stage, ...]:
    return (Stage(before_s, base), Stage(peak_s, peak), Stage(after_s, base))


def constant(users: int, duration_s: float) -> tuple[Stage, ...]:
    return (Stage(duration_s, users),)


def total_duration(stages: tuple[Stage, ...]) -> float:
    return sum(s.duration_s for s in stages)


def users_at(stages: tuple[Stage, ...], t: float) -> int | None:
    """Users wanted at ``t`` seconds into the run; None once the shape is over."""
    if t < 0:
        return stages[0].users if stages else None
    for s in stages:
        if t < s.duration_s:
            return s.users
        t -= s.duration_s
    return None


def parse_shape(spec: str) -> tuple[Stage, ...]:
    """A shape from its spec string (see the module docstring)."""
    kind, _, rest = spec.partition(":")
    parts = rest.split(":")
    try:
        if kind in ("ramp", "up") and len(parts) == 2:
            levels = tuple(int(x) for x in parts[0].split(","))
            return step_ramp(levels, float(parts[1]), down=kind == "ramp")
        if kind == "spike" and len(parts) == 2:
            base, peak = (int(x) for x in parts[0].split(","))
            before, during, after = (float(x) for x in parts[1].split(","))
            return spike(base, peak, before, during, after)
        if kind == "const" and len(parts) == 2:
            return constant(int(parts[0]), float(parts[1]))
    except ValueError as err:
        raise ValueError(f"bad shape spec {spec!r}: {err}") from err
    raise ValueError(f"bad shape spec {spec!r}: expected ramp:L1,L2,..:HOLD | up:... | "
                     "spike:BASE,PEAK:BEFORE,DURING,AFTER | const:USERS:SECONDS")
