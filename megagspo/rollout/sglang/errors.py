"""The errors the SGLang engine raises, apart in one module so that every part of the engine (config, servers,
weight sync, generation) raises the same classes without importing one another for them. A response that breaks
the schema is `schema.SGLangResponseError`, next to the parsing that finds it."""

from __future__ import annotations


class SGLangConfigError(ValueError):
    """A setting of `rollout.sglang` (or an engine argument) that cannot work; the message names the field."""


class SGLangServerError(RuntimeError):
    """A server that cannot be reached, or that answered an endpoint with an error."""


class SGLangUnavailableError(RuntimeError):
    """Something this configuration needs is missing here: the sglang package, CUDA, NCCL."""
