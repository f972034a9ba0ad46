"""Where a deployment's values came from: the file, and the line of every key.

YAML is composed into nodes (which carry `start_mark.line`) and turned into plain Python
values while a map from key path to line is recorded, so every error can name the file, the
line and the key:

    configs/edge.yaml:14: workers[1].device: 'tpu:0' is not a device; ...

Key paths look like `router.port`, `workers[1].device`, `engine.max_num_seqs`. A plain dict
(tests, `parse_deployment(raw)`) has no lines; its errors name the source and the key.
Duplicate keys are an error here (YAML itself keeps the last one silently).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml


@dataclass(frozen=True, slots=True)
class Issue:
    """One problem in a deployment file."""

    source: str
    line: int | None  # 1-based
    key: str  # "" for the whole document
    message: str

    def __str__(self) -> str:
        where = self.source if self.line is None else f"{self.source}:{self.line}"
        return f"{where}: {self.key}: {self.message}" if self.key else f"{where}: {self.message}"


class ConfigError(ValueError):
    """A deployment file that cannot be used; every issue names the file, line and key."""

    def __init__(self, issues: list[Issue] | str) -> None:
        if isinstance(issues, str):
            issues = [Issue("<config>", None, "", issues)]
        self.issues = sorted(issues, key=lambda i: i.line or 0)
        super().__init__("\n".join(str(i) for i in self.issues))


@dataclass(slots=True)
class Source:
    """A file name, the line of each key path, and the issues found so far."""

    name: str = "<dict>"
    lines: dict[str, int] = field(default_factory=dict)
    issues: list[Issue] = field(default_factory=list)
    text: str = ""

    def line(self, key: str) -> int | None:
        """The line of `key`, else of its nearest parent that has one."""
        while key:
            if key in self.lines:
                return self.lines[key]
            key = _parent(key)
        return self.lines.get("")

    def error(self, key: str, message: str) -> None:
        """Records an issue at `key`."""
        self.issues.append(Issue(self.name, self.line(key), key, message))

    def raise_if_any(self) -> None:
        """ConfigError with every issue recorded so far, if there is any."""
        if self.issues:
            raise ConfigError(self.issues)


def _parent(key: str) -> str:
    cut = max(key.rfind("."), key.rfind("["))
    return key[:cut] if cut > 0 else ""


def read_yaml(path: str | Path) -> tuple[Any, Source]:
    """The document in `path` as plain values, with the line of every key."""
    path = Path(path)
    src = Source(str(path))
    try:
        src.text = path.read_text()
    except OSError as e:
        raise ConfigError([Issue(str(path), None, "", f"cannot read ({e.strerror})")]) from e
    return parse_yaml(src.text, src), src


def parse_yaml(text: str, src: Source) -> Any:
    """Plain values of `text`; fills `src.lines` (and `src.issues` for duplicate keys)."""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        value = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = None if mark is None else mark.line + 1
        problem = getattr(e, "problem", None) or str(e)
        raise ConfigError([Issue(src.name, line, "", f"not valid YAML: {problem}")]) from e
    if node is not None:
        src.lines[""] = node.start_mark.line + 1
        _walk(node, "", src)
    return value


def _walk(node: yaml.Node, key: str, src: Source) -> None:
    if isinstance(node, yaml.MappingNode):
        seen: set[str] = set()
        for knode, vnode in node.value:
            name = str(knode.value)
            if name == "<<":  # merge key: the merged keys keep the line of their anchor
                continue
            path = f"{key}.{name}" if key else name
            src.lines[path] = knode.start_mark.line + 1
            if name in seen:
                src.error(path, "duplicate key (YAML would silently keep the last one)")
            seen.add(name)
            _walk(vnode, path, src)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            path = f"{key}[{i}]"
            src.lines[path] = item.start_mark.line + 1
            _walk(item, path, src)
