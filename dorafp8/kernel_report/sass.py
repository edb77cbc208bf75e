"""The main loop's instruction mix, read from SASS (nvdisasm's text of a cubin): plain text in, plain data out.

What the tensor cores wait for is decided in the GEMM main loop, one reduction step per iteration: how the fp8 weight
tile turns into the MMA's input type (F2FP unpacks, F2F conversions, PRMT byte shuffles, I2F), how wide the shared
and global loads are, and how many MMA instructions that feeds. PTX hides most of it (ptxas picks the conversion
instructions and the load widths), so the report reads the SASS.

The main loop is the first loop (a backward branch to a label) holding an MMA instruction. Triton does not unroll
these loops (its pipeliner keeps one reduction step per iteration: the loads of a later step and the MMAs of this
one), so the counts are per reduction step and per thread; docs/INSPECT.md says how the prediction uses them.
"""

from __future__ import annotations

import re

_INSTR = re.compile(r"^\s*/\*([0-9a-f]+)\*/\s+(?:@!?U?P[T\d]+\s+)?([A-Z][A-Z0-9_]*)((?:\.[A-Za-z0-9_]+)*)\s*([^;]*);")
_LABEL = re.compile(r"^(\.L_x_\d+):")
_BRANCH_TARGET = re.compile(r"`\((\.L_x_\d+)\)")

# MMA instructions: Hopper's warpgroup MMAs (HGMMA 16-bit, QGMMA fp8), warp MMAs (HMMA, also fp8 on sm_89/sm_120),
# Blackwell's tensor-core MMAs (UTCHMMA, UTCQMMA, ... issued by one thread for the CTA).
_MMA = re.compile(r"^(HGMMA|QGMMA|IGMMA|HMMA|QMMA|IMMA|OMMA|UTC\w*MMA)$")

# Fields of the mix, in report order (docs/INSPECT.md, "Main loop").
MIX_FIELDS = ("mma", "f2f", "f2fp_unpack", "f2fp_pack", "prmt", "i2f", "lds8", "lds16", "lds32", "lds64", "lds128",
              "ldsm", "ldg", "ldgsts", "fp32_alu", "instrs")


_SECTION = re.compile(r"^\s*\.section\s+\.text\.([^,\s]+)", re.M)


def split_functions(text: str) -> dict[str, str]:
    """{function name: its SASS} of nvdisasm's text of a cubin with several kernels (labels are numbered across the
    file, so each function's loops stay its own)."""
    heads = list(_SECTION.finditer(text))
    return {m.group(1): text[m.start():(heads[i + 1].start() if i + 1 < len(heads) else len(text))]
            for i, m in enumerate(heads)}


def parse_sass(text: str) -> list[dict]:
    """[{addr, op, mods, args}] in program order, plus {'label': name} entries where labels stand."""
    out = []
    for line in text.splitlines():
        if m := _LABEL.match(line):
            out.append({"label": m.group(1)})
        elif m := _INSTR.match(line):
            out.append({"addr": int(m.group(1), 16), "op": m.group(2), "mods": m.group(3), "args": m.group(4)})
    return out


def loops(instrs: list[dict]) -> list[tuple[int, int]]:
    """[(first, last)] index ranges of every loop: a branch back to a label that stands before it."""
    where = {e["label"]: i for i, e in enumerate(instrs) if "label" in e}
    out = []
    for i, e in enumerate(instrs):
        if e.get("op") == "BRA" and (t := _BRANCH_TARGET.search(e["args"])) and where.get(t.group(1), i) < i:
            out.append((where[t.group(1)], i))
    return out


def _lds_width(mods: str) -> str:
    m = mods.split(".")
    if "U8" in m or "S8" in m:
        return "lds8"
    if "U16" in m or "S16" in m:
        return "lds16"
    if "64" in m:
        return "lds64"
    if "128" in m:
        return "lds128"
    return "lds32"


def mix(instrs: list[dict]) -> dict:
    """Counts of MIX_FIELDS over the instructions given."""
    c = dict.fromkeys(MIX_FIELDS, 0)
    for e in instrs:
        op, mods = e.get("op"), e.get("mods", "")
        if op is None:
            continue
        c["instrs"] += 1
        if _MMA.match(op):
            c["mma"] += 1
        elif op == "F2F":
            c["f2f"] += 1
        elif op == "F2FP":
            c["f2fp_unpack" if "UNPACK" in mods else "f2fp_pack"] += 1
        elif op == "PRMT":
            c["prmt"] += 1
        elif op == "I2F" or op == "I2FP":
            c["i2f"] += 1
        elif op == "LDS":
            c[_lds_width(mods)] += 1
        elif op == "LDSM":
            c["ldsm"] += 1
        elif op == "LDG":
            c["ldg"] += 1
        elif op == "LDGSTS":
            c["ldgsts"] += 1
        elif op in ("FADD", "FMUL", "FFMA", "FMNMX"):
            c["fp32_alu"] += 1
    return c


def main_loop_mix(text: str) -> dict | None:
    """The instruction mix of the main loop, None if no loop holds an MMA instruction. The main loop is the first
    loop in program order that holds one: dorafp8's kernels run their main GEMM before their epilogue, whose rank-r
    GEMM can be a loop of MMAs too (as many per iteration, or more)."""
    instrs = parse_sass(text)
    for first, last in sorted(loops(instrs)):
        body = instrs[first:last + 1]
        if any(e.get("op") and _MMA.match(e["op"]) for e in body):
            return mix(body)
    return None
