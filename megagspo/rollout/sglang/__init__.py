"""The SGLang rollout engine ("sglang"), split by job: engine.py composes the parts (see its docstring); config,
errors and the SGLang HTTP schema are the names callers import. The client needs only the standard library;
the sglang package is imported where a server is launched or a CUDA IPC codec is made."""

from .config import DIST_BACKENDS, IPC_FORMATS, SYNC_DTYPES, WEIGHT_SYNC_MODES, SGLangEngineConfig, SGLangLaunchConfig
from .engine import SGLangEngine
from .errors import SGLangConfigError, SGLangServerError, SGLangUnavailableError
from .schema import SGLangResponseError
from .server import SGLANG_MISSING
from .tensor_sync import SGLangIpcCodec

__all__ = ["DIST_BACKENDS", "IPC_FORMATS", "SGLANG_MISSING", "SYNC_DTYPES", "WEIGHT_SYNC_MODES", "SGLangConfigError",
           "SGLangEngine", "SGLangEngineConfig", "SGLangIpcCodec", "SGLangLaunchConfig", "SGLangResponseError",
           "SGLangServerError", "SGLangUnavailableError"]
