"""Readers of what the compilers print (ptxas -v, PTX, TTGIR) and of Triton configs: plain text in, plain data out;
no Triton, torch or subprocess, so that both drivers import them and any machine tests them."""

from __future__ import annotations

import re
from collections import defaultdict
from typing import Iterable

_PTXAS_ENTRY = re.compile(r"Compiling entry function '([^']+)' for '(\w+)'")
_PTXAS_PROPS = re.compile(r"Function properties for (\S+)")
_PTXAS_SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_PTXAS_REGS = re.compile(r"Used (\d+) registers")
_PTXAS_SMEM = re.compile(r"(\d+) bytes smem")


_PTXAS_NOTE = re.compile(r"ptxas\S*\s+(?:info|warning)\s*:\s*(\(C\d+\).*|.*[Ww]arning.*)$")
_PTXAS_NOTE_FN = re.compile(r"function '([^']+)'")


def parse_ptxas_log(log: str) -> dict[str, dict]:
    """{entry function (mangled name): regs, spill_stores, spill_loads, stack_bytes, smem_static, ptxas_notes} from
    ptxas -v; callees' (.func) properties are not added. Warnings and advisories ("(C7512) ... serialized") go to the
    ptxas_notes of the function they name, else of every entry."""
    out: dict[str, dict] = {}
    notes: list[str] = []
    current = props_for = None
    for line in log.splitlines():
        if m := _PTXAS_NOTE.search(line):
            notes.append(m.group(1).strip())
        elif m := _PTXAS_ENTRY.search(line):
            current = m.group(1)
            out[current] = dict(regs=None, spill_stores=0, spill_loads=0, stack_bytes=0, smem_static=0,
                                ptxas_notes=[])
        elif m := _PTXAS_PROPS.search(line):
            props_for = m.group(1)
        elif m := _PTXAS_SPILL.search(line):
            if props_for in out:
                out[props_for].update(stack_bytes=int(m.group(1)), spill_stores=int(m.group(2)),
                                      spill_loads=int(m.group(3)))
        elif (m := _PTXAS_REGS.search(line)) and current is not None:
            out[current]["regs"] = int(m.group(1))
            if s := _PTXAS_SMEM.search(line):
                out[current]["smem_static"] = int(s.group(1))
    for note in notes:
        named = _PTXAS_NOTE_FN.search(note)
        for name, entry in out.items():
            if named is None or named.group(1) == name:
                entry["ptxas_notes"].append(note)
    return out


_PTX_FUNC = re.compile(r"^[ \t]*(?:\.visible[ \t]+|\.weak[ \t]+)*\.(?:entry|func)[ \t]+(?:\([^)]*\)[ \t]*)?([\w$]+)",
                       re.M)


def ptx_functions(ptx: str) -> dict[str, str]:
    """{function name: its text} for every .entry and .func of a PTX module."""
    heads = list(_PTX_FUNC.finditer(ptx))
    return {m.group(1): ptx[m.start():(heads[i + 1].start() if i + 1 < len(heads) else len(ptx))]
            for i, m in enumerate(heads)}


_WGMMA = re.compile(r"wgmma\.mma_async(?:\.sp)?\.sync\.aligned\.(m\d+n\d+k\d+)\.(\w+)\.(\w+)\.(\w+)")
# wgmma's A operand follows the accumulator list: a register list {..} or a 64-bit shared-memory descriptor %rd.
_WGMMA_A = re.compile(r"wgmma\.mma_async\S*\s+\{[^}]*\}\s*,\s*(\{|%)")
_MMA_SYNC = re.compile(r"\bmma\.sync\.aligned\.(m\d+n\d+k\d+)((?:\.[\w:]+)+)")
_MMA_LAYOUT = {"row", "col", "satfinite"}
# Blackwell's tcgen05.mma (sm_100a): "tcgen05.mma.cta_group::1.kind::f16 [d], a, b, idesc, ...": A is a tensor-memory
# address ([%r]) or a shared-memory descriptor (%rd); the types and shape are in idesc, only the kind in the mnemonic.
_TCGEN05 = re.compile(r"\btcgen05\.mma(?:\.sp)?\.cta_group::\d\.kind::(\w+)\s+\[[^\]]*\]\s*,\s*(\[|%)")
# fp32 FMAs, scalar or packed in pairs (fma.rn.f32x2: Blackwell, which Triton 3.6 emits for sm_120's fp32 dots)
_FMA = re.compile(r"\bfma\.rn(?:\.ftz)?\.f32(?:x2)?\b")


def classify_mma(ptx: str) -> dict:
    """The matrix instructions of PTX text: mma ("wgmma bf16.bf16->f32", "tcgen05 kind::f16", several joined by " + ",
    "fma" or "none"), their shapes (not tcgen05's), and where wgmma and tcgen05.mma take A from."""
    kinds, shapes = set(), set()
    for shape, d, a, b in _WGMMA.findall(ptx):
        kinds.add(f"wgmma {a}.{b}->{d}")
        shapes.add(shape)
    for shape, suffix in _MMA_SYNC.findall(ptx):
        types = [t for t in suffix.strip(".").split(".") if t not in _MMA_LAYOUT and "::" not in t]
        if len(types) == 4:  # d, a, b, c
            kinds.add(f"mma.sync {types[1]}.{types[2]}->{types[0]}")
        else:
            kinds.add(f"mma.sync {'.'.join(types)}")
        shapes.add(shape)
    tc = _TCGEN05.findall(ptx)
    kinds.update(f"tcgen05 kind::{kind}" for kind, _ in tc)
    a_ops = _WGMMA_A.findall(ptx)
    if kinds:
        mma = " + ".join(sorted(kinds))
    else:
        mma = "fma" if _FMA.search(ptx) else "none"
    return dict(mma=mma, mma_shapes=sorted(shapes), wgmma_a_regs=a_ops.count("{"), wgmma_a_smem=a_ops.count("%"),
                tcgen05_a_tmem=sum(a == "[" for _, a in tc), tcgen05_a_smem=sum(a == "%" for _, a in tc))


def tcgen05_types(mma: str, dots: list[dict]) -> str:
    """`mma` (classify_mma's) with each "tcgen05 kind::..." replaced by the operand types of the TTGIR's
    ttng.tc_gen5_mma ops ("tcgen05 bf16.bf16->f32", as wgmma and mma.sync are named), which the PTX does not spell."""
    if "tcgen05 kind::" not in mma:
        return mma
    kinds = {k for k in mma.split(" + ") if not k.startswith("tcgen05 kind::")}
    kinds.update(f"tcgen05 {d['types']}" for d in dots if d["op"] == "ttng.tc_gen5_mma" and d.get("types"))
    return " + ".join(sorted(kinds))


# --- TTGIR: which dot does the fp8 weight tile feed, and from where ----------------------------------------------------

_T_DEF = re.compile(r"^\s*(%[\w$.-]+(?::\d+)?(?:\s*,\s*%[\w$.-]+(?::\d+)?)*)\s*=\s*([\w.]+)(.*)$")
_T_RESULT = re.compile(r"%[\w$.-]+")     # the names in "%a, %b" or "%acc:3" (whose uses are %acc#0 ...)
_T_USE = re.compile(r"%[\w$.-]+")          # a use may carry a result index (%x#2): the match stops before it
_T_ATTRS = re.compile(r"\{[^{}]*\}")        # attribute dicts and encodings; region braces stay unbalanced
_T_TOKEN = re.compile(r"\btoken\s+%[\w$.-]+(?:#\d+)?")
_T_ITER_ARGS = re.compile(r"iter_args\((.*?)\)\s*->")
_T_PAIR = re.compile(r"(%[\w$.-]+)\s*=\s*(%[\w$.-]+)")
_T_LOC = re.compile(r"\s+loc\(.*\)\s*$")
_DOT_OPS = ("ttng.warp_group_dot", "tt.dot", "ttng.tc_gen5_mma")
# Ops that write into a shared-memory or tensor-memory buffer: (op, index of the destination among its operands).
_T_WRITES = {"ttg.async_copy_global_to_local": 1, "ttg.local_store": 1, "ttng.tmem_store": 1,
             "ttng.async_tma_copy_global_to_local": 3,  # TMA: "%desc[%x, %y] %buffer, %barrier, %pred"
             "ttng.tensormap_create": 0}  # a descriptor made in the kernel: "%scratch, %base_ptr, [box], ..."
_T_WS = re.compile(r"^\s*ttg\.warp_specialize\((.*?)\)")  # warp specialization: the values its partitions capture
_T_PARTITION = re.compile(r"^\s*partition\d+\(")
_T_BLOCK_ARG = re.compile(r"(%[\w$.-]+):")
# MLIR element types as PTX spells them (the mma labels)
_T_ELEM = {"f8E4M3FN": "e4m3", "f8E5M2": "e5m2", "f16": "f16", "bf16": "bf16", "f32": "f32", "i8": "s8", "i32": "s32"}
_T_ELEM_OF = re.compile(r"<(?:\d+x)+(\w+)")  # the element type after the shape: tensor<128x64xbf16, ...>


def _operand_kind(t: str) -> str:
    """Where a dot operand of TTGIR type `t` is read from: registers, shared memory or (tcgen05) tensor memory."""
    if not t.startswith("!ttg.memdesc"):
        return "registers"
    return "tensor memory" if "#ttng.tensor_memory" in t else "shared"


def _split_types(types: str) -> list[str]:
    """'!ttg.memdesc<64x64xbf16, #a, #b>, !ttg.memdesc<...>' -> the types, split at top-level commas."""
    out, depth, cur = [], 0, ""
    for ch in types:
        depth += ch == "<"
        depth -= ch == ">"
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    return out + [cur.strip()] if cur.strip() else out


def _elem(t: str) -> str:
    m = _T_ELEM_OF.search(t)
    return _T_ELEM.get(m.group(1), m.group(1)) if m else "?"
_T_VIEWS = ("ttg.memdesc_index", "ttg.memdesc_subslice", "ttg.memdesc_trans", "ttg.memdesc_reshape",
            "ttg.memdesc_reinterpret")


def _dot(op: str, code: str, operands: list[str]) -> dict:
    """A dot op's line (attributes and locations removed) -> its A and B operands, where each is read from, types."""
    if op == "ttng.tc_gen5_mma":  # "ttng.tc_gen5_mma %a, %b, %d, ... : type_a, type_b, type_d, ..."
        a_type, b_type, d_type = _split_types(code[code.index(" : ") + 3:])[:3]
    else:  # "%r = tt.dot %a, %b, %c : type_a * type_b -> type_d"
        star = code.index(" * ")
        a_type = code[code.rindex(" : ", 0, star) + 3:star].strip()
        b_type = code[star + 3:code.index(" -> ", star)].strip()
        d_type = code[code.index(" -> ", star) + 4:].strip()
    return dict(op=op, operands=operands[:2], kinds=[_operand_kind(t) for t in (a_type, b_type)],
                types=f"{_elem(a_type)}.{_elem(b_type)}->{_elem(d_type)}")


def ttgir_dots(ttgir: str, weight_arg: str) -> list[dict]:
    """Every dot of a TTGIR kernel with where each operand comes from: {"op", "a", "b", "types", "w8"}: "a"/"b"
    "registers", "shared" or "tensor memory" (tcgen05's A); "types" as "bf16.bf16->f32"; "w8" the operands ("A", "B",
    "AB" or "") that reach `%weight_arg` (e.g. "w_ptr") by a backward slice over the SSA def-use graph, through
    loop-carried values and shared/tensor-memory buffers (not async tokens or loop results)."""
    edges: dict[str, set[str]] = defaultdict(set)
    dots = []
    scopes: list[tuple[int, dict[str, str]]] = []  # (brace depth outside the loop, its block args -> unique keys)
    depth = 0

    # MLIR reuses a name after a sibling region that had it has closed: each definition gets its own key, and a use is
    # the latest definition above it.
    latest: dict[str, str] = {}

    def define(name: str, lineno: int) -> str:
        key = f"{name}@{lineno}" if name in latest else name
        latest[name] = key
        return key

    def resolve(name: str) -> str:  # block args (%argN) repeat across sibling loops: make them unique per loop
        for _, args in reversed(scopes):
            if name in args:
                return args[name]
        return latest.get(name, name)

    view_src: dict[str, str] = {}  # a view of a buffer (memdesc_index, ...) -> the memdesc it views

    def root_buffer(view: str) -> str:
        while view in view_src:
            view = view_src[view]
        return view

    captured: list[str] = []  # the operands of the last ttg.warp_specialize: its partitions' block arguments
    for lineno, raw in enumerate(ttgir.splitlines()):
        code = _T_TOKEN.sub("", _T_ATTRS.sub("", _T_LOC.sub("", raw)))
        opens = raw.count("{") - raw.count("}")  # attribute braces pair up on their line; regions span lines
        if m := _T_WS.match(code):
            captured = [resolve(u) for u in _T_USE.findall(m.group(1))]
        elif _T_PARTITION.match(raw):  # "partition0(%a: type loc(..), ...) num_warps(4) {": arguments by position
            for arg, value in zip(_T_BLOCK_ARG.findall(re.sub(r"loc\([^()]*(?:\([^()]*\))*[^()]*\)", "", raw)),
                                  captured):
                edges[define(arg, lineno)].add(value)
        elif " scf.for " in code and "iter_args(" in code:
            pairs = _T_PAIR.findall(_T_ITER_ARGS.search(code).group(1))
            keys = {arg: f"{arg}@{lineno}" for arg, _ in pairs}
            for arg, init in pairs:
                edges[keys[arg]].add(resolve(init))
            scopes.append((depth, keys))
        elif m := _T_DEF.match(code):
            results, op, rest = m.groups()
            operands = [resolve(u) for u in _T_USE.findall(rest)]
            for result in (define(r, lineno) for r in _T_RESULT.findall(results)):
                edges[result].update(operands)
                if op in _T_VIEWS and operands:
                    view_src[result] = operands[0]
            if op in _T_WRITES and len(operands) > _T_WRITES[op]:
                dst = operands[_T_WRITES[op]]
                edges[root_buffer(dst)].update(o for i, o in enumerate(operands) if i != _T_WRITES[op])
            if op in _DOT_OPS:
                dots.append(_dot(op, code, operands))
        elif m := re.match(r"^\s*([\w.]+)\s+(.*)$", code):  # an op without results
            operands = [resolve(u) for u in _T_USE.findall(m.group(2))]
            if m.group(1) in _T_WRITES and len(operands) > _T_WRITES[m.group(1)]:
                idx = _T_WRITES[m.group(1)]
                edges[root_buffer(operands[idx])].update(o for i, o in enumerate(operands) if i != idx)
            elif m.group(1) in _DOT_OPS:  # tcgen05 (sm_100a) accumulates in tensor memory in place
                dots.append(_dot(m.group(1), code, operands))
        depth += opens
        while scopes and depth <= scopes[-1][0]:
            scopes.pop()

    target = "%" + weight_arg

    def reaches_weight(value: str) -> bool:
        seen, todo = set(), [value]
        while todo:
            v = todo.pop()
            if v == target:
                return True
            if v not in seen:
                seen.add(v)
                todo.extend(edges.get(v, ()))
        return False

    return [dict(op=d["op"], a=d["kinds"][0], b=d["kinds"][1], types=d["types"],
                 w8="".join(side for side, v in zip("AB", d["operands"]) if reaches_weight(v)))
            for d in dots]


def ws_consumers(ttgir: str) -> int:
    """How many warp-specialized partitions of a TTGIR kernel hold a dot (its consumer warpgroups); 0 without."""
    parts = re.split(r"(?m)^\s*partition\d+\(", ttgir)[1:]
    return sum("warp_group_dot" in p or "tc_gen5_mma" in p for p in parts)


def w8_operand(dots: list[dict]) -> dict:
    """From ttgir_dots: w_operand (where the dots the weight tile feeds read it: "registers", "shared", "tensor memory",
    "mixed" or None), w8_dots (how many it feeds) and w8_side ("A", "B", "AB" or None)."""
    kinds = {d[side.lower()] for d in dots for side in d["w8"]}
    sides = "".join(sorted({side for d in dots for side in d["w8"]}))
    return dict(w_operand=(kinds.pop() if len(kinds) == 1 else "mixed") if kinds else None,
                w8_dots=sum(bool(d["w8"]) for d in dots), w8_side=sides or None)


def config_str(cfg) -> str:
    """A triton.Config as "BLOCK_M=128,BLOCK_N=128,BLOCK_K=64,GROUP_M=8,w8,s4" (w: warps, s: stages)."""
    parts = [f"{k}={v}" for k, v in cfg.kwargs.items()] + [f"w{cfg.num_warps}", f"s{cfg.num_stages}"]
    if getattr(cfg, "num_ctas", 1) not in (1, None):
        parts.append(f"ctas{cfg.num_ctas}")
    if getattr(cfg, "maxnreg", None):
        parts.append(f"maxnreg{cfg.maxnreg}")
    return ",".join(parts)



def check_variant(kernel: str, param_names: list[str], constexpr_names: set[str], args: dict, constexprs: dict,
                  tuned: Iterable[str]) -> list[str]:
    """Problems (empty if none) between a kernel's parameters and what its spec variant passes: every parameter
    given exactly once, runtime parameters in `args`, tl.constexpr ones in `constexprs` or the autotune config."""
    tuned = set(tuned)
    given_rt, given_ce = set(args), set(constexprs) | tuned
    params = set(param_names)
    problems = []
    if missing := [p for p in param_names if p not in given_rt | given_ce]:
        problems.append(f"{kernel}: parameters not given by the spec: {missing}")
    if unknown := sorted((given_rt | given_ce) - params):
        problems.append(f"{kernel}: the spec gives arguments the kernel does not have: {unknown}")
    if wrong := sorted(given_rt & constexpr_names):
        problems.append(f"{kernel}: tl.constexpr parameters given as runtime args: {wrong}")
    if wrong := sorted((given_ce & params) - constexpr_names):
        problems.append(f"{kernel}: runtime parameters given as constexprs: {wrong}")
    if both := sorted(set(constexprs) & tuned):
        problems.append(f"{kernel}: autotuned parameters also pinned by the spec: {both}")
    return problems
