"""Session-scoped engines that stop after the last test using them, and the module
order that keeps each shared cluster's users together (``tests/conftest.py`` uses
both; ``tests/unit/test_session_engines.py`` tests them without engines).

Every running engine holds memory (about 2 GB a tiny-model engine on the 2-core test
machine, more on the real model).  Kept to the session's end, the shared clusters ran
beside every module's own: fourteen engines at once, and CI's 24 GB machine lost
engines mid-lane (stop 54).  Stopped after their last user, with their users run
together, each runs only while it is used.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence


def uses(items, fixture: str) -> list:
    """The items (tests) that use ``fixture``, directly or through another fixture."""
    return [item for item in items if fixture in getattr(item, "fixturenames", ())]


class ReleasedAfterLastUse:
    """One ExitStack per shared fixture, closed after the last test in the run that
    uses it (:meth:`after_test`), or at the fixture's own teardown if that comes first
    (an interrupted run): closing twice is a no-op."""

    def __init__(self, fixtures: Sequence[str]) -> None:
        self.fixtures = tuple(fixtures)
        self._stacks: dict[str, contextlib.ExitStack] = {}

    def stack(self, fixture: str) -> contextlib.ExitStack:
        """The ExitStack for ``fixture``'s teardown (enter it in the fixture)."""
        if fixture not in self.fixtures:
            raise KeyError(f"{fixture} is not one of {self.fixtures}")
        stack = contextlib.ExitStack()
        self._stacks[fixture] = stack
        return stack

    def after_test(self, item, items) -> list[str]:
        """``item`` has run and its own fixtures are torn down: stop each fixture
        whose last user in ``items`` (the run's tests, in order) it was.  Returns
        the fixtures stopped."""
        stopped = []
        for fixture in list(self._stacks):
            users = uses(items, fixture)
            if users and users[-1] is item:
                self._stacks.pop(fixture).close()
                stopped.append(fixture)
        return stopped


def users_first(names: Sequence[str], modules: dict, fixtures: Sequence[str]) -> list[str]:
    """Module names (``modules``: name -> its items), those using ``fixtures[0]``
    first and together (its engines then run only while their users do), and so on
    for the rest of ``fixtures`` within each part; otherwise in collection order."""
    if not fixtures:
        return list(names)
    first, rest = fixtures[0], fixtures[1:]
    users = [name for name in names if uses(modules[name], first)]
    others = [name for name in names if name not in users]
    return users_first(users, modules, rest) + users_first(others, modules, rest)
