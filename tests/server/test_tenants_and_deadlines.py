"""Tenant identity (body `tenant`, or the API key's tenant from a keys file, which wins; a plain
key beside a keys file is refused), the per-class/tenant metrics and their label bound, and
overload shedding answered as a readable 504."""

from __future__ import annotations

import json

import openai
import pytest

from tests.server.conftest import ServerThread, assert_engine_clean, make_engine
from tests.server.helpers import MODEL, post, scrape, value
from tests.server.test_engine_process import assert_idle_and_released, make_mp_engine
from tokenweir.cli import build_parser
from tokenweir.metrics import MAX_TENANT_LABELS, TenantLabels
from tokenweir.server.app import build_app
from tokenweir.server.auth import KeyGrant, load_api_keys

BODY = {"model": MODEL, "prompt": "hello there", "max_tokens": 3, "temperature": 0.0}


def _generated(samples, tenant: str, priority_class: str = "0") -> float:
    return value(samples, "tokenweir:class_generation_tokens_total", model_name=MODEL,
                 priority_class=priority_class, tenant=tenant)


def test_the_body_names_the_tenant_without_a_keys_file(make_server):
    url = make_server()
    before = scrape(url)
    assert post(url, "/v1/completions", {**BODY, "tenant": "beta", "priority": 2}).status_code == 200
    after = scrape(url)
    assert _generated(after, "beta", "2") - _generated(before, "beta", "2") == 3


def test_the_keys_tenant_wins_over_the_body_and_other_keys_are_refused(make_server, tmp_path):
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"key-a": "alpha", "key-b": "beta"}))
    url = make_server(api_keys=load_api_keys(path), metrics_require_api_key=False)
    before = scrape(url)
    # A client of alpha claims beta's share: it is served as alpha.
    r = post(url, "/v1/completions", {**BODY, "tenant": "beta"}, headers={"Authorization": "Bearer key-a"})
    assert r.status_code == 200
    after = scrape(url)
    assert _generated(after, "alpha") - _generated(before, "alpha") == 3
    assert _generated(after, "beta") - _generated(before, "beta") == 0
    r = post(url, "/v1/completions", BODY, headers={"Authorization": "Bearer key-c"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert post(url, "/v1/completions", BODY).status_code == 401


def test_with_a_keys_file_each_tenant_has_its_own_prefix_cache(make_server, tmp_path):
    # Every key reads /metrics: had beta's request hit alpha's cached blocks, the hit counter
    # would tell beta what alpha asked, and naming alpha's salt would share its cache.
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"key-a": "alpha", "key-b": "beta"}))
    url = make_server(api_keys=load_api_keys(path))
    prompt = {**BODY, "prompt": " ".join(["water than call first who may down side been now find"] * 4)}

    def hits_of(key: str, body: dict) -> float:
        headers = {"Authorization": f"Bearer {key}"}
        before = value(scrape(url, headers), "tokenweir:prefix_cache_hits_total")
        assert post(url, "/v1/completions", body, headers=headers).status_code == 200
        return value(scrape(url, headers), "tokenweir:prefix_cache_hits_total") - before

    assert hits_of("key-a", prompt) == 0
    assert hits_of("key-a", prompt) > 0  # alpha's own cache
    assert hits_of("key-b", prompt) == 0  # not beta's
    salted = {**prompt, "cache_salt": "alpha-salt"}
    assert hits_of("key-a", salted) == 0 and hits_of("key-a", salted) > 0
    assert hits_of("key-b", salted) == 0


def test_a_keys_priority_bounds_its_requests_priority(make_server, tmp_path):
    # Under sla the priority class ranks before the tenant: a key free to name class 0 would
    # outrank the other tenants' shares. A key with a priority gets none more important.
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"key-a": {"tenant": "alpha", "priority": 1}, "key-b": "beta"}))
    url = make_server(api_keys=load_api_keys(path), metrics_require_api_key=False)
    before = scrape(url)
    for priority, key in ((0, "key-a"), (2, "key-a"), (0, "key-b")):
        r = post(url, "/v1/completions", {**BODY, "priority": priority}, headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 200
    after = scrape(url)
    # alpha's 0 became 1, its 2 (less important) stayed; beta's key bounds nothing.
    assert [_generated(after, t, c) - _generated(before, t, c)
            for t, c in (("alpha", "0"), ("alpha", "1"), ("alpha", "2"), ("beta", "0"))] == [0, 3, 3, 3]


def test_slo_attainment_is_counted_per_class(make_server):
    url = make_server()
    before = scrape(url)
    body = {**BODY, "priority": 1, "tenant": "t", "ttft_slo_ms": 60_000, "tpot_slo_ms": 0.001}
    assert post(url, "/v1/completions", body).status_code == 200
    after = scrape(url)

    def d(name, outcome):
        labels = dict(model_name=MODEL, priority_class="1", tenant="t", outcome=outcome)
        return value(after, name, **labels) - value(before, name, **labels)

    assert (d("tokenweir:slo_ttft_total", "met"), d("tokenweir:slo_ttft_total", "missed")) == (1, 0)
    assert (d("tokenweir:slo_tpot_total", "met"), d("tokenweir:slo_tpot_total", "missed")) == (0, 1)


def test_a_plain_api_key_beside_a_keys_file_is_refused(engine, tmp_path, capsys):
    # Its holders would name no tenant by the key, so the body's `tenant` would claim any
    # tenant's share ("alpha" here).
    with pytest.raises(ValueError, match=r"api_key \(--api-key\) and api_keys \(--api-keys-file\) are "
                                         r"exclusive: .* put the shared key in the file"):
        build_app(engine, api_key="shared", api_keys={"key-a": KeyGrant("alpha")})
    with pytest.raises(ValueError, match=r"api_keys maps each key to a KeyGrant"):
        build_app(engine, api_keys={"key-a": "alpha"})  # the form before grants
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"key-a": "alpha"}))
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--api-key", "shared", "--api-keys-file", str(path)])
    assert "argument --api-keys-file: not allowed with argument --api-key" in capsys.readouterr().err


def test_the_keys_files_tenants_get_their_own_label_after_squatters_took_the_free_ones(make_server, tmp_path):
    """Clients that name tenants first (no keys file) take the first-come labels; a keys file's
    tenant still gets its own."""
    url = make_server()
    for i in range(MAX_TENANT_LABELS + 2):
        assert post(url, "/v1/completions", {**BODY, "max_tokens": 1, "tenant": f"squat{i}"}).status_code == 200
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"key-g": "gamma"}))
    url = make_server(api_keys=load_api_keys(path), metrics_require_api_key=False)
    before = scrape(url)
    assert post(url, "/v1/completions", BODY, headers={"Authorization": "Bearer key-g"}).status_code == 200
    after = scrape(url)
    assert _generated(after, "gamma") - _generated(before, "gamma") == 3
    assert _generated(after, "other") - _generated(before, "other") == 0


def test_tenant_labels_reserved_ones_then_the_first_come_up_to_the_bound():
    labels = TenantLabels(limit=2)
    labels.reserve(["r1", "r2", "r3", "other", "none"])
    assert [labels(t) for t in ("a", "r1", "b", "c", "r3", None, "none", "other")] == [
        "a", "r1", "b", "other", "r3", "none", "other", "other"]


@pytest.mark.parametrize("contents, message", [
    ("[]", "must hold a non-empty JSON object"),
    ('{"k": ""}', "every key needs a non-empty tenant name, got '' for key #1"),
    ("{", "cannot be read as JSON"),
    ('{"": "alpha"}', "key #1 must be a non-empty bearer token"),
    # Never sendable as they are (a header's value is stripped): refused rather than never matching.
    ('{" padded-key ": "alpha"}', "key #1 must be a non-empty bearer token"),
    ('{"k": "alpha", "nl-key\\n": "beta"}', "key #2 must be a non-empty bearer token"),
    # Valid JSON, but no UTF-8: the first /metrics after its request was a 500, for everyone.
    ('{"k": "\\ud800"}', "the tenant of key #1 is not valid Unicode text"),
    # Accepted once, then every request with the key got a 400 about a `tenant` it never sent.
    (json.dumps({"k": "alpha", "k2": "t" * 257}), "the tenant of key #2 has 257 characters, more than 256"),
    ('{"k": "other"}', "the tenant of key #1 is 'other', the tenant metric label of the tenants past the label"),
    ('{"k": "none"}', "the tenant of key #1 is 'none', the tenant metric label of requests without a tenant"),
    # json keeps the last of a key given twice: the key would be billed to the second tenant. The
    # keys are secrets, so the error names their positions.
    ('{"k1": "alpha", "k2": "gamma", "k1": "beta"}', "key #3 is key #1 again"),
    ('{"k": {"tenant": "alpha", "priority": "high"}}', r"the priority of key #1 must be an integer in \["),
    ('{"k": {"tenant": "alpha", "priority": 2147483648}}', r"the priority of key #1 must be an integer in \["),
    ('{"k": {"tenant": "alpha", "class": 0}}', r"key #1 has unknown fields \['class'\]"),
    ('{"k": {"priority": 1}}', "every key needs a non-empty tenant name, got None for key #1"),
])
def test_a_bad_keys_file_is_refused(tmp_path, contents, message):
    path = tmp_path / "keys.json"
    path.write_text(contents)
    with pytest.raises(ValueError, match=message):
        load_api_keys(path)


def test_a_request_past_its_deadline_is_shed_with_a_504_the_client_can_read(tiny_model_dir):
    engine = make_engine(tiny_model_dir("llama"), scheduling_policy="sla", sla_drop_expired=True)
    server = ServerThread(build_app(engine))
    try:
        body = {**BODY, "max_tokens": 200, "ignore_eos": True, "deadline_ms": 1}
        r = post(server.url, "/v1/completions", body)
        assert r.status_code == 504, r.text
        error = r.json()["error"]
        assert error["code"] == "deadline_exceeded" and error["type"] == "timeout_error"
        assert error["message"].startswith("deadline exceeded: the request's deadline of 1 ms passed")
        r = post(server.url, "/v1/completions", {**body, "stream": True})
        assert r.status_code == 200 and '"code": "deadline_exceeded"' in r.text and r.text.endswith("data: [DONE]\n\n")
        # Requests without a deadline are served as before.
        assert post(server.url, "/v1/completions", BODY).status_code == 200
        after = scrape(server.url)
        assert value(after, "tokenweir:request_success_total", model_name=MODEL, finished_reason="abort") == 2
    finally:
        server.stop()
        assert_engine_clean(engine)
        engine.shutdown()


@pytest.mark.parametrize("engine_kind", ["in-process", "engine-process"])
def test_the_official_client_does_not_retry_a_shed_request(tiny_model_dir, engine_kind):
    """The openai client retries every 5xx (max_retries=2 by default) unless the response says
    `x-should-retry: false`: without it one shed request is sent, and prefilled, three times."""
    overrides = dict(scheduling_policy="sla", sla_drop_expired=True)
    engine = (make_engine(tiny_model_dir("llama"), **overrides) if engine_kind == "in-process"
              else make_mp_engine(tiny_model_dir("llama"), **overrides))
    server = ServerThread(build_app(engine))
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=60)
        assert client.max_retries == 2  # the default, which this test is about
        before = scrape(server.url)
        with pytest.raises(openai.InternalServerError) as info:
            client.completions.create(model=MODEL, prompt="hello there", max_tokens=200,
                                      extra_body={"ignore_eos": True, "deadline_ms": 1})
        assert info.value.status_code == 504 and info.value.code == "deadline_exceeded"
        after = scrape(server.url)
        aborted = "tokenweir:request_success_total"
        assert (value(after, aborted, finished_reason="abort")
                - value(before, aborted, finished_reason="abort")) == 1
        assert info.value.response.headers["x-should-retry"] == "false"
    finally:
        server.stop()
        if engine_kind == "in-process":
            assert_engine_clean(engine)
        else:
            assert_idle_and_released(engine)
        engine.shutdown()


def test_the_official_client_reads_why_a_deadline_cannot_be_met(tiny_model_dir, tmp_path):
    """--sla-drop-unmeetable: a request the step cost model says cannot finish by its deadline is
    answered at once with a 504 whose message says what it needs and what is left, not retried."""
    from tokenweir.core.cost_model import FEATURES, StepCostModel

    profile = tmp_path / "slow.json"  # every step 1 s: 10 tokens alone, x 0.8, are 8 s
    slow = StepCostModel({**dict.fromkeys(FEATURES, 0.0), "step": 1.0}, swap_bytes_per_second=1e9)
    profile.write_text(json.dumps(slow.to_dict()))
    engine = make_engine(tiny_model_dir("llama"), scheduling_policy="sla", sla_drop_unmeetable=True,
                         sla_cost_profile=str(profile), sla_step_time_correction=False)
    server = ServerThread(build_app(engine))
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=60)
        before = scrape(server.url)
        with pytest.raises(openai.InternalServerError) as info:
            client.completions.create(model=MODEL, prompt="hello there", max_tokens=10,
                                      extra_body={"ignore_eos": True, "deadline_ms": 2000})
        assert info.value.status_code == 504 and info.value.code == "deadline_exceeded"
        assert info.value.body["type"] == "timeout_error"
        assert info.value.body["message"].startswith("deadline cannot be met: needs at least 8000.0 ms, ")
        assert info.value.response.headers["x-should-retry"] == "false"
        aborted = "tokenweir:request_success_total"
        assert value(scrape(server.url), aborted, finished_reason="abort") - value(before, aborted, finished_reason="abort") == 1
        # With room for it, the same request is served.
        done = client.completions.create(model=MODEL, prompt="hello there", max_tokens=10,
                                         extra_body={"ignore_eos": True, "deadline_ms": 100_000})
        assert done.choices[0].finish_reason == "length" and done.usage.completion_tokens == 10
    finally:
        server.stop()
        assert_engine_clean(engine)
        engine.shutdown()
