"""A tiny Llama model directory generated locally and deterministically (no download).

The tokenizer is a byte-level BPE trained with `tokenizers` on a fixed built-in corpus; the
weights (`model.safetensors`, about 0.6 MB) are drawn from a seeded `random.Random` and
written by hand in the safetensors format. Imports only `tokenizers` and the standard
library: it runs in the gateway venv.

The weights are random noise with a designed bias, so that output under a grammar (JSON
schema, regex, EBNF) terminates within a few dozen tokens, greedy and sampled, while free text
stays varied noise that never ends early. With uniform small weights (SGLang's
`--load-format dummy`) every logit is about 0, so a grammar's choice among allowed tokens is
arbitrary: a JSON string or an integer never closed within max_tokens. Here every token has a
class (`token_class`) and the final residual stream carries, beside ~60 random dimensions, one
constant dimension and one flag per class of the *current* token that no layer writes to, so
the LM head adds to each next token's logit:

- a per-class bias (`BASE_LOGIT`): `"` and closing brackets high, `,` `:` lower, EOS and the
  other specials never chosen unconstrained (free text runs to max_tokens as before);
- a per-class bias that depends on the class of the token just generated (`LOGIT_AFTER`):
  nothing structural right after something structural (no `""`, strings are not empty),
  after a digit a closing bracket rather than another digit, after text a closing quote;
- minus a penalty for repeating the current token, against one-token loops.

Once a grammar is complete it allows only EOS, so "EOS after the closing `}`" needs no bias.
SGLang also needs `--constrained-json-disable-any-whitespace` (gateway/dev/cluster.py): with
whitespace allowed, indentation alone can fill max_tokens.
"""

import hashlib
import json
import os
import random
import shutil
import struct
import sys
import tempfile
from array import array
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

VOCAB_SIZE = 512
BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"
PAD_TOKEN = "<|pad|>"
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN)  # ids 0, 1, 2 in this order
MAX_POSITION_EMBEDDINGS = 65536
HIDDEN_SIZE = 64
INTERMEDIATE_SIZE = 128
NUM_LAYERS = 2
NUM_HEADS = 4
NUM_KV_HEADS = 2
HEAD_DIM = 16
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_SEED = 20261201

DEFAULT_MODEL_DIR = Path(__file__).resolve().parents[2] / ".run" / "models" / "tiny-llama"

# HF-style chat template: messages with role/content, optional generation prompt; tools and
# tool calls in the Hermes / Qwen 2.5 format (``tool_call_parser: qwen25``). Without tools a
# conversation renders as it always has: "role: content<|eos|>" per message.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}"
    "system: You may call functions. Their signatures:\n<tools>\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
    "</tools>\nReturn each call as a JSON object within <tool_call></tool_call> tags:\n"
    '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    "{{ eos_token }}\n"
    "{% endif %}"
    "{% for message in messages %}"
    "{{ message['role'] }}: "
    "{% if message['content'] is not none %}{{ message['content'] }}{% endif %}"
    "{% for call in message['tool_calls'] or [] %}"
    '<tool_call>\n{"name": "{{ call.function.name }}", "arguments": '
    "{% if call.function.arguments is string %}{{ call.function.arguments }}"
    "{% else %}{{ call.function.arguments | tojson }}{% endif %}}\n</tool_call>"
    "{% endfor %}"
    "{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)

_TRAINING_CORPUS = (
    "The quick brown fox jumps over the lazy dog. "
    "A gateway checks that every response belongs to the request that went in. "
    "Prefill computes the prompt's cache; decode generates tokens from it. "
    "Tenants share the machines but never each other's pages. "
    "Hello, world! How are you today? I am fine, thank you. "
    "system: You are a helpful assistant.\nuser: What is the capital of France?\n"
    "assistant: The capital of France is Paris.\n"
    "Numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000 and punctuation , . ; : ! ? ( ) [ ] { } \" ' "
    "def main():\n    return 0\n"
    "Isolation holds only while every page that decode reads was written for this request. "
)

# Written last, naming the generator that wrote the directory: a directory written by another
# version of this file (e.g. one cached under .run/models/ before the weights existed) is
# regenerated, not reused.
GENERATOR_FILE = "isogate-generator.json"
MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    WEIGHTS_FILE,
    GENERATOR_FILE,
)


def generator_key() -> str:
    """What identifies this generator: the hash of this source file (any edit regenerates)."""
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()


def is_current_model(directory: Path) -> bool:
    if not all((directory / name).is_file() for name in MODEL_FILES):
        return False
    try:
        written = json.loads((directory / GENERATOR_FILE).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(written, dict) and written.get("generator") == generator_key()


def ensure_tiny_model(directory: Path = DEFAULT_MODEL_DIR) -> Path:
    """Return `directory`, generating the tiny model there first unless this generator already
    wrote it (a file missing, or another generator's files, and it is written again)."""
    directory = Path(directory)
    if is_current_model(directory):
        return directory
    directory.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename, so a concurrent reader never sees half a model.
    staging = Path(tempfile.mkdtemp(prefix=".tiny-model-", dir=directory.parent))
    retired = directory.parent / f"{staging.name}-old"
    try:
        write_tiny_model(staging)
        if directory.exists():
            os.replace(directory, retired)  # a rename: the gap before the next one is tiny
        os.replace(staging, directory)
    except OSError:
        # Another process moved or replaced it first; its files are identical to ours.
        if not is_current_model(directory):
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        shutil.rmtree(retired, ignore_errors=True)
    return directory


def write_tiny_model(directory: Path) -> None:
    tokenizer = build_tokenizer()
    tokenizer.save(str(directory / "tokenizer.json"))
    write_safetensors(directory / WEIGHTS_FILE, build_weights(tokenizer))
    _write_json(directory / "config.json", llama_config())
    _write_json(
        directory / "generation_config.json",
        {"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2, "do_sample": False},
    )
    _write_json(
        directory / "special_tokens_map.json",
        {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN},
    )
    _write_json(directory / "tokenizer_config.json", tokenizer_config())
    _write_json(directory / GENERATOR_FILE, {"generator": generator_key()})


def build_tokenizer() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([_TRAINING_CORPUS] * 8, trainer=trainer)
    return tokenizer


def llama_config() -> dict[str, object]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": HIDDEN_SIZE,
        "intermediate_size": INTERMEDIATE_SIZE,
        "num_hidden_layers": NUM_LAYERS,
        "num_attention_heads": NUM_HEADS,
        "num_key_value_heads": NUM_KV_HEADS,
        "head_dim": HEAD_DIM,
        "vocab_size": VOCAB_SIZE,
        "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 2,
        "torch_dtype": "float32",
    }


def tokenizer_config(
    bos: str = BOS_TOKEN,
    eos: str = EOS_TOKEN,
    pad: str = PAD_TOKEN,
    max_length: int = MAX_POSITION_EMBEDDINGS,
    chat_template: str = CHAT_TEMPLATE,
) -> dict[str, object]:
    """A dev model's ``tokenizer_config.json`` (the tiny model's by default)."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "pad_token": pad,
        "add_bos_token": False,
        "add_eos_token": False,
        "model_max_length": max_length,
        "chat_template": chat_template,
        "clean_up_tokenization_spaces": False,
    }


def _write_json(path: Path, value: object) -> None:
    path.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n")


# --- Weights --------------------------------------------------------------------------------

TokenClass = Literal["quote", "close", "sep", "open", "digit", "text", "other", "special"]
Flag = Literal["structural", "digit", "text"]
FLAGS: tuple[Flag, ...] = ("structural", "digit", "text")
STRUCTURAL: frozenset[TokenClass] = frozenset({"quote", "close", "sep", "open"})
# Residual dimensions no layer writes to: 0 is constant (it carries BASE_LOGIT), then one flag
# per entry of FLAGS, set when the current token is of that kind (it carries LOGIT_AFTER).
CARRIER_DIMS = 1 + len(FLAGS)
CARRIER_VALUE = 4.0  # their value in the embedding, against N(0, 1) in every other dimension

# Logit added to a token of each class, whatever came before. Multi-character text and digit
# tokens get LOGIT_PER_EXTRA_CHAR more per character beyond the first: forced spans (keys,
# constants) then take fewer tokens; free text takes longer words.
BASE_LOGIT: Mapping[TokenClass, float] = {
    "quote": 5.0,  # `"`: closes a string
    "close": 5.0,  # `}` `]`
    "sep": 1.0,  # `,` `:`: below the closers, so an array or object ends rather than grows
    "open": 0.0,  # `{` `[`
    "digit": 0.0,
    "text": 0.0,  # printable ASCII
    "other": -6.0,  # control characters, bytes of a multi-byte character
    "special": -40.0,  # BOS, EOS, PAD: free text never ends before max_tokens
}
LOGIT_PER_EXTRA_CHAR = 0.5
# Logit added to a token of a class when the token just generated carries a flag.
LOGIT_AFTER: Mapping[Flag, Mapping[TokenClass, float]] = {
    # Never two structural tokens in a row where there is a choice: strings are not empty,
    # and a string's opening quote is not taken for its closing one.
    "structural": {"quote": -12.0, "close": -12.0, "sep": -12.0, "open": -12.0},
    # An integer ends: after a digit, a closing bracket beats another digit and a comma.
    "digit": {"digit": -4.0, "close": 2.0, "sep": -1.0},
    # A string ends: after text, its closing quote beats more text and a bracket in it.
    "text": {"quote": 1.5, "close": -3.0},
}
REPEAT_PENALTY = 4.0  # logit taken from the token just generated
RANDOM_LOGIT_STD = 1.5  # the random (bigram-like) part of a logit
LAYER_WEIGHT_STD = 0.13  # attention and MLP: enough that text depends on context, not more


def token_class(token_id: int, text: str) -> TokenClass:
    """The class of a token by its decoded text (a leading space does not change it)."""
    if token_id < len(SPECIAL_TOKENS):
        return "special"
    if not text or not all(" " <= c <= "~" for c in text):
        return "other"
    if text.strip(" "):
        text = text.lstrip(" ")
    if text == '"':
        return "quote"
    if text in ("}", "]"):
        return "close"
    if text in (",", ":"):
        return "sep"
    if text in ("{", "["):
        return "open"
    if text.isdigit():
        return "digit"
    return "text"


def _flag(token: TokenClass) -> Flag | None:
    if token in STRUCTURAL:
        return "structural"
    if token == "digit" or token == "text":
        return token
    return None


def _base_logit(token: TokenClass, text: str) -> float:
    logit = BASE_LOGIT[token]
    if token in ("digit", "text"):
        logit += LOGIT_PER_EXTRA_CHAR * (len(text) - 1)
    return logit


Tensor = tuple[list[int], list[float]]  # shape, values in row-major order


def build_weights(tokenizer: Tokenizer) -> dict[str, Tensor]:
    """Every tensor of the Llama config (HF names), from WEIGHTS_SEED: same tokenizer, same
    weights, bit for bit."""
    rng = random.Random(WEIGHTS_SEED)

    def normal(count: int, std: float) -> list[float]:
        return [rng.gauss(0.0, std) for _ in range(count)]

    def matrix(rows: int, cols: int, zero_rows: int = 0) -> Tensor:
        values = normal(rows * cols, LAYER_WEIGHT_STD)
        values[: zero_rows * cols] = [0.0] * (zero_rows * cols)  # never write the carriers
        return [rows, cols], values

    d, free = HIDDEN_SIZE, HIDDEN_SIZE - CARRIER_DIMS
    texts = [tokenizer.decode([i], skip_special_tokens=False) for i in range(VOCAB_SIZE)]
    classes = [token_class(i, text) for i, text in enumerate(texts)]
    embeddings = []
    for token in classes:
        flag = _flag(token)
        flags = [CARRIER_VALUE if flag == f else 0.0 for f in FLAGS]
        embeddings.append([CARRIER_VALUE, *flags, *normal(free, 1.0)])
    tensors: dict[str, Tensor] = {
        "model.embed_tokens.weight": ([VOCAB_SIZE, d], [x for row in embeddings for x in row])
    }
    q, kv = NUM_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM
    for layer in range(NUM_LAYERS):
        prefix = f"model.layers.{layer}."
        tensors[prefix + "input_layernorm.weight"] = ([d], [1.0] * d)
        tensors[prefix + "post_attention_layernorm.weight"] = ([d], [1.0] * d)
        tensors[prefix + "self_attn.q_proj.weight"] = matrix(q, d)
        tensors[prefix + "self_attn.k_proj.weight"] = matrix(kv, d)
        tensors[prefix + "self_attn.v_proj.weight"] = matrix(kv, d)
        tensors[prefix + "self_attn.o_proj.weight"] = matrix(d, q, zero_rows=CARRIER_DIMS)
        tensors[prefix + "mlp.gate_proj.weight"] = matrix(INTERMEDIATE_SIZE, d)
        tensors[prefix + "mlp.up_proj.weight"] = matrix(INTERMEDIATE_SIZE, d)
        tensors[prefix + "mlp.down_proj.weight"] = matrix(
            d, INTERMEDIATE_SIZE, zero_rows=CARRIER_DIMS
        )
    tensors["model.norm.weight"] = ([d], [1.0] * d)
    # After the final RMSNorm a carrier reads about CARRIER_VALUE / rms and a random dimension
    # about 1 / rms, with rms the embedding's (the layers add little): scale the head by it.
    rms = ((CARRIER_VALUE**2 + free) / d) ** 0.5
    carrier, unit = CARRIER_VALUE / rms, 1.0 / rms
    repeat = REPEAT_PENALTY / (unit * free)  # e.x / rms for x the current token is ~ free / rms
    head = []
    for text, token, embedding in zip(texts, classes, embeddings, strict=True):
        row = [_base_logit(token, text) / carrier]
        row += [LOGIT_AFTER[f].get(token, 0.0) / carrier for f in FLAGS]
        noise = normal(free, RANDOM_LOGIT_STD / (unit * free**0.5))
        row += [u - repeat * x for u, x in zip(noise, embedding[CARRIER_DIMS:], strict=True)]
        head.append(row)
    tensors["lm_head.weight"] = ([VOCAB_SIZE, d], [x for row in head for x in row])
    return tensors


def write_safetensors(path: Path, tensors: Mapping[str, Tensor]) -> None:
    """The safetensors format by hand (little-endian F32), so the gateway venv needs no torch."""
    header: dict[str, object] = {}
    blobs = []
    offset = 0
    for name in sorted(tensors):
        shape, values = tensors[name]
        data = array("f", values)
        if sys.byteorder == "big":
            data.byteswap()
        blob = data.tobytes()
        header[name] = {
            "dtype": "F32",
            "shape": shape,
            "data_offsets": [offset, offset + len(blob)],
        }
        blobs.append(blob)
        offset += len(blob)
    header["__metadata__"] = {"format": "pt"}
    encoded = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    with path.open("wb") as file:
        file.write(struct.pack("<Q", len(encoded)))
        file.write(encoded)
        for blob in blobs:
            file.write(blob)
