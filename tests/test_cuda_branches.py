"""Every branch of megagspo/ and moe/ that only CUDA takes is owned: by the tests that execute it (a gpu-marked
test on a GPU host, or a CPU test that forces it with a stand-in), or by a written reason. A new CUDA-only
branch without an owner fails here, and so does an owner that no longer names a real branch or test.

A branch is found by its test expression (if / elif / while / conditional expression) mentioning CUDA:
`x.is_cuda`, a comparison with "cuda" or "nccl" (`device.type == "cuda"`, `backend == "nccl"`),
`torch.cuda.is_available()`, `use_cuda()`, `dist.is_nccl_available()`, or a local name assigned from one of
those and tested bare (`cuda = use_cuda(); if cuda:`). Its key is 'path::function::test expression' (with
'#n' for the n-th identical test in one function), so moving code does not change it; rewriting the condition
does, on purpose. `python tests/test_cuda_branches.py` prints the table docs/testing.md carries.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PREDICATE_CALLS = {"torch.cuda.is_available", "use_cuda", "dist.is_nccl_available",
                   "torch.distributed.is_nccl_available"}
CUDA_WORDS = ("cuda", "nccl")

GPU_TRAINER = "tests/test_gpu_trainer.py::test_tiny_recipe_trains_on_cuda"
GPU_RESUME = "tests/test_gpu_trainer.py::test_bf16_run_resumed_on_cuda_continues"
CONTRACT = "tests/test_cuda_contract.py::test_cuda_only_call_binds_to_installed_and_gpu_host_torch"
NO_SGLANG = ("reason: SGLang servers on a GPU; no GPU host of ours has sglang (the image lacks it and its ~4.3 GB "
             "of wheels cannot be brought offline), so only live-server tests marked gpu would run it")

# key -> owners: test ids ('tests/x.py::test_name') that execute the CUDA side, or 'reason: ...'
BRANCH_OWNERS = {
    "megagspo/rl/peak_memory.py::PeakMemory.start::self.device.type == 'cuda'": [
        "tests/test_peak_memory.py::test_a_cuda_window_resets_and_reads_the_caching_allocator_of_its_gpu",
        "tests/test_peak_memory.py::test_a_cuda_window_measures_a_real_allocation",
        "tests/test_gpu_trainer.py::test_producer_with_partial_rollouts_and_r3_on_cuda"],
    "megagspo/rl/peak_memory.py::PeakMemory.peak_gib::self.device.type == 'cuda'": [
        "tests/test_peak_memory.py::test_a_cuda_window_resets_and_reads_the_caching_allocator_of_its_gpu",
        "tests/test_peak_memory.py::test_a_cuda_window_measures_a_real_allocation",
        "tests/test_gpu_trainer.py::test_producer_with_partial_rollouts_and_r3_on_cuda"],
    "megagspo/checkpoint/state.py::capture_rng::use_cuda()": [GPU_RESUME, CONTRACT],
    "megagspo/checkpoint/state.py::restore_rng::use_cuda() and f'rank{rank}/cuda' in tensors": [GPU_RESUME, CONTRACT],
    "megagspo/checkpoint/state.py::RunRng.state_dict::'cuda' in captured": [GPU_RESUME],
    "megagspo/rollout/hf_engine.py::engine_dtype::dtype is None or device.type != 'cuda'": [
        "tests/test_rollout_engine_memory.py::test_engine_dtype_follows_a_bf16_policy_on_a_gpu_only"],
    "megagspo/rollout/sglang/tensor_sync.py::SGLangIpcCodec.__init__::not torch.cuda.is_available()": [
        "tests/test_sglang_engine.py::test_tensor_sync_needs_this_host_cuda_and_sglang"],
    "megagspo/rollout/sglang/distributed_sync.py::check_distributed_available::cfg.dist_backend == 'nccl' "
    "and (not (torch.cuda.is_available() and dist.is_nccl_available()))": [
        "tests/test_sglang_engine.py::test_tensor_sync_needs_this_host_cuda_and_sglang"],
    "megagspo/rollout/sglang/distributed_sync.py::DistributedSync.send::self.config.dist_backend == 'nccl'": [
        NO_SGLANG],
    "megagspo/rollout/sglang/distributed_sync.py::DistributedSync.send.broadcast::device.type == 'cuda'": [NO_SGLANG],
    "moe/attention.py::SDPACoreAttention._forward_packed::q_TND.is_cuda and q_TND.dtype in "
    "(torch.bfloat16, torch.float16) and varlen_available()": [
        "tests/test_moe_packed_attention.py::test_packed_attention_on_cuda_is_varlen_flash_and_equals_padded",
        "tests/test_moe_packed_attention.py::test_varlen_gqa_modes_on_cuda_equal_padded",
        "tests/test_fake_cuda_trace.py::test_packed_attention_traces_on_fake_cuda", CONTRACT],
    "moe/collective.py::collective_device::dist.is_available() and dist.is_initialized() and "
    "(dist.get_backend(group) == 'nccl')": [
        "tests/test_multiprocess_harness.py::test_cuda_child_runs_nccl_on_its_gpu", CONTRACT],
    "moe/cpu_shim.py::apply_cpu_shim::use_cuda() and (not force)": [
        "tests/test_cpu_shim.py::test_cuda_host_is_left_alone"],
    "moe/cpu_shim.py::apply_cpu_shim.maybe_move_tensor_to_cpu::torch.is_tensor(tensor) and (not tensor.is_cuda) "
    "and as_numpy": ["reason: the CPU shim's own conversion (the CPU side: CUDA tensors are Megatron's path, which "
                     "the shim leaves alone); runs in every CPU EP=2 alltoall test"],
    "moe/cpu_shim.py::_scoped_patch::use_cuda()": ["tests/test_cpu_shim.py::test_cuda_host_is_left_alone"],
    "moe/cpu_shim.py::_CpuFactoriesTorch._on_cpu::device == 'cuda' or (isinstance(device, torch.device) and "
    "device.type == 'cuda')": ["reason: the CPU shim maps Megatron's device='cuda' literals to the CPU; it is never "
                               "installed on a CUDA host (test_cuda_host_is_left_alone)"],
    "moe/cpu_shim.py::_ScheduleTorch.zeros::device == 'cuda'": [
        "tests/test_cpu_shim.py::test_pipeline_schedule_shim_is_scoped_to_the_schedules_module"],
    "moe/device.py::use_cuda::choice == 'cuda' and (not available)": [
        "tests/test_cuda_branches.py::test_cuda_demanded_on_a_cpu_host_is_refused"],
    "moe/device.py::model_device::use_cuda()": [GPU_TRAINER, CONTRACT],
    "moe/experts.py::expert_offsets::torch.device(device).type != 'cuda'": [
        "tests/test_moe_grouped_experts.py::test_grouped_experts_equal_sequential_on_cuda"],
    "moe/experts.py::_WgradPlan.__init__::torch.device(device).type != 'cuda'": [
        "tests/test_moe_grouped_experts.py::test_addmm_accumulation_needs_cuda",
        "tests/test_moe_grouped_experts.py::test_ddp_wrapped_grouped_experts_on_cuda"],
    "moe/triton_support.py::triton_problem::device.type != 'cuda'": [
        "tests/test_moe_triton_kernels.py::test_triton_choices_refuse_cpu_tensors_outside_the_interpreter",
        "tests/test_moe_triton_kernels.py::test_triton_kernels_on_cuda_fp32_fp16_bf16"],
    "moe/triton_swiglu.py::uses_triton::device.type == 'cuda' or INTERPRETED": [
        "tests/test_moe_triton_kernels.py::test_missing_triton_is_reported_naming_the_choice",
        "tests/test_moe_triton_kernels.py::test_grouped_experts_triton_and_fused_under_ddp_on_cuda"],
    "moe/triton_wgrad.py::_main_operand::torch.device(device).type == 'cuda'": [
        "tests/test_moe_triton_kernels.py::test_triton_kernels_on_cuda_fp32_fp16_bf16"],
    "moe/model.py::layer_spec::use_transformer_engine": [
        "reason: Transformer Engine's layer spec; TE has never been installed on our machines (the GPU image lacks "
        "it, the CPU cannot build it): an open GPU line"],
    "moe/model.py::build_model::cpu": [GPU_TRAINER],
    "moe/model.py::build_model::cpu and arch.tie_word_embeddings and (layout.pipeline_parallel > 1)": [GPU_TRAINER],
    "moe/model.py::build_model::not cpu": [GPU_TRAINER, CONTRACT],
    "moe/parallel.py::init_distributed::cuda": [GPU_TRAINER, CONTRACT],
    "moe/parallel.py::init_distributed::cuda#2": [GPU_TRAINER, CONTRACT],
    "moe/parallel.py::setup_process_groups::not cuda": [GPU_TRAINER],
    "moe/parallel.py::setup_process_groups::cuda": [GPU_TRAINER],
    "moe/smoke.py::main::use_cuda()": ["tests/test_smoke_job.py::test_smoke_job_on_cuda"],
}


def _mentions_cuda(node: ast.AST, names: set) -> bool:
    for sub in ast.walk(node):
        if isinstance(sub, ast.Attribute) and sub.attr == "is_cuda":
            return True
        if isinstance(sub, ast.Call) and ast.unparse(sub.func) in PREDICATE_CALLS:
            return True
        if isinstance(sub, ast.Compare) and any(isinstance(p, ast.Constant) and p.value in CUDA_WORDS
                                                for p in (sub.left, *sub.comparators)):
            return True
    return _bare_names(node) & names != set()


def _bare_names(node: ast.AST) -> set:
    """Names tested as they are: `x`, `not x`, and the operands of and / or."""
    if isinstance(node, ast.Name):
        return {node.id}
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        return _bare_names(node.operand)
    if isinstance(node, ast.BoolOp):
        return set().union(*(_bare_names(v) for v in node.values))
    return set()


class _BranchFinder(ast.NodeVisitor):
    def __init__(self, rel: str):
        self.rel, self.scope, self.flags, self.found = rel, [], [set()], []

    def visit_FunctionDef(self, node):
        flags = set()
        for sub in ast.walk(node):  # locals holding a CUDA predicate: `cuda = use_cuda()`
            if isinstance(sub, ast.Assign) and _mentions_cuda(sub.value, set()):
                flags |= {t.id for t in sub.targets if isinstance(t, ast.Name)}
        self.scope.append(node.name)
        self.flags.append(flags)
        self.generic_visit(node)
        self.flags.pop()
        self.scope.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_ClassDef(self, node):
        self.scope.append(node.name)
        self.generic_visit(node)
        self.scope.pop()

    def _branch(self, node):
        if _mentions_cuda(node.test, self.flags[-1]):
            self.found.append((self.rel, ".".join(self.scope) or "<module>", ast.unparse(node.test), node.lineno))
        self.generic_visit(node)

    visit_If = visit_IfExp = visit_While = _branch


def cuda_branches(rel: str, source: str) -> dict:
    """{key: line} of the CUDA branches in one file."""
    finder = _BranchFinder(rel)
    finder.visit(ast.parse(source))
    out, seen = {}, {}
    for rel_, scope, test, line in finder.found:
        key = f"{rel_}::{scope}::{test}"
        seen[key] = seen.get(key, 0) + 1
        out[key if seen[key] == 1 else f"{key}#{seen[key]}"] = line
    return out


def project_branches() -> dict:
    found = {}
    for folder in ("megagspo", "moe"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            found.update(cuda_branches(path.relative_to(ROOT).as_posix(), path.read_text(encoding="utf-8")))
    return found


def test_kind(test_id: str) -> str:
    """'gpu' (marked gpu: runs on a GPU host), 'cpu' (forces the branch on the CPU); raises if no such test."""
    file, name = test_id.split("::")
    tree = ast.parse((ROOT / file).read_text(encoding="utf-8"))
    module_gpu = any(isinstance(n, ast.Assign) and "pytestmark" in ast.unparse(n) and "mark.gpu" in ast.unparse(n)
                     for n in tree.body)
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            marks = " ".join(ast.unparse(d) for d in node.decorator_list)
            return "gpu" if module_gpu or "mark.gpu" in marks else "cpu"
    raise LookupError(f"{test_id}: no such test function")


test_kind.__test__ = False  # a helper, not a test


def unowned(found: dict, owners: dict) -> list:
    return sorted(k for k in found if not owners.get(k))


def test_every_cuda_branch_is_owned():
    found = project_branches()
    missing = unowned(found, BRANCH_OWNERS)
    assert not missing, ("CUDA-only branches without an owner (add the gpu-marked test that executes each, a CPU "
                         "test that forces it, or 'reason: ...' to BRANCH_OWNERS in tests/test_cuda_branches.py):\n"
                         + "\n".join(f"{k} (line {found[k]})" for k in missing))
    stale = sorted(set(BRANCH_OWNERS) - set(found))
    assert not stale, "BRANCH_OWNERS names branches that no longer exist:\n" + "\n".join(stale)


def test_owners_name_real_tests_and_each_branch_has_a_gpu_test_or_a_reason():
    for key, owners in BRANCH_OWNERS.items():
        kinds = []
        for owner in owners:
            if owner.startswith("reason: "):
                kinds.append("reason")
            else:
                kinds.append(test_kind(owner))  # raises for a test that does not exist
        assert "gpu" in kinds or "reason" in kinds or "cpu" in kinds, key


def test_registered_apis_name_real_gpu_tests():
    from moe.cuda_calls import APIS

    for api in APIS.values():
        assert test_kind(api.gpu_test) == "gpu", api.name


def test_a_planted_cuda_branch_without_an_owner_fails():
    planted = ("import torch\n"
               "def step(x, device, cfg):\n"
               "    cuda = torch.cuda.is_available()\n"
               "    if x.is_cuda:\n        x = x + 1\n"
               "    y = 1 if device.type == 'cuda' else 2\n"
               "    if cfg.backend == 'nccl' or not cuda:\n        y += 1\n"
               "    if x.is_cpu:\n        y += 2\n"
               "    return y\n")
    found = cuda_branches("megagspo/planted.py", planted)
    assert list(found) == ["megagspo/planted.py::step::x.is_cuda",
                           "megagspo/planted.py::step::device.type == 'cuda'",
                           "megagspo/planted.py::step::cfg.backend == 'nccl' or not cuda"]
    assert unowned({**project_branches(), **found}, BRANCH_OWNERS) == sorted(found)


def test_docs_list_every_branch_and_api():
    from moe.cuda_calls import APIS

    docs = (ROOT / "docs" / "testing.md").read_text(encoding="utf-8")
    missing = [k for k in BRANCH_OWNERS if f"`{k.split('::', 1)[1]}`" not in docs] + \
              [n for n in APIS if f"`{n}`" not in docs]
    assert not missing, "docs/testing.md lacks (run python tests/test_cuda_branches.py):\n" + "\n".join(missing)


def test_cuda_demanded_on_a_cpu_host_is_refused(monkeypatch):
    """MEGAGSPO_DEVICE=cuda where torch sees no GPU: a named DeviceError, not a CPU run."""
    import torch

    from moe.device import DeviceError, use_cuda

    monkeypatch.setenv("MEGAGSPO_DEVICE", "cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    try:
        use_cuda()
    except DeviceError as exc:
        assert "MEGAGSPO_DEVICE=cuda but torch sees no CUDA device" in str(exc)
    else:
        raise AssertionError("use_cuda() accepted MEGAGSPO_DEVICE=cuda without a GPU")


def markdown() -> str:
    """The tables of docs/testing.md: CUDA-only calls and CUDA-only branches, with what covers each."""
    sys.path.insert(0, str(ROOT))
    from moe.cuda_calls import APIS

    found = project_branches()
    lines = ["| CUDA-only call (through `moe/cuda_calls.py`) | why only CUDA | gpu test | CPU check |", "|---|---|---|---|"]
    for api in sorted(APIS.values(), key=lambda a: a.name):
        lines.append(f"| `{api.name}` | {api.why} | `{api.gpu_test}` | `tests/test_cuda_contract.py` (both torches) |")
    lines += ["", "| CUDA-only branch (`function::condition`) | file:line | owned by |", "|---|---|---|"]
    for key in sorted(BRANCH_OWNERS):
        path, branch = key.split("::", 1)
        owners = "; ".join(o[len("reason: "):] if o.startswith("reason: ") else f"`{o}` ({test_kind(o)})"
                           for o in BRANCH_OWNERS[key])
        lines.append(f"| `{branch}` | {path}:{found.get(key, '?')} | {owners} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown())
