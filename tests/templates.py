"""A chat template with Qwen3's thinking switch, on the tiny dev model's tokenizer.

The tiny model's own template (``gateway.dev.model.CHAT_TEMPLATE``) with, after the generation
prompt, the empty thinking block Qwen3's template closes when ``enable_thinking`` is false, and
a ``system_prompt`` variable: what ``chat_template_kwargs`` is tested against, in the gateway's
rendering (unit), against ``apply_chat_template`` (engine venv) and on real SGLang (e2e).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from gateway.dev.model import CHAT_TEMPLATE

THINKING_TEMPLATE = (
    CHAT_TEMPLATE.replace(
        "{{ bos_token }}",
        "{{ bos_token }}{% if system_prompt is defined %}system: {{ system_prompt }}\n{% endif %}",
        1,
    )
    + "{% if add_generation_prompt and enable_thinking is defined and enable_thinking is false %}"
    + "<think>\n\n</think>\n\n{% endif %}"
)


def thinking_model(model_dir: Path, directory: Path) -> Path:
    """A copy of ``model_dir`` (a tiny dev model) at ``directory`` with ``THINKING_TEMPLATE``."""
    shutil.copytree(model_dir, directory)
    config_file = directory / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = THINKING_TEMPLATE
    config_file.write_text(json.dumps(config))
    return directory
