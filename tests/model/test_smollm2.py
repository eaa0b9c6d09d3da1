"""The built-in SmolLM2-135M: GGUF conversion + cache, greedy parity with transformers, tokenizer parity.

The first run converts the GGUF into the default cache (~30 s); later runs load the cached directory.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from orbitflow.model import IncrementalDecoder, LoadedModel, ModelLoadError, greedy_generate, load_model
from orbitflow.model.gguf_convert import converted_dir_for
from orbitflow.model.registry import resolve_model_path

TEXTS = [
    "Hello, world!",
    "  leading spaces and trailing  ",
    "Unicode: naïve café, 日本語のテキスト, emoji 🦀🚀.",
    "<|im_start|>user\nspecial tokens inside text<|im_end|>",
    "def f(x):\n\treturn x ** 2  # code\n",
]

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Count to three."},
        {"role": "assistant", "content": "1 2 3"},
        {"role": "user", "content": "Now backwards, in 日本語."},
    ],
]


@pytest.fixture(scope="module")
def smollm2() -> LoadedModel:
    return load_model("smollm2-135m")


@pytest.fixture(scope="module")
def hf_tokenizer(smollm2):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2.path)


def test_builtin_name_resolves_to_cached_conversion(smollm2) -> None:
    gguf = resolve_model_path("smollm2-135m")
    assert gguf.suffix == ".gguf"
    assert smollm2.path == converted_dir_for(gguf)
    assert (smollm2.path / "model.safetensors").exists() and (smollm2.path / "tokenizer.json").exists()
    assert smollm2.config.architecture == "llama" and smollm2.config.num_layers == 30
    assert smollm2.config.tie_word_embeddings
    assert 2 in smollm2.tokenizer.eos_token_ids  # <|im_end|>


def test_second_load_reads_the_cache_without_transformers(smollm2) -> None:
    """The cached path never imports transformers (that import alone costs seconds). The time itself is
    reported by benchmarks/engine_vs_hf.py, not asserted here."""
    code = (
        "import sys, time; t = time.perf_counter(); from orbitflow.model import load_model; "
        "load_model('smollm2-135m'); print(time.perf_counter() - t); "
        "assert 'transformers' not in sys.modules"
    )
    src = str(Path(__file__).parents[2] / "src")
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": src},
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert float(result.stdout.strip()) > 0


def test_greedy_matches_hf(smollm2) -> None:
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(
        smollm2.path, dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    tokenizer = smollm2.tokenizer
    prompts = [tokenizer.apply_chat_template(CHATS[0]), tokenizer.encode("The three primary colors are")]
    eos = tokenizer.eos_token_ids
    ours = greedy_generate(smollm2.model, prompts, max_new_tokens=16, eos_token_ids=eos)  # one packed batch
    with torch.inference_mode():
        for prompt, generated in zip(prompts, ours):
            expected = hf.generate(
                torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=list(eos)
            )
            assert generated == expected[0, len(prompt) :].tolist()
    assert "Paris" in tokenizer.decode(ours[0])


def test_encode_matches_hf(smollm2, hf_tokenizer) -> None:
    for text in TEXTS:
        assert smollm2.tokenizer.encode(text) == hf_tokenizer(text)["input_ids"], text


def test_decode_matches_hf(smollm2, hf_tokenizer) -> None:
    for text in TEXTS:
        ids = hf_tokenizer(text)["input_ids"]
        for skip in (True, False):
            assert smollm2.tokenizer.decode(ids, skip_special_tokens=skip) == hf_tokenizer.decode(
                ids, skip_special_tokens=skip
            )


def test_chat_template_matches_hf(smollm2, hf_tokenizer) -> None:
    for messages in CHATS:
        for add_generation_prompt in (True, False):
            expected = hf_tokenizer.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tokenize=False
            )
            assert smollm2.tokenizer.render_chat_template(messages, add_generation_prompt) == expected
            expected_ids = hf_tokenizer(expected, add_special_tokens=False)["input_ids"]
            assert smollm2.tokenizer.apply_chat_template(messages, add_generation_prompt) == expected_ids


def test_incremental_decoder_never_splits_characters(smollm2) -> None:
    tokenizer = smollm2.tokenizer
    for text in TEXTS:
        ids = tokenizer.encode(text)
        decoder = IncrementalDecoder(tokenizer)
        pieces = [decoder.push(token) for token in ids]
        pieces.append(decoder.flush())
        assert "".join(pieces) == tokenizer.decode(ids), text
        assert not any("\ufffd" in piece for piece in pieces)


def test_missing_path_raises(tmp_path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(ModelLoadError, match="nope"):
        load_model(str(missing))
    with pytest.raises(ModelLoadError, match="not-a-model"):
        load_model("not-a-model")


def test_garbage_files_raise(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("ORBITFLOW_CACHE", str(tmp_path / "cache"))
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"\x00not a gguf file at all" * 10)
    with pytest.raises(ModelLoadError, match="garbage.gguf"):
        load_model(str(garbage))

    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 40)
    with pytest.raises(ModelLoadError, match="truncated.gguf") as info:
        load_model(str(truncated))
    assert "\n" not in str(info.value)
    assert not list((tmp_path / "cache").glob("*"))  # failed conversions leave nothing behind

    other = tmp_path / "weights.bin"
    other.write_bytes(b"junk")
    with pytest.raises(ModelLoadError, match="weights.bin"):
        load_model(str(other))

    bad_dir = tmp_path / "bad_dir"
    bad_dir.mkdir()
    (bad_dir / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="bad_dir"):
        load_model(str(bad_dir))
