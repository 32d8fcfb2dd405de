"""Reading compose.yaml, the Dockerfiles and .dockerignore the way Docker would, without Docker.

No Docker engine runs where the tests run, so the deployment files are checked by parsing:
compose variable interpolation (``${VAR}``, ``${VAR:-default}``, ``${VAR:?error}``, ``$$``),
Dockerfile instructions (with line continuations and ``ARG`` defaults), and .dockerignore
patterns. Only what the checks need; Docker's own parsers stay the authority where present.
"""

from __future__ import annotations

import fnmatch
import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tests.harness import REPO_ROOT

COMPOSE_FILE = REPO_ROOT / "compose.yaml"
ENV_EXAMPLE = REPO_ROOT / "deploy" / "env.example"

_VARIABLE = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}")


class MissingVariable(KeyError):
    pass


def interpolate(value: Any, env: Mapping[str, str]) -> Any:
    """Compose's variable interpolation over a loaded document (strings anywhere inside)."""
    if isinstance(value, dict):
        return {key: interpolate(item, env) for key, item in value.items()}
    if isinstance(value, list):
        return [interpolate(item, env) for item in value]
    if not isinstance(value, str):
        return value

    def replace(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name, operator, argument = match.group(1), match.group(2), match.group(3)
        current = env.get(name)
        unset = current is None or (
            current == "" and operator is not None and operator.startswith(":")
        )
        if operator in ("-", ":-"):
            return argument if unset else current
        if operator in ("?", ":?"):
            if unset:
                raise MissingVariable(f"{name}: {argument}")
            return current
        return current or ""

    return _VARIABLE.sub(replace, value)


def read_env_file(path: Path) -> dict[str, str]:
    env: dict[str, str] = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            env[key.strip()] = value.strip()
    return env


def load_compose(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    document = yaml.safe_load(COMPOSE_FILE.read_text())  # SafeLoader resolves the << merges
    return document if env is None else interpolate(document, env)


def environment_of(service: Mapping[str, Any]) -> dict[str, str]:
    environment = service.get("environment") or {}
    if isinstance(environment, list):
        return dict(item.partition("=")[::2] for item in environment)
    return {key: "" if value is None else str(value) for key, value in environment.items()}


def depends_on(service: Mapping[str, Any]) -> dict[str, str]:
    """``{dependency: condition}``; the short list form means service_started."""
    value = service.get("depends_on") or {}
    if isinstance(value, list):
        return {name: "service_started" for name in value}
    return {name: (spec or {}).get("condition", "service_started") for name, spec in value.items()}


# ---- Dockerfiles ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Instruction:
    keyword: str
    arguments: str
    line: int


def dockerfile_instructions(path: Path) -> list[Instruction]:
    """Instructions with continuations joined and heredoc bodies folded into their RUN."""
    lines = path.read_text().splitlines()
    instructions: list[Instruction] = []
    index = 0
    while index < len(lines):
        start = index
        text = lines[index]
        index += 1
        if not text.strip() or text.lstrip().startswith("#"):
            continue
        while text.rstrip().endswith("\\") and index < len(lines):
            text = text.rstrip()[:-1] + " " + lines[index].strip()
            index += 1
        heredoc = re.search(r"<<-?'?\"?([A-Z]+)'?\"?", text)
        if heredoc:
            body = []
            while index < len(lines) and lines[index].strip() != heredoc.group(1):
                body.append(lines[index])
                index += 1
            index += 1
            text += "\n" + "\n".join(body)
        keyword, _, arguments = text.strip().partition(" ")
        instructions.append(Instruction(keyword.upper(), arguments.strip(), start + 1))
    return instructions


def base_images(path: Path) -> list[str]:
    """Every FROM image with ARG defaults substituted (stage names resolved away)."""
    args: dict[str, str] = {}
    stages: set[str] = set()
    images = []
    for instruction in dockerfile_instructions(path):
        if instruction.keyword == "ARG" and "=" in instruction.arguments:
            name, _, default = instruction.arguments.partition("=")
            args.setdefault(name.strip(), default.strip().strip('"'))
        if instruction.keyword == "FROM":
            words = [w for w in instruction.arguments.split() if not w.startswith("--")]
            image = re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m.group(1), m.group(0)), words[0])
            if len(words) >= 3 and words[1].upper() == "AS":
                stages.add(words[2])
            if image not in stages:
                images.append(image)
    return images


def copy_sources(path: Path) -> list[str]:
    sources = []
    for instruction in dockerfile_instructions(path):
        if instruction.keyword not in ("COPY", "ADD") or "--from=" in instruction.arguments:
            continue
        arguments = instruction.arguments
        words = json_or_shell_words(arguments)
        words = [w for w in words if not w.startswith("--")]
        sources.extend(words[:-1])
    return sources


def json_or_shell_words(arguments: str) -> list[str]:
    if arguments.startswith("["):
        return list(yaml.safe_load(arguments))
    return shlex.split(arguments)


def dockerignore_patterns() -> list[str]:
    text = (REPO_ROOT / ".dockerignore").read_text()
    return [line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")]


def is_ignored(relative: str, patterns: list[str]) -> bool:
    """Docker's rule: the last matching pattern wins, and a pattern covers what is under it."""
    parts = relative.strip("/").split("/")
    ignored = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pattern_parts = pattern.lstrip("!").strip("/").split("/")
        if any(_match(parts[:end], pattern_parts) for end in range(1, len(parts) + 1)):
            ignored = not negate
    return ignored


def _match(parts: list[str], pattern: list[str]) -> bool:
    """Segment by segment: ``*`` stays within a segment, ``**`` spans any number of them."""
    if not pattern:
        return not parts
    if pattern[0] == "**":
        return any(_match(parts[skip:], pattern[1:]) for skip in range(len(parts) + 1))
    return (
        bool(parts) and fnmatch.fnmatchcase(parts[0], pattern[0]) and _match(parts[1:], pattern[1:])
    )
