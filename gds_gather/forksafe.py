"""Locks that survive fork(): a child gets fresh locks in every live object that asked for it.

A lock held by another thread of the parent at the moment of fork() stays held forever in the child (that thread
does not exist there), so the child's first read on an inherited Table would hang. Objects name their lock
attributes in `_FORK_LOCKS` and call `track(self)`; hooks registered with `on_child` run after that (e.g. the row
cache forgets the parent's caches, which another parent thread may have been changing mid-fork).
"""
from __future__ import annotations

import os
import threading
import weakref

_RLOCK = type(threading.RLock())
_LIVE: weakref.WeakSet = weakref.WeakSet()
_HOOKS: list = []


def track(obj) -> None:
    """Give `obj`'s locks (the attributes named in obj._FORK_LOCKS) fresh ones in a forked child."""
    _LIVE.add(obj)


def on_child(fn) -> None:
    """Run fn() in a forked child, after the locks are fresh."""
    _HOOKS.append(fn)


def _after_fork_in_child() -> None:
    for obj in list(_LIVE):
        for name in getattr(obj, "_FORK_LOCKS", ()):
            old = getattr(obj, name, None)
            if old is not None:
                setattr(obj, name, threading.RLock() if isinstance(old, _RLOCK) else threading.Lock())
    for fn in _HOOKS:
        fn()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
