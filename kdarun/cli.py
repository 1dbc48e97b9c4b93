"""The `kdarun` command line: layer-run, make-checkpoint, inspect, stages, bench.

Every user mistake (a file, flag or number that cannot work) is refused with one line that
says what, where, what was expected and what was found, before any computation: exit code 1,
or 2 for usage errors (click's own). `kdarun --debug ...` shows the traceback instead.
Nothing the user owns is overwritten without `--force`, and no output may replace an input
or a checkpoint's file.
"""

from __future__ import annotations

import json
import math
import shlex
import signal
import sys
from contextlib import ExitStack
from importlib import metadata
from pathlib import Path
from typing import Any, Callable

import click

from . import synthetic
from .backends import cuda_available, open_backend
from .checkpoint import Checkpoint
from .config import LAYOUTS, MAX_DECODE_ROWS
from .errors import KdaError
from .loader import load_stack, stack_nbytes
from .reference import KDARUN, KDARUN_LABEL
from .run import (DEMO, TP_MODES, ErrorReport, RunPlan, claim_output, compare,
                  open_run_checkpoint, random_hidden, read_hidden, reference_of, run_layer,
                  run_tp, write_output)
from .tp import launch, visible_gpus

E2E_TOL = 1e-2  # end-to-end rel error vs reference.KDARUN (measured in docs/design.md)
TP_MODE_CHOICES = ("auto", *TP_MODES)
FORCE_HELP = "Replace what the output path already holds (never an input or a checkpoint file)."


MAX_COUNT = 2**31 - 1  # tokens and decode steps: the kernels count rows in 32-bit ints


def _terminated(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


class _Cli(click.Group):
    """The command group: a KdaError (or the host running out of memory) ends the command
    with its message on one line and exit code 1, or with its traceback under --debug. A
    SIGTERM (a scheduler's or `timeout`'s kill) ends it as Ctrl-C does, through every
    cleanup: no output's temporary is left behind."""

    def invoke(self, ctx: click.Context) -> Any:
        before = signal.signal(signal.SIGTERM, _terminated)
        try:
            return super().invoke(ctx)
        except (KdaError, MemoryError) as e:
            if ctx.params.get("debug"):
                raise
            msg = str(e) if isinstance(e, KdaError) else \
                "the host ran out of memory; use fewer tokens or a smaller preset"
            raise click.ClickException(" ".join(msg.split())) from None
        finally:
            signal.signal(signal.SIGTERM, before)


class _Path(click.Path):
    """click.Path refusing the empty path (an unset shell variable, say), which would run as
    if the option were left out, or as the current directory."""

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> Any:
        if value == "":
            self.fail("an empty path names nothing; give a path, or leave the option out",
                      param, ctx)
        return super().convert(value, param, ctx)


def _version() -> str:
    try:
        return metadata.version("kdarun")
    except metadata.PackageNotFoundError:
        return "unknown (not installed)"


def _table(rows: list[tuple[str, str]]) -> str:
    w = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k.ljust(w)}  {v}" for k, v in rows)


def _json(obj: Any) -> str:
    """Strict JSON: a non-finite float (NaN, Inf) becomes null, never a bare NaN."""
    def clean(v: Any) -> Any:
        if isinstance(v, float) and not math.isfinite(v):
            return None
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items()}
        return [clean(x) for x in v] if isinstance(v, (list, tuple)) else v
    return json.dumps(clean(obj), indent=2, allow_nan=False)


def _error_text(e: ErrorReport) -> str:
    if e.nonfinite:
        return f"{e.nonfinite} NaN/Inf value(s)"
    return f"rel {e.rel:.3e}  max-abs {e.max_abs:.3e}"


# Options that say where a run's results go, not what it computes: a repeat leaves them out.
_NOT_REPEATED = {"output_path", "dump_dir", "as_json", "force"}


def _repeat_command(**resolved) -> str:
    """The command line that repeats the current run: every argument and option the command
    has, at the value this run used (`resolved` overrides values worked out from defaults),
    paths made absolute. Built from the command's own parameters, so a new option repeats
    without being added here."""
    ctx = click.get_current_context()
    words = ["kdarun", ctx.info_name]
    for param in ctx.command.params:
        if param.name in _NOT_REPEATED:
            continue
        value = resolved.get(param.name, ctx.params.get(param.name))
        if value is None or value is False:
            continue
        if isinstance(param.type, click.Path):
            value = str(Path(value).resolve())
        if isinstance(param, click.Argument):
            words.append(str(value))
        elif param.is_flag:
            words.append(param.opts[0])
        else:
            words += [param.opts[0], str(value)]
    return " ".join(shlex.quote(w) for w in words)


def _tp_options(scope: str) -> Callable:
    """--tp and --tp-mode, as layer-run and bench take them; `scope` ends --tp-mode's help."""
    def add(f: Callable) -> Callable:
        f = click.option("--tp-mode", type=click.Choice(TP_MODE_CHOICES), default="auto",
                         show_default=True,
                         help="How --tp N runs: nccl (one process a GPU, an NCCL all-reduce), "
                              "in-turn (the N ranks one after the other on one device) or auto "
                              f"(in-turn on the host backend or one GPU, else nccl){scope}.")(f)
        return click.option("--tp", "tp", type=click.IntRange(1), default=1, show_default=True,
                            help="Tensor parallel ranks: the layer's heads split over N ranks, "
                                 "their outputs summed (num_heads must divide by N).")(f)
    return add


@click.group(cls=_Cli)
@click.version_option(_version(), prog_name="kdarun")
@click.option("--debug", is_flag=True,
              help="Show an error's traceback instead of its one-line message.")
def main(debug: bool) -> None:
    """kdarun: run one Kimi Delta Attention block through hand-written CUDA kernels."""


@main.command("layer-run")
@click.argument("checkpoint", required=False, type=_Path(file_okay=False))
@click.option("--layer", "layer_idx", type=int, default=None,
              help="0-based layer index in the stack (default: the first KDA layer).")
@click.option("--tokens", type=click.IntRange(0, MAX_COUNT), default=None,
              help="Prefill tokens (default 100, or what --input holds beyond the decodes).")
@click.option("--decode-steps", type=click.IntRange(0, MAX_COUNT), default=4, show_default=True,
              help="Single-token decodes after the prefill.")
@click.option("--k", "k", type=click.IntRange(0, MAX_DECODE_ROWS), default=None,
              help="Tokens of one decode_k (speculative verify) after the decodes (default 0); "
                   "with --batch, draft tokens a sequence of its batched verify (default 3).")
@click.option("--backend", type=click.Choice(["auto", "cuda", "host"]), default="auto",
              show_default=True,
              help="cuda (CuPy on a GPU), host (the NumPy twins) or auto (cuda where usable).")
@click.option("--input", "input_path", type=_Path(dir_okay=False, exists=True),
              help="Hidden states [N, hidden] (.npy or .safetensors); default random.")
@click.option("--output", "output_path", type=_Path(dir_okay=False),
              help="Write final_out (and states, for .safetensors) here.")
@click.option("--force", is_flag=True, help=FORCE_HELP)
@click.option("--seed", type=click.IntRange(0), default=0, show_default=True,
              help="Seed of the random input.")
@click.option("--dump-stages", "dump_dir", type=_Path(file_okay=False),
              help="Write every stage of the run, in order, to this directory.")
@click.option("--batch", type=click.IntRange(1, 1024), default=None,
              help="Serve this many sequences instead: random prompts of up to --tokens tokens "
                   "in one packed prefill, --decode-steps batched decodes and one batched "
                   "verify of --k rows (default 3), each sequence checked.")
@_tp_options("")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def layer_run(checkpoint, layer_idx, tokens, decode_steps, k, backend, input_path, output_path,
              force, seed, dump_dir, batch, tp, tp_mode, as_json) -> None:
    """Run one KDA layer (prefill, decodes, decode_k) and compare with the float64 reference
    (rounded to bf16 where kdarun's buffers are bf16).

    With no CHECKPOINT it runs the built-in tiny demo checkpoint."""
    from .stages import StageRecorder, claim_dump, fingerprint, write_dump
    run: dict = {"checkpoint": {"demo": DEMO} if checkpoint is None
                 else {"path": str(Path(checkpoint).resolve())}}
    if checkpoint is not None:
        Checkpoint(checkpoint)  # a missing or malformed one is refused before the backend opens
    gpu = open_backend(backend, announce=not as_json)
    with open_run_checkpoint(run) as ckpt_path, ExitStack() as claims:
        ckpt = Checkpoint(ckpt_path)
        cfg = ckpt.config
        protected = {Path(f): "the checkpoint's file" for f in ckpt.files()}
        if input_path:
            protected[Path(input_path)] = "the input"
        dump = claims.enter_context(claim_dump(dump_dir, force, protected)) if dump_dir else None
        if output_path and dump_dir and Path(dump_dir).resolve() in (
                Path(output_path).resolve(), Path(output_path).resolve().parent):
            raise KdaError(f"output {output_path} lies in the --dump-stages directory "
                           f"{dump_dir}, which the dump replaces whole; choose another path")
        out = claims.enter_context(claim_output(output_path, force, protected)) \
            if output_path else None
        layer_idx = cfg.kda_layers[0] if layer_idx is None else layer_idx
        if layer_idx not in cfg.kda_layers:
            raise KdaError(f"--layer {layer_idx} is not a KDA layer of "
                           f"{checkpoint or 'the built-in demo checkpoint'} "
                           f"(0-based KDA layers: {list(cfg.kda_layers)})")
        if tp > 1:
            if batch is not None:
                raise click.UsageError("--tp runs one sequence (prefill, decodes, decode_k); "
                                       "the serving run of --batch is not tensor parallel here")
            if dump_dir:
                raise click.UsageError("--dump-stages shows one layer's buffers; a tensor "
                                       "parallel rank's are partial: dump with --tp 1")
            cfg.check_tp(0, tp)
        tp_run_mode = _tp_run_mode(tp_mode, gpu.name, tp)
        if batch is not None:
            if input_path or output_path:
                raise click.UsageError("--batch runs random prompts: it takes no --input and "
                                       "writes no --output")
            tokens, k = 100 if tokens is None else tokens, 3 if k is None else k
            if tokens < 1 or k < 1:
                raise click.UsageError(f"--batch prefills prompts of 1 to --tokens tokens and "
                                       f"verifies --k draft tokens a sequence: both need at "
                                       f"least 1, got --tokens {tokens} --k {k}")
            run.update(layer=layer_idx, backend=gpu.name, device=gpu.device_name, seed=seed,
                       config=cfg.to_hf(), input="random",
                       command=_repeat_command(layer_idx=layer_idx, tokens=tokens, k=k,
                                               backend=gpu.name))
            _layer_run_batch(gpu, ckpt_path, cfg, layer_idx, batch, tokens, decode_steps, k,
                             seed, as_json, dump, run)
            return
        k = 0 if k is None else k
        hidden = read_hidden(input_path, cfg.hidden_size) if input_path else None
        if tokens is None:
            tokens = hidden.shape[0] - decode_steps - k if hidden is not None else 100
            if tokens < 0:
                raise KdaError(f"--input {input_path} holds {hidden.shape[0]} rows, fewer than "
                               f"--decode-steps {decode_steps} and --k {k} take")
        plan = RunPlan(tokens, decode_steps, k)
        plan.check()
        if hidden is not None and hidden.shape[0] < plan.total:
            raise KdaError(f"--input {input_path} holds {hidden.shape[0]} rows; the run takes "
                           f"{plan.total} (prefill {plan.prefill} + decode steps "
                           f"{plan.decode_steps} + k {plan.k})")
        # one rank's stack first: its memory check refuses a run too large before any input
        rows = max(plan.prefill, plan.k, 1)
        stack = load_stack(gpu, ckpt_path, rows, [layer_idx]) if tp == 1 else None
        if tp > 1:  # the ranks this process will hold, checked as load_stack checks each
            share, held = cfg.shard(tp), tp if tp_run_mode == "in-turn" else 1
            gpu.check_free_memory(held * stack_nbytes(share, rows, 1),
                                  f"{held} tp rank(s) of layer {layer_idx} with a workspace of "
                                  f"{rows} tokens")
        if hidden is None:
            input_text = f"random (seed {seed})"
            hidden = random_hidden(plan.total, cfg.hidden_size, seed)
        else:  # the first rows the plan takes; said, so that rows left out are not a surprise
            input_text = f"{input_path}: rows 0-{plan.total - 1} of its {hidden.shape[0]}"
        hidden = hidden[:plan.total]
        recorder = StageRecorder() if dump else None
        if stack is None:
            result = run_tp(gpu, ckpt_path, layer_idx, hidden, plan, tp, tp_run_mode)
        else:
            try:
                result = run_layer(gpu, stack, layer_idx, hidden, plan, recorder=recorder)
            finally:
                stack.free(gpu)
        tensors = ckpt.layer_tensors(layer_idx)
        ref = reference_of(ckpt, layer_idx, hidden, tensors, KDARUN)
        run.update(layer=layer_idx, backend=gpu.name, device=gpu.device_name, seed=seed,
                   plan=vars(plan), config=cfg.to_hf(),
                   input={"path": str(Path(input_path).resolve())} if input_path else "random",
                   command=_repeat_command(layer_idx=layer_idx, tokens=plan.prefill,
                                           backend=gpu.name))
        if dump is not None:
            write_dump(dump, recorder, hidden, run, fingerprint(cfg, tensors))
        if out is not None:
            write_output(out, result)
    out_err = compare(result.final_out, ref.stages["final_out"])
    state_err = compare(result.recurrent_state, ref.recurrent_state)
    ok = out_err.ok(E2E_TOL) and state_err.ok(E2E_TOL)
    ckpt_label = f"built-in demo ({DEMO['preset']} preset, {DEMO['gate']} gate)" \
        if checkpoint is None else checkpoint
    mode = " + ".join(f"{name} {n}" for name, n in (("prefill", plan.prefill),
                                                    ("decode", plan.decode_steps),
                                                    ("decode_k", plan.k)) if n)
    if as_json:
        click.echo(_json({
            "backend": gpu.name, "device": gpu.device_name, "checkpoint": ckpt_label,
            "layer": layer_idx, "gate": cfg.gate_form, "mode": mode, "tokens": plan.total,
            "input": input_text,
            "tp": tp, "tp_mode": tp_run_mode,
            "wall_ms": result.wall_ms, "final_out": vars(out_err),
            "recurrent_state": vars(state_err), "reference": KDARUN_LABEL,
            "tolerance": E2E_TOL, "ok": ok,
            "dump": dump_dir}))
    else:
        wall = ", ".join(f"{p} {ms:.2f} ms" for p, ms in result.wall_ms.items())
        click.echo("kdarun layer-run")
        click.echo(_table([
            ("backend", f"{gpu.name} ({gpu.device_name})"),
            ("checkpoint", ckpt_label),
            ("layer", f"{layer_idx} (0-based; {cfg.gate_form} gate, H={cfg.num_heads}, "
                      f"D={cfg.head_dim}, hidden={cfg.hidden_size})"),
            ("mode", mode),
            ("tokens", str(plan.total)),
            ("input", input_text),
        ] + ([("tensor parallel", f"{tp} ranks of {cfg.num_heads // tp} head(s), "
                                  f"{tp_run_mode}")] if tp > 1 else []) + [
            ("wall time", wall + (" (with stage dumps)" if dump else "")),
            ("reference", KDARUN_LABEL),
            ("final_out vs reference", _error_text(out_err)),
            ("state vs reference", _error_text(state_err)),
            ("result", f"{'PASS' if ok else 'FAIL'} (tolerance rel < {E2E_TOL:g}, no NaN/Inf)"),
        ] + ([("stages", f"{len(recorder.records)} written to {dump_dir}")] if dump else [])))
    if not ok:
        sys.exit(1)


def _tp_run_mode(requested: str, backend: str, tp: int) -> str | None:
    """How --tp N runs (None for one rank): --tp-mode as given, auto picking in-turn on the
    host backend or a single visible GPU and nccl otherwise (where `tp.launch` refuses fewer
    GPUs than ranks, with the way out)."""
    if tp == 1:
        return None
    if requested == "nccl" and backend != "cuda":
        raise click.UsageError(f"--tp-mode nccl runs on CUDA GPUs; the backend is {backend} "
                               "(use --tp-mode in-turn there)")
    if requested != "auto":
        return requested
    return "in-turn" if backend != "cuda" or visible_gpus() == 1 else "nccl"


def _layer_run_batch(gpu, ckpt_path: str, cfg, layer_idx: int, n: int, max_prompt: int,
                     decode_steps: int, k: int, seed: int, as_json: bool, dump, run: dict) -> None:
    """layer-run --batch: the serving run (`batch_run.run_batch`) and its table, its stages
    written to `dump` when given; exit 1 when a sequence fails."""
    from .batch_run import BATCH_TOL, run_batch
    from .stages import StageRecorder, fingerprint, write_dump
    stack = load_stack(gpu, ckpt_path, max(max_prompt, n * k), [layer_idx])
    recorder = StageRecorder() if dump is not None else None
    try:
        result = run_batch(gpu, stack, layer_idx, n, seed, max_prompt, decode_steps, k,
                           recorder=recorder)
        tensors = stack.checkpoint.layer_tensors(layer_idx)
    finally:
        stack.free(gpu)
    checks = result.checks
    if dump is not None:
        run.update(plan=vars(RunPlan(max_prompt, decode_steps, k)),
                   batch={"lengths": result.lengths, "slots": result.slots})
        write_dump(dump, recorder, result.hidden, run, fingerprint(cfg, tensors))
    ok = all(c.ok for c in checks)
    if as_json:
        click.echo(_json({"backend": gpu.name, "device": gpu.device_name, "layer": layer_idx,
                          "sequences": [vars(c) | {"ok": c.ok} for c in checks],
                          "tolerance": BATCH_TOL, "ok": ok,
                          "dump": None if dump is None else str(dump.path)}))
    else:
        click.echo(f"kdarun layer-run --batch {n}: {gpu.name} ({gpu.device_name}), layer "
                   f"{layer_idx}, {cfg.gate_form} gate; packed prefill, {decode_steps} batched "
                   f"decode(s), one batched verify of {k} rows")
        click.echo(f"  {'seq':>4} {'slot':>5} {'prefill':>8} {'final_out rel':>14} "
                   f"{'state rel':>10}  result")
        for c in checks:
            click.echo(f"  {c.sequence:>4} {c.slot:>5} {c.prefill:>8} {c.out_rel:>14.3e} "
                       f"{c.state_rel:>10.3e}  {'PASS' if c.ok else 'FAIL'}")
        click.echo(f"result: {'PASS' if ok else 'FAIL'}, {sum(c.ok for c in checks)} of {n} "
                   f"sequences within rel < {BATCH_TOL:g} of the reference ({KDARUN_LABEL}), "
                   "no NaN/Inf")
        if dump is not None:
            click.echo(f"stages: {len(recorder.records)} written to {dump.path}")
    if not ok:
        sys.exit(1)


@main.command("stages")
@click.argument("dump", type=_Path(file_okay=False))
@click.option("--against", "against", type=_Path(file_okay=False),
              help="Another dump of the same run (e.g. the other backend).")
@click.option("--reference", "use_reference", is_flag=True,
              help="Compare with the float64 reference fed the dumped input (rounded to bf16 "
                   "where kdarun's buffers are bf16).")
@click.option("--only", multiple=True, help="Only these stages (key or buffer name); repeatable.")
@click.option("--json", "as_json", is_flag=True, help="Print the table as JSON.")
def stages_cmd(dump, against, use_reference, only, as_json) -> None:
    """Per-stage error of a stage dump; exits 1 when a stage is past its tolerance. A dump
    whose checkpoint changed since it was written is refused before any stage is blamed."""
    from .stages import compare_stages
    if bool(against) == use_reference:
        raise click.UsageError("pass exactly one of --against OTHER_DIR or --reference")
    table = compare_stages(dump, against, list(only) or None)
    click.echo(_json(table.to_json()) if as_json else table.format())
    if not table.ok:
        sys.exit(1)


@main.command("make-checkpoint")
@click.argument("out", type=_Path(file_okay=False))
@click.option("--preset", type=click.Choice(sorted(synthetic.PRESETS)), default="tiny",
              show_default=True, help="The model shape.")
@click.option("--gate", type=click.Choice(synthetic.GATES), default=None,
              help="Gate form (default: the preset's own; bounded for glm-5.3-flash, else "
                   "softplus).")
@click.option("--lower-bound", type=click.FloatRange(-5.0, 0.0, max_open=True), default=None,
              help=f"gate_lower_bound of the bounded gate, in [-5, 0) (default "
                   f"{synthetic.DEFAULT_LOWER_BOUND:g}); the softplus gate has none.")
@click.option("--layers", type=click.IntRange(1, synthetic.MAX_LAYERS),
              default=synthetic.DEFAULT_LAYERS, show_default=True,
              help="Layers in the stack (every 4th is attention).")
@click.option("--layout", type=click.Choice(LAYOUTS), default=None,
              help="Checkpoint layout (default: the preset's own; glm5_next for glm-5.3-flash, "
                   "else kimi_linear).")
@click.option("--shards", type=click.IntRange(1), default=None,
              help="Files the layers are spread over, with an index when more than one "
                   "(default: the preset's own, at most one a layer; 4 for glm-5.3-flash, "
                   "else 1).")
@click.option("--seed", type=click.IntRange(0), default=0, show_default=True,
              help="Seed of the weights.")
@click.option("--force", is_flag=True,
              help="Replace the checkpoint OUT holds (only a checkpoint's files, no others).")
def make_checkpoint(out, preset, gate, lower_bound, layers, layout, shards, seed,
                    force) -> None:
    """Write a seeded synthetic checkpoint in the HF Kimi Linear or GLM-5.3-Flash layout to
    OUT, a layer at a time, into a temporary directory that then takes OUT's place."""
    gate = synthetic.PRESETS[preset].gate if gate is None else gate
    if lower_bound is not None and gate == "softplus":
        raise click.UsageError(f"--lower-bound applies to the bounded gate, and the gate is "
                               f"softplus (preset {preset}); pass --gate bounded with it")
    if shards is None:
        shards = min(synthetic.PRESETS[preset].shards, layers)
    cfg = synthetic.preset_config(preset, gate, layers, synthetic.DEFAULT_LOWER_BOUND
                                  if lower_bound is None else lower_bound, layout)
    with ExitStack() as on_exit:
        bar: list = []  # the progress bar, shown from the first layer written (after the checks)

        def advance(n: int) -> None:
            if not bar:
                bar.append(on_exit.enter_context(click.progressbar(
                    length=layers, label=f"writing {out}", file=sys.stderr)))
            bar[0].update(n)
        path = synthetic.write_checkpoint(out, cfg, seed=seed, shards=shards, force=force,
                                          progress=advance)
    click.echo(f"wrote {path}: preset {preset}, {cfg.layout} layout, {cfg.gate_form} gate, "
               f"{layers} layers ({len(cfg.kda_layers)} KDA), {shards} shard(s)")


@main.command("inspect")
@click.argument("checkpoint", type=_Path(file_okay=False))
def inspect_cmd(checkpoint) -> None:
    """Show a checkpoint's layout, KDA config, layers and tensors, and any problems found."""
    ckpt = Checkpoint(checkpoint)
    cfg = ckpt.config
    click.echo(f"checkpoint {checkpoint}")
    click.echo(_table([
        ("layout", f"{ckpt.layout} (layers under {ckpt.prefix})"),
        ("hidden_size", str(cfg.hidden_size)),
        ("heads x head_dim", f"{cfg.num_heads} x {cfg.head_dim} (qkv {cfg.qkv})"),
        ("conv kernel", str(cfg.conv_kernel)),
        ("gate", cfg.gate_form + ("" if cfg.gate_lower_bound is None
                                  else f" (lower bound {cfg.gate_lower_bound})")),
        ("rms_norm_eps", f"{cfg.rms_norm_eps:g}"),
        ("layers", f"{cfg.num_hidden_layers}: {len(cfg.kda_layers)} KDA, "
                   f"{len(cfg.full_attn_layers)} attention"),
        (f"KDA layers (0-based, {len(cfg.kda_layers)})", ", ".join(map(str, cfg.kda_layers))),
    ]))
    first = cfg.kda_layers[0]
    try:
        spelling, stored = ckpt.layer_spelling(first), ckpt.stored_tensors(first)
    except KdaError:  # a layer of two spellings: listed under problems below
        spelling, stored = "mixed", []
    click.echo(f"tensors of layer {first}, {spelling} spelling (every KDA layer has the same "
               "set):")
    for s in stored:
        where = ckpt.weight_map.get(s.name)
        click.echo(f"  {s.name}  expected {list(s.shapes(cfg)[0])} "
                   f"{'/'.join(s.dtypes)}  {'in ' + where.name if where else 'MISSING'}")
    problems = ckpt.problems()
    click.echo(f"problems: {len(problems) or 'none'}")
    for p in problems:
        click.echo(f"  - {p}")
    if problems:
        sys.exit(1)


def _int_list(ctx: click.Context, param: click.Parameter, text: str) -> list[int]:
    """A comma-separated list of positive integers (a click callback)."""
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {text!r}") from None
    if min(values) < 1:
        raise click.BadParameter(f"expected positive integers, got {text!r}")
    return values


def _parse_mix(text: str) -> list[tuple[int, int]]:
    from .bench import parse_mix
    try:
        return parse_mix(text)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--mix") from None


@main.command("bench")
@click.option("--preset", type=click.Choice(sorted(synthetic.PRESETS)), default="kimi-linear-48b",
              show_default=True, help="The model shape.")
@click.option("--mode", type=click.Choice(["decode", "decode-k", "prefill", "batch-decode",
                                           "batch-verify", "varlen"]), default="decode",
              show_default=True, help="What to time.")
@click.option("--k", "k", type=click.IntRange(1, MAX_DECODE_ROWS), default=4, show_default=True,
              help="Rows of decode-k; draft tokens a sequence of batch-verify.")
@click.option("--batch", default="1,8,32,64,128,256", show_default=True, callback=_int_list,
              help="Sequences a call of batch-decode / batch-verify, comma-separated.")
@click.option("--graph/--eager", default=True, show_default=True,
              help="Time CUDA-graph replays or eager calls (decode modes; batch modes replay).")
@click.option("--tokens", default="64,1024,4096,16384", show_default=True, callback=_int_list,
              help="Prefill lengths, comma-separated.")
@click.option("--mix", default="1x4096,8x512,32x128,128x32", show_default=True,
              callback=lambda ctx, param, v: _parse_mix(v),
              help="Packed prefills of varlen mode: sequences x tokens, comma-separated.")
@click.option("--fla/--no-fla", "with_fla", default=True, show_default=True,
              help="Also time fla's KimiDeltaAttention where it is importable (prefill: "
                   "in turn with kdarun's layer, rep by rep).")
@click.option("--flashkda/--no-flashkda", "with_flashkda", default=True, show_default=True,
              help="Prefill: also time FlashKDA's forward (bounded gate, D = 128) where "
                   "flash_kda is importable, beside the core (vs_flashkda).")
@_tp_options(" (bench: decode and decode-k; in-turn is timed with one rank alone too)")
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON.")
def bench_cmd(preset, mode, k, batch, graph, tokens, mix, with_fla, with_flashkda, tp, tp_mode,
              as_json) -> None:
    """Time decode, decode_k, batched decode or verify, packed (varlen) prefill or prefill on
    random weights and inputs (CUDA only); decode and decode_k also tensor parallel."""
    from . import bench

    if tp > 1:
        if mode not in ("decode", "decode-k"):
            raise click.UsageError(f"--tp times decode and decode-k; got --mode {mode}")
        synthetic.preset_config(preset).check_tp(0, tp)
        if tp_mode == "auto" and not cuda_available():  # not "use in-turn", which fails too
            open_backend("cuda", announce=False)  # the one "no usable CUDA device" refusal
        if _tp_run_mode(tp_mode, "cuda", tp) == "nccl":
            kk = 1 if mode == "decode" else k
            ranks = launch(tp, bench.bench_decode_rank, preset, kk, graph, 200)
            rows = [vars(r) | {"rank": i} for i, r in enumerate(ranks)]
            if as_json:
                click.echo(_json({"rows": rows}))
                return
            click.echo(f"--tp {tp} over NCCL, a process a GPU: the group's call takes its "
                       f"slowest rank's {max(r.us for r in ranks):.1f} us a layer")
            click.echo(bench.results_table(rows))
            return
    gpu = open_backend("cuda", announce=False)
    stream = gpu.create_stream()
    ceil = bench.measure_ceilings(gpu, stream)
    use_fla = with_fla and bench.fla_available()
    use_flashkda = with_flashkda and bench.flashkda_available()
    rows: list[dict] = []
    if mode == "prefill":
        for r in bench.bench_prefill(gpu, preset, tokens, stream, fla=use_fla,
                                     flashkda=use_flashkda):
            rows.append(vars(r) | {"vs_fla": r.fla_ms / r.ms if r.fla_ms else None,
                                   "vs_flashkda": r.flashkda_core_ms / r.core_ms
                                   if r.flashkda_core_ms else None})
    elif mode == "varlen":
        for r in bench.bench_varlen(gpu, preset, mix, stream, fla=use_fla):
            rows.append(vars(r) | {"vs_fla": r.fla_ms / r.ms if r.fla_ms else None})
    elif mode.startswith("batch"):
        for b in batch:
            r = bench.bench_batch(gpu, preset, b, 1 if mode == "batch-decode" else k, ceil, stream)
            if use_fla and mode == "batch-decode":
                r.fla_us = bench.fla_decode_us(preset, True, batch=b)
            rows.append(vars(r) | {"vs_fla": r.fla_us / r.us if r.fla_us else None})
    else:
        kk = 1 if mode == "decode" else k
        r = bench.bench_decode(gpu, preset, kk, graph, ceil, stream)
        if use_fla and mode == "decode":
            r.fla_us = bench.fla_decode_us(preset, graph)
        rows.append(vars(r) | {"vs_fla": r.fla_us / r.us if r.fla_us else None})
        if tp > 1:  # in turn on this GPU, beside the one-rank figure above
            rows.append(vars(bench.bench_decode_tp(gpu, preset, kk, graph, ceil, stream, tp)))
    if as_json:
        click.echo(_json({"device": gpu.device_name, "ceilings": vars(ceil), "rows": rows}))
        return
    click.echo(f"{gpu.device_name}: copy {ceil.copy_gbps:.0f} GB/s, bf16 GEMM "
               f"{ceil.gemm_tflops:.0f} TFLOP/s (measured in this run)")
    click.echo(bench.results_table(rows))


if __name__ == "__main__":
    main()
