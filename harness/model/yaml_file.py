"""Reading the YAML files users give (specs, matrix files) in bounded time and memory, with one-line errors.

A file is read in two passes of libyaml's C parser (PyYAML's pure-Python parser takes over 10 s on a 1 MiB
file): the first streams its events and counts its values, alias expansions included, and its nesting depth,
stopping at the limit, so a file too large for a spec is refused for that reason before anything is built
from it; only then is the document built, with each mapping refusing a key it already has.
"""
from __future__ import annotations

from pathlib import Path

import yaml

from harness.errors import clip

MAX_YAML_BYTES = 1 << 20  # a spec or matrix file is a few KiB
MAX_YAML_VALUES = 100_000  # every key, scalar, list and mapping; a spec has hundreds (a layer is 2 or more)
MAX_YAML_DEPTH = 100  # the built-in models nest 6 deep; the composer recurses once per level

_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml when PyYAML was built with it (its wheels are)


class _DuplicateKey(yaml.YAMLError):
    def __init__(self, key, first: int, again: int):
        super().__init__(f"key '{clip(key, 60)}' appears twice, at lines {first} and {again}; a mapping takes "
                         f"each key once (the second would silently win)")
        self.line = again


class _Expanded(yaml.YAMLError):
    """More values, or deeper nesting, than a spec has: the message says which."""


class _UniqueKeyLoader(_Loader):
    """The safe loader whose mappings refuse a duplicated key, naming it and both lines."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            lines: dict = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue  # `<<: *base` then `key:` overrides base's key on purpose
                key, line = self.construct_object(key_node, deep=True), key_node.start_mark.line + 1
                try:
                    if key in lines:
                        raise _DuplicateKey(key, lines[key], line)
                    lines[key] = line
                except TypeError:  # an unhashable key: SafeConstructor says so below
                    continue
        return super().construct_mapping(node, deep=deep)


def _check_size(text: str) -> None:
    """_Expanded when the document holds more than MAX_YAML_VALUES values once its aliases (&/*) are expanded, or
    nests deeper than MAX_YAML_DEPTH; stops as soon as it knows, so its time is bounded by the limits."""
    anchored: dict[str, int] = {}  # anchor -> values in the node it names, its own aliases expanded
    open_nodes: list[list] = []  # per collection being read: [anchor, values so far]
    written = expanded = 0  # values as written in the file, and once aliases are expanded
    for event in yaml.parse(text, Loader=_Loader):
        if isinstance(event, (yaml.ScalarEvent, yaml.AliasEvent)):
            written += 1
            size = 1 if isinstance(event, yaml.ScalarEvent) else anchored.get(event.anchor, 1)
            if isinstance(event, yaml.ScalarEvent) and event.anchor:
                anchored[event.anchor] = 1
        elif isinstance(event, yaml.CollectionStartEvent):
            written += 1
            open_nodes.append([event.anchor, 1])
            if len(open_nodes) > MAX_YAML_DEPTH:
                raise _Expanded(f"invalid YAML: nested too deeply (more than {MAX_YAML_DEPTH} levels)")
            continue
        elif isinstance(event, yaml.CollectionEndEvent):
            anchor, size = open_nodes.pop()
            if anchor:
                anchored[anchor] = size
        else:
            continue
        if open_nodes:
            open_nodes[-1][1] += size
            expanded = max(expanded, open_nodes[-1][1])
        else:
            expanded = max(expanded, size)
        if written > MAX_YAML_VALUES:
            raise _Expanded(f"more than {MAX_YAML_VALUES} values (keys, numbers, strings, lists, mappings): too large "
                            f"for a spec")
        if expanded > MAX_YAML_VALUES:
            raise _Expanded(f"more than {MAX_YAML_VALUES} values once its aliases (&/*) are expanded: not a spec")


def read_yaml(path: Path, error: type[Exception]):
    """A small YAML file's content, or `error` with one line naming the file: unreadable, too large, not UTF-8
    text, invalid, a key given twice in one mapping, too many values (aliases expanded) or nested too deeply."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_YAML_BYTES + 1)
    except OSError as exc:
        raise error(f"{clip(path, 200)}: cannot read: {exc.strerror}") from None
    if len(raw) > MAX_YAML_BYTES:
        raise error(f"{path}: larger than {MAX_YAML_BYTES >> 20} MiB: not a spec") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"{path}: byte {exc.start}: not UTF-8 text") from None
    try:
        _check_size(text)
        return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 (a safe loader)
    except _Expanded as exc:
        raise error(f"{path}: {exc}") from None
    except _DuplicateKey as exc:
        raise error(f"{path}: line {exc.line}: {exc}") from None
    except yaml.YAMLError as exc:
        mark, problem = getattr(exc, "problem_mark", None), str(getattr(exc, "problem", None) or exc)
        if "maximum nesting depth" in problem:  # libyaml's own limit, met while it reads ahead of our count
            raise error(f"{path}: invalid YAML: nested too deeply (more than {MAX_YAML_DEPTH} levels)") from None
        where = f"line {mark.line + 1}: " if mark else ""
        raise error(f"{path}: {where}invalid YAML: {clip(problem, 200)}") from None
    except RecursionError:
        raise error(f"{path}: invalid YAML: nested too deeply") from None
