"""Cluster files: the figures the step-time model prices a step with, each naming where it comes from.

A cluster file is a small TOML file. Every figure is an inline table ``{ value = ..., kind = ..., source =
... }``: ``kind`` is ``"specification"`` (a vendor's published figure), ``"measurement"`` (measured; the
source names the file in this repository or the command that measured it) or ``"assumption"`` (neither:
the source says why the value was chosen). A figure without its value, kind or source is refused.

    [device]   peak_tflops_bf16, peak_tflops_fp32, memory_gib, memory_gbps, gemm_efficiency,
               memory_efficiency, launch_us
    [node]     devices_per_node
    [intra]    bandwidth_gbps, latency_us              (links between the devices of one node, per device)
    [inter]    nics_per_node, nic_gbps, latency_us     (the network; bandwidths in GB/s, one direction)
    [overlap]  fsdp                                    (true: FSDP2's gathers and reduce-scatters run beside
                                                        the compute, as on a GPU's separate streams)

Optional ``[ops.<op>]`` tables (what ``--calibrate here`` writes) give one collective's own measured
``latency_us`` (per algorithm step) and ``bandwidth_gbps`` (wire bytes per second); they replace the link
figures for that op on groups within a node.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from .sources import write_text

REQUIRED: dict[str, tuple[str, ...]] = {
    "device": ("peak_tflops_bf16", "peak_tflops_fp32", "memory_gib", "memory_gbps", "gemm_efficiency",
               "memory_efficiency", "launch_us"),
    "node": ("devices_per_node",),
    "intra": ("bandwidth_gbps", "latency_us"),
    "inter": ("nics_per_node", "nic_gbps", "latency_us"),
    "overlap": ("fsdp",),
}
KINDS = ("specification", "measurement", "assumption")
SHIPPED = ("aurora", "h100-dgx", "h200-dgx", "b200-dgx")


class ClusterError(ValueError):
    """A cluster file that cannot be used, in one line naming the file and the key."""


@dataclass(frozen=True)
class Figure:
    value: Any
    kind: str
    source: str


@dataclass
class Cluster:
    name: str
    path: str
    figures: dict[str, Figure] = field(default_factory=dict)
    """``"section.key"`` -> figure (``"ops.all_reduce.latency_us"`` for the per-op ones)."""

    def __getitem__(self, key: str) -> Any:
        return self.figures[key].value

    def get(self, key: str, default: Any = None) -> Any:
        f = self.figures.get(key)
        return default if f is None else f.value

    @property
    def devices_per_node(self) -> int:
        return int(self["node.devices_per_node"])

    def peak_flops(self, dtype: str) -> float:
        return 1e12 * float(self["device.peak_tflops_fp32" if dtype == "fp32" else "device.peak_tflops_bf16"])

    def sources(self) -> list[tuple[str, Figure]]:
        return sorted(self.figures.items())


# ----------------------------------------------------------------------------- TOML
def _load_toml(text: str) -> dict:
    try:
        import tomllib  # Python 3.11+
    except ImportError:  # pragma: no cover - Python 3.10
        try:
            import tomli as tomllib  # type: ignore[no-redef]
        except ImportError:
            return parse_small_toml(text)
    return tomllib.loads(text)


def _scalar(tok: str) -> Any:
    tok = tok.strip()
    if tok.startswith('"') and tok.endswith('"') and len(tok) >= 2:
        return tok[1:-1].encode().decode("unicode_escape")
    if tok in ("true", "false"):
        return tok == "true"
    try:
        return int(tok.replace("_", ""))
    except ValueError:
        return float(tok.replace("_", ""))


def _split_top(s: str, sep: str) -> list[str]:
    """Split ``s`` at ``sep`` outside double quotes and braces."""
    out, depth, quoted, cur = [], 0, False, []
    for i, ch in enumerate(s):
        if ch == '"' and (i == 0 or s[i - 1] != "\\"):
            quoted = not quoted
        elif not quoted and ch == "{":
            depth += 1
        elif not quoted and ch == "}":
            depth -= 1
        if ch == sep and not quoted and depth == 0:
            out.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    out.append("".join(cur))
    return out


def _value(tok: str) -> Any:
    tok = tok.strip()
    if tok.startswith("{") and tok.endswith("}"):
        body = tok[1:-1].strip()
        table = {}
        for item in _split_top(body, ",") if body else []:
            k, v = _split_top(item, "=")[0], "=".join(_split_top(item, "=")[1:])
            table[k.strip()] = _value(v)
        return table
    return _scalar(tok)


def parse_small_toml(text: str) -> dict:
    """The TOML subset cluster files use (``[a.b]`` tables, ``key = value`` with strings, numbers, booleans
    and one-line inline tables, ``#`` comments): the fallback where neither tomllib nor tomli exists."""
    root: dict = {}
    cur = root
    for n, raw in enumerate(text.splitlines(), 1):
        line = _split_top(raw, "#")[0].strip()
        if not line:
            continue
        if line.startswith("[") and line.endswith("]"):
            cur = root
            for part in line[1:-1].strip().split("."):
                cur = cur.setdefault(part.strip(), {})
            continue
        parts = _split_top(line, "=")
        if len(parts) < 2:
            raise ValueError(f"line {n}: expected 'key = value', got {raw.strip()!r}")
        cur[parts[0].strip()] = _value("=".join(parts[1:]))
    return root


# ----------------------------------------------------------------------------- loading
def _figure(path: str, key: str, raw: Any) -> Figure:
    if not isinstance(raw, dict):
        raise ClusterError(f"cluster file {path}: {key} must be {{ value = ..., kind = ..., source = ... }}, "
                           f"got {raw!r}")
    for part in ("value", "kind", "source"):
        if part not in raw or raw[part] in ("", None):
            raise ClusterError(f"cluster file {path}: {key} has no {part}")
    if raw["kind"] not in KINDS:
        raise ClusterError(f"cluster file {path}: {key}.kind must be one of {', '.join(KINDS)}, got {raw['kind']!r}")
    value = raw["value"]
    if not isinstance(value, bool) and (not isinstance(value, (int, float)) or value <= 0) and key != "overlap.fsdp":
        raise ClusterError(f"cluster file {path}: {key} must be a positive number, got {value!r}")
    return Figure(value, raw["kind"], raw["source"])


def cluster_from_dict(data: dict, path: str) -> Cluster:
    c = Cluster(name=str(data.get("name") or os.path.splitext(os.path.basename(path))[0]), path=path)
    for section, keys in REQUIRED.items():
        table = data.get(section)
        for key in keys:
            if not isinstance(table, dict) or key not in table:
                raise ClusterError(f"cluster file {path}: missing {section}.{key}")
            c.figures[f"{section}.{key}"] = _figure(path, f"{section}.{key}", table[key])
    for op, table in (data.get("ops") or {}).items():
        for key, raw in table.items():
            c.figures[f"ops.{op}.{key}"] = _figure(path, f"ops.{op}.{key}", raw)
    if c["device.gemm_efficiency"] > 1 or c["device.memory_efficiency"] > 1:
        raise ClusterError(f"cluster file {path}: device.gemm_efficiency and device.memory_efficiency are "
                           "fractions of the peak (at most 1)")
    return c


def shipped_text(name: str) -> str:
    """The text of a cluster file shipped with the package (read through importlib.resources)."""
    from importlib import resources

    return (resources.files(__package__) / "clusters" / f"{name}.toml").read_text(encoding="utf-8")


def load_cluster(name_or_path: str) -> Cluster:
    """A shipped cluster by name (``aurora``, ``h100-dgx``, ``h200-dgx``, ``b200-dgx``) or a TOML file."""
    if name_or_path in SHIPPED:
        text, path = shipped_text(name_or_path), f"{name_or_path} (shipped)"
    else:
        if not os.path.isfile(name_or_path):
            raise ClusterError(f"--cluster {name_or_path}: neither a shipped cluster ({', '.join(SHIPPED)}) "
                               "nor a file")
        path = name_or_path
        with open(path, encoding="utf-8") as f:
            text = f.read()
    try:
        data = _load_toml(text)
    except ValueError as e:  # tomllib.TOMLDecodeError is a ValueError
        raise ClusterError(f"cluster file {path}: not valid TOML ({e})") from None
    return cluster_from_dict(data, path)


def format_figure(value: Any, kind: str, source: str) -> str:
    """One TOML inline table (what :func:`write_cluster` writes for each figure)."""
    v = ("true" if value else "false") if isinstance(value, bool) else repr(value)
    src = source.replace("\\", "\\\\").replace('"', '\\"')
    return f'{{ value = {v}, kind = "{kind}", source = "{src}" }}'


def write_cluster(path: str, name: str, description: str, sections: dict[str, dict[str, tuple]]) -> None:
    """Write a cluster file: ``sections[section][key] = (value, kind, source)``; written to a temporary
    name and renamed, so a process that dies leaves no half file."""
    lines = [f'name = "{name}"', f'description = "{description}"', ""]
    for section, figs in sections.items():
        lines.append(f"[{section}]")
        lines += [f"{k} = {format_figure(*fig)}" for k, fig in figs.items()]
        lines.append("")
    write_text(path, "\n".join(lines))
