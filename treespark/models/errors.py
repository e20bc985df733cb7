"""Why a model could not be loaded, in one line (no torch: the serving side catches these).

``ModelLoadError``: a target or drafter that cannot be loaded (a bad path, no network
for a hub id). ``DrafterCheckpointError``: a drafter checkpoint refused by
``treespark.models.checkpoint``, its message naming the key, tensor or shape. Both are
``ValueError``s, so a command reports them as one line and a replica as its reason for
being unhealthy, never as a traceback.
"""

from __future__ import annotations


class ModelLoadError(ValueError):
    """A model that cannot be loaded, said in one line (a bad path, a refused checkpoint)."""


class DrafterCheckpointError(ModelLoadError):
    """A drafter checkpoint this drafter cannot load as it is; the message names what."""
