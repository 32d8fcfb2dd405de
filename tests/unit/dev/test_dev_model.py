"""The dev model's generator (gateway/dev/model.py): weights file and cache reuse."""

from __future__ import annotations

import itertools
import json
import struct
from pathlib import Path

from gateway.dev.model import (
    GENERATOR_FILE,
    HIDDEN_SIZE,
    VOCAB_SIZE,
    WEIGHTS_FILE,
    ensure_tiny_model,
    generator_key,
)


def test_a_model_written_by_another_generator_is_regenerated(tmp_path: Path) -> None:
    directory = ensure_tiny_model(tmp_path / "model")
    # As a directory cached before the weights existed: the old files, no weights, no key.
    (directory / WEIGHTS_FILE).unlink()
    (directory / GENERATOR_FILE).write_text(json.dumps({"generator": "an older generator"}))

    ensure_tiny_model(directory)

    assert (directory / WEIGHTS_FILE).is_file()
    assert json.loads((directory / GENERATOR_FILE).read_text()) == {"generator": generator_key()}


def test_the_weights_file_holds_every_tensor_of_the_config(tmp_path: Path) -> None:
    directory = ensure_tiny_model(tmp_path / "model")
    config = json.loads((directory / "config.json").read_text())
    raw = (directory / WEIGHTS_FILE).read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + size])
    header.pop("__metadata__")

    layers = {n.split(".")[2] for n in header if n.startswith("model.layers.")}
    assert layers == {str(i) for i in range(config["num_hidden_layers"])}
    assert header["lm_head.weight"]["shape"] == [VOCAB_SIZE, HIDDEN_SIZE]
    assert header["model.embed_tokens.weight"]["shape"] == [VOCAB_SIZE, HIDDEN_SIZE]
    # Contiguous F32 tensors that fill the file exactly.
    spans = sorted(tuple(t["data_offsets"]) for t in header.values())
    assert spans[0][0] == 0 and all(a[1] == b[0] for a, b in itertools.pairwise(spans))
    assert 8 + size + spans[-1][1] == len(raw)
    for tensor in header.values():
        count = 1
        for dim in tensor["shape"]:
            count *= dim
        assert tensor["dtype"] == "F32"
        assert tensor["data_offsets"][1] - tensor["data_offsets"][0] == 4 * count
