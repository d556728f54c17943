"""The offline API on a tiny model: sampling, stops, chat, errors, leak checks."""

from __future__ import annotations

import json
import logging
import shutil

import pytest

from tokenweir import SamplingParams
from tests.model.tiny_models import WORDS

KV = dict(num_gpu_blocks_override=128)


def test_seeded_sampling_is_reproducible_across_batch_compositions(make_llm, tiny_model_dir):
    llm = make_llm(tiny_model_dir("llama"), **KV)
    seeded = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    alone = llm.generate("the capital of france is", seeded, use_tqdm=False)[0].outputs[0]
    others = [SamplingParams(max_tokens=n, temperature=1.0, ignore_eos=True) for n in (3, 9, 20)]
    batch = llm.generate(["hello world", "the capital of france is", "you and him", "one two"],
                         [others[0], seeded, others[1], others[2]], use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone.token_ids
    assert batch[1].outputs[0].text == alone.text
    other_seed = llm.generate("the capital of france is",
                              SamplingParams(max_tokens=12, temperature=1.0, seed=99, ignore_eos=True),
                              use_tqdm=False)[0].outputs[0]
    assert other_seed.token_ids != alone.token_ids


def test_stop_strings_cut_the_text_and_free_the_request(make_llm, tiny_model_dir):
    llm = make_llm(tiny_model_dir("llama"), **KV)
    free = llm.generate("hello world", SamplingParams(max_tokens=20, temperature=0, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    words = free.text.split()
    assert len(words) >= 6
    stop = words[4]
    cut = free.text.index(stop)
    out = llm.generate("hello world", SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert out.text == free.text[:cut] and out.finish_reason == "stop" and out.stop_reason == stop
    assert len(out.token_ids) < 20
    kept = llm.generate("hello world", SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, stop=stop,
                                                      include_stop_str_in_output=True),
                        use_tqdm=False)[0].outputs[0]
    assert kept.text == free.text[:cut + len(stop)]


def test_stop_token_ids_and_eos(make_llm, tiny_model_dir):
    llm = make_llm(tiny_model_dir("llama"), **KV)
    free = llm.generate("one two", SamplingParams(max_tokens=10, temperature=0, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    stop_id = free.token_ids[3]
    first = free.token_ids.index(stop_id)
    out = llm.generate("one two", SamplingParams(max_tokens=10, temperature=0, ignore_eos=True,
                                                 stop_token_ids=[stop_id]), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == free.token_ids[:first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    length = llm.generate("one two", SamplingParams(max_tokens=4, temperature=0, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0]
    assert length.finish_reason == "length" and len(length.token_ids) == 4


def test_logprobs_are_returned(make_llm, tiny_model_dir):
    llm = make_llm(tiny_model_dir("llama"), **KV)
    out = llm.generate("the a", SamplingParams(max_tokens=3, temperature=0, logprobs=2, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == 3
    for token, entry in zip(out.token_ids, out.logprobs):
        assert token in entry and len(entry) >= 2
        assert entry[token] == max(entry.values())  # greedy picks the most likely
    assert out.cumulative_logprob == pytest.approx(sum(e[t] for t, e in zip(out.token_ids, out.logprobs)))


def test_chat_uses_the_template(make_llm, tiny_model_dir):
    llm = make_llm(tiny_model_dir("llama"), **KV)
    out = llm.chat([{"role": "user", "content": "hello"}], SamplingParams(max_tokens=4, temperature=0),
                   use_tqdm=False)[0]
    expected = llm.get_tokenizer().apply_chat_template([{"role": "user", "content": "hello"}],
                                                       tokenize=False, add_generation_prompt=True)
    assert out.prompt == expected
    assert out.prompt_token_ids == llm.get_tokenizer().encode(expected, add_special_tokens=False)
    greedy = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    batch = llm.chat([[{"role": "user", "content": "hello"}], [{"role": "user", "content": "world"}]],
                     greedy, use_tqdm=False)
    alone = [llm.chat([{"role": "user", "content": w}], greedy, use_tqdm=False)[0] for w in ("hello", "world")]
    assert [o.prompt for o in batch] == [o.prompt for o in alone]
    assert [o.outputs[0].token_ids for o in batch] == [o.outputs[0].token_ids for o in alone]


def test_priority_and_metrics(make_llm, tiny_model_dir):
    llm = make_llm(tiny_model_dir("llama"), scheduling_policy="priority", max_num_seqs=1, **KV)
    outs = llm.generate(["one", "two", "three"], SamplingParams(max_tokens=3, ignore_eos=True),
                        priority=[2, 0, 1], use_tqdm=False)
    finish = [o.metrics.finished_time for o in outs]
    assert finish[1] <= finish[2] <= finish[0]  # served in priority order
    for o in outs:
        m = o.metrics
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time


@pytest.mark.parametrize("prompt, message", [
    ({"prompt_token_ids": []}, "the prompt is empty"),
    ({"prompt_token_ids": [5] * 600}, r"the prompt has 600 tokens, more than max_model_len \(512\)"),
    ({"prompt_token_ids": [5, 100000]}, r"prompt token ids must be integers in \[0, 256\)"),
    ({"prompt_token_ids": [True, 2]}, r"prompt token ids must be integers in \[0, 256\); got \[True\]"),
    ({"tokens": [1]}, r"a prompt must be a string, \{'prompt': str\} or \{'prompt_token_ids': \[...\]\}"),
    ({"prompt_token_ids": 5}, r"^'prompt_token_ids' must be a list of token ids, got int$"),
    ({"prompt_token_ids": None}, r"^'prompt_token_ids' must be a list of token ids, got NoneType$"),
])
def test_bad_prompts_raise_and_leave_nothing_behind(make_llm, tiny_model_dir, prompt, message):
    llm = make_llm(tiny_model_dir("llama"), **KV)
    with pytest.raises(ValueError, match=message):
        llm.generate(["one two", prompt], SamplingParams(max_tokens=2), use_tqdm=False)
    # The engine still serves, and exactly as before.
    greedy = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    after = llm.generate("one", greedy, use_tqdm=False)[0].outputs[0]
    assert after.token_ids == make_llm(tiny_model_dir("llama"), **KV).generate(
        "one", greedy, use_tqdm=False)[0].outputs[0].token_ids and len(after.token_ids) == 3


def test_bad_sampling_params_and_engine_args(make_llm, tiny_model_dir):
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="unknown engine arguments: \\['max_num_sequences'\\]"):
        make_llm(tiny_model_dir("llama"), max_num_sequences=4)
    # A knob given where it does nothing is refused at its default's value too, as any other.
    for knobs, message in ((dict(scheduling_policy="fcfs", sla_base_weight=10.0),
                            r"^sla_base_weight only applies to scheduling_policy 'sla', not 'fcfs'$"),
                           (dict(scheduling_policy="priority", vtc_input_weight=1.0),
                            r"^vtc_input_weight applies only to scheduling_policy 'vtc'"),
                           (dict(admission_window=32), r"^admission_window applies only to an admission_order")):
        with pytest.raises(ValueError, match=message):
            make_llm(tiny_model_dir("llama"), **knobs, **KV)
    llm = make_llm(tiny_model_dir("llama"), **KV)
    with pytest.raises(ValueError, match="got 1 SamplingParams for 2 prompts"):
        llm.generate(["a", "b"], [SamplingParams()], use_tqdm=False)


def test_model_folder_errors(tmp_path, make_llm):
    with pytest.raises((ValueError, FileNotFoundError), match="does-not-exist"):
        make_llm(str(tmp_path / "does-not-exist"))
    (tmp_path / "empty").mkdir()
    with pytest.raises((ValueError, FileNotFoundError), match="config.json"):
        make_llm(str(tmp_path / "empty"))


def test_words_roundtrip_through_incremental_detokenization(make_llm, tiny_model_dir):
    llm = make_llm(tiny_model_dir("llama"), **KV)
    out = llm.generate("the", SamplingParams(max_tokens=15, temperature=0, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    tok = llm.get_tokenizer()
    assert out.text.strip() == tok.decode(out.token_ids, skip_special_tokens=True).strip()
    assert all(w in WORDS or w.startswith("<") for w in out.text.split())


def test_an_output_processing_error_fails_that_request_only(make_llm, tiny_model_dir, monkeypatch):
    llm = make_llm(tiny_model_dir("llama"), **KV)
    engine = llm.engine
    process_tokens = engine.output_processor.process_tokens

    def failing(state, *args, **kwargs):
        if state.request.request_id == "bad" and state.request.num_output_tokens >= 2:
            raise RuntimeError("detokenizer exploded")
        return process_tokens(state, *args, **kwargs)

    monkeypatch.setattr(engine.output_processor, "process_tokens", failing)
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    engine.add_request("bad", "one two", params)
    engine.add_request("good", "three four", params)
    finished, failed = {}, {}
    while engine.has_unfinished_requests():
        result = engine.step()
        finished.update((o.request_id, o) for o in result.outputs if o.finished)
        failed.update(result.failed)
    assert list(failed) == ["bad"] and "exploded" in str(failed["bad"])
    assert list(finished) == ["good"] and len(finished["good"].outputs[0].token_ids) == 5
    assert engine.states == {}

    def always_failing(state, *args, **kwargs):
        raise ValueError("boom")

    # Offline, the failure surfaces as an exception and the batch's other requests are aborted.
    monkeypatch.setattr(engine.output_processor, "process_tokens", always_failing)
    with pytest.raises(RuntimeError, match="request .* failed in the engine: ValueError..boom"):
        llm.generate(["one", "two"], SamplingParams(max_tokens=3), use_tqdm=False)


def test_generation_config_eos_ids_stop_like_eos(make_llm, tiny_model_dir, tmp_path):
    """Llama 3 Instruct style: generation_config.json lists EOS ids beyond config.json's one."""
    free_llm = make_llm(tiny_model_dir("llama"), **KV)
    greedy = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    free = free_llm.generate("one two", greedy, use_tqdm=False)[0].outputs[0]
    second_eos = free.token_ids[3]
    assert second_eos != 2
    folder = tmp_path / "two-eos"
    shutil.copytree(tiny_model_dir("llama"), folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, second_eos]}))
    llm = make_llm(str(folder), **KV)
    out = llm.generate("one two", SamplingParams(max_tokens=10, temperature=0), use_tqdm=False)[0].outputs[0]
    first = free.token_ids.index(second_eos)
    assert out.token_ids == free.token_ids[:first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == second_eos
    # ignore_eos covers every EOS id; min_tokens holds them all back.
    assert llm.generate("one two", greedy, use_tqdm=False)[0].outputs[0].token_ids == free.token_ids
    held = llm.generate("one two", SamplingParams(max_tokens=10, temperature=0, min_tokens=first + 2),
                        use_tqdm=False)[0].outputs[0]
    assert second_eos not in held.token_ids[:first + 2]


def test_seeded_sampling_survives_preemption(make_llm, tiny_model_dir):
    seeded = SamplingParams(max_tokens=40, temperature=1.0, seed=7, ignore_eos=True)
    alone = make_llm(tiny_model_dir("llama"), **KV).generate(
        "the capital of france is", seeded, use_tqdm=False)[0].outputs[0]
    # 10 blocks of 8 tokens: four requests of ~45 tokens cannot all stay; the seeded one is
    # admitted last, so FCFS preempts it first.
    llm = make_llm(tiny_model_dir("llama"), num_gpu_blocks_override=10, block_size=8, max_model_len=80)
    outs = llm.generate(["one two three", "hello world", "you and him", "the capital of france is"],
                        [SamplingParams(max_tokens=40, temperature=1.0, ignore_eos=True)] * 3 + [seeded],
                        use_tqdm=False)
    assert outs[3].metrics.num_preemptions >= 1
    assert outs[3].outputs[0].token_ids == alone.token_ids


def test_stop_strings_wait_for_min_tokens(make_llm, tiny_model_dir):
    llm = make_llm(tiny_model_dir("llama"), **KV)
    free = llm.generate("hello world", SamplingParams(max_tokens=20, temperature=0, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    stop = free.text.split()[1]
    early = llm.generate("hello world", SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, stop=stop),
                         use_tqdm=False)[0].outputs[0]
    assert early.finish_reason == "stop"
    late = llm.generate("hello world", SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, stop=stop,
                                                      min_tokens=len(early.token_ids) + 1),
                        use_tqdm=False)[0].outputs[0]
    assert late.text.startswith(early.text + stop)  # the first occurrence came too early to stop


def test_progress_bar_counts_requests(make_llm, tiny_model_dir, capsys):
    llm = make_llm(tiny_model_dir("llama"), **KV)
    llm.generate(["one", "two", "three"], SamplingParams(max_tokens=2))
    err = capsys.readouterr().err
    assert "3/3" in err and "Processed prompts" in err


def test_engine_logs_kv_blocks_and_max_concurrency(make_llm, tiny_model_dir, caplog):
    with caplog.at_level(logging.INFO, logger="tokenweir"):
        make_llm(tiny_model_dir("llama"), num_gpu_blocks_override=96, block_size=16, max_model_len=256)
    assert ("KV cache: 96 blocks of 16 tokens = 1536 tokens; maximum concurrency for 256 tokens "
            "per request: 6.00x") in caplog.text


def test_a_stop_string_on_the_last_allowed_token_reports_stop(make_llm, tiny_model_dir):
    llm = make_llm(tiny_model_dir("llama"), **KV)
    # The first token of the output whose text is a word not seen before it completes the stop
    # string; max_tokens ends the request on that very token.
    free = llm.generate("hello world", SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    pieces = [llm.get_tokenizer().decode([t]).strip() for t in free.token_ids]
    n = next(i + 1 for i, piece in enumerate(pieces) if piece and i > 0 and piece not in "".join(pieces[:i]))
    stop = pieces[n - 1]
    out = llm.generate("hello world", SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == free.token_ids[:n] and stop not in out.text
    assert out.finish_reason == "stop" and out.stop_reason == stop


def test_a_failed_step_leaves_nothing_behind(make_llm, tiny_model_dir, monkeypatch):
    llm = make_llm(tiny_model_dir("llama"), **KV)
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in llm.generate(["one two", "you and him"], params, use_tqdm=False)]
    runner = llm.engine.runner
    execute = runner.execute_model
    calls = []

    def fail_on_the_third_step(out):
        calls.append(out)
        if len(calls) == 3:
            execute(out)  # the runner's state moves on, the scheduler's does not
            raise KeyboardInterrupt
        return execute(out)

    monkeypatch.setattr(runner, "execute_model", fail_on_the_third_step)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(["one two", "you and him"], params, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    got = [o.outputs[0].token_ids for o in llm.generate(["one two", "you and him"], params, use_tqdm=False)]
    assert got == expected


def test_scheduling_hints_reach_the_sla_policy(make_llm, tiny_model_dir, monkeypatch):
    """`LLM` users of scheduling_policy="sla" set what the server's clients set: priority,
    tenant, deadline and the TTFT / TPOT SLOs, one value for all prompts or one per prompt."""
    from tokenweir.core.policies.sla_queue import SLAQueue

    seen = {}
    add = SLAQueue.add

    def record(queue, request):
        seen.setdefault(request.request_id, (request.priority, request.tenant, request.hints.deadline,
                                             request.ttft_slo, request.tpot_slo))
        add(queue, request)

    monkeypatch.setattr(SLAQueue, "add", record)
    llm = make_llm(tiny_model_dir("llama"), scheduling_policy="sla", sla_tenant_fairness=True, **KV)
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    outs = llm.generate(["one", "two", "three"], params, priority=[0, 1, 2], tenant=["a", "b", None],
                        deadline=[None, 30.0, None], ttft_slo=5.0, tpot_slo=[0.5, None, 1.0], use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [2, 2, 2]
    chat = llm.chat([{"role": "user", "content": "hello"}], params, tenant="c", ttft_slo=2.0, use_tqdm=False)
    assert [seen[o.request_id] for o in outs + chat] == [
        (0, "a", None, 5.0, 0.5), (1, "b", 30.0, 5.0, None), (2, None, None, 5.0, 1.0), (0, "c", None, 2.0, None)]


def test_the_engine_explains_an_unfinished_requests_sla_score(make_llm, tiny_model_dir):
    """EngineCore.explain_request: a request waiting for the one slot has its score parts now
    (also in get_stats' longest-waiting ones); an unknown id raises KeyError."""
    from tokenweir.request import SchedulingHints

    llm = make_llm(tiny_model_dir("llama"), scheduling_policy="sla", max_num_seqs=1, **KV)
    engine = llm.engine
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    engine.add_request("first", [5, 6, 7], params)
    engine.add_request("second", [8, 9, 10], params, SchedulingHints(priority=1, ttft_slo=5.0))
    engine.step()
    parts = engine.explain_request("second")
    assert (parts["status"], parts["base"], parts["priority_class"], parts["aged"]) == ("WAITING", -10.0, 1, False)
    assert 0 < parts["urgency"] < 1 and parts["total"] < -9.0
    assert engine.explain_request("first")["status"] == "RUNNING"
    assert list(engine.get_stats().longest_waiting) == ["second"]
    with pytest.raises(KeyError, match="no unfinished request 'third'"):
        engine.explain_request("third")
    while engine.has_unfinished_requests():
        engine.step()


@pytest.mark.parametrize("kwargs, message", [
    (dict(priority=[0, "x"]), r"priority must be an integer in \[-2147483648, 2147483647\], got 'x'"),
    (dict(priority=[0, None]), r"priority must be an integer in \[.*\], got None"),
    (dict(priority=[0, 2**31]), r"priority must be an integer in \[.*\], got 2147483648"),
    (dict(priority=[0, 1, 2]), r"^got 3 priority values for 2 prompts$"),
    (dict(tenant=""), r"^prompt 0: tenant must be a non-empty string of at most 256 characters or None, got ''$"),
    (dict(tenant=["a", 3]), r"^prompt 1: tenant must be a non-empty string of at most 256 characters"),
    (dict(tenant=["a"]), r"^got 1 tenant values for 2 prompts$"),
    (dict(deadline=[1.0, -1.0]), r"^prompt 1: deadline must be a finite number of seconds > 0 or None, got -1.0$"),
    (dict(ttft_slo=float("inf")), r"^prompt 0: ttft_slo must be a finite number of seconds > 0 or None, got inf$"),
    (dict(tpot_slo={"one": 0.1}), r"^tpot_slo must be one value for every prompt or a list with one per prompt, "
                                  r"got dict$"),
    (dict(sampling_params=SamplingParams(stop_token_ids=[5000])),
     r"stop_token_ids must be token ids below the vocabulary size \(256\)"),
])
def test_bad_request_arguments_leave_nothing_behind(make_llm, tiny_model_dir, kwargs, message):
    llm = make_llm(tiny_model_dir("llama"), scheduling_policy="priority", **KV)
    kwargs.setdefault("sampling_params", SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match=message):
        llm.generate(["one", "two"], use_tqdm=False, **kwargs)
    assert not llm.engine.has_unfinished_requests()


def test_sampling_params_must_be_sampling_params(make_llm, tiny_model_dir):
    llm = make_llm(tiny_model_dir("llama"), **KV)
    with pytest.raises(ValueError, match="sampling_params must be SamplingParams or a list of them"):
        llm.generate("hi", {"max_tokens": 3}, use_tqdm=False)
    for prompts in (None, 5):
        with pytest.raises(ValueError, match=r"^prompts must be a prompt \(a string or a prompt dict\) or a list"):
            llm.generate(prompts, use_tqdm=False)


def test_the_engine_checks_what_it_is_given_and_keeps_its_own_params(make_llm, tiny_model_dir):
    """EngineCore.add_request, the entry of the LLM and the server alike: a wrong type is a
    ValueError, SamplingParams changed after construction are checked again, and changing them
    while the request runs does not reach it."""
    engine = make_llm(tiny_model_dir("llama"), **KV).engine
    with pytest.raises(ValueError, match="^params must be SamplingParams, got NoneType$"):
        engine.add_request("a", "one two", None)
    with pytest.raises(ValueError, match="^a prompt must be a string or a list of token ids, got NoneType$"):
        engine.add_request("a", None, SamplingParams())
    changed = SamplingParams(max_tokens=4)
    changed.max_tokens = 0
    with pytest.raises(ValueError, match="max_tokens must be an integer >= 1 or None, got 0"):
        engine.add_request("a", "one two", changed)
    changed.max_tokens, changed.stop = 4, "xyz"  # a string where the list was: each character a stop
    assert engine.add_request("a", "one two", changed).sampling_params.stop == ["xyz"]
    engine.abort_requests(["a"])
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    request = engine.add_request("b", "one two", params)
    params.max_tokens = 1
    while engine.has_unfinished_requests():
        engine.step()
    assert request.num_output_tokens == 4


def test_greedy_min_tokens_in_bf16(make_llm, tiny_model_dir):
    # An all-greedy step keeps bf16 logits; masking EOS below min_tokens must work on them.
    llm = make_llm(tiny_model_dir("llama"), dtype="bfloat16", **KV)
    out = llm.generate(["hello world", "one two"], SamplingParams(max_tokens=6, min_tokens=6, temperature=0),
                       use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in out] == [6, 6]


def test_outputs_are_snapshots_not_views_of_live_lists(make_llm, tiny_model_dir):
    engine = make_llm(tiny_model_dir("llama"), **KV).engine
    engine.add_request("r", [5, 6, 7], SamplingParams(max_tokens=5, temperature=0, logprobs=2, ignore_eos=True))
    outputs = []
    while engine.has_unfinished_requests():
        outputs.extend(engine.step().outputs)
    # Each output still shows what it showed when it was made: one logprob entry per token.
    assert [len(o.outputs[0].token_ids) for o in outputs] == [1, 2, 3, 4, 5]
    assert [len(o.outputs[0].logprobs) for o in outputs] == [1, 2, 3, 4, 5]


def test_add_request_is_atomic(make_llm, tiny_model_dir, monkeypatch):
    engine = make_llm(tiny_model_dir("llama"), **KV).engine

    def broken(*args, **kwargs):
        raise RuntimeError("no output state")

    monkeypatch.setattr(engine.output_processor, "new_state", broken)
    with pytest.raises(RuntimeError, match="no output state"):
        engine.add_request("r", [5, 6, 7], SamplingParams(max_tokens=2))
    # Nothing half-added: the scheduler never saw it, and the id is free again.
    assert not engine.has_unfinished_requests() and engine.states == {}
    monkeypatch.undo()
    engine.add_request("r", [5, 6, 7], SamplingParams(max_tokens=2))
    while engine.has_unfinished_requests():
        engine.step()


def test_time_comes_from_the_engines_monotonic_clock(make_llm, tiny_model_dir):
    import itertools
    import time

    from tests.engine.helpers import assert_engine_released
    from tokenweir.engine.core import EngineCore

    engine = make_llm(tiny_model_dir("llama"), **KV).engine
    before = time.monotonic()
    request = engine.add_request("default", [5, 6], SamplingParams(max_tokens=1))
    assert before <= request.arrival_time <= time.monotonic()  # monotonic by default, not time.time()
    engine.abort_requests(["default"])
    # An injected clock is the only time the scheduler and the outputs see.
    ticks = itertools.count(100.0)
    core = EngineCore(engine.args, engine.loaded, clock=lambda: next(ticks))
    core.add_request("r", [5, 6], SamplingParams(max_tokens=3, ignore_eos=True))
    final = None
    while core.has_unfinished_requests():
        final = core.step().outputs[-1]
    m = final.metrics
    assert m.arrival_time == 100.0 and 100.0 < m.first_scheduled_time < m.first_token_time < m.finished_time < 120.0
    assert_engine_released(core)


def test_a_request_shed_for_its_deadline_says_why(make_llm, tiny_model_dir):
    # sla_drop_expired finishes a request whose deadline passed: LLM users get finish_reason
    # "abort" (as for an abort) and, unlike for an abort, the reason; the other request runs on.
    llm = make_llm(tiny_model_dir("llama"), scheduling_policy="sla", sla_drop_expired=True, **KV)
    shed, kept = llm.generate(["one two three", "four five"], SamplingParams(max_tokens=200, ignore_eos=True),
                              deadline=[0.001, None], use_tqdm=False)
    assert shed.outputs[0].finish_reason == "abort" and shed.status_message.startswith("deadline exceeded: ")
    assert kept.outputs[0].finish_reason == "length" and kept.status_message is None
    assert len(kept.outputs[0].token_ids) == 200


def test_a_request_that_cannot_meet_its_deadline_is_shed_at_once_and_says_why(make_llm, tiny_model_dir, tmp_path):
    from tokenweir.core.cost_model import FEATURES, StepCostModel

    # A profile of a machine whose every step takes 1 s, trusted as it is: 10 tokens alone take
    # 10 steps, x 0.8 = 8 s, more than a deadline of 2 s; 100 s leaves room.
    profile = tmp_path / "slow.json"
    slow = StepCostModel({**dict.fromkeys(FEATURES, 0.0), "step": 1.0}, swap_bytes_per_second=1e9)
    profile.write_text(json.dumps(slow.to_dict()))
    llm = make_llm(tiny_model_dir("llama"), scheduling_policy="sla", sla_drop_unmeetable=True,
                   sla_cost_profile=str(profile), sla_step_time_correction=False, **KV)
    params = SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.0)
    shed, kept = llm.generate(["one two three", "four five"], params, deadline=[2.0, 100.0], use_tqdm=False)
    assert shed.outputs[0].finish_reason == "abort" and shed.outputs[0].token_ids == []
    assert shed.status_message.startswith("deadline cannot be met: needs at least 8000.0 ms, ")
    # The one that fits is served as it would be without a deadline (greedy, token for token).
    alone = llm.generate("four five", params, use_tqdm=False)[0]
    assert kept.status_message is None and kept.outputs[0].token_ids == alone.outputs[0].token_ids
    assert len(alone.outputs[0].token_ids) == 10
