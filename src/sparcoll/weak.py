"""Callbacks that do not keep their object alive. A hook that a DataParallel registers on the user's
module, a thread's loop, or a communicator's threads' callback would otherwise keep the object (its
threads, model and groups) alive as long as the module or the thread, though its owner dropped it."""
from __future__ import annotations

import weakref


def weak_method(method, *args):
    """`method(*args, ...)` called through a weak reference to its object: returns what it returns,
    or None once the object is gone."""
    ref = weakref.WeakMethod(method)

    def call(*more, **kwargs):
        bound = ref()
        return None if bound is None else bound(*args, *more, **kwargs)
    return call
