from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from tests.model.tiny_models import write_stub_gguf, write_tiny_gguf
from tokenweir.model.arch import arch_from_hf_config
from tokenweir.model.attention import AttentionMetadata, allocate_kv_caches
from tokenweir.model.gguf_conversion import ensure_hf_folder
from tokenweir.model.loader import default_model_path, load_model, resolve_dtype


def test_default_model_path():
    path = default_model_path()
    assert path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf") and os.path.isfile(path)


@pytest.fixture(scope="module")
def default_fp32():
    return load_model(None, dtype="float32", device="cpu")


def test_gguf_cached_once(default_fp32):
    folder = ensure_hf_folder(default_model_path())
    assert folder == default_fp32.path
    weights = os.path.join(folder, "model.safetensors")
    before = os.stat(weights).st_mtime_ns
    assert ensure_hf_folder(default_model_path()) == folder
    assert os.stat(weights).st_mtime_ns == before
    assert {"config.json", "tokenizer.json"} <= set(os.listdir(folder))


def test_default_model_matches_transformers(default_fp32):
    from transformers import AutoModelForCausalLM

    loaded = default_fp32
    assert loaded.name == "SmolLM2-135M-Instruct"
    assert loaded.arch.num_hidden_layers == 30 and loaded.arch.tie_word_embeddings
    assert loaded.arch.rope_theta == 100000.0 and loaded.arch.eos_token_ids == (2,)
    tok = loaded.tokenizer
    assert tok.eos_token_id == 2 and tok.chat_template
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True, tokenize=False
    )
    ids = tok(prompt).input_ids

    ref = AutoModelForCausalLM.from_pretrained(loaded.path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref_logits = ref(torch.tensor([ids])).logits[0, -1]

    arch = loaded.arch
    kv = allocate_kv_caches(arch, 16, 16, torch.float32, "cpu")
    table = list(range(16))
    seq = list(ids)
    out: list[int] = []
    for step in range(9):
        new = seq if step == 0 else seq[-1:]
        meta = AttentionMetadata.build([len(new)], [len(seq)], [table], 16, "cpu")
        hidden = loaded.model(torch.tensor(new), torch.arange(len(seq) - len(new), len(seq)), meta, kv)
        logits = loaded.model.compute_logits(hidden[-1:])[0]
        if step == 0:
            torch.testing.assert_close(logits, ref_logits, atol=1e-3, rtol=0)
            assert logits.argmax() == ref_logits.argmax()
        seq.append(int(logits.argmax()))
        out.append(seq[-1])
    assert tok.decode(out).startswith("The capital of France is Paris")


def test_tiny_folder_name_and_tokenizer(tiny_model_dir):
    folder = tiny_model_dir("llama")
    loaded = load_model(folder, dtype="float32", device="cpu")
    assert loaded.name == os.path.basename(folder)
    assert loaded.dtype == torch.float32 and loaded.device.type == "cpu"
    assert loaded.tokenizer.eos_token_id == 2
    assert "assistant" in loaded.tokenizer.apply_chat_template(
        [{"role": "user", "content": "hello"}], add_generation_prompt=True, tokenize=False
    )


def test_missing_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="does-not-exist"):
        load_model(str(tmp_path / "does-not-exist"))


def test_folder_without_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(str(tmp_path))


def _copy(tmp_path, tiny_model_dir, arch: str = "llama"):
    folder = tmp_path / "m"
    shutil.copytree(tiny_model_dir(arch), folder)
    return folder


def _rewrite_config(folder, drop: tuple[str, ...] = (), **updates) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    for key in drop:
        del cfg[key]
    (folder / "config.json").write_text(json.dumps({**cfg, **updates}))


def _rewrite_weights(folder, drop: tuple[str, ...] = (), add: dict[str, torch.Tensor] | None = None) -> None:
    from safetensors.torch import load_file, save_file

    path = str(folder / "model.safetensors")
    weights = load_file(path)
    for name in drop:
        del weights[name]
    save_file({**weights, **(add or {})}, path)


def test_unsupported_architecture(tmp_path, tiny_model_dir):
    folder = _copy(tmp_path, tiny_model_dir)
    _rewrite_config(folder, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM"):
        load_model(str(folder))


def test_no_safetensors(tmp_path, tiny_model_dir):
    folder = _copy(tmp_path, tiny_model_dir)
    (folder / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model(str(folder))


def test_config_not_json(tmp_path, tiny_model_dir):
    folder = _copy(tmp_path, tiny_model_dir)
    (folder / "config.json").write_text('{"hidden_size": 64,\n "vocab_size": }')
    with pytest.raises(ValueError, match=r"m/config.json: invalid JSON: Expecting value at line 2, column 16"):
        load_model(str(folder))
    (folder / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="m/config.json: expected a JSON object, found list"):
        load_model(str(folder))


def test_config_missing_or_bad_keys(tmp_path, tiny_model_dir):
    folder = _copy(tmp_path, tiny_model_dir)
    _rewrite_config(folder, drop=("hidden_size", "num_hidden_layers"))
    with pytest.raises(ValueError, match=r"m/config.json: missing required key\(s\): hidden_size, num_hidden_layers$"):
        load_model(str(folder))
    _rewrite_config(folder, hidden_size="64", num_hidden_layers=0)
    with pytest.raises(ValueError, match="expected positive integers: hidden_size='64', num_hidden_layers=0$"):
        load_model(str(folder))


@pytest.mark.parametrize("updates, message", [
    (dict(max_position_embeddings="abc"), "expected positive integers: max_position_embeddings='abc'$"),
    (dict(num_key_value_heads=0), "expected positive integers: num_key_value_heads=0$"),
    (dict(rms_norm_eps="small"), "rms_norm_eps must be a positive number, got 'small'$"),
    (dict(hidden_act="gelu"), "hidden_act 'gelu' is not supported; supported: silu, swish$"),
    # transformers refuses these at its first forward pass (a size mismatch) or not at all.
    (dict(num_key_value_heads=3), r"num_attention_heads \(4\) must be a multiple of num_key_value_heads \(3\)"),
    (dict(head_dim=15), "head_dim must be even"),
    (dict(tie_word_embeddings="false"), "expected true or false: tie_word_embeddings='false'$"),
    (dict(attention_bias="false"), "expected true or false: attention_bias='false'$"),
    (dict(eos_token_id=100000), r"eos_token_id must be a token id or a list of them, each in \[0, vocab_size=256\), got 100000$"),
    (dict(eos_token_id=2.7), r"eos_token_id must be .*, got 2.7$"),
    (dict(eos_token_id={"a": 1}), r"eos_token_id must be .*, got \{'a': 1\}$"),
    (dict(rope_theta=-5), "rope_theta must be a positive number, got -5$"),
    (dict(rope_theta=0), "rope_theta must be a positive number, got 0$"),
    (dict(rope_scaling="linear"), "rope_scaling must be an object, got 'linear'$"),
    (dict(rope_scaling={"rope_type": "linear", "factor": 0}), r"rope scaling 'linear' needs positive numbers: factor=0$"),
    (dict(rope_scaling={"rope_type": "linear", "factor": "two"}), "rope scaling 'linear' needs positive numbers: factor='two'$"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0, "high_freq_factor": 2.0,
                        "original_max_position_embeddings": 64}),
     "rope scaling 'llama3' needs high_freq_factor > low_freq_factor, got 2.0 and 2.0$"),
])
def test_config_values_are_checked(tmp_path, tiny_model_dir, updates, message):
    folder = _copy(tmp_path, tiny_model_dir)
    _rewrite_config(folder, **updates)
    with pytest.raises(ValueError, match="m/config.json: " + message):
        load_model(str(folder))


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_unreadable_weights_name_the_file(tmp_path, tiny_model_dir, damage):
    folder = _copy(tmp_path, tiny_model_dir)
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(b"\xff" * 64 if damage == "garbage" else data[: len(data) // 2])
    with pytest.raises(ValueError, match=f"{weights}: not a readable safetensors file"):
        load_model(str(folder), dtype="float32", device="cpu")


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_unreadable_gguf_names_the_file(tmp_path, tiny_model_dir, monkeypatch, damage):
    from tokenweir.model import gguf_conversion

    monkeypatch.setattr(gguf_conversion, "cache_root", lambda: tmp_path / "cache")
    path = tmp_path / "m.gguf"
    data = Path(write_tiny_gguf(tiny_model_dir("llama"), str(path))).read_bytes()
    path.write_bytes(b"GGUF" + b"\xff" * 60 if damage == "garbage" else data[: len(data) // 2])
    with pytest.raises(ValueError, match=f"{path}: not a readable GGUF file"):
        load_model(str(path))


@pytest.mark.parametrize("device", ["foo", "tpu", "cuda:x"])
def test_bad_device(tiny_model_dir, device):
    with pytest.raises(ValueError, match="device must be 'auto', 'cpu', 'cuda' or 'cuda:N'"):
        load_model(tiny_model_dir("llama"), device=device)


@pytest.mark.parametrize(
    "name, shape",
    [("model.layers.1.mlp.up_proj.weight", (127, 64)), ("model.norm.weight", (1,))],  # torch would broadcast [1]
)
def test_weight_with_wrong_shape(tmp_path, tiny_model_dir, name, shape):
    folder = _copy(tmp_path, tiny_model_dir)
    _rewrite_weights(folder, add={name: torch.zeros(shape)})
    expected = [128, 64] if "up_proj" in name else [64]
    with pytest.raises(ValueError) as err:
        load_model(str(folder))
    assert str(err.value) == (
        f"{folder}/model.safetensors: weight {name!r} has shape {list(shape)}; config.json implies {expected}"
    )


def test_missing_and_unexpected_weights(tmp_path, tiny_model_dir):
    folder = _copy(tmp_path, tiny_model_dir)
    # harmless extras: an old checkpoint's RoPE table, and lm_head in a tied one
    harmless = {"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8), "lm_head.weight": torch.ones(256, 64)}
    _rewrite_weights(folder, add=harmless)
    assert load_model(str(folder), dtype="float32", device="cpu").arch.tie_word_embeddings

    extra, missing = "model.layers.3.mlp.up_proj.weight", "model.layers.2.self_attn.k_proj.weight"
    _rewrite_weights(folder, add={extra: torch.zeros(128, 64)})
    with pytest.raises(ValueError, match=f"m: weights that config.json does not describe: '{extra}'$"):
        load_model(str(folder))
    _rewrite_weights(folder, drop=(extra, missing))
    with pytest.raises(ValueError, match=f"m: weights required by config.json are missing: '{missing}'$"):
        load_model(str(folder))


def test_a_sharded_folder_reads_the_files_its_index_lists(tmp_path, tiny_model_dir):
    # As transformers does: another export beside the shards (Mistral's consolidated.safetensors)
    # is not part of the checkpoint. A weight in two listed files is refused, not picked by order.
    from safetensors.torch import load_file, save_file

    folder = _copy(tmp_path, tiny_model_dir)
    weights = load_file(str(folder / "model.safetensors"))
    (folder / "model.safetensors").unlink()
    names = sorted(weights)
    halves = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for file, keys in halves.items():
        save_file({k: weights[k] for k in keys}, str(folder / file))
    index = {"metadata": {}, "weight_map": {k: file for file, keys in halves.items() for k in keys}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    save_file({"layers.0.attention.wq.weight": torch.zeros(4, 4)}, str(folder / "consolidated.safetensors"))
    assert load_model(str(folder), dtype="float32", device="cpu").arch.num_hidden_layers == 3

    save_file({names[0]: weights[names[0]]}, str(folder / "model-00002-of-00002.safetensors"))
    save_file({k: weights[k] for k in names[1:]}, str(folder / "model-00001-of-00002.safetensors"))
    save_file({names[0]: weights[names[0]]}, str(folder / "model-00003.safetensors"))
    index["weight_map"] = {k: "model-00001-of-00002.safetensors" for k in names[1:]}
    index["weight_map"][names[0]] = "model-00003.safetensors"
    index["weight_map"]["x"] = "model-00002-of-00002.safetensors"
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=f"weight '{names[0]}' is also in model-0000"):
        load_model(str(folder))
    index["weight_map"]["y"] = "missing.safetensors"
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="its weight_map must name files of this folder; .*'missing.safetensors'$"):
        load_model(str(folder))
    (folder / "model.safetensors.index.json").write_text("[]")
    with pytest.raises(ValueError, match="not a safetensors index"):
        load_model(str(folder))


def test_a_gguf_is_converted_by_its_contents_not_its_name_and_size(tmp_path, tiny_model_dir, monkeypatch):
    # Two fine-tunes of one base: same file name, same size, same first and last MiB; only a
    # middle tensor differs. Each must load its own weights.
    from tokenweir.model import gguf_conversion

    monkeypatch.setattr(gguf_conversion, "cache_root", lambda: tmp_path / "cache")
    from tests.model.tiny_models import make_tiny_model

    (tmp_path / "a").mkdir()
    wide = make_tiny_model(str(tmp_path / "wide"), "llama", intermediate_size=2048)
    first = Path(write_tiny_gguf(wide, str(tmp_path / "a" / "model.gguf")))
    data = bytearray(first.read_bytes())
    assert len(data) > 4 << 20  # past the first and last MiB, which a cheaper key would read
    second = tmp_path / "b" / "model.gguf"
    second.parent.mkdir()
    middle = len(data) // 2
    data[middle:middle + 64] = bytes(255 - b for b in data[middle:middle + 64])
    second.write_bytes(bytes(data))
    assert os.path.getsize(first) == os.path.getsize(second)
    a, b = load_model(str(first), dtype="float32", device="cpu"), load_model(second, dtype="float32", device="cpu")
    assert a.path != b.path
    differs = [n for n, p in a.model.named_parameters() if not torch.equal(p, dict(b.model.named_parameters())[n])]
    assert differs
    # A second load of the same file reuses its folder (its digest remembered, not recomputed).
    assert ensure_hf_folder(str(first)) == a.path


def test_folder_without_tokenizer(tmp_path, tiny_model_dir):
    folder = _copy(tmp_path, tiny_model_dir)
    (folder / "tokenizer.json").unlink()
    expected = r"m: no tokenizer files \(expected one of tokenizer.json, tokenizer.model, vocab.json\)$"
    with pytest.raises(FileNotFoundError, match=expected):
        load_model(str(folder))
    (folder / "tokenizer.json").write_text('{"model": 3}')
    with pytest.raises(ValueError, match="m: the tokenizer files could not be loaded: KeyError: 'added_tokens'$"):
        load_model(str(folder))


def test_unsupported_gguf_architecture(tmp_path):
    with pytest.raises(ValueError, match="'gpt2' is not supported"):
        load_model(write_stub_gguf(str(tmp_path / "tiny.gguf"), "gpt2"))


def _cfg(**extra):
    base = dict(
        architectures=["LlamaForCausalLM"],
        vocab_size=10,
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        eos_token_id=2,
    )
    return {**base, **extra}


def test_rope_config_forms():
    # transformers 5 form
    arch = arch_from_hf_config(_cfg(rope_parameters={"rope_type": "default", "rope_theta": 5e5}))
    assert arch.rope_theta == 5e5 and arch.rope_scaling is None and arch.num_key_value_heads == 2
    # legacy form with the old "type" key
    arch = arch_from_hf_config(_cfg(rope_theta=1e4, rope_scaling={"type": "linear", "factor": 4.0}))
    assert arch.rope_theta == 1e4 and arch.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    with pytest.raises(ValueError, match="unsupported rope type 'yarn'"):
        arch_from_hf_config(_cfg(rope_scaling={"rope_type": "yarn", "factor": 4.0}))
    # Llama 3 instruct: end-of-turn ids from generation_config.json join config's eos
    arch = arch_from_hf_config(_cfg(eos_token_id=[2, 5]), {"eos_token_id": [5, 7]})
    assert arch.eos_token_ids == (2, 5, 7) and arch.eos_token_id == 2
    # Mistral's sliding window caps the usable context
    arch = arch_from_hf_config(
        _cfg(architectures=["MistralForCausalLM"], sliding_window=64, max_position_embeddings=512)
    )
    assert arch.max_model_len == 64


def test_resolve_dtype():
    cpu = torch.device("cpu")
    assert resolve_dtype("bf16", cpu) is torch.bfloat16
    assert resolve_dtype("fp32", cpu) is torch.float32
    assert resolve_dtype("half", cpu) is torch.float16
    flags = open("/proc/cpuinfo").read()
    fast = "avx512_bf16" in flags or "amx_bf16" in flags
    assert resolve_dtype("auto", cpu) is (torch.bfloat16 if fast else torch.float32)
    with pytest.raises(ValueError, match="unsupported dtype"):
        resolve_dtype("int3", cpu)
    for dtype in (torch.int8, torch.float64):
        with pytest.raises(ValueError, match="the model runs in float32, bfloat16 or float16"):
            resolve_dtype(dtype, cpu)
    for dtype in (None, 16):
        with pytest.raises(ValueError, match="dtype must be a name"):
            resolve_dtype(dtype, cpu)
