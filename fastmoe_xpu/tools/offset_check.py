"""Find int32 products of a row index and a stride in a Triton kernel's pointer offsets (its TTIR).

A row index times a row stride computed in int32 wraps once the buffer passes 2^31 elements: a
``[R, 2I]`` bf16 buffer does at R = 1.12M rows (T=140,000 tokens, K=8, I=1024). Triton computes
``ptr + i * stride`` in the type of ``i * stride``, so every such product must be formed in int64
(``i.to(tl.int64) * stride``) before it reaches the pointer.

:func:`int32_offset_products` reads a kernel's TTIR (``compiled.asm["ttir"]``) and reports every
``arith.muli`` that

* yields ``i32`` (a scalar or a tensor of ``i32``),
* multiplies a kernel argument (a dimension or stride such as ``H``, possibly cast, broadcast or
  scaled by a compile-time value, as in ``2 * I``) by another value known only at run time (a
  program id, a loaded index, a loop variable, another argument, or anything computed from one):
  a product with a compile-time constant (``pid * BLOCK_M``, ``BLOCK_K * N``) is bounded by the
  tiles, and products that involve no argument (tile counts multiplied together) are counts, and
  both pass,
* and feeds the offset operand of a ``tt.addptr``, directly or through any arithmetic, casts,
  broadcasts or loop-carried values (a value loaded from memory starts a new chain: its pointer is
  checked where it was formed).

Tile-index products such as ``program_id * block_size`` where ``block_size`` is a kernel argument
count too: the check cannot tell an index from an offset, so such products are formed in int64 as
well. Strides passed as ``tl.constexpr`` escape the check (the kernels take their strides as
run-time arguments). Each finding names the source line (file:line and its text) that formed the
product. :mod:`fastmoe_xpu.tools.compile_check` runs this on every compiled kernel and fails on a
finding.
"""
from __future__ import annotations

import linecache
import os
import re
from dataclasses import dataclass, field

_NAME = r"%[\w.$-]+"
_DEF = re.compile(rf"^\s*((?:{_NAME}(?::\d+)?\s*,\s*)*{_NAME}(?::\d+)?)\s*=\s*(\"?[\w.]+\"?)(.*)$")
_LOC_REF = re.compile(r"loc\((#loc\d*)\)\s*$")
_LOC_DEF = re.compile(r"^(#loc\d*) = loc\((.*)\)\s*$")
_USE = re.compile(rf"({_NAME})(?:#\d+)?")
_PAIR = re.compile(rf"({_NAME})\s*=\s*({_NAME})")

#: Ops whose result is compile-time bounded when every operand is (shape and integer arithmetic).
_PURE = ("tt.splat", "tt.broadcast", "tt.expand_dims", "tt.reshape", "tt.trans", "arith.addi", "arith.subi",
         "arith.muli", "arith.extsi", "arith.extui", "arith.trunci", "arith.divsi", "arith.divui", "arith.remsi",
         "arith.remui", "arith.andi", "arith.ori", "arith.shli", "arith.shrsi", "arith.shrui", "arith.select",
         "arith.minsi", "arith.maxsi", "arith.index_cast", "ttg.convert_layout")
_REGION_OPS = ("scf.for", "scf.while", "scf.if")


@dataclass(eq=False)
class _Value:
    op: str  # defining op, "kernel_arg", "arg" (block argument, loop variable) or "iter_arg" (carried)
    operands: list["_Value"] = field(default_factory=list)
    type: str = ""
    loc: str | None = None
    text: str = ""


@dataclass
class _Frame:
    """One region being read: its names, the op that owns it (whose results its terminator feeds)
    and the values its terminator feeds besides (a loop's carried values, positionally)."""

    names: dict[str, _Value] = field(default_factory=dict)
    owner: _Value | None = None
    carried: list[_Value] = field(default_factory=list)
    op: str = ""


def _strip_loc(line: str) -> str:
    """``line`` without its ``loc(...)`` annotations (balanced parentheses)."""
    out, i = [], 0
    while True:
        j = line.find("loc(", i)
        if j < 0 or (j > 0 and (line[j - 1].isalnum() or line[j - 1] == "_")):
            if j < 0:
                out.append(line[i:])
                return "".join(out).rstrip()
            out.append(line[i:j + 4])
            i = j + 4
            continue
        out.append(line[i:j])
        depth, k = 0, j + 3
        while k < len(line):
            depth += {"(": 1, ")": -1}.get(line[k], 0)
            k += 1
            if depth == 0:
                break
        i = k


def _split_type(rest: str) -> tuple[str, str]:
    """``(operands text, result type text)`` of an op's text after its name."""
    rest = re.sub(r"<?\{[^{}]*\}>?", "", rest)  # attribute dictionaries (may hold " : ")
    if " : " in rest:
        operands, type_text = rest.rsplit(" : ", 1)
        return operands, type_text
    return rest, ""


class _Parser:
    def __init__(self) -> None:
        self.frames: list[_Frame] = [_Frame()]
        self.values: list[_Value] = []
        self.addptr_offsets: list[_Value] = []
        self.while_results: list[_Value] = []

    def lookup(self, name: str) -> _Value:
        for frame in reversed(self.frames):
            if name in frame.names:
                return frame.names[name]
        return _Value("arg", text=f"{name} (undefined)")  # a forward reference: run-time unknown

    def uses(self, text: str) -> list[_Value]:
        return [self.lookup(m.group(1)) for m in _USE.finditer(text)]

    def define(self, name: str, value: _Value) -> None:
        self.frames[-1].names[name] = value
        self.values.append(value)

    def line(self, raw: str) -> None:
        line = raw.rstrip()
        body = _strip_loc(line).strip()
        loc_m = _LOC_REF.search(line)
        loc = loc_m.group(1) if loc_m else None
        if not body or body.startswith("#") or body == "module {":
            return
        if body.startswith("}"):
            closed = self.frames.pop()
            if body.endswith("{"):  # "} do {" (scf.while's body) or "} else {" (scf.if)
                op = "scf.while.do" if " do " in body else closed.op
                self.frames.append(_Frame(owner=closed.owner, carried=closed.carried, op=op))
            return
        if body.startswith("tt.func"):
            frame = _Frame(op="tt.func")
            for m in re.finditer(rf"({_NAME}):", body):
                frame.names[m.group(1)] = _Value("kernel_arg", text=m.group(1))
            self.frames.append(frame)
            return
        if body.startswith("^bb"):  # block arguments; a while body's come from scf.condition
            frame = self.frames[-1]
            for i, m in enumerate(re.finditer(rf"({_NAME}):", body)):
                arg = _Value("arg", text=m.group(1))
                if frame.op == "scf.while.do" and i < len(self.while_results):
                    arg = _Value("iter_arg", [self.while_results[i]], text=m.group(1))
                self.define(m.group(1), arg)
            return
        if body.startswith(("scf.yield", "scf.condition")):
            self._terminator(body)
            return
        m = _DEF.match(body)
        names = [n.split(":")[0].strip() for n in m.group(1).split(",")] if m else []
        op = m.group(2).strip('"') if m else body.split()[0].strip('"')
        rest = m.group(3) if m else body[len(body.split()[0]):]
        if op in _REGION_OPS:
            value = _Value(op, [], "", loc, body)
            frame = self._region_frame(op, rest, value)
        else:
            operand_text, type_text = _split_type(rest)
            operands = [] if op in ("arith.constant", "tt.make_range") else self.uses(operand_text)
            value = _Value(op, operands, type_text, loc, body)
            frame = _Frame(op=op)
            if op == "tt.addptr" and len(operands) >= 2:
                self.addptr_offsets.append(operands[1])
        for name in names:
            self.define(name, value)
        if body.endswith("{"):
            self.frames.append(frame)

    def _region_frame(self, op: str, rest: str, owner: _Value) -> _Frame:
        """The frame of a loop's or branch's first region: a for loop's induction variable (run
        time) and its carried values, which start from their initial values."""
        frame = _Frame(owner=owner, op=op)
        if op == "scf.for":
            iv = re.match(rf"\s*({_NAME})\s*=", rest)
            if iv:
                frame.names[iv.group(1)] = _Value("arg", text=iv.group(1))
            pairs = rest.split("iter_args", 1)[1] if "iter_args" in rest else ""
        elif op == "scf.while":
            pairs = rest.split(")", 1)[0]
        else:
            pairs = ""
        for m in _PAIR.finditer(pairs):
            arg = _Value("iter_arg", [self.lookup(m.group(2))], text=m.group(1))
            frame.names[m.group(1)] = arg
            frame.carried.append(arg)
        return frame

    def _terminator(self, body: str) -> None:
        frame = self.frames[-1]
        operand_text, _ = _split_type(body.split(None, 1)[1] if " " in body else "")
        vals = self.uses(operand_text)
        if body.startswith("scf.condition"):
            vals = vals[1:]  # the condition itself
            self.while_results = vals
            if frame.owner is not None:
                frame.owner.operands.extend(vals)
            return
        if frame.owner is not None and frame.op != "scf.while.do":
            frame.owner.operands.extend(vals)  # the op's results
        if frame.op in ("scf.for", "scf.while.do"):
            for arg, v in zip(frame.carried, vals):  # the next iteration's carried values
                arg.operands.append(v)


def _is_i32(type_text: str) -> bool:
    return re.fullmatch(r"\s*(i32|tensor<[0-9x]*xi32(,.*)?>)\s*", type_text) is not None


def _bounded(v: _Value, memo: dict[int, bool]) -> bool:
    """Whether ``v`` is computed from compile-time constants and ``tl.arange`` ranges alone."""
    key = id(v)
    if key not in memo:
        memo[key] = False  # cycles (none expected in SSA) count as run time
        if v.op in ("arith.constant", "tt.make_range"):
            memo[key] = True
        elif v.op in _PURE:
            memo[key] = all(_bounded(o, memo) for o in v.operands)
    return memo[key]


#: Ops that keep a kernel argument a stride: a cast, a broadcast, or scaling by a compile-time value.
_KEEPS_STRIDE = ("tt.splat", "tt.broadcast", "tt.expand_dims", "arith.extsi", "arith.extui", "arith.trunci",
                 "arith.muli", "arith.addi", "arith.shli")


def _stride_like(v: _Value, memo: dict[int, bool], bounded: dict[int, bool]) -> bool:
    """Whether ``v`` is a kernel argument (a dimension or stride), possibly cast, broadcast or
    scaled by a compile-time value (``2 * I``)."""
    key = id(v)
    if key not in memo:
        memo[key] = False
        if v.op == "kernel_arg":
            memo[key] = True
        elif v.op in _KEEPS_STRIDE and v.operands:
            if v.op in ("arith.muli", "arith.addi", "arith.shli"):
                memo[key] = len(v.operands) == 2 and any(
                    _stride_like(a, memo, bounded) and _bounded(b, bounded)
                    for a, b in (v.operands, v.operands[::-1]))
            else:
                memo[key] = _stride_like(v.operands[0], memo, bounded)
    return memo[key]


def _top_level_at(text: str) -> int:
    """Index of the `` at `` of ``callee at caller`` outside any parentheses, or -1."""
    depth = 0
    for i, ch in enumerate(text):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0 and text.startswith(" at ", i):
            return i
    return -1


def _locations(loc: str | None, locs: dict[str, str], depth: int = 0) -> list[tuple[str, int]]:
    """``(file, line)`` pairs of a TTIR location (a ``#loc`` reference or its text), the op's own
    first, then its call sites."""
    text = (loc or "").strip()
    if not text or depth > 64:
        return []
    if re.fullmatch(r"#loc\d*", text):
        return _locations(locs.get(text), locs, depth + 1)
    m = re.fullmatch(r'"([^"]+)":(\d+):\d+', text)
    if m:
        return [(m.group(1), int(m.group(2)))]
    m = re.fullmatch(r'"[^"]*"\((.*)\)', text, re.S)  # a named location: "name"(inner)
    if m:
        return _locations(m.group(1), locs, depth + 1)
    m = re.fullmatch(r"callsite\((.*)\)", text, re.S)
    if m and _top_level_at(m.group(1)) >= 0:
        at = _top_level_at(m.group(1))
        return _locations(m.group(1)[:at], locs, depth + 1) + _locations(m.group(1)[at + 4:], locs, depth + 1)
    out: list[tuple[str, int]] = []  # fused[...] and anything else: every location it names
    for ref in re.findall(r'#loc\d*|"[^"]+":\d+:\d+', text):
        out += _locations(ref, locs, depth + 1)
    return out


def int32_offset_products(ttir: str) -> list[str]:
    """Every int32 product of a kernel argument and another run-time value that reaches a pointer
    offset in ``ttir`` (one kernel's TTIR), as ``"file.py:LINE: source text"`` (the line that formed
    it; the calling line where that is inside Triton's own library), deduplicated, in order of
    appearance."""
    parser = _Parser()
    locs: dict[str, str] = {}
    for raw in ttir.splitlines():
        m = _LOC_DEF.match(raw.strip())
        if m:
            locs[m.group(1)] = m.group(2)
            continue
        parser.line(raw)
    memo: dict[int, bool] = {}
    strides: dict[int, bool] = {}
    found: list[_Value] = []
    seen: set[int] = set()
    todo = list(parser.addptr_offsets)
    while todo:
        v = todo.pop()
        if id(v) in seen:
            continue
        seen.add(id(v))
        if v.op == "tt.load":  # data: its own pointer is checked where it was formed
            continue
        if v.op == "arith.muli" and _is_i32(v.type) and len(v.operands) == 2 \
                and not any(_bounded(o, memo) for o in v.operands) \
                and any(_stride_like(o, strides, memo) for o in v.operands):
            found.append(v)
        todo.extend(v.operands)
    out: list[str] = []
    for v in sorted(found, key=lambda v: parser.values.index(v) if v in parser.values else 0):
        where = _locations(v.loc, locs)
        if where:
            path, line = where[-1] if _in_triton(where[0][0]) else where[0]
            src = linecache.getline(path, line).strip()
            desc = f"{os.path.basename(path)}:{line}: {src}" if src else f"{os.path.basename(path)}:{line}"
        else:
            desc = v.text
        if desc not in out:
            out.append(desc)
    return out


def _in_triton(path: str) -> bool:
    """Whether ``path`` is a file of the triton package (``tl.cdiv`` and the like)."""
    try:
        import triton
    except ImportError:
        return False
    root = os.path.dirname(os.path.abspath(triton.__file__))
    return os.path.abspath(path).startswith(root + os.sep)
