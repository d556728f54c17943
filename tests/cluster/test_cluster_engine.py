"""The cluster end to end: real Ray actors, real process kills. Greedy output equals
transformers' whatever replica serves a request and through a replica's death (SIGKILL) or hang
(SIGSTOP); streams neither repeat nor skip a token across a failover; a seeded sampled request
keeps its random stream; prefix affinity sends a shared prefix where it is cached; aborts and
bad input lose nothing else."""

from __future__ import annotations

import asyncio
import ipaddress
import os
import signal
import time

import pytest

from tests.server.conftest import wait_until
from tests.engine.helpers import greedy_oracle
from tokenweir import SamplingParams
from tokenweir.engine.output import RequestOutput

NUM_NEW = 40
PROMPTS = {f"r{i}": [3 + (13 * i + j) % 90 for j in range(12 + 6 * i)] for i in range(6)}
GREEDY = SamplingParams(max_tokens=NUM_NEW, min_tokens=NUM_NEW, temperature=0.0)
SEEDED = SamplingParams(max_tokens=NUM_NEW, min_tokens=NUM_NEW, temperature=0.8, top_p=0.9, seed=5, logprobs=1)


@pytest.fixture(scope="module")
def oracle(tiny_model_dir) -> dict[str, list[int]]:
    return greedy_oracle(tiny_model_dir("llama"), PROMPTS, NUM_NEW)


async def stream(cluster, rid: str, prompt: list[int], params: SamplingParams,
                 on_progress=None) -> tuple[RequestOutput, list[int]]:
    """The final output, and the token ids the stream's outputs added one after another."""
    outputs = await cluster.add_request(rid, prompt, params)
    seen: list[int] = []
    last = None
    async for output in outputs:
        tokens = output.outputs[0].token_ids
        assert tokens[:len(seen)] == seen, "an output rewrote tokens already streamed"
        seen.extend(tokens[len(seen):])
        if on_progress is not None:
            on_progress(rid, len(seen))
        last = output
    return last, seen


def run_all(cluster, requests: dict[str, tuple[list[int], SamplingParams]], on_progress=None):
    async def main():
        return await asyncio.gather(*[stream(cluster, rid, p, params, on_progress)
                                      for rid, (p, params) in requests.items()])
    return dict(zip(requests, asyncio.run(main())))


def test_greedy_output_equals_transformers_on_every_replica(cluster, oracle):
    before = [s.prefix_cache.requests for s in cluster.replica_stats()]
    results = run_all(cluster, {rid: (p, GREEDY) for rid, p in PROMPTS.items()})
    for rid, (final, seen) in results.items():
        assert final.finished and final.outputs[0].token_ids == oracle[rid] == seen
    served = [s.prefix_cache.requests - b for s, b in zip(cluster.replica_stats(), before)]
    assert sum(served) == len(PROMPTS) and min(served) > 0, served  # both replicas served


def test_prefix_affinity_sends_a_shared_prefix_where_it_is_cached(cluster):
    system = [[5 + (i * 31 + j) % 80 for j in range(64)] for i in range(2)]  # 4 full blocks each
    before = [(s.prefix_cache.hits, s.prefix_cache.requests) for s in cluster.replica_stats()]
    params = SamplingParams(max_tokens=2, temperature=0.0)
    # One at a time, alternating system prompts: round robin would put each on the replica
    # that does not hold it half the time; affinity finds its blocks every time after the first.
    for i in range(8):
        run_all(cluster, {f"p{i}": (system[i % 2] + [7 + i, 9], params)})
    hits = sum(s.prefix_cache.hits - b[0] for s, b in zip(cluster.replica_stats(), before))
    assert hits == 6 * 64, hits  # every request after the first of its system prompt: all 4 blocks


def kill_busiest_when(cluster, sig: int, progress: dict[str, int], minimum: int):
    """An on_progress callback that sends `sig` to the replica holding most requests, once every
    request has streamed `minimum` tokens. Returns (callback, [the pid it signalled, when])."""
    killed: list = []

    def on_progress(rid: str, n: int) -> None:
        progress[rid] = n
        if not killed and len(progress) == len(PROMPTS) and min(progress.values()) >= minimum:
            counts, pids = cluster.replica_num_requests(), cluster.replica_pids()
            busiest = max(range(len(counts)), key=counts.__getitem__)
            assert counts[busiest] and pids[busiest] is not None, (counts, pids)
            killed.extend([pids[busiest], time.monotonic()])
            os.kill(pids[busiest], sig)
    return on_progress, killed


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "hung"])
def test_failover_continues_every_stream_without_repeating_or_skipping(cluster, oracle, sig):
    requests = {rid: (p, SEEDED if rid in ("r1", "r4") else GREEDY) for rid, p in PROMPTS.items()}
    undisturbed = run_all(cluster, requests)
    pids = cluster.replica_pids()
    progress: dict[str, int] = {}
    on_progress, killed = kill_busiest_when(cluster, sig, progress, minimum=3)
    try:
        results = run_all(cluster, {f"{rid}-f": r for rid, r in requests.items()}, on_progress)
    finally:
        if killed and sig == signal.SIGSTOP:
            os.kill(killed[0], signal.SIGCONT)  # let the killed-by-now process exit (or the test's end)
    assert killed, "the failure was never injected"
    killed_at = killed[1]
    for rid in requests:
        final, seen = results[f"{rid}-f"]
        expected = undisturbed[rid][0].outputs[0]
        # Greedy and seeded alike: the same tokens as without the failure, each streamed once.
        assert final.finished and seen == final.outputs[0].token_ids == expected.token_ids
        assert final.outputs[0].text == expected.text
        # A resumed request keeps its first token's time (every stream had tokens before the kill).
        assert final.metrics.first_token_time is not None and final.metrics.first_token_time < killed_at
        if rid in ("r1", "r4"):
            assert [list(e) for e in final.outputs[0].logprobs] == [list(e) for e in expected.logprobs]
        else:
            assert seen == oracle[rid]
    wait_until(lambda: None not in cluster.replica_pids(), "the replica's restart", 120.0)
    assert killed[0] not in cluster.replica_pids() and set(cluster.replica_pids()) != set(pids)
    # The dead replica's counters are kept: nothing counted goes back.
    assert cluster.get_stats().prefix_cache.requests >= 2 * len(PROMPTS)


def test_aborts_while_queued_and_running_free_everything(cluster):
    params = SamplingParams(max_tokens=200, ignore_eos=True, temperature=0.0)

    async def main():
        # More requests than the replicas take at once: some are still in the global queue.
        streams = [await cluster.add_request(f"a{i}", PROMPTS["r5"], params) for i in range(12)]
        first = await streams[0].__anext__()
        assert first.outputs[0].token_ids
        for s in streams:
            await s.aclose()
    asyncio.run(main())


def test_bad_input_is_refused_with_the_engines_error_and_others_go_on(cluster, oracle):
    async def bad():
        with pytest.raises(ValueError, match=r"prompt token ids must be integers in \[0, 256\)"):
            await cluster.add_request("bad", [3, 999], GREEDY)
        with pytest.raises(ValueError, match="the prompt has 300 tokens, more than max_model_len"):
            await cluster.add_request("long", [3] * 300, GREEDY)
        with pytest.raises(ValueError, match="stop_token_ids must be token ids below the vocabulary size"):
            await cluster.add_request("stop", [3, 4], SamplingParams(stop_token_ids=[300]))
    asyncio.run(bad())
    final, _ = run_all(cluster, {"ok": (PROMPTS["r0"], GREEDY)})["ok"]
    assert final.outputs[0].token_ids == oracle["r0"]


def test_the_local_ray_listens_on_loopback_only(cluster):
    import psutil

    ours = {p.pid for p in psutil.Process().children(recursive=True)} | set(cluster.replica_pids())
    listening = [c for c in psutil.net_connections(kind="inet")
                 if c.status == psutil.CONN_LISTEN and c.pid in ours]
    assert listening, "found none of the local Ray's sockets"
    for c in listening:
        ip = ipaddress.ip_address(c.laddr.ip)
        assert (getattr(ip, "ipv4_mapped", None) or ip).is_loopback, c


def test_an_id_reused_at_once_after_an_abort_gets_its_own_answer(cluster, oracle):
    long = SamplingParams(max_tokens=200, ignore_eos=True, temperature=0.0)

    async def main():
        await stream(cluster, "warm", PROMPTS["r3"], SamplingParams(max_tokens=1))  # one replica caches r3
        old = await cluster.add_request("same", PROMPTS["r3"], long)  # there, by prefix affinity
        await old.__anext__()
        await old.aclose()  # aborts it; the replica still runs it for a moment
        # The same prompt, to the same replica (its cache), which may still hold the old one.
        return await stream(cluster, "same", PROMPTS["r3"], GREEDY)
    final, seen = asyncio.run(main())
    assert final.finished and final.outputs[0].finish_reason == "length"
    assert seen == final.outputs[0].token_ids == oracle["r3"]


def test_a_request_on_too_many_lost_replicas_fails_and_the_cluster_goes_on(cluster, oracle):
    import threading

    from tokenweir.engine.client import RequestFailedError

    params = SamplingParams(max_tokens=200, ignore_eos=True, temperature=0.0)
    losses = cluster.cluster.max_request_failovers + 1
    killed: list[int] = []
    stop = threading.Event()

    def kill_its_replica_each_time() -> None:
        """Kill whichever replica holds the request, as soon as one does, `losses` times."""
        while len(killed) < losses and not stop.is_set():
            counts, pids = cluster.replica_num_requests(), cluster.replica_pids()
            for count, pid in zip(counts, pids):
                if count and pid is not None and pid not in killed:
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
            time.sleep(0.002)

    async def main():
        outputs = await cluster.add_request("poison", PROMPTS["r0"], params)
        with pytest.raises(RequestFailedError, match=f"on {losses} replicas that were lost"):
            async for _ in outputs:
                pass
    killer = threading.Thread(target=kill_its_replica_each_time)
    killer.start()
    try:
        asyncio.run(main())
    finally:
        stop.set()
        killer.join()
    assert len(killed) == losses
    wait_until(lambda: None not in cluster.replica_pids(), "the replicas' restarts", 120.0)
    final, _ = run_all(cluster, {"after": (PROMPTS["r2"], GREEDY)})["after"]
    assert final.outputs[0].token_ids == oracle["r2"]
