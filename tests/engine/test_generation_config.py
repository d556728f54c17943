"""--generation-config auto (vLLM's default): the sampling knobs a model folder's
generation_config.json sets are the defaults of requests that leave them unset; vllm ignores
them. transformers' generate applies the same file by default, so it stays the oracle."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.engine.helpers import assert_engine_released
from tests.hf_reference import hf_greedy
from tokenweir.config import EngineArgs
from tokenweir.request import SamplingParams

CONFIG = {"do_sample": False, "temperature": 0.0, "repetition_penalty": 1.8, "top_k": 5, "max_new_tokens": 3,
          "eos_token_id": 2}
PROMPT = [11, 12, 13, 11, 12, 13, 40, 41]


@pytest.fixture
def folder(tiny_model_dir, tmp_path):
    path = tmp_path / "with-generation-config"
    shutil.copytree(tiny_model_dir("llama"), path)
    (path / "generation_config.json").write_text(json.dumps(CONFIG))
    return str(path)


def test_the_models_defaults_apply_to_requests_without_params(make_llm, folder):
    llm = make_llm(folder)
    defaults = llm.get_default_sampling_params()
    # max_new_tokens is not a sampling default: max_tokens stays SamplingParams' own.
    assert (defaults.temperature, defaults.repetition_penalty, defaults.top_k, defaults.max_tokens) == (0.0, 1.8, 5, 16)
    got = llm.generate({"prompt_token_ids": PROMPT}, use_tqdm=False)[0].outputs[0].token_ids
    plain = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=16, temperature=0.0),
                         use_tqdm=False)[0].outputs[0].token_ids
    # transformers reads the same file: greedy with the repetition penalty, up to EOS.
    expected = hf_greedy(folder, [PROMPT], len(got), pad_token_id=0)[0]
    assert got == expected and got != plain


def test_vllm_ignores_the_models_generation_config(make_llm, folder):
    llm = make_llm(folder, generation_config="vllm")
    assert llm.get_default_sampling_params() == SamplingParams()


def test_a_bad_generation_config_is_refused_naming_the_file(make_llm, folder, tmp_path):
    with open(f"{folder}/generation_config.json", "w") as f:
        json.dump({"repetition_penalty": 0}, f)
    with pytest.raises(ValueError, match=r"generation_config.json: repetition_penalty must be in .*"
                                         r"\(--generation-config vllm ignores this file\)"):
        make_llm(folder)
    # ... which vllm does: the file is not read.
    assert make_llm(folder, generation_config="vllm").get_default_sampling_params() == SamplingParams()
    with pytest.raises(ValueError, match="generation_config must be one of auto, vllm"):
        EngineArgs(generation_config="model")


@pytest.mark.parametrize("flags, expected", [
    ([], (0.0, 1.0, 1.8, 5)),  # greedy by the command's default; the model's other knobs
    (["--temperature", "0.5", "--top-p", "0.9"], (0.5, 0.9, 1.8, 5)),
    (["--generation-config", "vllm"], (0.0, 1.0, 1.0, 0)),
])
def test_the_generate_command_takes_the_models_defaults_for_what_its_flags_leave(folder, monkeypatch, capsys,
                                                                                 flags, expected):
    from tokenweir import cli
    from tokenweir.engine.core import EngineCore

    seen = []
    add_request = EngineCore.add_request

    def spy(self, *args, **kwargs):
        request = add_request(self, *args, **kwargs)
        seen.append(request.sampling_params)
        return request

    monkeypatch.setattr(EngineCore, "add_request", spy)
    cli.main(["generate", "hi", "--no-chat", "--max-tokens", "2", "--model", folder, "--dtype", "float32",
              "--device", "cpu", "--num-gpu-blocks-override", "64", *flags])
    (params,) = seen
    assert (params.temperature, params.top_p, params.repetition_penalty, params.top_k) == expected
    assert params.max_tokens == 2
