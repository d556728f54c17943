"""The OpenAPI document against the running server: schemathesis generates requests from the
schema (valid and invalid ones) for every operation and checks each answer against it: no 5xx,
only documented status codes, content types and headers, bodies that match their schema, and
schema-invalid requests rejected.

Bounded and reproducible: a fixed number of examples per operation and generation mode, from a
derandomized (fixed-seed) hypothesis run, against the real app on a real socket with the tiny
model. (schemathesis' own pytest loader does not run under pytest 9, so the test drives each
operation's hypothesis strategy itself.)
"""

from __future__ import annotations

import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.generation import GenerationMode
from schemathesis.specs.openapi.checks import (content_type_conformance, negative_data_rejection,
                                               response_headers_conformance, response_schema_conformance,
                                               status_code_conformance)

EXAMPLES = 60  # per operation and generation mode
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_headers_conformance, response_schema_conformance, negative_data_rejection]


def test_every_operation_answers_as_documented(make_server):
    # A waiting limit, so that the 429 path is part of the contract under test too.
    url = make_server(max_waiting_requests=64)
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {f"{op.method.upper()} {op.path}" for op in operations} == {
        "POST /v1/completions", "POST /v1/chat/completions", "GET /v1/models", "GET /health",
        "GET /version", "GET /metrics"}
    for operation in operations:
        # GETs take no input: there is nothing invalid to send them.
        modes = [GenerationMode.POSITIVE] + ([GenerationMode.NEGATIVE] if operation.method == "post" else [])
        for mode in modes:
            @given(case=operation.as_strategy(generation_mode=mode))
            @settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
                      suppress_health_check=list(HealthCheck))
            def check(case):
                case.call_and_validate(base_url=url, checks=CHECKS, timeout=60)

            check()
