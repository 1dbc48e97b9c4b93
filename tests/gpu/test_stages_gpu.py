"""CUDA and host stage dumps of the same run agree stage by stage: prefill, decode, decode_k."""

from __future__ import annotations

from kdarun.loader import load_stack
from kdarun.run import RunPlan, random_hidden, run_layer
from kdarun.stages import StageRecorder, claim_dump, compare_stages, fingerprint, write_dump


def test_cuda_and_host_dumps_agree(cuda, host, gpu_ckpts, tmp_path):
    for name in ("bounded", "d128"):
        dumps = []
        for gpu in (cuda, host):
            stack = load_stack(gpu, gpu_ckpts[name], 200, [1])
            h = random_hidden(206, stack.cfg.hidden_size, 3)
            rec = StageRecorder()
            run_layer(gpu, stack, 1, h, RunPlan(200, 2, 4), recorder=rec)
            run = {"checkpoint": {"path": gpu_ckpts[name]}, "layer": 1, "backend": gpu.name,
                   "plan": {"prefill": 200, "decode_steps": 2, "k": 4},
                   "config": stack.cfg.to_hf()}
            prints = fingerprint(stack.cfg, stack.checkpoint.layer_tensors(1))
            dumps.append(write_dump(claim_dump(tmp_path / f"{name}-{gpu.name}"), rec, h, run,
                                    prints))
            stack.free(gpu)
        table = compare_stages(dumps[0], dumps[1])
        assert table.ok, table.format()
        assert len(table.rows) > 50


def test_cuda_batch_dump_against_host_and_reference(cuda, gpu_ckpts, tmp_path):
    """A serving run's dump (packed prefill, batched decodes, batched verify) keys each
    sequence apart; the CUDA one agrees with the host's stage by stage and with float64."""
    from click.testing import CliRunner

    from kdarun.cli import main
    dumps = {}
    for backend in ("cuda", "host"):
        dumps[backend] = tmp_path / backend
        r = CliRunner().invoke(main, ["layer-run", gpu_ckpts["d128"], "--layer", "1",
                                      "--batch", "4", "--tokens", "150", "--decode-steps", "2",
                                      "--k", "3", "--backend", backend, "--dump-stages",
                                      str(dumps[backend])])
        assert r.exit_code == 0, r.output
    table = compare_stages(dumps["cuda"], dumps["host"])
    assert table.ok, table.format()
    assert {row.key.split(".", 1)[0] for row in table.rows} == {f"seq{i}" for i in range(4)}
    table = compare_stages(dumps["cuda"])
    assert table.ok, table.format()
