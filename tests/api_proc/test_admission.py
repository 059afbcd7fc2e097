from __future__ import annotations

import asyncio

import pytest

from api_proc.admission import AdmissionController
from api_proc.errors import OverBudget, PayloadTooLarge


async def test_grants_at_once_when_it_fits_and_releases():
    adm = AdmissionController(100, timeout_s=1)
    r1 = await adm.acquire(60)
    r2 = await adm.acquire(40)
    assert adm.in_flight_bytes == 100
    r1.release()
    r1.release()  # idempotent
    assert adm.in_flight_bytes == 40
    r2.release()
    assert adm.in_flight_bytes == 0


async def test_request_larger_than_budget_is_413_at_once():
    adm = AdmissionController(100, timeout_s=10)
    with pytest.raises(PayloadTooLarge, match="mm_inflight_budget") as e:
        await adm.acquire(101)
    assert e.value.status == 413
    assert adm.in_flight_bytes == 0 and adm.num_waiting == 0


async def test_waiters_are_served_in_fifo_order():
    adm = AdmissionController(100, timeout_s=5)
    first = await adm.acquire(100)
    order: list[str] = []

    async def want(name, n):
        r = await adm.acquire(n)
        order.append(name)
        return r

    big = asyncio.create_task(want("big", 80))
    await asyncio.sleep(0)
    small = asyncio.create_task(want("small", 10))  # would fit after a partial release
    await asyncio.sleep(0)
    assert adm.num_waiting == 2
    first.release(15)  # 85 in use: small (10) fits but must not pass the big head
    await asyncio.sleep(0.01)
    assert order == []
    first.release()
    rb, rs = await big, await small
    assert order == ["big", "small"]
    assert adm.in_flight_bytes == 90
    rb.release()
    rs.release()
    assert adm.in_flight_bytes == 0


async def test_timeout_is_429_with_a_clear_message_and_leaves_no_trace():
    adm = AdmissionController(100, timeout_s=0.05)
    held = await adm.acquire(90)
    with pytest.raises(OverBudget, match="waited") as e:
        await adm.acquire(20)
    assert e.value.status == 429
    assert adm.num_waiting == 0 and adm.in_flight_bytes == 90
    held.release()
    assert adm.in_flight_bytes == 0


async def test_timed_out_head_lets_the_next_waiters_in():
    adm = AdmissionController(100, timeout_s=5)
    held = await adm.acquire(50)
    head = asyncio.create_task(adm.acquire(80, timeout_s=0.05))
    await asyncio.sleep(0)
    nxt = asyncio.create_task(adm.acquire(30))
    with pytest.raises(OverBudget):
        await head
    r = await asyncio.wait_for(nxt, 1)
    assert adm.in_flight_bytes == 80
    r.release()
    held.release()
    assert adm.in_flight_bytes == 0


async def test_cancelled_waiter_is_removed():
    adm = AdmissionController(100, timeout_s=5)
    held = await adm.acquire(100)
    waiter = asyncio.create_task(adm.acquire(10))
    await asyncio.sleep(0)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert adm.num_waiting == 0
    held.release()
    assert adm.in_flight_bytes == 0


async def test_cancel_in_the_same_tick_as_the_grant_gives_bytes_back():
    adm = AdmissionController(100, timeout_s=5)
    held = await adm.acquire(100)
    waiter = asyncio.create_task(adm.acquire(10))
    await asyncio.sleep(0)
    held.release()  # grants the waiter ...
    waiter.cancel()  # ... which is cancelled before it runs
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert adm.in_flight_bytes == 0 and adm.num_waiting == 0


async def test_shrink_keeps_only_what_is_asked():
    adm = AdmissionController(100, timeout_s=5)
    r = await adm.acquire(70)
    waiter = asyncio.create_task(adm.acquire(60))
    await asyncio.sleep(0)
    r.shrink_to(30)
    assert adm.in_flight_bytes == 90
    (await waiter).release()
    r.release()
    assert adm.in_flight_bytes == 0


async def test_many_concurrent_requests_never_exceed_budget():
    adm = AdmissionController(1000, timeout_s=5)
    peak = 0

    async def one(n):
        nonlocal peak
        reservation = await adm.acquire(n)
        try:
            peak = max(peak, adm.in_flight_bytes)
            await asyncio.sleep(0.001 * (n % 3))
        finally:
            reservation.release()

    await asyncio.gather(*(one(50 + (i * 37) % 400) for i in range(200)))
    assert peak <= 1000
    assert adm.in_flight_bytes == 0 and adm.num_waiting == 0


async def test_priority_waiters_go_ahead_of_new_requests_in_fifo_order():
    adm = AdmissionController(100, timeout_s=5)
    held = await adm.acquire(100)
    order: list[str] = []

    async def want(name, n, priority=False):
        r = await adm.acquire(n, priority=priority)
        order.append(name)
        return r

    tasks = [asyncio.create_task(want("new", 10))]
    await asyncio.sleep(0)
    tasks.append(asyncio.create_task(want("first exchange", 50, priority=True)))
    await asyncio.sleep(0)
    tasks.append(asyncio.create_task(want("second exchange", 40, priority=True)))
    await asyncio.sleep(0)
    held.release()
    for r in await asyncio.gather(*tasks):
        r.release()
    assert order == ["first exchange", "second exchange", "new"]
    assert adm.in_flight_bytes == 0


async def test_priority_request_that_fits_is_granted_past_waiting_new_requests():
    adm = AdmissionController(100, timeout_s=5)
    held = await adm.acquire(60)
    new = asyncio.create_task(adm.acquire(50))
    await asyncio.sleep(0)
    exchange = await adm.acquire(40, priority=True)  # fits now; the new one still waits
    assert adm.num_waiting == 1 and adm.in_flight_bytes == 100
    exchange.release()
    held.release()
    (await new).release()
    assert adm.in_flight_bytes == 0


async def test_exchange_keeps_a_reservation_that_already_covers_the_need():
    adm = AdmissionController(100, timeout_s=5)
    body = await adm.acquire(70)
    pixels = await adm.exchange(body, 30)
    assert (body.nbytes, pixels.nbytes, adm.in_flight_bytes) == (0, 30, 30)
    body.release()  # emptied: nothing more comes back
    pixels.release()
    assert adm.in_flight_bytes == 0


async def test_exchange_gives_the_body_back_and_waits_ahead_of_new_requests():
    adm = AdmissionController(100, timeout_s=5)
    other = await adm.acquire(50)
    body = await adm.acquire(40)
    new = asyncio.create_task(adm.acquire(10))  # fits now: granted at once
    r_new = await new
    late = asyncio.create_task(adm.acquire(60))  # waits
    await asyncio.sleep(0)
    exchange = asyncio.create_task(adm.exchange(body, 80))  # 40 back, then 80 with priority
    await asyncio.sleep(0)
    assert body.nbytes == 0 and adm.in_flight_bytes == 60 and adm.num_waiting == 2
    other.release()
    r_new.release()
    pixels = await exchange
    assert pixels.nbytes == 80 and not late.done()
    pixels.release()
    (await late).release()
    assert adm.in_flight_bytes == 0


async def test_exchange_for_more_than_the_budget_is_413_and_leaves_the_body_to_its_owner():
    adm = AdmissionController(100, timeout_s=5)
    body = await adm.acquire(40)
    with pytest.raises(PayloadTooLarge):
        await adm.exchange(body, 101)
    assert body.nbytes == 40
    body.release()
    assert adm.in_flight_bytes == 0 and adm.num_waiting == 0


async def test_absorb_merges_reservations():
    adm = AdmissionController(100, timeout_s=5)
    a, b = await adm.acquire(30), await adm.acquire(20)
    a.absorb(b)
    assert (a.nbytes, b.nbytes) == (50, 0)
    b.release()
    assert adm.in_flight_bytes == 50
    a.release()
    assert adm.in_flight_bytes == 0
