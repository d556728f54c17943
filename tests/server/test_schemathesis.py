"""The OpenAPI document against the running server: schemathesis generates requests from the
schema (valid and invalid ones) for every operation and checks each answer against it: no 5xx,
only documented status codes, content types and headers, bodies (JSON and SSE events) that match
their schema, and schema-invalid requests refused.

Bounded and reproducible: a fixed number of examples per operation, a fixed seed and
schemathesis' deterministic mode, against the real app on a real socket with the tiny model.
schemathesis runs as its CLI in a process of its own: hypothesis cannot draw floats in a process
whose floating-point state a `-ffast-math` library (the C kernels) has set to flush subnormals.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

CHECKS = ["not_a_server_error", "status_code_conformance", "content_type_conformance",
          "response_headers_conformance", "response_schema_conformance", "negative_data_rejection"]
EXAMPLES = 60  # per operation
SEED = 20261201
OPERATIONS = ["POST /v1/completions", "POST /v1/chat/completions", "GET /v1/models", "GET /health",
              "GET /version", "GET /metrics"]


def schemathesis_cli() -> list[str]:
    exe = Path(sys.executable).with_name("schemathesis")
    return [str(exe)] if exe.exists() else [shutil.which("schemathesis") or "schemathesis"]


def test_every_operation_answers_as_documented(make_server, tmp_path):
    # A waiting limit, so that the 429 path is part of the contract under test too.
    url = make_server(max_waiting_requests=64)
    command = [*schemathesis_cli(), "run", f"{url}/openapi.json", "--checks", ",".join(CHECKS),
               "--mode", "all", "--phases", "examples,coverage,fuzzing", "--max-examples", str(EXAMPLES),
               "--seed", str(SEED), "--generation-deterministic",
               "--workers", "1", "--request-timeout", "60", "--no-color",
               "--report", "junit", "--report-junit-path", str(tmp_path / "junit.xml")]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    print(result.stdout[-1200:])  # the summary: phases run and the number of test cases
    report = (tmp_path / "junit.xml").read_text()
    for operation in OPERATIONS:  # every operation was tested, none skipped
        assert f'name="{operation}"' in report, operation
    assert "<skipped" not in report
