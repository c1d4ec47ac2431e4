"""Every command line the README and docs show names options and presets that exist: each line that
runs one of the package's commands (in a code block or an inline code span) is split as the shell
splits it, and every ``--option`` is looked up in that command's own parser (built, not grepped);
every ``--preset`` value must be a preset of the trainer or the benchmark."""
from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
#: How a command is written in the docs -> its name here.
COMMANDS = {
    "fastmoe-train": "train", "fastmoe_trainer": "train", "trainer": "train",
    "fastmoe-launch": "launch", "trainer.ft.launch": "launch", "fastmoe_trainer.ft.launch": "launch",
    "fastmoe-preprocess": "preprocess", "trainer.data.preprocess": "preprocess",
    "fastmoe_trainer.data.preprocess": "preprocess",
    "fastmoe-export": "export", "trainer.outputs.export": "export", "fastmoe_trainer.outputs.export": "export",
    "fastmoe-bench": "bench", "bench": "bench", "fastmoe_bench": "bench",
    "fastmoe_xpu.tools.config_sweep": "config_sweep",
    "fastmoe-plan": "plan", "trainer.parallelism.plan": "dry_run", "fastmoe_trainer.parallelism.plan": "dry_run",
}


class _Captured(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        super().__init__()
        self.parser = parser


def _capture(main, argv: list[str]) -> argparse.ArgumentParser:
    """The parser ``main(argv)`` builds, caught at its first parse (nothing runs)."""
    mp = pytest.MonkeyPatch()

    def grab(self, *args, **kwargs):
        if self.add_help:  # a pre-parser without --help is not the command's parser
            raise _Captured(self)
        return real(self, *args, **kwargs)

    real = argparse.ArgumentParser.parse_known_args
    mp.setattr(argparse.ArgumentParser, "parse_known_args", grab)
    try:
        main(argv)
    except _Captured as got:
        return got.parser
    finally:
        mp.undo()
    raise AssertionError(f"{main.__module__}.main({argv}) parsed nothing")


_PARSERS: dict[tuple[str, str], argparse.ArgumentParser] = {}


def _parser(command: str, study: str = "") -> argparse.ArgumentParser:
    key = (command, study)
    if key not in _PARSERS:
        if command == "train":
            from trainer.cli import build_parser
            _PARSERS[key] = build_parser()
        elif command == "bench":
            from bench import cli
            _PARSERS[key] = _capture(cli.main, [study]) if study else cli.build_parser()
        elif command == "plan":  # fastmoe-plan: the planner and tracer, or the step-time model's own parser
            from trainer.scale import command as plan_command, model_cli
            _PARSERS[key] = model_cli.build_parser() if study == "model" else plan_command.build_parser()
        elif command == "dry_run":
            from trainer.parallelism.plan import build_parser
            _PARSERS[key] = build_parser()
        else:
            module = {"launch": "trainer.ft.launch", "preprocess": "trainer.data.preprocess",
                      "export": "trainer.outputs.export", "config_sweep": "fastmoe_xpu.tools.config_sweep"}[command]
            import importlib
            _PARSERS[key] = _capture(importlib.import_module(module).main, ["--help"])
    return _PARSERS[key]


def _command_lines(text: str) -> list[str]:
    """Lines of the code blocks, and inline code spans, that may hold a command (continuations joined)."""
    found = []
    for block in re.findall(r"```(?:bash|sh|console)?\n(.*?)```", text, re.S):
        joined = re.sub(r"\\\n\s*", " ", block)
        found.extend(line.split(" #")[0] for line in joined.splitlines())
    found.extend(re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S)))
    return [line for line in found if "--" in line or "fastmoe-" in line]


def _invocations(line: str) -> list[tuple[str, list[str]]]:
    """(command, its arguments) for every package command in ``line``; fastmoe-launch's trainer
    arguments (after ``--``) count as the trainer's."""
    try:
        words = shlex.split(line)
    except ValueError:
        return []
    out = []
    for i, w in enumerate(words):
        name = w.rsplit("/", 1)[-1]
        if i > 0 and words[i - 1] == "-m" and name in COMMANDS:
            command = COMMANDS[name]
        elif w.startswith(("fastmoe-", ".venv/bin/fastmoe-")) and name in COMMANDS:
            command = COMMANDS[name]
        else:
            continue
        args = words[i + 1:]
        if command == "launch" and "--" in args:
            cut = args.index("--")
            out.append(("train", args[cut + 1:]))
            args = args[:cut]
        out.append((command, args))
        break
    return out


def _options(args: list[str]) -> list[tuple[str, str | None]]:
    """(--option, the word after it) for each option token, placeholders and brackets stripped."""
    found = []
    for i, w in enumerate(args):
        w = w.strip("[]()',;")
        if not w.startswith("--") or w == "--" or "..." in w:
            continue
        name = w.split("=", 1)[0].split("|", 1)[0]
        value = w.split("=", 1)[1] if "=" in w else (args[i + 1].strip("[]()',;") if i + 1 < len(args) else None)
        found.append((name, value))
    return found


def _known(parser: argparse.ArgumentParser) -> set[str]:
    return set(parser._option_string_actions)


def _checked_lines():
    for page in PAGES:
        for line in _command_lines(page.read_text(encoding="utf-8")):
            for command, args in _invocations(line):
                yield page, line, command, args


def test_docs_show_commands():
    """The check below reads something: the docs show every command."""
    seen = {command for _, _, command, _ in _checked_lines()}
    assert {"train", "launch", "preprocess", "export", "bench", "config_sweep", "plan"} <= seen, seen


def test_every_documented_option_and_preset_exists():
    from bench.harness.presets import resolve_presets
    from trainer.scale.command import MODEL_OPTIONS
    from bench.studies import SUBCOMMANDS
    from trainer.config.presets import PRESETS as TRAIN_PRESETS

    wrong = []
    for page, line, command, args in _checked_lines():
        study = args[0] if command == "bench" and args and args[0] in SUBCOMMANDS else ""
        model = command == "plan" and any(a.strip("[]").split("=")[0] in MODEL_OPTIONS for a in args)
        known = _known(_parser(command, "model" if model else study))
        for option, value in _options(args[1:] if study else args):
            if option not in known:
                wrong.append(f"{page.relative_to(REPO)}: {command}{' ' + study if study else ''} has no {option}: {line.strip()}")
            elif option == "--preset" and value and re.fullmatch(r"[a-z0-9-]+", value):
                if command in ("train", "plan", "dry_run") and value not in TRAIN_PRESETS:
                    wrong.append(f"{page.relative_to(REPO)}: no trainer preset {value!r}: {line.strip()}")
                elif command == "bench":
                    try:
                        resolve_presets([value])
                    except ValueError:
                        wrong.append(f"{page.relative_to(REPO)}: no benchmark preset {value!r}: {line.strip()}")
    assert not wrong, "\n".join(wrong)


def test_every_documented_command_and_make_target_exists():
    """Every ``fastmoe-*`` command the pages name is a console script of pyproject.toml, and every
    ``make TARGET`` one of the Makefile's targets."""
    import tomllib

    scripts = set(tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]["scripts"])
    targets = set(re.findall(r"^([a-z][a-z0-9-]*):", (REPO / "Makefile").read_text(encoding="utf-8"), re.M))
    wrong = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for name in set(re.findall(r"(?<![\w/.-])(fastmoe-[a-z]+)\b", text)) - scripts:
            wrong.append(f"{page.relative_to(REPO)}: no command {name}")
        for name in set(re.findall(r"`make ([a-z][a-z0-9-]*)", text)) - targets:
            wrong.append(f"{page.relative_to(REPO)}: no make target {name}")
    assert scripts and targets and not wrong, "\n".join(wrong)
