"""The server's side of --generation-config auto: a body's unset knobs get the model's
defaults, a body's own values win."""

from __future__ import annotations

from tests.engine.helpers import assert_engine_released
from tests.engine.test_generation_config import CONFIG, PROMPT, folder  # noqa: F401 (a fixture)
from tests.server.helpers import client
from tokenweir.config import EngineArgs
from tokenweir.engine.async_engine import AsyncLLMEngine
from tokenweir.engine.core import EngineCore


def test_the_server_fills_what_a_body_leaves_unset(make_server, folder, monkeypatch):
    engine = AsyncLLMEngine(EngineCore(EngineArgs(model=folder, dtype="float32", device="cpu",
                                                  num_gpu_blocks_override=64, served_model_name="m")))
    try:
        assert engine.model_info.default_sampling_params == {k: CONFIG[k] for k in ("temperature", "repetition_penalty",
                                                                                    "top_k")}
        seen = []
        add_request = engine.core.add_request

        def spy(*args, **kwargs):
            seen.append(add_request(*args, **kwargs).sampling_params)
            return seen[-1]

        monkeypatch.setattr(engine.core, "add_request", spy)
        c = client(make_server(engine))
        c.completions.create(model="m", prompt=PROMPT, max_tokens=2)
        c.completions.create(model="m", prompt=PROMPT, max_tokens=2, temperature=0.5, top_p=0.9,
                             extra_body={"repetition_penalty": 1.0, "top_k": 0})
        unset, given = seen
        assert (unset.temperature, unset.repetition_penalty, unset.top_k, unset.top_p) == (0.0, 1.8, 5, 1.0)
        assert (given.temperature, given.repetition_penalty, given.top_k, given.top_p) == (0.5, 1.0, 0, 0.9)
    finally:
        engine.shutdown()
        assert_engine_released(engine.core)
