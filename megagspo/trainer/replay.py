"""Routing replay availability (moe.routing_replay, built on Megatron-Core's RouterReplay)."""

from __future__ import annotations


def replay_available() -> tuple[bool, str]:
    try:
        import moe.routing_replay  # noqa: F401
    except ImportError as exc:
        return False, f"moe.routing_replay cannot be imported ({exc})"
    return True, ""
