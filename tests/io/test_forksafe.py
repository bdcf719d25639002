"""forksafe: a child forked while the parent holds an object's locks gets fresh ones of the same kind (else its
first read would wait forever on a lock no thread of the child holds), and the on_child hooks run after."""
from __future__ import annotations

import os
import threading

import pytest

from gds_gather.io import forksafe

SEEN = {}


class Locked:

    def __init__(self):
        self.lock, self.rlock, self.absent = threading.Lock(), threading.RLock(), None
        forksafe.track(self, "lock", "rlock", "absent")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork() here")
def test_child_gets_fresh_locks():
    obj = Locked()
    forksafe.on_child(lambda: SEEN.update(hook=obj.lock.locked()))     # runs after the locks are replaced
    obj.lock.acquire()
    obj.rlock.acquire()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:        # the child: report, then leave without running the parent's exit handlers
        try:
            ok = (obj.lock.acquire(blocking=False) and obj.rlock.acquire(blocking=False)
                  and type(obj.rlock) is type(threading.RLock()) and obj.absent is None and SEEN == {"hook": False})
            os.write(w, b"ok" if ok else b"held")
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        got = f.read()
    os.waitpid(pid, 0)
    assert got == b"ok"
    assert obj.lock.locked() and "hook" not in SEEN         # the parent's lock stays held; its hooks did not run
    obj.lock.release()
    obj.rlock.release()
