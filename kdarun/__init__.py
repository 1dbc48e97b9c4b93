"""kdarun: one Kimi Delta Attention block on NVIDIA GPUs through hand-written CUDA kernels."""

from .backend import DevicePtr, GpuBackend, LaunchConfig
from .backends import open_backend
from .checkpoint import Checkpoint
from .config import CHUNK, Glm5NextKdaConfig
from .errors import KdaError
from .kernels import Glm5NextKdaKernels
from .layer import Glm5NextKdaLayer, Stage, prefill_packed, prefill_windowed
from .loader import KdaStack, load_stack
from .pool import KdaStatePool
from .state import KdaSeqState
from .tp import TpGroup
from .weights import Glm5NextKdaWeights
from .workspace import Glm5NextKdaWorkspace

__all__ = [
    "CHUNK", "Checkpoint", "DevicePtr", "Glm5NextKdaConfig", "Glm5NextKdaKernels",
    "Glm5NextKdaLayer", "Glm5NextKdaWeights", "Glm5NextKdaWorkspace", "GpuBackend", "KdaError",
    "KdaSeqState", "KdaStack", "LaunchConfig", "Stage", "load_stack", "open_backend",
    "prefill_packed", "prefill_windowed", "KdaStatePool", "TpGroup",
]
