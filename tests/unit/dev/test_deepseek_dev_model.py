"""The DeepSeek-V4 dev model (gateway/dev/deepseek_model.py): the real tokenizer, our chat
template, the tiny layers, read the way the gateway reads a model directory."""

from __future__ import annotations

import asyncio
import json
import struct
from pathlib import Path

import pytest

from gateway.dev import deepseek_model as ds
from gateway.dev import model as tiny
from gateway.openai.tokenize import ChatTurn, ModelTokenizer


@pytest.fixture(scope="module")
def model_dir() -> Path:
    # The shared cache under .run/models (written once, about 15 s; reused while current).
    return ds.ensure_deepseek_model()


def test_the_tokenizer_is_the_packaged_deepseek_v4_one_verbatim(model_dir: Path) -> None:
    shipped = ds.packaged_tokenizer_file().read_bytes()
    assert (model_dir / "tokenizer.json").read_bytes() == shipped
    data = json.loads(shipped)
    assert len(data["model"]["vocab"]) == 128_000
    assert len(data["added_tokens"]) == 1_283
    config = json.loads((model_dir / "config.json").read_text())
    assert config["vocab_size"] == 1 + max(t["id"] for t in data["added_tokens"])
    assert json.loads((model_dir / "tokenizer_config.json").read_text())["model_max_length"] == (
        1_048_576
    )


def test_a_tokenizer_of_another_size_is_refused() -> None:
    data = json.loads(ds.packaged_tokenizer_file().read_bytes())
    data["added_tokens"] = data["added_tokens"][:-1]
    with pytest.raises(ds.TokenizerPackageError, match="1282 added tokens"):
        ds.check_tokenizer(data)


def test_the_gateway_renders_deepseek_chat_format_with_special_tokens_as_single_ids(
    model_dir: Path,
) -> None:
    tokenizer = ModelTokenizer(model_dir)
    turns = [
        ChatTurn("system", "Be brief."),
        ChatTurn("user", "Hi"),
        ChatTurn("assistant", "Hello."),
        ChatTurn("user", "Bye"),
    ]
    text = tokenizer.render_chat(turns)
    assert text == (
        "<｜begin▁of▁sentence｜>Be brief.<｜User｜>Hi<｜Assistant｜></think>Hello."
        "<｜end▁of▁sentence｜><｜User｜>Bye<｜Assistant｜></think>"
    )
    ids = asyncio.run(tokenizer.encode_chat(turns))
    vocab = json.loads((model_dir / "tokenizer.json").read_text())["added_tokens"]
    by_name = {t["content"]: t["id"] for t in vocab}
    assert ids[0] == by_name[ds.BOS_TOKEN]
    assert ids[-2:] == [by_name[ds.ASSISTANT_TOKEN], by_name[ds.THINK_END]]
    assert ids.count(by_name[ds.USER_TOKEN]) == 2


def test_the_weights_are_the_tiny_layers_over_the_deepseek_vocabulary(model_dir: Path) -> None:
    raw = (model_dir / tiny.WEIGHTS_FILE).read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + size])
    header.pop("__metadata__")
    config = json.loads((model_dir / "config.json").read_text())
    assert header["model.embed_tokens.weight"]["shape"] == [ds.VOCAB_SIZE, tiny.HIDDEN_SIZE]
    assert header["lm_head.weight"]["shape"] == [ds.VOCAB_SIZE, tiny.HIDDEN_SIZE]
    assert config["tie_word_embeddings"] is False
    q = tiny.NUM_HEADS * tiny.HEAD_DIM
    assert header["model.layers.0.self_attn.q_proj.weight"]["shape"] == [q, tiny.HIDDEN_SIZE]
    assert {n.split(".")[2] for n in header if n.startswith("model.layers.")} == {
        str(i) for i in range(config["num_hidden_layers"])
    }
    assert 8 + size + max(t["data_offsets"][1] for t in header.values()) == len(raw)


def test_a_current_directory_is_reused_and_a_stale_one_rewritten(
    model_dir: Path, tmp_path: Path
) -> None:
    key = ds.generator_key(ds.packaged_tokenizer_file().read_bytes())
    assert ds.is_current_model(model_dir, key)
    copy = tmp_path / "copy"
    copy.mkdir()
    for name in ds.MODEL_FILES:
        (copy / name).write_bytes((model_dir / name).read_bytes())
    (copy / tiny.GENERATOR_FILE).write_text(json.dumps({"generator": "another"}))
    assert not ds.is_current_model(copy, key)
    assert ds.is_current_model(model_dir, key)  # only the copy was touched
