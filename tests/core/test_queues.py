"""The waiting queues and policies, and a policy added from outside the scheduler loop."""

import pytest

from tests.core.helpers import PagedFakeRunner, make_request, reference_stream, run_until_done, step
from tokenweir.core.policies import POLICIES, FCFSPolicy, create_policy, priority_key
from tokenweir.core.queues import FCFSQueue, KeyedQueue
from tokenweir.request import Request


def drain(queue) -> list[str]:
    out = []
    while len(queue):
        out.append(queue.pop().request_id)
    return out


def test_fcfs_queue_keeps_arrival_order_and_push_front_restores_a_turn():
    q = FCFSQueue()
    a, b, c = (make_request(rid, 3) for rid in "abc")
    for r in (a, b, c):
        q.add(r)
    assert q.pop() is a
    q.push_front(a)  # popped but not admitted, or preempted: it keeps its place
    q.remove(b)  # aborted while waiting
    assert len(q) == 2 and {r.request_id for r in q} == {"a", "c"}
    assert drain(q) == ["a", "c"]


def test_priority_order_is_priority_then_arrival_then_id():
    q = KeyedQueue(priority_key)
    reqs = [make_request("late-urgent", 3, priority=0, arrival_time=5.0),
            make_request("early-lax", 3, priority=1, arrival_time=0.0),
            make_request("early-urgent", 3, priority=0, arrival_time=1.0),
            make_request("b-tie", 3, priority=0, arrival_time=5.0),
            make_request("a-tie", 3, priority=0, arrival_time=5.0)]
    for r in reqs:
        q.add(r)
    assert drain(q) == ["early-urgent", "a-tie", "b-tie", "late-urgent", "early-lax"]


def test_priority_scheduler_admits_waiting_requests_in_priority_order(make_scheduler):
    s = make_scheduler(policy="priority", max_num_seqs=1)
    runner = PagedFakeRunner(s.block_size)
    # Ids sort against arrival, so only the arrival tie-break puts "p0-b" first.
    for rid, prio, t in [("p2", 2, 0.0), ("p0-a", 0, 2.0), ("p1", 1, 1.0), ("p0-b", 0, 1.5)]:
        s.add_request(make_request(rid, 4, max_tokens=1, priority=prio, arrival_time=t))
    order = []
    while s.has_unfinished_requests():
        out = step(s, runner)
        order += [rid for rid in out.num_scheduled_tokens if rid not in order]
    assert order == ["p0-b", "p0-a", "p1", "p2"]


class _PreemptiveFCFS(FCFSPolicy):
    """Arrival order, but a waiting request may displace a running one of lower priority: a
    policy whose queue puts a preempted victim at the front, right where its preemptor was."""

    name = "test-preemptive-fcfs"

    def may_preempt(self, waiting: Request, victim: Request, now: float) -> bool:
        return waiting.priority < victim.priority


def test_a_new_policy_plugs_in_and_its_victim_is_not_mistaken_for_the_preemptor(make_scheduler):
    s = make_scheduler(policy=_PreemptiveFCFS(), max_num_seqs=1)
    runner = PagedFakeRunner(s.block_size)
    low = make_request("low", 6, max_tokens=5, priority=1)
    high = make_request("high", 6, max_tokens=5, priority=0)
    s.add_request(low)
    step(s, runner)
    s.add_request(high)
    out = step(s, runner)
    assert out.preempted_req_ids == {"low"} and list(out.num_scheduled_tokens) == ["high"]
    assert s.running == [high] and [r.request_id for r in s.waiting] == ["low"]
    run_until_done(s, runner)
    for r in (low, high):
        assert r.output_token_ids == reference_stream(r.prompt_token_ids, 5)


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_policy_is_reachable_by_name(name):
    assert create_policy(name).name == name
