"""Locks that survive fork(): a child gets fresh locks in every live object that asked for it.

A lock held by another thread of the parent at the moment of fork() stays held forever in the child (that thread
does not exist there), so the child's first read on an inherited Table would hang. Objects call `track(self,
"lock", ...)` with the names of their lock attributes; hooks registered with `on_child` run after that (e.g. the
row cache forgets the parent's caches, which another parent thread may have been changing mid-fork).
"""
from __future__ import annotations

import os
import threading
import weakref

_RLOCK = type(threading.RLock())
_LIVE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()     # object -> names of its lock attributes
_HOOKS: list = []


def track(obj, *locks: str) -> None:
    """Give `obj`'s locks (its attributes named `locks`) fresh ones in a forked child."""
    _LIVE[obj] = locks


def on_child(fn) -> None:
    """Run fn() in a forked child, after the locks are fresh."""
    _HOOKS.append(fn)


def _after_fork_in_child() -> None:
    for obj, names in list(_LIVE.items()):
        for name in names:
            old = getattr(obj, name, None)
            if old is not None:
                setattr(obj, name, threading.RLock() if isinstance(old, _RLOCK) else threading.Lock())
    for fn in _HOOKS:
        fn()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
