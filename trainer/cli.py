"""Command line: ``fastmoe-train --preset NAME [overrides...]`` (under torchrun for many processes).

Every config field is an option named ``--section.field`` (``--optim.lr 1e-3``,
``--model.moe_impl hf``, ``--logging.tensorboard/--no-logging.tensorboard``); the common ones also
have short aliases (``--lr``, ``--steps``, ``--dp``, ...). A config error prints one line and exits
with status 2 before any work.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import sys
from typing import Any, Sequence

from .config import ConfigError, TrainConfig, field_docs, section_classes, validate
from .config.errors import EXIT_USAGE, OneLineParser
from .config.file import field_types as _field_types, parse_value as _parse_value
from .config.presets import PRESETS, get_preset

#: Short aliases of frequently changed fields.
ALIASES: dict[str, str] = {
    "steps": "schedule.steps",
    "compile": "model.compile",
    "allow-fresh-start": "checkpoint.allow_fresh_start",
    "reschedule": "checkpoint.reschedule",
    "checkpoint.async": "checkpoint.async_save",
    "resume-from": "checkpoint.resume_from",
    "lr": "optim.lr",
    "min-lr": "schedule.min_lr",
    "warmup": "schedule.warmup_steps",
    "global-batch": "schedule.global_batch",
    "micro-batch": "schedule.micro_batch",
    "context": "data.context",
    "data": "data.path",
    "out": "logging.out",
    "dp": "parallel.dp",
    "ep": "parallel.ep",
    "pp": "parallel.pp",
    "tp": "parallel.tp",
    "ac": "parallel.ac",
    "broadcast": "parallel.broadcast",
    "pp-schedule": "parallel.pp_schedule",
    "init-from": "model.init_from",
    "device": "parallel.device",
    "moe-impl": "model.moe_impl",
    "optimizer": "optim.name",
    "grad-reduce-dtype": "optim.grad_reduce_dtype",
    "param-dtype": "model.param_dtype",
    "peak-tflops": "logging.peak_tflops",
    "seed": "seed",
    "export-hf": "eval.export_hf",
}

EXIT_CONFIG_ERROR = EXIT_USAGE
DEFAULT_PRESET = "tiny-moe"


def _shown(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return "none" if value is None or value == "" else str(value)


def build_parser(shown: TrainConfig | None = None) -> argparse.ArgumentParser:
    """The parser; ``shown`` is the config whose values ``--help`` names as each option's default
    (the ``--preset`` given, else ``tiny-moe``). Options default to None, so an option given on
    the command line is told apart from the preset's value."""
    p = OneLineParser(
        prog="fastmoe-train",
        description="Pretrain an OLMoE / OLMo model with FastSparseMoE, sharded AdamW / EPSO, DP x EP. "
                    "Under torchrun: torchrun --nproc-per-node N -m fastmoe_trainer [options].",
        allow_abbrev=False,  # --step must not quietly become --steps
        formatter_class=_HelpFormatter,
    )
    if shown is None:
        shown = get_preset(DEFAULT_PRESET)
    p.add_argument("--preset", default=DEFAULT_PRESET, help=f"one of: {', '.join(PRESETS)} (default: {DEFAULT_PRESET})")
    p.add_argument("--config", default=None, metavar="FILE",
                   help="read the run's configuration from a TOML, YAML or JSON file: the same nested fields as "
                        "these options (docs/trainer.md); the preset first, then the file, then the options given")
    p.add_argument("--print-config", nargs="?", const="json", default=None, choices=("json", "toml", "yaml"),
                   metavar="FORMAT", help="print the config (preset, --config file and options combined) as json "
                                          "(default), toml or yaml, in a form --config reads back, and exit")
    p.add_argument("--list-presets", action="store_true", help="list presets with parameter counts and exit")
    p.add_argument("--dry-run", action="store_true",
                   help="print the layout, parameters and memory per rank for --world ranks and exit (no model built)")
    p.add_argument("--world", type=int, default=None,
                   help="world size for --dry-run and --print-config (default: this launch's)")
    p.add_argument("--nproc-per-node", type=int, default=None, metavar="N",
                   help="start N training processes on this machine (torchrun's launcher, run in this process: "
                        "the same as torchrun --standalone --nproc-per-node N -m fastmoe_trainer; Ctrl-C stops "
                        "them all after their step with one line)")
    p.add_argument("--threads", type=int, default=None, metavar="N",
                   help="torch intra-op threads per process (default: this process's share of the cores, "
                        "cores // processes on this machine, less cores other work keeps busy; printed at start)")
    reverse = {v: k for k, v in ALIASES.items()}
    top_docs = field_docs(TrainConfig)
    for name in ("seed",):
        flags = [f"--{name}"]
        p.add_argument(*flags, dest=name, default=None, metavar="INT",
                       help=f"{top_docs.get(name, '')} ({shown.preset}: {_shown(getattr(shown, name))})")
    for section, cls in section_classes().items():
        docs = field_docs(cls)
        types_ = _field_types(cls)
        group = p.add_argument_group(section, (cls.__doc__ or "").strip().splitlines()[0])
        for f in dataclasses.fields(cls):
            key = f"{section}.{f.name}"
            typ, optional = types_[f.name]
            flags = [f"--{key}"]
            if key in reverse:
                flags.append(f"--{reverse[key]}")
            help_text = f"{docs.get(f.name, '')} ({shown.preset}: {_shown(getattr(getattr(shown, section), f.name))})"
            if typ is bool:
                group.add_argument(*flags, dest=key, default=None, action=BoolOption, help=help_text)
            else:
                group.add_argument(*flags, dest=key, default=None, metavar=typ.__name__.upper(), help=help_text)
    return p


class _HelpFormatter(argparse.HelpFormatter):
    """argparse's layout, with a yes/no option shown as ``--x [true|false], --no-x``."""

    def _format_action_invocation(self, action: argparse.Action) -> str:
        if isinstance(action, BoolOption):
            return ", ".join(o if o.startswith("--no-") else f"{o} [{action.metavar}]" for o in action.option_strings)
        return super()._format_action_invocation(action)


class BoolOption(argparse.Action):
    """A yes/no option: ``--x`` or ``--no-x``, and ``--x true`` / ``--x false`` (also yes/no, on/off,
    1/0) as a config file or a script would spell it."""

    TRUE, FALSE = ("true", "yes", "on", "1"), ("false", "no", "off", "0")

    def __init__(self, option_strings: Sequence[str], dest: str, default: Any = None, help: str | None = None) -> None:
        names = [*option_strings, *(f"--no-{o[2:]}" for o in option_strings if o.startswith("--"))]
        super().__init__(names, dest, nargs="?", default=default, help=help, metavar="true|false")

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        negative = bool(option_string and option_string.startswith("--no-"))
        if values is None:
            setattr(namespace, self.dest, not negative)
            return
        if negative:
            parser.error(f"{option_string} takes no value (got {values!r}): write {option_string}, or "
                         f"--{option_string[5:]} {values}")
        word = str(values).strip().lower()
        if word not in self.TRUE + self.FALSE:
            parser.error(f"{option_string} takes true or false (or nothing), got {values!r}")
        setattr(namespace, self.dest, word in self.TRUE)

    def format_usage(self) -> str:
        return " | ".join(self.option_strings)


def config_from_args(argv: Sequence[str] | None = None) -> tuple[TrainConfig, argparse.Namespace]:
    """Parse ``argv`` into a config (preset, then the ``--config`` file, then the options given);
    raises ConfigError on bad values."""
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--preset", default=None)
    pre.add_argument("--config", default=None)
    early = pre.parse_known_args(argv)[0]
    from_file: dict[str, Any] = {}
    if early.config is not None:
        from .config.file import read_config_file

        from_file = read_config_file(early.config)
    preset = early.preset or from_file.get("preset") or DEFAULT_PRESET
    try:
        shown = _preset_and_file(preset, from_file, early.config)
    except (ConfigError, ValueError, KeyError):
        shown = None  # the full parse below (or the preset's lookup after it) reports the error
    parser = build_parser(shown)
    args = parser.parse_args(argv)
    args.preset = preset
    cfg = _preset_and_file(preset, from_file, early.config)
    if args.seed is not None:
        cfg.seed = _parse_value(args.seed, int, False, "seed")
    for section, cls in section_classes().items():
        sub = getattr(cfg, section)
        types_ = _field_types(cls)
        for f in dataclasses.fields(cls):
            key = f"{section}.{f.name}"
            raw = getattr(args, key)
            if raw is None:
                continue
            typ, optional = types_[f.name]
            value = raw if typ is bool else _parse_value(raw, typ, optional, key)
            setattr(sub, f.name, value)
    if cfg.schedule.decay_from is not None and getattr(args, "schedule.steps") is None:
        cfg.schedule.steps = 0  # a decay branch without --steps: decay_from plus its decay (trainer/config/schedule.py)
    if cfg.data.path is not None and getattr(args, "data.context") is None and "data.context" not in from_file:
        # a data set of one's own: its manifest records the context it was cut to
        from .data.mixture import data_context

        cfg.data.context = data_context(cfg.data.path)
    return cfg, args


def _preset_and_file(preset: str, from_file: dict[str, Any], path: str | None) -> TrainConfig:
    """The preset with the ``--config`` file's values on top (trainer/config/file.py)."""
    cfg = get_preset(preset)
    if from_file:
        from .config.file import apply_config_values

        apply_config_values(cfg, from_file, str(path))
    return cfg


def _without_nproc(argv: list[str]) -> list[str]:
    """``argv`` less ``--nproc-per-node N`` (or ``--nproc-per-node=N``): the workers' arguments."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--nproc-per-node":
            skip = True
        elif not a.startswith("--nproc-per-node="):
            out.append(a)
    return out


def _human(n: int) -> str:
    return f"{n / 1e9:.3f}B" if n >= 1e9 else f"{n / 1e6:.3f}M"


def list_presets() -> str:
    from .model.build import param_counts

    rows = ["preset           arch   layers hidden heads  I      E    K  total        active"]
    for name, fn in PRESETS.items():
        c = fn()
        m = c.model
        pc = param_counts(m, m.vocab_size or 258)
        experts = str(m.num_experts) if m.is_moe or m.is_hf else "-"
        k = str(m.top_k) if m.is_moe or m.is_hf else "-"
        rows.append(f"{name:16s} {m.arch:6s} {m.num_layers:6d} {m.hidden_size:6d} {m.num_heads:5d} "
                    f"{m.intermediate_size:6d} {experts:>4s} {k:>2s}  {_human(pc.total):>9s}  {_human(pc.active):>9s}")
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> int:
    from .ft.stop import StopRequest, Stopped

    stop = StopRequest().install()  # SIGINT / SIGTERM: finish the step, checkpoint, one line (trainer/ft/stop.py)
    orderly = False
    try:
        code = _main(argv, stop)
        orderly = True
        return code
    except Stopped as e:
        from .ft.stop import under_launcher

        orderly = True
        # under the node launcher every rank says it (its stderr goes to the node's log, where the
        # launcher reads the step and the checkpoint); elsewhere rank 0 alone
        if os.environ.get("RANK", "0") == "0" or under_launcher():
            print(str(e), file=sys.stderr, flush=True)
        return e.exit_code
    finally:
        stop.uninstall()
        if orderly:
            release_process_groups()


def release_process_groups() -> None:
    """Destroy the process groups and free them now, while the interpreter is whole.

    The trainer's objects hold its process groups in reference cycles, so they would otherwise be
    freed during interpreter shutdown, with gloo's worker threads still running; a thread that then
    needs the interpreter ends the process with ``terminate called without an active exception``
    (SIGABRT: a finished rank "failed" with -6, and its peers were killed). Called on every orderly
    end (finished, stopped by a signal, or an error every rank agreed on: exit 2, 75, 76), never
    after an unexpected exception, where a peer may still wait in a collective."""
    import gc

    if "torch.distributed" not in sys.modules:
        return  # never imported: no group to free (a run refused before any work ends without importing torch)
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch without distributed
        return
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()  # the groups' last references are in cycles: their threads are joined here


def env_world_size() -> int:
    """torchrun's ``WORLD_SIZE`` (1 without): no process group is up yet where the CLI asks, and
    torch is not imported for it (a run refused by the lease on ``--out`` says so in a second)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def _main(argv: Sequence[str] | None, stop: Any) -> int:
    from .outputs.run_dir import RunDirClaim

    claim = None
    try:
        cfg, args = config_from_args(argv)
        launcher = args.nproc_per_node is not None and "LOCAL_RANK" not in os.environ
        if not (args.list_presets or args.dry_run or args.print_config):
            # --out first: a run directory another job writes is refused in a second, before the checks
            # below import torch; a refused run leaves --out as it found it (RunDirClaim.undo)
            claim = RunDirClaim(cfg.logging.out, launcher=launcher)
        if launcher:
            from fastmoe_xpu.threads import check_threads

            from .ft.local_launch import launch

            check_threads(args.threads)
            validate(dataclasses.replace(cfg), args.nproc_per_node)  # fail here, not in N processes at once
            stop.uninstall()  # the launcher's handlers pass signals on to the workers
            code = launch(args.nproc_per_node, _without_nproc(sys.argv[1:] if argv is None else list(argv)))
        elif args.list_presets:
            print(list_presets())
            return 0
        elif args.dry_run:
            from .parallelism.plan import plan_from_config

            print(plan_from_config(cfg, args.world or env_world_size()))
            return 0
        else:
            as_given = copy.deepcopy(cfg) if args.print_config else None  # before validate fills in the layout
            # the only check: the Trainer takes the validated config as it is
            validate(cfg, (args.world if args.print_config else None) or env_world_size())
            if args.print_config:
                from .config.file import dump_config

                print(dump_config(as_given, args.print_config, get_preset(args.preset)), end="")
                return 0
            code = _fit(cfg, args, stop)
    except (ConfigError, ValueError) as e:
        # config and data errors (bad preset, layout, missing or corrupt shards): one line, no work lost
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        code = EXIT_CONFIG_ERROR
    finally:
        if claim is not None:
            claim.release()
    if claim is not None and code == EXIT_CONFIG_ERROR:
        claim.undo()
    return code


def _fit(cfg: TrainConfig, args: argparse.Namespace, stop: Any) -> int:
    """Build the Trainer and train it; the exit status, with one line for each way it can fail."""
    from fastmoe_xpu.threads import configure

    from .checkpoint.slots import CheckpointError
    from .ft.fault import EXIT_CHECKPOINT_FAILURE, EXIT_SOFT_FAILURE, SoftFailure
    from .ft.space import OutOfSpace

    configure(args.threads)  # this process's share of the cores (fastmoe_xpu/threads.py)
    from .trainer import Trainer

    trainer = Trainer(cfg)
    trainer.stop = stop
    try:
        trainer.fit()
    except ConfigError as e:  # found on resume (a changed schedule)
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    except SoftFailure as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_SOFT_FAILURE
    except (CheckpointError, OutOfSpace) as e:  # a checkpoint, or the metrics on a full disk
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return EXIT_CHECKPOINT_FAILURE
    sm = trainer.summary  # the whole run's, earlier runs on this --out included
    if trainer.layout.is_main and sm:
        print(json.dumps({"steps": sm["steps"], "loss_first": round(sm["loss_first"], 4),
                          "loss_last": round(sm["loss_last"], 4), "out": cfg.logging.out}))
    if trainer.artefacts.get("export_error"):  # said once, when it happened (trainer/outputs/run_end.py)
        return EXIT_CONFIG_ERROR  # the output folder: a restart would meet it again
    return 0  # main() destroys the process groups
