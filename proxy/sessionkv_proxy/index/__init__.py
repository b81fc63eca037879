"""Where prompt blocks live: the ``KVIndex`` interface and its backends.

``MemoryIndex`` (in-process, the default) is exported here.  ``RedisIndex``, for
several proxy replicas sharing one index, is imported from ``.redis`` explicitly so
that the redis client is only needed when that backend is chosen.
"""

from . import base
from .base import (TIER_DEVICE, TIER_HOST, TIER_STORAGE, EngineHash, KVIndex, PrefixMatch,
                   PublishedHandles, RouteRead)
from .memory import MemoryIndex

__all__ = sorted([*base.__all__, "MemoryIndex"])
