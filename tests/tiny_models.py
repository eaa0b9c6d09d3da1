"""Tiny random Hugging Face models and an engine factory for the runtime tests."""

from types import SimpleNamespace

import pytest
import torch


class IdTokenizer:
    """Stands in for a tokenizer when prompts are given as token ids."""

    def __init__(self, eos_token_ids=(2,)):
        self.eos_token_ids = tuple(eos_token_ids)

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))

    def encode(self, text):
        return [int(t) for t in text.split()]


def _tiny(kind: str, tmp_path_factory):
    import transformers

    from orbitflow.model.loader import load_weights

    common = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  initializer_range=0.2, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    if kind == "qwen2":
        hf = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common, tie_word_embeddings=False))
    else:
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common, tie_word_embeddings=True))
    hf.eval()
    path = tmp_path_factory.mktemp(kind)
    hf.save_pretrained(path)
    model, config = load_weights(path)
    return SimpleNamespace(hf=hf, model=model, config=config, path=path)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    return _tiny("llama", tmp_path_factory)


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory):
    return _tiny("qwen2", tmp_path_factory)


def hf_greedy(hf, prompt: list[int], max_tokens: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False,
                          pad_token_id=0, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()


def make_llm(tiny, policy=None, profile="rough", **config):
    from orbitflow.config import EngineConfig
    from orbitflow.llm import LLM
    from orbitflow.model.loader import LoadedModel

    loaded = LoadedModel(model=tiny.model, config=tiny.config, tokenizer=IdTokenizer(), name="tiny", path=tiny.path)
    config.setdefault("device_kv_blocks", 512)
    config.setdefault("host_kv_blocks", 1024)
    return LLM(EngineConfig.build(model="tiny", **config), policy=policy, profile=profile, loaded=loaded)


@pytest.fixture(scope="session")
def tiny_chat_dir(tmp_path_factory):
    """HF directory of a 4-layer random Llama whose vocabulary is SmolLM2's, with SmolLM2's tokenizer files:
    real text in and out (gibberish, but deterministic) at a fraction of SmolLM2's step time."""
    import shutil

    import transformers

    from orbitflow.model.loader import _model_dir_for
    from orbitflow.model.registry import resolve_model_path

    smollm2 = _model_dir_for(resolve_model_path("smollm2-135m"))
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2, bos_token_id=1,
        eos_token_id=2, tie_word_embeddings=True,
    )
    path = tmp_path_factory.mktemp("tiny-chat")
    transformers.LlamaForCausalLM(config).eval().save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
        if (smollm2 / name).exists():
            shutil.copy(smollm2 / name, path / name)
    return path
