"""Whether a csrc change altered any kernel's machine code: compiles a .cu file at a git revision
and in the work tree to cubins (no GPU needed) and compares each kernel's .text section.

    python3 scripts/kernel_text_diff.py csrc/gemm/sm80/w4a8_gemm_mma.cu e80ba12 [--arch 90a]

Kernel names are compared without the anonymous namespace's two hashes (they vary with the path and the build).
--rename OLD=NEW maps a name fragment of the work tree's kernels back to the revision's (e.g.
"ELb0E=E" when a bool template parameter was added); kernels only one side has are listed.
Exit status 1 when a kernel both sides have differs.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import re
import struct
import subprocess
import sys
import tempfile


def text_sections(cubin: str) -> dict[str, str]:
    """ELF .text.<kernel> sections of a cubin: name (hash-free) -> md5 of the bytes."""
    data = open(cubin, "rb").read()
    shoff = struct.unpack_from("<Q", data, 0x28)[0]
    entsize, num, strndx = struct.unpack_from("<HHH", data, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * entsize) for i in range(num)]
    names_at = headers[strndx][4]
    out = {}
    for name_off, _, _, _, off, size, *_ in headers:
        end = data.index(b"\0", names_at + name_off)
        name = data[names_at + name_off:end].decode()
        if name.startswith(".text."):
            # both hashes of the anonymous namespace (_GLOBAL__N__<h>_<len>_<file>_<h>) vary by build
            name = re.sub(r"_GLOBAL__N__[0-9a-f]+_(\d+_\w+?)_[0-9a-f]{8}", r"_GLOBAL__N__\1_", name)
            out[name] = hashlib.md5(data[off:off + size]).hexdigest()
    return out


def compile_cubin(src: str, include: str, arch: str, out: str) -> None:
    subprocess.run(["nvcc", "-std=c++17", "-O3", "--expt-relaxed-constexpr", f"-gencode=arch=compute_{arch},code=sm_{arch}",
                    f"-I{include}", "-cubin", src, "-o", out], check=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("source", help="the .cu file, relative to the repository root")
    ap.add_argument("rev", help="the git revision to compare against")
    ap.add_argument("--arch", default="90a", help="compute capability to compile for (default 90a)")
    ap.add_argument("--rename", action="append", default=[], metavar="OLD=NEW")
    args = ap.parse_args()
    root = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True, check=True).stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        old_tree = os.path.join(tmp, "old")
        os.makedirs(old_tree)
        subprocess.run(f"git -C {root} archive {args.rev} csrc | tar -x -C {old_tree}", shell=True, check=True)
        compile_cubin(os.path.join(old_tree, args.source), os.path.join(old_tree, "csrc"), args.arch,
                      os.path.join(tmp, "old.cubin"))
        compile_cubin(os.path.join(root, args.source), os.path.join(root, "csrc"), args.arch, os.path.join(tmp, "new.cubin"))
        old, new = text_sections(os.path.join(tmp, "old.cubin")), text_sections(os.path.join(tmp, "new.cubin"))
    renamed = {}
    for name, digest in new.items():
        for rule in args.rename:
            frm, to = rule.split("=", 1)
            name = name.replace(frm, to)
        renamed.setdefault(name, digest)
    same = sorted(n for n in old if renamed.get(n) == old[n])
    changed = sorted(n for n in old if n in renamed and renamed[n] != old[n])
    print(f"{args.source} at {args.rev} against the work tree (sm_{args.arch}): {len(same)} kernels identical, "
          f"{len(changed)} changed, {len(set(old) - set(renamed))} only at {args.rev}, "
          f"{len(set(renamed) - set(old))} only in the work tree")
    for n in changed:
        print("  changed:", n)
    return 1 if changed else 0


if __name__ == "__main__":
    sys.exit(main())
