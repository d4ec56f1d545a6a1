"""The service FIFO on its own: order, bounds, and waiters that leave."""

import asyncio

import pytest

from strata_serve.service import Claim, QueueFull, ServiceFIFO


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
    fifo.release(0)
    await waiters[0]
    fifo.release(0)
    await waiters[1]
    fifo.release(0)
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
    fifo.release(0)
    await asyncio.wait_for(stayer, 1)
    assert fifo.holders == 1
    fifo.release(0)
    assert fifo.idle


async def test_turn_granted_while_being_cancelled_is_passed_on():
    fifo = ServiceFIFO(capacity=1, limit=5)
    await fifo.acquire()
    first = asyncio.create_task(fifo.acquire())
    second = asyncio.create_task(fifo.acquire())
    await asyncio.sleep(0)
    fifo.release(0)  # hands the turn to `first`...
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
    fifo.release(2)
    await asyncio.wait_for(blocked, 1)


# -- several slots ---------------------------------------------------------------------


async def test_a_conversation_waits_for_its_own_turn_while_others_go_ahead():
    fifo = ServiceFIFO(capacity=2, limit=10)
    first = await fifo.acquire(Claim(key="a"))
    same = asyncio.create_task(fifo.acquire(Claim(key="a")))
    other = asyncio.create_task(fifo.acquire(Claim(key="b")))
    await asyncio.sleep(0)
    assert not same.done(), "one conversation never runs in two slots"
    assert other.done() and other.result() != first, "the next conversation is not held back"
    fifo.release(first)
    assert await asyncio.wait_for(same, 1) == first


async def test_a_waiter_for_one_slot_gets_that_slot():
    fifo = ServiceFIFO(capacity=3, limit=10)
    held = await fifo.acquire(Claim(slot=1))
    assert held == 1
    again = asyncio.create_task(fifo.acquire(Claim(slot=1)))
    anywhere = asyncio.create_task(fifo.acquire())
    await asyncio.sleep(0)
    assert not again.done() and anywhere.result() == 0
    fifo.release(1)
    assert await asyncio.wait_for(again, 1) == 1


async def test_an_exclusive_claim_waits_for_every_slot_and_holds_back_those_behind():
    fifo = ServiceFIFO(capacity=2, limit=10)
    running = await fifo.acquire(Claim(key="a"))
    everything = asyncio.create_task(fifo.acquire(exclusive=True))
    later = asyncio.create_task(fifo.acquire(Claim(key="b")))
    await asyncio.sleep(0)
    assert not everything.done() and not later.done(), "nobody passes a waiting exclusive claim"
    fifo.release(running)
    assert await asyncio.wait_for(everything, 1) == -1 and fifo.holders == 1
    await asyncio.sleep(0)
    assert not later.done()
    fifo.release(-1)
    await asyncio.wait_for(later, 1)
    fifo.release(later.result())
    assert fifo.idle


async def test_the_chooser_places_a_claim_among_the_free_slots():
    asked = []

    def chooser(claim, free):
        asked.append((claim.key, list(free)))
        return free[-1]

    fifo = ServiceFIFO(capacity=3, limit=10, chooser=chooser)
    assert await fifo.acquire(Claim(key="a")) == 2
    assert await fifo.acquire(Claim(key="b")) == 1
    assert asked == [("a", [0, 1, 2]), ("b", [0, 1])]


def test_a_slot_is_chosen_by_what_displacing_it_costs():
    from strata_serve.slot_state import SlotRegistry
    from strata_serve.service import Service

    service = Service.__new__(Service)
    picture = service.slots = SlotRegistry.for_engine(4)
    # 0: the least recently used conversation; 1: another, more recent; 2: a file current;
    # 3: nothing nameable.
    for n, (key, last, current) in enumerate([("a", 1, False), ("b", 5, False), ("c", 3, True), (None, 9, False)]):
        picture[n].key, picture[n].tokens, picture[n].last_request, picture[n].file_current = key, 100, last, current
    assert service.choose_slot(Claim(key="new"), [0, 1, 2, 3]) == 3
    assert service.choose_slot(Claim(key="new"), [0, 1, 2]) == 2
    assert service.choose_slot(Claim(key="new"), [0, 1]) == 0
    assert service.choose_slot(Claim(), [0, 1]) == 0, "an unkeyed request is placed alike"
    assert service.choose_slot(Claim(key="b"), [0, 1, 2]) == 1, "a conversation goes to its own slot"
    assert service.choose_slot(Claim(key="b"), [0, 2]) is None, "and waits for it when it is busy"
    picture[0].tokens = 0
    assert service.choose_slot(Claim(key="new"), [0, 1, 2, 3]) == 0, "an empty slot first"
