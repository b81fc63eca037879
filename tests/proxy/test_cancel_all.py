"""cancel_all ends tasks that lose a cancellation (a proxy once hung on SIGTERM so).
Pure asyncio, milliseconds."""

from __future__ import annotations

import asyncio

from sessionkv_proxy.tasks import cancel_all


async def _loses_the_first_cancellation(parked: asyncio.Event) -> None:
    """A retry loop around a call that turns CancelledError into its own error, as
    a library may: the first cancellation is lost, and the task waits again."""
    try:
        try:
            parked.set()
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            raise ConnectionError("closed while reading") from None
    except ConnectionError:
        pass
    parked.set()
    await asyncio.sleep(3600)


async def test_a_task_that_lost_its_cancellation_still_ends():
    parked = asyncio.Event()
    task = asyncio.create_task(_loses_the_first_cancellation(parked))
    await parked.wait()
    await asyncio.wait_for(cancel_all([task], recancel_after_s=0.05), timeout=30)
    assert task.cancelled()


async def test_control_one_cancellation_leaves_it_running():
    """The negative control: cancelled once, as before, the task is still waiting."""
    parked = asyncio.Event()
    task = asyncio.create_task(_loses_the_first_cancellation(parked))
    await parked.wait()
    parked.clear()
    task.cancel()
    await parked.wait()           # back in its wait after losing the cancellation
    assert not task.done()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def test_results_and_errors_are_collected():
    async def fails():
        raise RuntimeError("boom")

    async def returns():
        return 1

    tasks = [asyncio.create_task(fails()), asyncio.create_task(returns())]
    await asyncio.sleep(0)
    await cancel_all(tasks)
    assert all(t.done() for t in tasks)
