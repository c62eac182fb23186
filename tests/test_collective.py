"""moe.collective over 2 gloo ranks: run_on_rank0's result reaches the peer, and rank 0's error reaches it
too (same type, or the caller's peer type), so that no rank is left waiting in a collective; collective_device
is the CPU under gloo."""

from __future__ import annotations

import pytest

from multiprocess import run_distributed


class _Refused(ValueError):
    pass


def _body(rank, world_size):
    import torch

    from moe.collective import run_on_rank0

    calls = []
    out = {"result": run_on_rank0("counting", lambda: calls.append(rank) or {"rank": rank, "t": torch.ones(2)})}
    out["calls"] = list(calls)

    def fail():
        raise _Refused("the disk is full")

    for key, peer in (("same_type", None), ("peer_type", KeyError)):
        try:
            run_on_rank0("saving", fail, peer_error=peer)
        except Exception as exc:  # noqa: BLE001 - what each rank raised is the result
            out[key] = (type(exc).__name__, str(exc))
    torch.distributed.barrier()  # both ranks got here: nobody was left in the broadcast
    from moe.collective import collective_device

    out["device"] = str(collective_device())  # gloo takes CPU tensors (NCCL would need the rank's GPU)
    from moe.collective import sum_over

    out["sum"] = sum_over([rank + 0.5, 2.0], None)
    return out


@pytest.mark.multiprocess
def test_rank0_result_and_errors_reach_every_rank():
    r0, r1 = run_distributed(_body, world_size=2, timeout_s=120)
    assert r0["calls"] == [0] and r1["calls"] == []  # fn ran on rank 0 only
    assert r0["result"]["rank"] == r1["result"]["rank"] == 0
    assert r0["same_type"] == ("_Refused", "the disk is full")  # rank 0 re-raises its own error untouched
    assert r1["same_type"] == ("_Refused", "saving failed on rank 0 (global rank 0): _Refused: the disk is full")
    assert r0["peer_type"] == ("_Refused", "the disk is full")
    assert r1["peer_type"][0] == "KeyError" and "_Refused: the disk is full" in r1["peer_type"][1]
    assert r0["device"] == r1["device"] == "cpu"
    assert r0["sum"] == r1["sum"] == [2.0, 4.0]


def test_without_a_process_group_it_is_a_plain_call():
    from moe.collective import run_on_rank0

    from moe.collective import collective_device

    assert run_on_rank0("adding", lambda: 1 + 1) == 2
    assert collective_device().type == "cpu"
    from moe.collective import sum_over

    assert sum_over([1, 2.5], None) == [1.0, 2.5]
    with pytest.raises(_Refused, match="no"):
        run_on_rank0("refusing", lambda: (_ for _ in ()).throw(_Refused("no")))
