"""Per-object locks that a forked child takes fresh.

A fork copies every lock as it is: one that a thread of the parent held at that moment stays held in
the child, where that thread does not exist, and the child's first call that takes it waits for ever.
A child may go on using the Client it inherited (its first call opens a session of its own), so the
objects that Client keeps across sessions register here, and each forked child gives their ``_lock``
a new lock. Module-level locks are renewed by their own module's hook.
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import Any, TypeVar

T = TypeVar("T")

_owners: "weakref.WeakSet[Any]" = weakref.WeakSet()


def renew_in_child(owner: T) -> T:
    """Have every forked child replace ``owner._lock`` with a new lock; returns ``owner``."""
    _owners.add(owner)
    return owner


def _renew() -> None:
    # The child has one thread: nothing else reads these locks while they are replaced.
    for owner in list(_owners):
        owner._lock = threading.Lock()


os.register_at_fork(after_in_child=_renew)
