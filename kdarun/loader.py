"""The loader: binds checkpoint weights and compiled kernels into layer objects that
share one workspace."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from .backend import DeviceOwner, GpuBackend
from .checkpoint import Checkpoint
from .config import Glm5NextKdaConfig
from .errors import KdaError, check_int, is_host_sequence
from .kernels import Glm5NextKdaKernels
from .layer import Glm5NextKdaLayer
from .weights import Glm5NextKdaWeights, weights_nbytes
from .workspace import Glm5NextKdaWorkspace, workspace_nbytes


@dataclass(repr=False)
class KdaStack(DeviceOwner):
    """Every bound KDA layer of a checkpoint (keyed by 0-based layer_idx) and the one
    workspace they share; under tensor parallelism, rank `tp_rank` of `tp_size`'s share of
    them, `cfg` then that rank's config (`Glm5NextKdaConfig.shard`). After `free` the stack,
    its layers and its workspace refuse every use."""
    cfg: Glm5NextKdaConfig
    kernels: Glm5NextKdaKernels
    workspace: Glm5NextKdaWorkspace
    layers: dict[int, Glm5NextKdaLayer]
    checkpoint: Checkpoint
    tp_rank: int = 0
    tp_size: int = 1

    _DEVICE_ATTRS = ("workspace", "layers")

    def free(self, gpu: GpuBackend) -> None:
        """Release every layer's weights and the workspace."""
        with self._freeing():
            release_bound(gpu, self.layers.values(), self.workspace)

    def layer(self, layer_idx: int) -> Glm5NextKdaLayer:
        layer_idx = check_int(layer_idx, "KdaStack.layer: layer_idx", 0)
        if layer_idx not in self.layers:
            raise KdaError(f"layer {layer_idx} is not loaded; loaded KDA layers (0-based): "
                           f"{sorted(self.layers)}")
        return self.layers[layer_idx]


def release_bound(gpu: GpuBackend, layers: Iterable[Glm5NextKdaLayer],
                  workspace: Glm5NextKdaWorkspace) -> None:
    """Give back what binding layers allocated: each layer's weights and their workspace."""
    for layer in layers:
        layer.weights.free(gpu)
    workspace.free()


def stack_nbytes(cfg: Glm5NextKdaConfig, max_tokens: int, layers: int) -> int:
    """Device bytes of a stack of `layers` layers of cfg with a workspace of max_tokens."""
    return workspace_nbytes(cfg, max_tokens) + layers * weights_nbytes(cfg)


def load_stack(gpu: GpuBackend, path: str | Path, max_tokens: int,
               layers: Iterable[int] | None = None, stream: int = 0, tp_rank: int = 0,
               tp_size: int = 1) -> KdaStack:
    """Open the checkpoint at `path`, upload the KDA layers (all, or the 0-based `layers`)
    and bind them with one kernel set and one workspace of `max_tokens` tokens. With
    tp_size > 1, only rank `tp_rank`'s share of each layer is read and uploaded, and the
    stack runs that rank's config (H / tp_size heads). Everything is checked (the layers,
    the sharding, the device memory the workspace and weights need) before anything is
    allocated."""
    ckpt = Checkpoint(path)
    ckpt.config.check_tp(tp_rank, tp_size)
    cfg = ckpt.config.shard(tp_size)
    max_tokens = check_int(max_tokens, "load_stack: max_tokens", 1)
    if layers is not None and not is_host_sequence(layers):
        raise KdaError(f"load_stack: layers must be 0-based layer indices (a list, tuple, "
                       f"range or array), or None for every KDA layer; got {layers!r}")
    wanted = [check_int(i, "load_stack: a layer index")
              for i in (cfg.kda_layers if layers is None else layers)]
    if not wanted:
        raise KdaError("load_stack: layers is empty; name at least one layer, or pass None "
                       "for every KDA layer")
    if len(set(wanted)) != len(wanted):
        raise KdaError(f"load_stack: layers names a layer more than once: {wanted}")
    for i in wanted:
        if i not in cfg.kda_layers:
            raise KdaError(f"layer {i} is not a KDA layer of {path} "
                           f"(0-based KDA layers: {list(cfg.kda_layers)})")
    gpu.check_free_memory(stack_nbytes(cfg, max_tokens, len(wanted)),
                          f"{len(wanted)} layer(s) with a workspace of {max_tokens} tokens")
    kernels = Glm5NextKdaKernels(gpu, cfg)
    ws = Glm5NextKdaWorkspace(gpu, cfg, max_tokens)
    bound: dict[int, Glm5NextKdaLayer] = {}
    try:
        for i in wanted:
            weights = Glm5NextKdaWeights.upload(gpu, cfg, ckpt.layer_tensors(i, tp_rank, tp_size),
                                                stream)
            bound[i] = Glm5NextKdaLayer(i, cfg, weights, kernels)
    except BaseException:  # a layer refused (NaN, a bad tensor): give back what was bound
        release_bound(gpu, bound.values(), ws)
        raise
    return KdaStack(cfg, kernels, ws, bound, ckpt, tp_rank, tp_size)
