"""The service FIFO on its own: order, bounds, and waiters that leave."""

import asyncio

import pytest

from strata_serve.service import QueueFull, ServiceFIFO


async def test_one_holder_at_a_time_in_arrival_order():
    fifo = ServiceFIFO(capacity=1, limit=10)
    order, active = [], []

    async def worker(n):
        async with fifo.hold():
            active.append(n)
            assert len(active) == 1, "two holders at once"
            await asyncio.sleep(0.01)
            order.append(n)
            active.remove(n)

    tasks = []
    for n in range(8):
        tasks.append(asyncio.create_task(worker(n)))
        await asyncio.sleep(0)  # arrival order = creation order
    await asyncio.gather(*tasks)
    assert order == list(range(8))
    assert fifo.idle


async def test_queue_limit_refuses_past_the_bound():
    fifo = ServiceFIFO(capacity=1, limit=2)
    await fifo.acquire()
    waiters = [asyncio.create_task(fifo.acquire()) for _ in range(2)]
    await asyncio.sleep(0)
    with pytest.raises(QueueFull):
        await fifo.acquire()
    fifo.release()
    await waiters[0]
    fifo.release()
    await waiters[1]
    fifo.release()
    assert fifo.idle


async def test_cancelled_waiter_leaves_without_taking_a_turn():
    fifo = ServiceFIFO(capacity=1, limit=5)
    await fifo.acquire()
    leaver = asyncio.create_task(fifo.acquire())
    stayer = asyncio.create_task(fifo.acquire())
    await asyncio.sleep(0)
    assert fifo.waiting == 2
    leaver.cancel()
    await asyncio.sleep(0)
    assert fifo.waiting == 1
    fifo.release()
    await asyncio.wait_for(stayer, 1)
    assert fifo.holders == 1
    fifo.release()
    assert fifo.idle


async def test_turn_granted_while_being_cancelled_is_passed_on():
    fifo = ServiceFIFO(capacity=1, limit=5)
    await fifo.acquire()
    first = asyncio.create_task(fifo.acquire())
    second = asyncio.create_task(fifo.acquire())
    await asyncio.sleep(0)
    fifo.release()  # hands the turn to `first`...
    first.cancel()  # ...which is cancelled before it runs
    with pytest.raises(asyncio.CancelledError):
        await first
    await asyncio.wait_for(second, 1)
    assert fifo.holders == 1


async def test_capacity_above_one_admits_that_many():
    fifo = ServiceFIFO(capacity=3, limit=5)
    for _ in range(3):
        await fifo.acquire()
    assert fifo.holders == 3
    blocked = asyncio.create_task(fifo.acquire())
    await asyncio.sleep(0)
    assert not blocked.done()
    fifo.release()
    await asyncio.wait_for(blocked, 1)
