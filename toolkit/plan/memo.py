"""Results kept for the length of one layout search.

The search (toolkit.plan.search) prices thousands of candidate configurations that share most of
their sections (the same model, cluster, data ... objects: dataclasses.replace keeps them) and,
within a layout, the parameters of its stages. A function decorated `@during_search()` keeps its
results while `searching()` is active, keyed by its arguments: the first `by_identity` of them
(configuration sections: mutable dataclasses, unhashable) by identity, the others by value and
type. Outside a search it computes every time, so a configuration changed in place between two
calls is read afresh; nothing changes a configuration while a search runs. The results are kept
per thread (a context variable), and dropped when the search ends.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Callable, Iterator

# While searching (in this thread or task): (function, argument ids, values and types) -> (result, arguments held)
_results: ContextVar[dict | None] = ContextVar("toolkit_plan_memo", default=None)
_KEYWORDS = object()  # in a key, between the positional arguments and the keywords' names and values


@contextmanager
def searching() -> Iterator[None]:
    """Keep the results of `during_search` functions until the outermost `searching` ends."""
    outer = _results.get()
    token = _results.set({} if outer is None else outer)
    try:
        yield
    finally:
        _results.reset(token)


def during_search(by_identity: int = 1) -> Callable[[Callable], Callable]:
    """Keep `fn`'s results inside `searching()`: its first `by_identity` positional arguments keyed by
    identity (and held until the search ends, so that no other object takes their ids), the other
    arguments by value and type (they must be hashable). The function must be pure: the same result
    for the same arguments, and a result its callers do not change."""

    def decorate(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def kept(*args, **kwargs):
            results = _results.get()
            if results is None:
                return fn(*args, **kwargs)
            held, values = args[:by_identity], args[by_identity:]
            if kwargs:
                values = (*values, _KEYWORDS, *kwargs, *kwargs.values())
            # by value and type: 1, 1.0 and True are equal keys, but not the same argument
            key = (fn, *map(id, held), values, tuple(map(type, values)))
            found = results.get(key)
            if found is None:
                found = results[key] = fn(*args, **kwargs), held
            return found[0]

        kept.uncached = fn  # the function itself (tests compare the two)
        return kept

    return decorate
