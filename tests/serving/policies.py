"""Policies the serving tests pin.

``LADDER``: the hand ladder. The served default (``perstep``) measures the replica's
step costs before it serves (20-50 s on this machine), which the tests that are not
about pricing need not pay for every app they start.
"""

from deployments.config import PolicyArgs

LADDER = PolicyArgs(kind="ladder")
