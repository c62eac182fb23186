"""Record the signatures of the CUDA-only torch APIs the project calls (moe.cuda_calls.APIS), as some torch
offers them, into a JSON file that tests/test_cuda_contract.py binds the project's real calls against.

    python tools/torch_signatures.py --installed --out tests/assets/gpu_host_torch_signatures.json   # on the GPU host
    pip download --no-deps --only-binary=:all: --python-version 3.12 torch==2.11.0 -d /tmp/w && \
      unzip -q /tmp/w/torch-2.11.0-*.whl 'torch/*.py' 'torch/*.pyi' -d /tmp/w/src && \
      python tools/torch_signatures.py --torch-root /tmp/w/src/torch --out tests/assets/gpu_host_torch_signatures.json

The signatures are read with `ast` from torch's Python sources and its stubs (torch/_C/*.pyi for builtins such as
addmm), so a torch that cannot be imported here (the GPU host's CUDA build of 2.11, whose CPU build is not
published) is read from its unzipped wheel without installing it. `make gpu-check` records the GPU host's own
torch in its env stage (gpu-check-out/torch_signatures.json), to compare with the committed file.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from moe.cuda_calls import APIS, read_signatures  # noqa: E402


def torch_version(torch_root: str) -> str:
    """torch's __version__ from its version.py, read without importing it."""
    with open(os.path.join(torch_root, "version.py"), encoding="utf-8") as fh:
        for node in ast.parse(fh.read()).body:
            targets = [t.id for t in getattr(node, "targets", [getattr(node, "target", None)]) if isinstance(t, ast.Name)]
            if "__version__" in targets and isinstance(node.value, ast.Constant):
                return node.value.value
    raise LookupError(f"{torch_root}/version.py has no __version__")


def record(torch_root: str, origin: str) -> dict:
    return {"torch": torch_version(torch_root), "origin": origin,
            "apis": {name: {"source": api.source, "overloads": read_signatures(torch_root, api.source)}
                     for name, api in sorted(APIS.items())}}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--installed", action="store_true", help="the torch this Python imports")
    where.add_argument("--torch-root", help="a torch package folder (an unzipped wheel's torch/)")
    parser.add_argument("--origin", default=None, help="how the sources were obtained (recorded in the file)")
    parser.add_argument("--out", default="-", help="JSON file to write (default: stdout)")
    parser.add_argument("--compare", default=None, metavar="RECORD",
                        help="a committed record: print each API whose signatures differ; exit 1 when the torch "
                             "versions are the same and the signatures are not (the record is wrong)")
    args = parser.parse_args(argv)
    if args.installed:
        import torch

        root = os.path.dirname(torch.__file__)
        origin = args.origin or f"the installed torch ({root}), python {sys.version.split()[0]}"
    else:
        root = os.path.abspath(args.torch_root)
        origin = args.origin or f"torch sources at {root}"
    text = json.dumps(record(root, origin), indent=1, sort_keys=True) + "\n"
    if args.out == "-":
        sys.stdout.write(text)
    else:
        with open(args.out, "w", encoding="utf-8") as fh:
            fh.write(text)
        print(f"torch_signatures: {len(APIS)} APIs of torch {torch_version(root)} -> {args.out}")
    if args.compare:
        return compare(json.loads(text), args.compare)
    return 0


def compare(current: dict, record_path: str) -> int:
    with open(record_path, encoding="utf-8") as fh:
        recorded = json.load(fh)
    differ = sorted(name for name in set(current["apis"]) | set(recorded["apis"])
                    if current["apis"].get(name, {}).get("overloads") != recorded["apis"].get(name, {}).get("overloads"))
    same_torch = current["torch"] == recorded["torch"]
    for name in differ:
        print(f"torch_signatures: {name} differs between torch {current['torch']} (here) and {recorded['torch']} "
              f"({record_path})")
    if not differ:
        print(f"torch_signatures: torch {current['torch']} here has the signatures of {record_path} "
              f"(torch {recorded['torch']})")
    elif not same_torch:
        print(f"torch_signatures: this host's torch is not the recorded one: to check the CPU against it, commit "
              f"this output as {record_path}")
    return 1 if differ and same_torch else 0


if __name__ == "__main__":
    sys.exit(main())
