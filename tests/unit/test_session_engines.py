"""tests/session_engines.py without engines: a shared fixture's teardown runs after
its last user and only then, and the module order puts each shared fixture's users
first and together, nested in the order the fixtures are named."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from session_engines import ReleasedAfterLastUse, users_first


def _item(*fixtures: str) -> SimpleNamespace:
    return SimpleNamespace(fixturenames=("request", *fixtures))


def test_a_fixture_stops_after_its_last_user_and_not_before():
    items = [_item("a"), _item(), _item("a", "b"), _item("b"), _item()]
    released = ReleasedAfterLastUse(("a", "b"))
    stopped: list[str] = []
    for name in ("a", "b"):
        released.stack(name).callback(stopped.append, name)
    seen = [released.after_test(item, items) for item in items]
    assert seen == [[], [], ["a"], ["b"], []]
    assert stopped == ["a", "b"]


def test_the_fixture_teardown_after_an_early_stop_stops_nothing_twice():
    items = [_item("a")]
    released = ReleasedAfterLastUse(("a",))
    stopped: list[str] = []
    with released.stack("a") as stack:
        stack.callback(stopped.append, "a")
        assert released.after_test(items[0], items) == ["a"]
    assert stopped == ["a"]


def test_a_fixture_never_set_up_is_not_stopped():
    items = [_item("a")]
    released = ReleasedAfterLastUse(("a", "b"))
    assert released.after_test(items[0], items) == []


def test_an_unknown_fixture_is_refused():
    with pytest.raises(KeyError, match="c is not one of"):
        ReleasedAfterLastUse(("a", "b")).stack("c")


def test_users_come_first_together_nested_in_the_named_order():
    modules = {
        "m1": [_item()],
        "m2": [_item("pd"), _item()],
        "m3": [_item("plain")],
        "m4": [_item("pd", "2p2d")],
        "m5": [_item()],
        "m6": [_item("pd")],
        "m7": [_item("plain")],
        "m8": [_item("pd", "2p2d")],
    }
    order = users_first(list(modules), modules, ("pd", "2p2d", "plain"))
    assert order == ["m4", "m8", "m2", "m6", "m3", "m7", "m1", "m5"]
    assert sorted(order) == sorted(modules)


def test_without_shared_fixtures_the_order_is_collection_order():
    modules = {name: [_item()] for name in ("z", "a", "m")}
    assert users_first(list(modules), modules, ("pd",)) == ["z", "a", "m"]
