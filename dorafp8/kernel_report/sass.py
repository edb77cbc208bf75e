"""The main loop's instruction mix, read from SASS (nvdisasm's text of a cubin): plain text in, plain data out. The
main loop is the first loop holding an MMA; Triton keeps one reduction step per iteration, so counts are per step and
per thread. docs/INSPECT.md, "The main loop (what the SASS shows)"."""

from __future__ import annotations

import re

_INSTR = re.compile(r"^\s*/\*([0-9a-f]+)\*/\s+(?:@!?U?P[T\d]+\s+)?([A-Z][A-Z0-9_]*)((?:\.[A-Za-z0-9_]+)*)\s*([^;]*);")
_LABEL = re.compile(r"^(\.L_x_\d+):")
_BRANCH_TARGET = re.compile(r"`\((\.L_x_\d+)\)")

# MMA instructions: Hopper's warpgroup MMAs (HGMMA 16-bit, QGMMA fp8), warp MMAs (HMMA, also fp8 on sm_89/sm_120),
# Blackwell's tensor-core MMAs (UTCHMMA, UTCQMMA, ... issued by one thread for the CTA).
_MMA = re.compile(r"^(HGMMA|QGMMA|IGMMA|HMMA|QMMA|IMMA|OMMA|UTC\w*MMA)$")

# Fields of the mix, in report order (docs/INSPECT.md, "Main loop", says what each counts).
MIX_FIELDS = ("mma", "f2f", "f2fp_unpack", "f2fp_pack", "prmt", "i2f", "lds8", "lds16", "lds32", "lds64", "lds128",
              "ldsm", "ldg", "ldgsts", "fp32_alu", "utmaldg", "mbar_wait", "bar_cta", "bar_named", "instrs")


_SECTION = re.compile(r"^\s*\.section\s+\.text\.([^,\s]+)", re.M)


def split_functions(text: str) -> dict[str, str]:
    """{function name: its SASS} from nvdisasm's text of a multi-kernel cubin (labels are numbered file-wide)."""
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
        elif op == "UTMALDG":
            c["utmaldg"] += 1
        elif op == "SYNCS" and "PHASECHK" in mods:
            c["mbar_wait"] += 1
        elif op == "BAR" and ".SYNC" in mods:  # BAR.SYNC[.DEFER_BLOCKING] id[, thread count]
            c["bar_named" if "," in e.get("args", "") else "bar_cta"] += 1
    return c


def _holding(instrs: list[dict], ranges: list[tuple[int, int]], pattern) -> list[tuple[int, int]]:
    """The ranges whose body holds an instruction matching `pattern`, innermost only (none of them inside another
    range that holds one: a persistent kernel's tile loop holds its main loop), in program order."""
    hold = [r for r in sorted(ranges) if any(e.get("op") and pattern(e) for e in instrs[r[0]:r[1] + 1])]
    return [r for r in hold if not any(o != r and r[0] <= o[0] and o[1] <= r[1] for o in hold)]


def _is_mma(e: dict) -> bool:
    return bool(_MMA.match(e["op"]))


def _is_tma_load(e: dict) -> bool:
    return e["op"] == "UTMALDG"


def main_loop_mix(text: str) -> dict | None:
    """The instruction mix of the main loop, the first innermost loop holding an MMA instruction (the main GEMM runs
    before the epilogue's); None if none does. Under warp specialization, the first consumer warpgroup's copy."""
    instrs = parse_sass(text)
    found = _holding(instrs, loops(instrs), _is_mma)
    return mix(instrs[found[0][0]:found[0][1] + 1]) if found else None


def loads_after_first_store(text: str, in_main_loop: bool = False) -> int:
    """Global loads (LDG, LDGSTS) that stand after the first global store (STG) of the kernel, or of its main loop
    (main_loop_mix's): a load is not moved past a store (the pointers might alias), so each is a round trip of its own
    after the store's, where a streaming pass wants every load of a step issued before it waits on any."""
    instrs = parse_sass(text)
    if in_main_loop:
        found = _holding(instrs, loops(instrs), _is_mma)
        instrs = instrs[found[0][0]:found[0][1] + 1] if found else []
    ops = [e["op"] for e in instrs if "op" in e]
    first = ops.index("STG") if "STG" in ops else len(ops)
    return sum(op in ("LDG", "LDGSTS") for op in ops[first:])


def pipeline(text: str) -> dict:
    """What the SASS says of the main loop's pipeline beyond the mix: whether it lies inside a persistent kernel's tile
    loop, the producer's loop mix under warp specialization (None without), kernel_instrs (every instruction: what lies
    outside the loops runs once per tile) and tile_instrs (inside the tile loops; None without one)."""
    instrs = parse_sass(text)
    every = loops(instrs)
    main = _holding(instrs, every, _is_mma)
    producer = [r for r in _holding(instrs, every, _is_tma_load)
                if not any(e.get("op") and _is_mma(e) for e in instrs[r[0]:r[1] + 1])]
    nested = bool(main) and any(o[0] < main[0][0] and main[0][1] < o[1] for o in every)
    # a persistent kernel's tile loops: the outermost loops holding an MMA or a TMA load (every partition's); what
    # lies outside them (the setup: arguments, descriptors, barriers' init) runs once per CTA, not once per tile
    work = [r for r in every if any(e.get("op") and (_is_mma(e) or _is_tma_load(e)) for e in instrs[r[0]:r[1] + 1])]
    outer = [r for r in work if not any(o != r and o[0] <= r[0] and r[1] <= o[1] for o in work)]
    inside = {i for r in outer for i in range(r[0], r[1] + 1)}  # (ranges may overlap: each instruction once)
    tile_instrs = sum("op" in instrs[i] for i in inside) if nested else None
    return dict(tile_loop=nested, producer_loop=mix(instrs[producer[0][0]:producer[0][1] + 1]) if producer else None,
                kernel_instrs=sum("op" in e for e in instrs), tile_instrs=tile_instrs)
