"""The loops of one kernel in `cuobjdump -sass` output, each as one line of its memory and MMA
instructions in issue order: where a kernel's loads sit against the MMAs that use them.

    cuobjdump -sass build.o > k.sass      # the GPU host's, or the Triton wheel's: .venv/lib/python3*/
                                          # site-packages/triton/backends/nvidia/bin/cuobjdump
    python3 scripts/sass_loops.py k.sass 'decode_kernelILi1ELi2ELi4ELb0ELi3ELb1E13__nv_bfloat16'

Per loop (a backward branch and its target): instruction count, LDG.128, all LDG, IMMA/HMMA, local
loads/stores, then the body as letters: W = LDG.128, g = narrower LDG, M = IMMA/HMMA, L = LDL,
s = STL, | = branch, (n) = n other instructions in a row. Session 53 used it to see that the
double-buffered decode kernel issued its activation loads just before their MMAs
(csrc/gemm/NOTES.md "Session 53").
"""
from __future__ import annotations

import argparse
import re
import sys

_INSTR = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_BRANCH = re.compile(r"\bBRA\b.*?(0x[0-9a-f]+)")


def function_instructions(sass: str, pattern: str) -> list[tuple[int, str]]:
    """(address, instruction) of the first function whose name matches pattern (re.search)."""
    found, out = False, []
    for line in sass.splitlines():
        if "Function :" in line:
            if found:
                break
            found = re.search(pattern, line) is not None
            continue
        m = _INSTR.match(line) if found else None
        if m:
            out.append((int(m.group(1), 16), m.group(2)))
    if not found:
        raise SystemExit(f"no function matching {pattern!r}")
    return out


def letter(instr: str) -> str:
    op = instr.split()[1] if instr.startswith("@") else instr.split()[0]  # skip a predicate
    if op.startswith("LDG"):
        return "W" if ".128" in op else "g"
    if op.startswith(("IMMA", "HMMA")):
        return "M"
    if op.startswith("LDL"):
        return "L"
    if op.startswith("STL"):
        return "s"
    if op.startswith("BRA"):
        return "|"
    return "."


def loops(instrs: list[tuple[int, str]]) -> list[dict]:
    index = {addr: i for i, (addr, _) in enumerate(instrs)}
    found = []
    for i, (addr, text) in enumerate(instrs):
        m = _BRANCH.search(text)
        target = int(m.group(1), 16) if m else None
        if target is None or target >= addr or target not in index:
            continue
        body = [t for _, t in instrs[index[target]:i + 1]]
        letters = "".join(letter(t) for t in body)
        found.append({
            "first": index[target], "last": i, "instructions": len(body),
            "ldg128": letters.count("W"), "ldg": letters.count("W") + letters.count("g"),
            "mma": letters.count("M"), "local": letters.count("L") + letters.count("s"),
            "body": re.sub(r"\.{2,}", lambda r: f"({len(r.group())})", letters),
        })
    return found


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("sass", help="cuobjdump -sass output")
    ap.add_argument("function", help="regular expression for the kernel's (mangled) name")
    args = ap.parse_args(argv)
    with open(args.sass) as f:
        instrs = function_instructions(f.read(), args.function)
    for lp in loops(instrs):
        print(f"loop {lp['first']}-{lp['last']} ({lp['instructions']} instructions): LDG.128 {lp['ldg128']}, "
              f"LDG {lp['ldg']}, MMA {lp['mma']}, local {lp['local']}")
        print(f"  {lp['body']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
