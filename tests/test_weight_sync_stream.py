"""Streamed weight sync: the trainer's model reaches the rollout engines in buckets of at most `bucket_bytes`,
gathered one bucket at a time over TP / EP / PP (moe.sharding.iter_full_state_buckets), never as a whole-model
gather on every rank.

* the buckets, concatenated, equal `gather_full_state_dict` bit for bit, in its order; each respects the cap
  (a tensor bigger than the cap alone); at TP=1, TP=2, EP=2, TP=2 x EP=2 (2 gloo ranks), PP=2 (even, uneven
  and tied embeddings, 2 ranks) and PP=2 x TP=2, PP=2 x EP=2 (4 ranks); with only the rollout ranks receiving
  (model-parallel rank 0 of each data-parallel rank) the others get the same number of empty buckets;
* the embedded HF engine fed by buckets (a bucket may hold some of a layer's experts only) ends with the
  same state dict, generations and log-probs as one fed the whole HF state dict (the former path), and casts
  bf16 buckets to its float32 parameters; the SGLang engine fed a stream sends what it sends for the whole
  state (tensor and disk sync);
* memory: on a model 16 times the bucket size, the peak of extra CPU memory allocated during a sync
  (torch.profiler's records of the CPU allocator: every allocation and free with its size and address, summed
  in time order; an upper bound, see `_peak_extra_bytes`; the engine's own model built before) stays below 2
  buckets on every rank (and below the design bound, one bucket + the largest tensor, on the receiving rank:
  measured exactly that at TP=2 x EP=2, the bucket + the staging buffer; 0 on a single process, where the
  buckets alias the parameters), while the former path (whole gather on every rank, then a whole HF state
  dict) holds at least the whole model (a lower bound), 16 buckets, 32 measured.

Weights are copies, so they are compared exactly. Each multi-process test draws a fresh seed and prints it
(MEGAGSPO_TEST_SEED=N reruns one).

The single-process tests also run, marked gpu, with the model and the engines on CUDA (`[cuda]`, the
`single_process` fixture's second parameter; tests/devices.py): weights and states still compared exactly
(copies); generations of two engines with equal weights compared exactly in token ids and routes, and in
log-probs to 1e-5 (the engines' forwards run on the GPU, whose float32 reductions need not repeat bit for bit
between two engines); the memory bound read from CUDA's allocator (peak allocated bytes above the start of the
sync, exact) instead of the CPU allocator's profiler records.
"""

from __future__ import annotations

import os
import zlib

import pytest
import torch

from devices import DEVICES, child_env
from helpers import fresh_seed
from multiprocess import run_distributed

EMBEDDING = "embedding.word_embeddings.weight"


def _arch(tie: bool = False, big: bool = False):
    """4 layers (layer 0 dense, 1-3 MoE), so that both pipeline stages hold MoE layers; `big`: 8 experts for
    the memory test (about 450 kB of float32 in 130 tensors, the largest 12 kB)."""
    from moe.architecture import Qwen3MoeArchitecture

    if big:
        return Qwen3MoeArchitecture(vocab_size=64, hidden_size=48, num_hidden_layers=4, num_attention_heads=4,
                                    num_key_value_heads=2, head_dim=8, moe_intermediate_size=24, num_experts=8,
                                    num_experts_per_tok=2, max_position_embeddings=64, mlp_only_layers=(0,),
                                    intermediate_size=32, tie_word_embeddings=tie)
    return Qwen3MoeArchitecture(vocab_size=96, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                                num_key_value_heads=2, head_dim=8, moe_intermediate_size=16, num_experts=4,
                                num_experts_per_tok=2, max_position_embeddings=64, mlp_only_layers=(0,),
                                intermediate_size=24, tie_word_embeddings=tie)


class _Tok:
    pad_id, eos_id, bos_id = 0, 1, 2
    eos_ids = (1,)


def _by_name(name: str, shape, seed: int) -> torch.Tensor:
    """A random tensor determined by the full-model name (crc32: stable across processes)."""
    g = torch.Generator().manual_seed(seed * 7919 + zlib.crc32(name.encode()))
    return torch.randn(tuple(shape), generator=g) * 0.2


def _full_state(arch, seed: int) -> dict:
    """The full (TP=EP=PP=1) state of `arch`: names and shapes from a PP=1 model on this rank."""
    from moe.model import build_model
    from moe.parallel import ParallelLayout, destroy_model_parallel, initialize_model_parallel

    initialize_model_parallel(ParallelLayout())
    model = build_model(arch)
    full = {n: _by_name(n, p.shape, seed) for n, p in model.named_parameters()}
    destroy_model_parallel()
    return full


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _summary(stream) -> dict:
    """Consume a stream: its merged tensors (cloned: the stream frees each bucket), names and bytes per bucket."""
    merged, names, sizes = {}, [], []
    for bucket in stream:
        names.append(list(bucket))
        sizes.append([_nbytes(t) for t in bucket.values()])
        merged.update({k: v.clone() for k, v in bucket.items()})
    return dict(merged=merged, names=names, sizes=sizes, planned=stream.bucket_names)


def _check_cap(summary: dict, cap: int, where: str) -> None:
    for names, sizes in zip(summary["names"], summary["sizes"]):
        assert sum(sizes) <= cap or len(sizes) == 1, f"{where}: bucket {names} holds {sum(sizes)} > {cap} bytes"


# ------------------------------------------------------------------------------------------- memory
def _peak_extra_bytes(fn, trace_path: str):
    """Run fn() under torch.profiler(profile_memory=True) and return the peak of CPU bytes allocated during it
    and not yet freed, from the CPU allocator's own records (chrome-trace `[memory]` events: every allocation
    and free made on a thread the profiler watches, with its size and address), in time order, as (upper,
    lower) bounds.

    Two artifacts of the gloo test backend are handled explicitly:
    * gloo's worker threads, which the profiler does not watch, sometimes drop the last reference to a
      collective's tensors (e.g. gathered shards) after the caller has dropped its own, so that free is not
      recorded. `upper` counts such a block as live until its address is handed out again (an allocation at
      a live address proves the old block was freed before) or to the end: never freed early, so it bounds
      the true peak from above. `lower` leaves out every block whose free was not recorded.
    * the temporaries the backend allocates for a collective (gloo flattens a gather's outputs into a buffer,
      on its worker thread) are the backend's, not the sync's: allocations on another thread than the one
      running fn, or inside a c10d op, are not counted (NCCL's gather and all_gather_single write into the
      given tensors); their addresses still prove earlier frees."""
    import json
    import threading

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    prof.export_chrome_trace(trace_path)
    with open(trace_path) as f:
        trace = json.load(f)["traceEvents"]
    os.remove(trace_path)
    mine = threading.get_native_id()
    memory = [e for e in trace if e.get("name") == "[memory]" and e["args"].get("Device Type") == 0]
    assert not memory or any(e["tid"] == mine for e in memory), "profiler thread ids are not native ids"
    collectives = [(e["ts"], e["ts"] + e.get("dur", 0)) for e in trace
                   if e.get("ph") == "X" and e.get("tid") == mine and str(e.get("name", "")).startswith("c10d::")]

    def backend(e) -> bool:
        return e["tid"] != mine or any(a <= e["ts"] <= b for a, b in collectives)

    events = sorted((e["ts"], i, int(e["args"]["Bytes"]), e["args"]["Addr"], backend(e))
                    for i, e in enumerate(memory))
    freed_seen = set()  # allocation indices of blocks whose free was recorded
    live: dict = {}  # address -> (bytes, allocation index)
    for _, i, nbytes, addr, _ in events:
        if nbytes > 0:
            live[addr] = (nbytes, i)
        elif addr in live:
            freed_seen.add(live.pop(addr)[1])
    peaks = {}
    for bound in ("upper", "lower"):
        live, now, peak = {}, 0, 0
        for _, i, nbytes, addr, backend in events:
            if nbytes > 0:
                if addr in live:  # the block that had this address was freed, unseen
                    now -= live.pop(addr)
                if not backend and (bound == "upper" or i in freed_seen):
                    live[addr] = nbytes
                    now += nbytes
            elif addr in live:
                now -= live.pop(addr)
            peak = max(peak, now)
        peaks[bound] = peak
    return peaks["upper"], peaks["lower"]


def _old_sync(model, engine, arch):
    """The former path: the whole model gathered on every rank, then a whole HF state dict loaded."""
    from megagspo.rollout.weight_sync import megatron_to_hf_state_dict
    from moe.sharding import gather_full_state_dict

    full = gather_full_state_dict(model)
    engine.model.load_state_dict(megatron_to_hf_state_dict(full, arch), strict=False)


class _Paced:
    """A stream that pauses 2 ms after each bucket is consumed (allocating nothing), so that gloo's worker
    threads have dropped their references to the bucket's tensors before the stream frees it: the frees are
    then made, and recorded, on the measured thread (see _peak_extra_bytes)."""

    def __init__(self, stream):
        self.stream, self.receive = stream, stream.receive

    def __len__(self):
        return len(self.stream)

    def __iter__(self):
        import time

        for bucket in self.stream:
            yield bucket
            time.sleep(0.002)


def _new_sync(model, engine, cap, receive):
    from moe.sharding import iter_full_state_buckets

    engine.update_weights_from_buckets(_Paced(iter_full_state_buckets(model, cap, receive=receive)))


def _cuda_peak_extra_bytes(fn):
    """Peak CUDA bytes allocated during fn() above what was allocated before it, from the caching allocator's
    own counters (exact: no thread or backend artifacts), as (upper, lower) bounds like _peak_extra_bytes."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    return peak, peak


def _memory_measure(model, arch, cap, receive):
    """Peak extra memory (CPU, or CUDA when the model is there) of the streamed sync (upper bound) and of the
    former one (lower bound), each into a fresh HF engine built before measuring."""
    import tempfile

    from megagspo.rollout import HFRolloutEngine

    engine = HFRolloutEngine(arch, _Tok(), record_routes=False)
    if next(model.parameters()).is_cuda:
        return (_cuda_peak_extra_bytes(lambda: _new_sync(model, engine, cap, receive)),
                _cuda_peak_extra_bytes(lambda: _old_sync(model, engine, arch)))
    trace = os.path.join(tempfile.gettempdir(), f"weight_sync_trace_{os.getpid()}.json")
    new_peak = _peak_extra_bytes(lambda: _new_sync(model, engine, cap, receive), trace)
    old_peak = _peak_extra_bytes(lambda: _old_sync(model, engine, arch), trace)
    return new_peak, old_peak


def _memory_line(m: dict) -> str:
    (nu, nl), (ou, ol) = m["new_peak"], m["old_peak"]
    return (f"model {m['total']} B, bucket cap {m['cap']} B, largest tensor {m['largest']} B; peak extra CPU "
            f"memory during the streamed sync {nu} B (lower bound {nl} B) = {nu / m['cap']:.2f} buckets; former "
            f"whole-model path {ol} B (upper bound {ou} B) = {ol / m['cap']:.1f} buckets")


# ----------------------------------------------------------------------------------- single process
def _single_process_body(rank, world_size, seed):
    from devices import child_device, seed_megatron

    from megagspo.rollout import HFRolloutEngine, SamplingParams
    from megagspo.rollout.weight_sync import megatron_to_hf_state_dict
    from moe.cpu_shim import apply_cpu_shim
    from moe.model import build_model
    from moe.parallel import ParallelLayout, destroy_model_parallel, initialize_model_parallel
    from moe.sharding import FullStateBuckets, gather_full_state_dict, iter_full_state_buckets, load_full_state_dict

    apply_cpu_shim()  # nothing on CUDA
    seed_megatron(seed)
    out = {"device": child_device().type}
    # (a) buckets == the whole gather, for several caps, tied embeddings too
    for tie in (False, True):
        arch = _arch(tie)
        full = _full_state(arch, seed)
        initialize_model_parallel(ParallelLayout())
        model = build_model(arch)
        load_full_state_dict(model, full)
        gathered = gather_full_state_dict(model)
        largest = max(_nbytes(t) for t in full.values())
        for cap in (1, 3000, largest, 10**9):
            out[("caps", tie, cap)] = dict(full=full, gathered=gathered,
                                           stream=_summary(iter_full_state_buckets(model, cap)))
        aliases = {n: p.data_ptr() for n, p in model.named_parameters()}
        out[("alias", tie)] = dict(
            gathered_aliases=any(t.data_ptr() in aliases.values() for t in gathered.values()),
            stream_aliases=all(t.data_ptr() == aliases[n] for b in FullStateBuckets(model, 4000) for n, t in b.items()))
        destroy_model_parallel()

    # (b) the HF engine fed by buckets == the HF engine fed the whole HF state dict (the former path)
    arch = _arch()
    full = _full_state(arch, seed)
    initialize_model_parallel(ParallelLayout())
    model = build_model(arch)
    load_full_state_dict(model, full)
    prompts, sampling = [[2, 5, 7, 9], [2, 11, 3, 4], [2, 6]], SamplingParams(max_new_tokens=6, greedy=True)
    reference = HFRolloutEngine(arch, _Tok())
    reference.model.load_state_dict(megatron_to_hf_state_dict(full, arch), strict=False)
    streamed = HFRolloutEngine(arch, _Tok())
    experts_split = 5000  # a bucket ends inside a layer's experts: the fused tensors are written slice by slice
    streamed.update_weights_from_buckets(iter_full_state_buckets(model, experts_split))
    whole = HFRolloutEngine(arch, _Tok())
    whole.update_weights(full)
    gen = {name: eng.generate(prompts, 2, sampling) for name, eng in
           (("reference", reference), ("streamed", streamed), ("whole", whole))}
    sampled = {}
    for name, eng in (("reference", reference), ("streamed", streamed)):
        torch.manual_seed(seed)  # the same draws for both
        sampled[name] = eng.generate(prompts, 2, SamplingParams(max_new_tokens=6))
    # bf16 buckets into the float32 engine: cast on copy, exactly what load_state_dict of the bf16 dict gives
    bf16 = HFRolloutEngine(arch, _Tok())
    bf16.update_weights_from_buckets({k: v.to(torch.bfloat16) for k, v in b.items()}
                                     for b in iter_full_state_buckets(model, experts_split))
    bf16_reference = HFRolloutEngine(arch, _Tok())
    bf16_reference.model.load_state_dict(megatron_to_hf_state_dict(
        {k: v.to(torch.bfloat16) for k, v in full.items()}, arch), strict=False)
    out["engine"] = dict(
        states={name: {k: v.clone() for k, v in eng.model.state_dict().items()} for name, eng in
                (("reference", reference), ("streamed", streamed), ("whole", whole), ("bf16", bf16),
                 ("bf16_reference", bf16_reference))},
        gen={name: (o.response_ids_RL, o.response_mask_RL, o.logp_RL, o.routes_RPLyK) for name, o in gen.items()},
        sampled={name: (o.response_ids_RL, o.logp_RL) for name, o in sampled.items()},
        bucket_names=FullStateBuckets(model, experts_split).bucket_names,
    )
    # a stream that misses a tensor, or repeats one, fails naming it
    errors = {}
    for label, buckets in (("missing", [{k: v for k, v in full.items() if k != EMBEDDING}]),
                           ("repeated", [full, {EMBEDDING: full[EMBEDDING]}]),
                           ("unknown", [dict(full, **{"decoder.layers.9.mlp.router.weight": full[EMBEDDING]})])):
        try:
            HFRolloutEngine(arch, _Tok()).update_weights_from_buckets(buckets)
            errors[label] = None
        except (RuntimeError, KeyError, ValueError) as exc:
            errors[label] = str(exc)
    out["errors"] = errors
    destroy_model_parallel()

    # (c) memory, single process
    arch = _arch(big=True)
    full = _full_state(arch, seed)
    initialize_model_parallel(ParallelLayout())
    model = build_model(arch)
    load_full_state_dict(model, full)
    total = sum(_nbytes(t) for t in full.values())
    cap = total // 16
    new_peak, old_peak = _memory_measure(model, arch, cap, receive=True)
    out["memory"] = dict(total=total, cap=cap, largest=max(_nbytes(t) for t in full.values()),
                         new_peak=new_peak, old_peak=old_peak)
    destroy_model_parallel()
    return out


@pytest.fixture(scope="module", params=DEVICES)
def single_process(request):
    seed = fresh_seed()
    (result,) = run_distributed(_single_process_body, world_size=1, args=(seed,), timeout_s=240,
                                env=child_env(request.param))
    assert result["device"] == request.param, result["device"]
    return seed, result


def test_single_process_buckets_concatenate_to_the_full_gather_under_the_cap(single_process):
    seed, r = single_process
    for tie in (False, True):
        for key, case in r.items():
            if key[0] != "caps" or key[1] != tie:
                continue
            cap, s, where = key[2], case["stream"], f"seed {seed} tie={tie} cap={key[2]}"
            assert list(case["gathered"]) == [n for names in s["names"] for n in names], where  # same order
            assert s["names"] == s["planned"], where
            assert s["merged"].keys() == case["full"].keys(), where
            assert all(torch.equal(s["merged"][k], case["full"][k]) for k in case["full"]), where
            assert all(torch.equal(case["gathered"][k], case["full"][k]) for k in case["full"]), where
            _check_cap(s, cap, where)
            if cap == 1:
                assert all(len(n) == 1 for n in s["names"]), where  # every tensor over the cap: alone
            if cap == 10**9:
                assert len(s["names"]) == 1, where
            if cap == 3000:
                assert 1 < len(s["names"]) < len(case["full"]), where
        # zero copy where nothing is gathered; gather_full_state_dict always returns its own storage
        assert r[("alias", tie)] == dict(gathered_aliases=False, stream_aliases=True)


def test_hf_engine_fed_by_buckets_equals_the_whole_state(single_process):
    seed, r = single_process
    e = r["engine"]
    # some bucket ends inside a MoE layer's experts: the fused tensors were written expert by expert
    split = [names for names in e["bucket_names"] if any(".local_experts." in n for n in names)]
    layers_of_bucket = [{n.split(".local_experts.")[0] for n in names if ".local_experts." in n} for names in split]
    assert any(len(set.intersection(a, b)) for a, b in zip(layers_of_bucket, layers_of_bucket[1:])), e["bucket_names"]
    ref = e["states"]["reference"]
    cuda = r["device"] == "cuda"

    def same(a, b, floating_ok):
        # CPU: bit-exact. CUDA: token ids, masks and routes exact; float log-probs to 1e-5 (rel and abs): two
        # engines with equal weights, but GPU float32 reductions (atomics in the MoE's index_add, cuBLAS
        # algorithm choice) need not repeat bit for bit from one engine to the other.
        if cuda and floating_ok and a.is_floating_point():
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
            return True
        return torch.equal(a, b)

    for name in ("streamed", "whole"):
        state = e["states"][name]
        assert state.keys() == ref.keys()
        assert all(torch.equal(state[k], ref[k]) for k in ref), f"seed {seed}: {name}"
        for a, b in zip(e["gen"][name], e["gen"]["reference"]):
            assert (a is None and b is None) or same(a, b, True), f"seed {seed}: {name} generations"
    for a, b in zip(e["sampled"]["streamed"], e["sampled"]["reference"]):
        assert same(a, b, True), f"seed {seed}: sampled"
    bf16, bf16_ref = e["states"]["bf16"], e["states"]["bf16_reference"]
    assert all(v.dtype == torch.float32 for v in bf16.values())
    assert all(torch.equal(bf16[k], bf16_ref[k]) for k in bf16_ref)
    assert not torch.equal(bf16["model.embed_tokens.weight"], ref["model.embed_tokens.weight"])  # really rounded
    errors = r["errors"]
    assert "model.embed_tokens.weight (0 of" in errors["missing"], errors
    assert "not written exactly once" in errors["repeated"] and "model.embed_tokens.weight" in errors["repeated"]
    assert "decoder.layers.9.mlp.router.weight" in errors["unknown"], errors


def test_single_process_sync_peak_memory_stays_under_two_buckets(single_process):
    seed, r = single_process
    m = r["memory"]
    print(f"single process ({r['device']}): {_memory_line(m)}")
    assert m["total"] >= 16 * m["cap"] and m["largest"] <= m["cap"]
    assert m["new_peak"][0] < 2 * m["cap"], m
    # the check can fail: the former path holds the whole model (twice: Megatron names, then HF names)
    assert m["old_peak"][1] >= m["total"] > 2 * m["cap"], m


# -------------------------------------------------------------------------------------- 2 and 4 ranks
def _layouts_body(rank, world_size, seed, cases, memory_case):
    """Per case: a model at the layout loaded from a PP=1 full state; the whole gather; the stream with every
    rank receiving; the stream with the rollout ranks only receiving (model-parallel rank 0), feeding an HF
    engine there."""
    from megatron.core import parallel_state as ps

    from megagspo.rollout import HFRolloutEngine
    from moe.cpu_shim import apply_cpu_shim, initialize_cpu_rng
    from moe.model import build_model
    from moe.parallel import ParallelLayout, destroy_model_parallel, initialize_model_parallel
    from moe.sharding import gather_full_state_dict, iter_full_state_buckets, load_full_state_dict

    apply_cpu_shim()
    initialize_cpu_rng(seed)
    out = {}
    for label, layout_kwargs, overrides, tie, cap in cases:
        arch = _arch(tie)
        full = _full_state(arch, seed)
        layout = ParallelLayout(**layout_kwargs)
        dims = initialize_model_parallel(layout)
        model = build_model(arch, layout, **overrides)
        load_full_state_dict(model, full)
        generates = torch.distributed.get_rank(ps.get_model_parallel_group()) == 0
        every = _summary(iter_full_state_buckets(model, cap))  # ranks and groups read from parallel_state
        # ranks and groups from the run's ParallelDims (the trainer's weight sync): the same plan and tensors
        rollout = _summary(iter_full_state_buckets(model, cap, receive=generates, dims=dims))
        engine = HFRolloutEngine(arch, _Tok(), record_routes=False)
        engine.update_weights_from_buckets(iter_full_state_buckets(model, cap, receive=generates, dims=dims))
        out[label] = dict(full=full, gathered=gather_full_state_dict(model), every=every, rollout=rollout,
                          generates=generates, engine={k: v.clone() for k, v in engine.model.state_dict().items()},
                          sizes=(ps.get_tensor_model_parallel_world_size(), ps.get_expert_model_parallel_world_size(),
                                 ps.get_pipeline_model_parallel_world_size()))
        destroy_model_parallel()
    if memory_case is not None:
        layout_kwargs, divisor = memory_case
        arch = _arch(big=True)
        full = _full_state(arch, seed)
        layout = ParallelLayout(**layout_kwargs)
        initialize_model_parallel(layout)
        model = build_model(arch, layout)
        load_full_state_dict(model, full)
        generates = torch.distributed.get_rank(ps.get_model_parallel_group()) == 0
        total = sum(_nbytes(t) for t in full.values())
        cap = total // divisor
        new_peak, old_peak = _memory_measure(model, arch, cap, receive=generates)
        out["memory"] = dict(total=total, cap=cap, largest=max(_nbytes(t) for t in full.values()),
                             new_peak=new_peak, old_peak=old_peak, generates=generates)
        destroy_model_parallel()
    return out


def _check_layouts(reports, seed):
    from megagspo.rollout.weight_sync import megatron_to_hf_state_dict

    hf_refs = {}
    for rank, report in enumerate(reports):
        for label, r in report.items():
            if label == "memory":
                continue
            where = f"seed {seed} rank {rank} {label}"
            full, gathered, every, rollout = r["full"], r["gathered"], r["every"], r["rollout"]
            assert gathered.keys() == full.keys() and all(torch.equal(gathered[k], full[k]) for k in full), where
            assert [n for names in every["names"] for n in names] == list(gathered), where
            assert all(torch.equal(every["merged"][k], full[k]) for k in full), where
            assert every["names"] == every["planned"] and len(every["names"]) > 3, where
            assert rollout["planned"] == every["planned"], where  # every rank plans the same buckets
            if r["generates"]:
                assert rollout["names"] == every["names"], where
                assert all(torch.equal(rollout["merged"][k], full[k]) for k in full), where
                if label not in hf_refs:
                    hf_refs[label] = megatron_to_hf_state_dict(full, _arch(label.endswith("tied")))
                engine, ref = r["engine"], hf_refs[label]
                assert all(torch.equal(engine[k], ref[k]) for k in ref), f"{where}: HF engine"
            else:  # relays only: as many (empty) buckets, nothing held
                assert rollout["names"] == [[] for _ in every["names"]], where


_CAP = 3000  # bytes; the tiny models hold ~45-60 kB (largest tensor 12 kB: alone in its bucket)


@pytest.mark.multiprocess
def test_two_ranks_stream_equals_gather_at_tp_ep_pp_and_memory_stays_under_two_buckets():
    """TP=2, EP=2, TP=2 x EP=2, PP=2 (even, uneven, tied) on 2 gloo ranks; then the memory check at
    TP=2 x EP=2 (rank 0 receives and feeds its HF engine, rank 1 relays)."""
    seed = fresh_seed()
    cases = [
        ("tp2", dict(tensor_parallel=2), {}, False, _CAP),
        ("ep2", dict(expert_parallel=2), {}, False, _CAP),
        ("tp2_ep2", dict(tensor_parallel=2, expert_parallel=2), {}, False, _CAP),
        ("pp2", dict(pipeline_parallel=2), {}, False, _CAP),
        ("pp2_uneven", dict(pipeline_parallel=2),
         {"num_layers_in_first_pipeline_stage": 1, "num_layers_in_last_pipeline_stage": 3}, False, _CAP),
        ("pp2_tied", dict(pipeline_parallel=2), {}, True, _CAP),
    ]
    reports = run_distributed(_layouts_body, world_size=2, args=(seed, cases, (dict(tensor_parallel=2,
                                                                                   expert_parallel=2), 16)),
                              timeout_s=240)
    for rank, report in enumerate(reports):
        sizes = {label: r["sizes"] for label, r in report.items() if label != "memory"}
        assert sizes == {"tp2": (2, 1, 1), "ep2": (1, 2, 1), "tp2_ep2": (2, 2, 1), "pp2": (1, 1, 2),
                         "pp2_uneven": (1, 1, 2), "pp2_tied": (1, 1, 2)}, sizes
        # EP=2 alone: both ranks are data-parallel ranks that generate; TP / PP: rank 0 only
        assert {label: r["generates"] for label, r in report.items() if label != "memory"} == {
            "tp2": rank == 0, "ep2": True, "tp2_ep2": rank == 0, "pp2": rank == 0, "pp2_uneven": rank == 0,
            "pp2_tied": rank == 0}
    _check_layouts(reports, seed)
    for rank, report in enumerate(reports):
        for label, r in report.items():
            if label != "memory":
                _check_cap(r["every"], _CAP, f"seed {seed} rank {rank} {label}")
    for rank, report in enumerate(reports):
        m = report["memory"]
        print(f"TP=2 x EP=2 rank {rank} ({'receives' if m['generates'] else 'relays'}): {_memory_line(m)}")
        assert m["total"] >= 16 * m["cap"] and m["largest"] <= m["cap"]
        assert m["new_peak"][0] < 2 * m["cap"], (rank, m)
        assert m["new_peak"][0] <= m["cap"] + m["largest"] + 4096, (rank, m)  # + the metadata exchange's pickles
        assert m["old_peak"][1] >= m["total"] > 2 * m["cap"], (rank, m)


@pytest.mark.multiprocess
def test_four_ranks_stream_equals_gather_with_pipeline_relays():
    """PP=2 x TP=2 and PP=2 x EP=2 on 4 gloo ranks: the later stage's tensors are assembled over TP / EP there
    and relayed to stage 0; only model-parallel rank 0 of each data-parallel rank receives."""
    seed = fresh_seed()
    cases = [
        ("pp2_tp2", dict(pipeline_parallel=2, tensor_parallel=2), {}, False, _CAP),
        ("pp2_ep2", dict(pipeline_parallel=2, expert_parallel=2), {}, False, _CAP),
    ]
    reports = run_distributed(_layouts_body, world_size=4, args=(seed, cases, None), timeout_s=300)
    receivers = {label: [rank for rank, report in enumerate(reports) if report[label]["generates"]]
                 for label, _, _, _, _ in cases}
    assert len(receivers["pp2_tp2"]) == 1 and len(receivers["pp2_ep2"]) == 2, receivers  # DP = 1 and 2
    _check_layouts(reports, seed)


# --------------------------------------------------------------------------------------------- SGLang
def _split_stream(state: dict, pieces: int) -> list:
    """The full state as `pieces` buckets in Megatron order (bucket ends fall inside layers' experts)."""
    items = list(state.items())
    step = -(-len(items) // pieces)
    return [dict(items[i:i + step]) for i in range(0, len(items), step)]


def test_sglang_tensor_sync_of_a_stream_sends_what_the_whole_state_sends(tmp_path):
    from test_sglang_engine import ARCH, TOK, CpuCodec, FakeSGLang, expected_hf, random_megatron_state

    from megagspo.rollout.sglang import SGLangEngine, SGLangEngineConfig

    fake = FakeSGLang()
    try:
        cap = 3000
        cfg = SGLangEngineConfig(urls=[fake.url], weight_sync="tensor", bucket_bytes=cap, sync_dtype="bfloat16")
        eng = SGLangEngine(ARCH, TOK, config=cfg, ipc_codec=CpuCodec())
        state = random_megatron_state(7)
        stream = iter(_split_stream(state, 7))  # no len(): the last bucket is known when the stream ends
        eng.update_weights_from_buckets(stream)
        bodies = fake.posted("/update_weights_from_tensor")
        want = expected_hf(state, torch.bfloat16)
        assert len(bodies) > 3 and sorted(fake.received) == sorted(want)
        assert all(torch.equal(fake.received[k], want[k]) for k in want)
        assert [b["flush_cache"] for b in bodies] == [False] * (len(bodies) - 1) + [True]
        assert [b.get("weight_version") for b in bodies] == [None] * (len(bodies) - 1) + ["1"]
        # a stream that lacks a tensor is refused before the flush
        partial = _split_stream({k: v for k, v in state.items() if "linear_proj" not in k}, 3)
        with pytest.raises(KeyError, match=r"lacked .*o_proj"):
            eng.update_weights_from_buckets(partial)
        assert all(not b["flush_cache"] for b in fake.posted("/update_weights_from_tensor")[len(bodies):])
    finally:
        fake.close()


def test_sglang_disk_sync_of_a_stream_writes_the_same_checkpoint(tmp_path):
    from safetensors.torch import load_file
    from test_sglang_engine import ARCH, TOK, FakeSGLang, expected_hf, random_megatron_state

    from megagspo.rollout.sglang import SGLangEngine, SGLangEngineConfig

    fake = FakeSGLang()
    try:
        eng = SGLangEngine(ARCH, TOK, config=SGLangEngineConfig(urls=[fake.url], sync_dir=str(tmp_path / "sync"),
                                                                bucket_bytes=4096))
        state = random_megatron_state(8)
        eng.update_weights_from_buckets(_split_stream(state, 5))
        path = fake.posted("/update_weights_from_disk")[-1]["model_path"]
        loaded = {}
        files = sorted(p for p in os.listdir(path) if p.endswith(".safetensors"))
        for f in files:
            loaded.update(load_file(os.path.join(path, f)))
        want = expected_hf(state)
        assert len(files) > 1 and os.path.exists(os.path.join(path, "model.safetensors.index.json"))
        assert sorted(loaded) == sorted(want) and all(torch.equal(loaded[k], want[k]) for k in want)
    finally:
        fake.close()
