"""GPU fixtures: the CUDA backend (tests skip cleanly without one) and layers bound on
both backends from the same checkpoint, so every stage can be compared."""

from __future__ import annotations

import pytest

from kdarun import Glm5NextKdaConfig, open_backend, synthetic
from kdarun.backends import cuda_available

from ..helpers import Env, forced_core


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.gpu)


@pytest.fixture(scope="session")
def cuda():
    if not cuda_available():
        pytest.skip("no CUDA device (CuPy missing or no GPU)")
    return open_backend("cuda")


@pytest.fixture(scope="session")
def gpu_ckpts(tmp_path_factory) -> dict[str, str]:
    """Checkpoints the GPU tests run on: both gates at D=64 (tiny, conv width 4), a D=128 stack
    with an odd hidden size and conv width 3 (the prefill conv's generic kernel; width 4 has
    its own). The extreme gates have their own checkpoints in test_prefill_gpu.py."""
    specs = {
        "softplus": synthetic.preset_config("tiny", "softplus", layers=4),
        "bounded": synthetic.preset_config("tiny", "bounded", layers=4, lower_bound=-3.0),
        "d128": Glm5NextKdaConfig(hidden_size=1000, num_heads=2, head_dim=128,
                                            conv_kernel=3, rms_norm_eps=1e-5,
                                            num_hidden_layers=2, kda_layers=(0, 1)),
    }
    out = {}
    for name, cfg in specs.items():
        out[name] = str(synthetic.write_checkpoint(tmp_path_factory.mktemp(name), cfg, seed=11))
    return out


@pytest.fixture(scope="session", params=["softplus", "bounded", "d128"])
def pair(request, cuda, host, gpu_ckpts):
    """(cuda Env, host Env) on the same checkpoint, layer 1, max_tokens 4096."""
    path = gpu_ckpts[request.param]
    return Env(cuda, path, 4096), Env(host, path, 4096)


@pytest.fixture(scope="session", params=["hopper", "portable", "portable:64"])
def core(request, cuda) -> str:
    """Each walk of the chunked core this device runs: the prefill tests run on all. The test
    configs' few heads leave SMs idle, so the portable walk takes its blocks of half the rows
    there; "portable:64" forces its blocks of WALK_ROWS, which the many-headed presets take."""
    if request.param == "hopper" and not cuda.has_wgmma:
        pytest.skip(f"{cuda.device_name} has no warpgroup MMAs: the Hopper walk cannot run")
    return request.param


@pytest.fixture(scope="session", params=["softplus", "bounded", "d128"])
def core_pair(request, core, cuda, host, gpu_ckpts):
    """`pair`, its CUDA layer on the `core` walk."""
    path = gpu_ckpts[request.param]
    with forced_core(core):
        cu = Env(cuda, path, 4096)
    assert cu.layer.kernels.core == core.partition(":")[0]
    return cu, Env(host, path, 4096)
