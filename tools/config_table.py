"""Every configuration key as a Markdown table, from megagspo/config.py itself (its dataclasses' fields, their
defaults and the comments beside or above them), so that the documented keys are the keys the code reads.

    python tools/config_table.py > docs/configuration-keys.md
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import re
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

# Fields whose meaning the source states in its docstrings rather than beside them.
EXTRA = {"name": "the run folder is log.out_dir/name (one plain folder name)",
         "seed": "the run's seed: weight init, data order, sampling"}
FIELD = re.compile(r"^    ([a-z_][a-z0-9_]*): [^=]+?(?:= (.*?))?\s*(?:#\s?(.*))?$")


def _comments(source_lines: list, cls_name: str) -> dict:
    """{field: comment} for the dataclass `cls_name`: the trailing comment, its continuation lines (an indented
    comment right below) and the comment lines right above the field."""
    start = next(i for i, line in enumerate(source_lines) if re.match(rf"class {cls_name}\b[:(]", line))
    out, above, last = {}, [], None
    for line in source_lines[start + 1:]:
        if line and not line.startswith((" ", "#")):
            break
        stripped = line.strip()
        if stripped.startswith("#"):
            text = stripped.lstrip("#").strip()
            if text.startswith("----"):  # a divider naming a group of fields, not a field's comment
                continue
            if last is not None and line.startswith(" " * 20):  # continues the previous field's trailing comment
                out[last] = f"{out[last]} {text}".strip()
            else:
                above.append(text)
                last = None
            continue
        match = FIELD.match(line)
        if match and not stripped.startswith("def "):
            name, trailing = match.group(1), match.group(3) or ""
            out[name] = " ".join(above + ([trailing] if trailing else [])).strip()
            above, last = [], name
        else:
            above, last = [], None
    return out


def _default(value) -> str:
    if isinstance(value, str):
        return f'`"{value}"`' if value == "" else f"`{value}`"
    if value is None:
        return "`null`"
    if isinstance(value, dict):
        return "`{}`" if not value else f"`{value}`"
    return f"`{value}`"


def _source_of(cls) -> list:
    """The lines of the file that defines `cls` (the algorithm's Configs are rl sections as they are)."""
    return open(inspect.getsourcefile(cls)).read().splitlines()


def _section(path: str, section, lines: list) -> None:
    """`path`'s table (its plain keys), then each nested section's, depth first, under its dotted name."""
    cls = type(section)
    comments = _comments(_source_of(cls), cls.__name__)
    doc = " ".join((inspect.getdoc(cls) or "").split("\n\n")[0].split())
    if doc.startswith(cls.__name__ + "("):  # a dataclass without a docstring: its generated signature
        doc = ""
    rows, nested = [], []
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        if dataclasses.is_dataclass(value):
            nested.append((f"{path}.{f.name}", value))
            continue
        text = comments.get(f.name, "").replace("|", "\\|")
        rows.append(f"| `{path}.{f.name}` | {_default(value)} | {text} |")
    lines += ["", f"## `{path}`", "", *([doc, ""] if doc else [])]
    if rows:
        lines += ["| key | default | meaning |", "|---|---|---|", *rows]
    for sub_path, sub in nested:
        _section(sub_path, sub, lines)


def table() -> str:
    from megagspo.config import Config, declared_default

    lines = ["# Configuration keys", "",
             "Every key of a recipe (`configs/*.yaml`) and of the command line (`section.key=value`), with its default and",
             "what it does, generated from the config dataclasses (`megagspo/config.py` and the algorithm's own Configs,",
             "which are rl sections as they are) by `python tools/config_table.py > docs/configuration-keys.md`.",
             "Each section is validated on construction; a bad value is an error naming the key. The guide is",
             "[configuration.md](configuration.md). Keys of earlier recipes (the flat `rl.lr`, `rl.loss: grpo`, ...)",
             "still load, moved onto these with one warning; the table of moves is the last section.", ""]
    top_comments = _comments(_source_of(Config), "Config")
    lines += ["## Top level", "", "| key | default | meaning |", "|---|---|---|"]
    sections = []
    for f in dataclasses.fields(Config):
        value = declared_default(f)  # fresh sections, before Config resolves e.g. data.tokenizer: auto
        if dataclasses.is_dataclass(value):
            sections.append((f.name, value))
        else:
            lines.append(f"| `{f.name}` | {_default(value)} | {top_comments.get(f.name) or EXTRA.get(f.name, '')} |")
    for name, section in sections:
        _section(name, section, lines)
    from megagspo.config_moves import MOVED_KEYS

    lines += ["", "## Keys that moved", "", "An earlier recipe, override, ablation arm or saved run's `config.yaml` may use the "
              "key on the left; it loads under the key on the right, with one warning per file naming them.", "",
              "| earlier key | key now |", "|---|---|", *(f"| `{old}` | `{new}` |" for old, new in MOVED_KEYS.items())]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(table())
