"""Does a built extension carry its own copy of the C++ exception runtime? (Used by setup.py after each build.)

Some toolchains link libstdc++ statically into shared objects (a wrapper `g++` that passes -static-libstdc++: the
GPU host's CUDA image has one at /opt/gcc/bin/g++, set as $CXX). An extension built that way defines
`__cxa_throw`, `__cxa_begin_catch` and `__gxx_personality_v0` itself, next to the process's libstdc++.so.6 that
torch uses: the first TORCH_CHECK that fails inside the extension then kills the process with SIGSEGV instead of
raising RuntimeError (measured on the H200 host, 2026-11-26: every C++ input check of megagspo._C; the same
sources built with /usr/bin/g++ raise). setup.py refuses such a build with this module's message.
Standard library only: setup.py imports it before anything is built."""

from __future__ import annotations

import shutil
import subprocess

# defined by libstdc++ / libsupc++; an extension that links libstdc++.so.6 only references them
PRIVATE_RUNTIME_SYMBOLS = ("__cxa_throw", "__cxa_begin_catch", "__gxx_personality_v0")


def defined_dynamic_symbols(nm_output: str) -> set:
    """Names in `nm -D --defined-only` output (version suffixes such as @@CXXABI_1.3 dropped)."""
    names = set()
    for line in nm_output.splitlines():
        parts = line.split()
        if len(parts) >= 3:
            names.add(parts[-1].split("@")[0])
    return names


def private_runtime_problem(library: str, nm_output: str | None = None, compiler: str = "") -> str | None:
    """The error message when `library` defines the C++ exception runtime itself, else None. `nm_output` is
    read with binutils' nm when not given (None: nm missing, nothing checked)."""
    if nm_output is None:
        nm = shutil.which("nm")
        if nm is None:
            return None
        nm_output = subprocess.run([nm, "-D", "--defined-only", library], capture_output=True, text=True,
                                   check=False).stdout
    found = sorted(defined_dynamic_symbols(nm_output) & set(PRIVATE_RUNTIME_SYMBOLS))
    if not found:
        return None
    return (f"{library} defines its own C++ exception runtime ({', '.join(found)}): the compiler "
            f"{compiler or '(CXX)'} linked libstdc++ statically, and a failing input check inside the extension "
            "would crash the process instead of raising. Rebuild with a compiler that links libstdc++.so.6, e.g. "
            "CXX=/usr/bin/g++ CC=/usr/bin/gcc CUDAHOSTCXX=/usr/bin/g++ (tools/gpu_check.sh does).")
