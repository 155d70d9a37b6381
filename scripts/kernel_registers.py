"""The decode / verify kernels compiled for an H200 (sm_90a) on any machine, GPU or not: Triton's
code generator and the ptxas that ships with it. Per launch: registers per thread, spill
stores, and the one-warp programs per SM the registers allow. It catches what the CPU
interpreter cannot (a kernel that does not compile for the GPU, a change that spills) and gives
the register side of a schedule before device time is spent on it.

    python scripts/kernel_registers.py            # the table
    python scripts/kernel_registers.py --check    # no spills; prefetch launches load before storing (CI)
    python scripts/kernel_registers.py --order "verify KDA"   # their global loads / stores in SASS order

--order shows where the compiled code waits on memory: a global load placed after a global
store (LDG after STG) cannot be issued before that store, so a load that a later instruction
needs at once costs a whole memory latency there.

Must run without TRITON_INTERPRET (the interpreter replaces the kernels' compiled form). The
launches are the ones recurrent.recurrent_fwd picks over a K-last pool for 32 heads of 128
(KDA, GDN) and GDN's 256 (Qwen3.5's value heads), with 16-byte aligned pointers and row strides
as a real launch specialises them.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from hyla.ops.triton.recurrent import recurrent_kernel
from hyla.ops.triton.recurrent_decode import decode_persistent_kernel

TARGET = GPUTarget("cuda", 90, 32)
_BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
PTXAS, CUOBJDUMP = os.path.join(_BIN, "ptxas"), os.path.join(_BIN, "cuobjdump")
REGISTERS_PER_SM, MAX_PROGRAMS_PER_SM = 65536, 32

_INPUTS = dict(q="*bf16", k="*bf16", v="*bf16", g="*fp32", beta="*bf16", A_log="*fp32", dt_bias="*fp32",
               lower_bound="fp32", scale="fp32", o="*bf16")


@dataclass
class Launch:
    """One kernel launch: which kernel, its compile-time constants and warps."""

    name: str
    persistent: bool
    gate: int  # 2: KDA's per-channel gate, 1: GDN's scalar one
    block_v: int
    K: int = 128
    spec: bool = False  # a speculative verify (rows of several tokens, a state per position)
    prefetch: bool = False  # the next token's inputs loaded first (recurrent_fwd's prefetch_next_token)
    fused_gate: bool = False
    warps: int = 1

    def source(self) -> ASTSource:
        common = dict(H=32, HV=32, K=self.K, V=self.K, BK=self.K, BV=self.block_v, GATE=self.gate,
                      GATE_FN=1 if self.fused_gate else 0, HAS_BIAS=self.fused_gate, USE_L2NORM=True,
                      BETA_SIGMOID=False, KLAST=True, IDX_W=2 if self.spec else 1, SPEC=self.spec)
        if self.persistent:
            fn = decode_persistent_kernel
            sig = dict(_INPUTS, pool="*fp32", idx="*i32", n_acc="*i32", cu_seqlens="*i32", n_tiles="i32", T="i32",
                       sq="i32", sk="i32", sv="i32")
            consts = dict(common, STAGES=0, ROWS=self.spec, IS_VARLEN=self.spec)
        else:
            fn = recurrent_kernel
            sig = dict(_INPUTS, h0="*fp32", ht="*fp32", cu_seqlens="*i32", idx="*i32", n_acc="*i32", T="i32",
                       sq="i32", sk="i32", sv="i32")
            consts = dict(common, IS_VARLEN=self.spec, HAS_H0=True, STORE_HT=True, POOL=True, PREFETCH=self.prefetch)
        if self.gate == 1:
            sig["g"] = "*bf16" if self.fused_gate else "*fp32"
        sig.update({name: "constexpr" for name in consts})
        aligned = [n for n, t in sig.items() if t.startswith("*") or n in ("sq", "sk", "sv")]
        attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
        return ASTSource(fn, sig, consts, attrs)


LAUNCHES = [
    Launch("decode KDA, 8 col", False, 2, 8),
    Launch("decode KDA, persistent 16 col", True, 2, 16),
    Launch("decode KDA fused gate, persistent 8 col", True, 2, 8, fused_gate=True),
    Launch("decode GDN, 8 col", False, 1, 8),
    Launch("decode GDN D 256, 8 col", False, 1, 8, K=256),
    Launch("verify KDA, 8 col", False, 2, 8, spec=True),
    Launch("verify KDA, 8 col, prefetch", False, 2, 8, spec=True, prefetch=True),
    Launch("verify GDN, 16 col", False, 1, 16, spec=True),
    Launch("verify GDN, 16 col, prefetch", False, 1, 16, spec=True, prefetch=True),
    Launch("verify GDN, 8 col, prefetch", False, 1, 8, spec=True, prefetch=True),
    Launch("verify KDA, persistent 8 col", True, 2, 8, spec=True),
    Launch("verify GDN D 256, 16 col", False, 1, 16, K=256, spec=True),
]


def compile_launch(launch: Launch):
    """The launch's sm_90a kernel (Triton's CompiledKernel: .asm["ptx"], .asm["cubin"])."""
    return triton.compile(launch.source(), target=TARGET, options=dict(num_warps=launch.warps))


def registers(kernel) -> tuple[int, int]:
    """A compiled launch -> (registers per thread, spill-store bytes), as ptxas reports them."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.ptx")
        with open(path, "w") as f:
            f.write(kernel.asm["ptx"])
        out = subprocess.run([PTXAS, "-v", "--gpu-name", "sm_90a", path, "-o", os.devnull], capture_output=True,
                             text=True, check=True).stderr
    regs = re.search(r"Used (\d+) registers", out)
    spill = re.search(r"(\d+) bytes spill stores", out)
    return int(regs.group(1)), int(spill.group(1)) if spill else 0


def memory_order(kernel) -> list[tuple[int, str, int]]:
    """A compiled launch's SASS global loads / stores, branches and barriers in program order,
    runs of the same opcode merged -> [(first instruction's index, opcode, count)]."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(kernel.asm["cubin"])
        sass = subprocess.run([CUOBJDUMP, "-sass", path], capture_output=True, text=True, check=True).stdout
    runs: list[tuple[int, str, int]] = []
    for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.]*)", sass):
        op = m.group(2)
        if not op.startswith(("LDG", "STG", "BRA", "BAR", "EXIT")):
            continue
        if runs and runs[-1][1] == op:
            runs[-1] = (runs[-1][0], op, runs[-1][2] + 1)
        else:
            runs.append((int(m.group(1), 16) // 16, op, 1))
    return runs


def loads_after_output(runs: list[tuple[int, str, int]]) -> int:
    """memory_order's runs -> the global loads placed after the last token-output store (o is
    bf16: a 16-bit STG): with prefetch_next_token none may be, else a token waits on them after
    its stores."""
    last_out = max(i for i, (_, op, _) in enumerate(runs) if op.startswith("STG.E.U16"))
    return sum(n for _, op, n in runs[last_out + 1:] if op.startswith("LDG"))


def programs_per_sm(regs: int, warps: int) -> int:
    """Programs one SM holds by registers (allocated per warp in 256-register units)."""
    per_warp = -(-regs * 32 // 256) * 256
    return min(MAX_PROGRAMS_PER_SM, REGISTERS_PER_SM // (per_warp * warps))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true",
                    help="exit status 1 if a launch spills or a prefetch launch loads after its output store")
    ap.add_argument("--order", metavar="NAME", help="print the SASS memory order of the launches whose name "
                    "contains NAME instead of the table")
    args = ap.parse_args()
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        sys.exit("unset TRITON_INTERPRET: the interpreter replaces the compiled kernels")
    if args.order is not None:
        for launch in (x for x in LAUNCHES if args.order in x.name):
            print(f"{launch.name}: " + " ".join(f"{op}{f'x{n}' if n > 1 else ''}@{i}"
                                                for i, op, n in memory_order(compile_launch(launch))), flush=True)
        return 0
    print("| launch | registers | spill stores (bytes) | programs / SM | loads after the output store |\n"
          "|---|---:|---:|---:|---:|")
    spilled, late = [], []
    for launch in LAUNCHES:
        kernel = compile_launch(launch)
        regs, spill = registers(kernel)
        late_loads = loads_after_output(memory_order(kernel))
        print(f"| {launch.name} | {regs} | {spill} | {programs_per_sm(regs, launch.warps)} | {late_loads} |",
              flush=True)
        if spill and launch.K <= 128:
            spilled.append(launch.name)
        if launch.prefetch and late_loads:
            late.append(launch.name)
    if args.check and (spilled or late):
        print(f"spills: {spilled}; prefetch launches with a load after the output store: {late}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
