"""The bounded reader of a YAML file from disk (an architecture given as YAML, `model.arch_file`): size and
nesting checked before the document is built, every failure one line naming the file.

libyaml's composer recurses once per nested collection (~50,000 levels crash the process) and PyYAML's pure
Python one raises RecursionError far earlier, so the nesting is measured first from the parser's event stream,
which does not recurse. megagspo's recipe reader (megagspo.config.parse_yaml) takes the same pre-scan from here.
"""

from __future__ import annotations

import os

import yaml

from moe.json_files import read_bytes_bounded

MAX_BYTES = 1 << 20  # an architecture or a recipe is a few KB
MAX_DEPTH = 256


class YamlFileError(ValueError):
    """A YAML file that cannot be trusted: the message is one line and names it."""


def safe_loader():
    """PyYAML's C-accelerated safe loader where libyaml is present (the pure-Python one takes minutes on a
    large file)."""
    return getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def yaml_depth(text: str, stop_above: int = MAX_DEPTH) -> int:
    """The deepest nesting of YAML collections in `text` (counted up to stop_above + 1), from the parser's
    event stream, so a hostile depth is found before it can crash the loader. Raises yaml.YAMLError when the
    text does not parse."""
    depth = deepest = 0
    for event in yaml.parse(text, Loader=safe_loader()):
        if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            depth += 1
            deepest = max(deepest, depth)
            if deepest > stop_above:
                break
        elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
            depth -= 1
    return deepest


def read_yaml(path, max_bytes: int = MAX_BYTES, max_depth: int = MAX_DEPTH):
    """The YAML document in the file `path` (safe loader). Raises YamlFileError naming the file when it is
    unreadable, larger than `max_bytes`, not UTF-8, not YAML or nested deeper than `max_depth`."""
    path = os.fspath(path)
    data = read_bytes_bounded(path, max_bytes, YamlFileError, "a YAML file")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise YamlFileError(f"{path}: not UTF-8 text") from None
    try:
        if yaml_depth(text, max_depth) > max_depth:
            raise YamlFileError(f"{path}: YAML nested deeper than {max_depth} levels")
        return yaml.load(text, Loader=safe_loader())  # noqa: S506 - the safe loader
    except yaml.YAMLError as exc:
        problem = (getattr(exc, "problem", None) or str(exc).splitlines()[0])[:200]
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        raise YamlFileError(f"{path}: not valid YAML: {problem}{where}") from None
    except RecursionError:
        raise YamlFileError(f"{path}: YAML nested too deeply") from None
