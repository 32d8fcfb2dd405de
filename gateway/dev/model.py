"""A tiny Llama model directory generated locally and deterministically (no download).

The weights are not stored: SGLang serves the config with `--load-format dummy` (random
weights, so greedy output is deterministic but meaningless). The tokenizer is a byte-level
BPE trained with `tokenizers` on a fixed built-in corpus, so every run produces the same
files. Imports only `tokenizers` and the standard library: it runs in the gateway venv.
"""

import json
import os
import shutil
import tempfile
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

VOCAB_SIZE = 512
BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"
PAD_TOKEN = "<|pad|>"
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN)  # ids 0, 1, 2 in this order
MAX_POSITION_EMBEDDINGS = 65536

DEFAULT_MODEL_DIR = Path(__file__).resolve().parents[2] / ".run" / "models" / "tiny-llama"

# HF-style chat template: messages with role/content, optional generation prompt.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}{{ eos_token }}\n"
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

MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
)


def ensure_tiny_model(directory: Path = DEFAULT_MODEL_DIR) -> Path:
    """Return `directory`, generating the tiny model there first if any file is missing."""
    directory = Path(directory)
    if all((directory / name).is_file() for name in MODEL_FILES):
        return directory
    directory.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename, so a concurrent reader never sees half a model.
    staging = Path(tempfile.mkdtemp(prefix=".tiny-model-", dir=directory.parent))
    try:
        write_tiny_model(staging)
        if directory.exists():
            shutil.rmtree(directory)
        os.replace(staging, directory)
    except FileExistsError:
        pass  # another process finished first; its files are identical
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return directory


def write_tiny_model(directory: Path) -> None:
    build_tokenizer().save(str(directory / "tokenizer.json"))
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
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
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


def tokenizer_config() -> dict[str, object]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "add_bos_token": False,
        "add_eos_token": False,
        "model_max_length": MAX_POSITION_EMBEDDINGS,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
    }


def _write_json(path: Path, value: object) -> None:
    path.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n")
