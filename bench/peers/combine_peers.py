#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Peers of bench_combine's merge: N partial attention states (o, lse) -> the LSE-weighted output.

The same operation as dcpattn's fast-mode all-to-all merge (merge_fast_*): for each (token, head)
row, L = logsumexp_r(lse_r), out = sum_r exp(lse_r - L) o_r, rounded to bf16. Inputs are laid out
as the exchange delivers them, rank-major: o (N, T * H_local, 512) and lse (N, T * H_local).

Two implementations, timed on the shapes of bench_combine (T in {1, 16, 64, 256, 1024, 8192},
H in {16, 128}, N in {2, 4, 8}, H_local = H / N), fp32 and bf16 partials:
  - torch_eager: logsumexp, exp, a broadcast multiply and a sum (PyTorch eager)
  - triton: one program per (token, head) that loads the N lse values, computes the weights and
    sums the N o rows (a plain Triton kernel, no autotuning)
Times are triton.testing.do_bench medians (it clears the L2 cache before each run). Bytes count
every input read once and the output written once, as bench_combine does.

Usage: python3 combine_peers.py [out.json]   (default: combine_peers.json)
"""

import json
import sys

import torch
import triton
import triton.language as tl

DV = 512


@triton.jit
def merge_kernel(o_ptr, lse_ptr, out_ptr, rows, N: tl.constexpr, NP2: tl.constexpr,
                 DV: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    r = tl.arange(0, NP2)
    rmask = r < N
    lse = tl.load(lse_ptr + r * rows + row, mask=rmask, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # all empty: weights become 0, not NaN
    e = tl.exp(lse - m)
    s = tl.sum(e, 0)
    w = tl.where(s > 0.0, e / s, 0.0)
    d = tl.arange(0, DV)
    o = tl.load(o_ptr + (r[:, None] * rows + row) * DV + d[None, :], mask=rmask[:, None], other=0.0)
    acc = tl.sum(w[:, None] * o.to(tl.float32), 0)
    tl.store(out_ptr + row * DV + d, acc.to(tl.bfloat16))


def triton_merge(o, lse, out):
    n, rows, dv = o.shape
    merge_kernel[(rows,)](o, lse, out, rows, N=n, NP2=triton.next_power_of_2(n), DV=dv,
                          num_warps=4)
    return out


def torch_merge(o, lse):
    total = torch.logsumexp(lse, dim=0, keepdim=True)  # (1, rows); -inf for an all-empty row
    w = torch.exp(lse - total).nan_to_num_(0.0)  # (N, rows)
    return (w.unsqueeze(-1) * o.float()).sum(0).to(torch.bfloat16)


def copy_bandwidth_gbs():
    x = torch.empty(1 << 29, dtype=torch.float32, device="cuda")  # 2 GiB
    y = torch.empty_like(x)
    ms = triton.testing.do_bench(lambda: y.copy_(x), warmup=25, rep=200, return_mode="median")
    return 2.0 * x.numel() * 4 / (ms * 1e-3) / 1e9


def main():
    out_path = sys.argv[1] if len(sys.argv) > 1 else "combine_peers.json"
    torch.manual_seed(0)
    copy_gbs = copy_bandwidth_gbs()
    print(f"device: {torch.cuda.get_device_name()}, copy bandwidth {copy_gbs:.0f} GB/s")
    records = [{"impl": "copy_ceiling", "gbps": copy_gbs,
                "device": torch.cuda.get_device_name(),
                "torch": torch.__version__, "triton": triton.__version__}]

    # correctness of both peers against a float64 reference, on a small shape with empty states
    n, rows = 4, 64
    o = torch.randn(n, rows, DV, device="cuda")
    lse = torch.randn(n, rows, device="cuda") * 4
    lse[1, ::3] = float("-inf")
    lse[:, 5] = float("-inf")
    ref_w = torch.exp(lse.double() - torch.logsumexp(lse.double(), 0, keepdim=True)).nan_to_num(0.0)
    ref = (ref_w.unsqueeze(-1) * o.double()).sum(0)
    for name, got in (("torch_eager", torch_merge(o, lse)),
                      ("triton", triton_merge(o, lse, torch.empty(rows, DV, dtype=torch.bfloat16,
                                                                  device="cuda")))):
        err = (got.double() - ref).norm() / ref.norm()
        assert torch.isfinite(got.float()).all() and err < 1e-2, f"{name}: rel. error {err}"

    print(f"{'impl':12} {'partial':7} {'T':>6} {'H':>4} {'N':>2} {'median_us':>10} {'GB/s':>8} "
          f"{'%copy':>6}")
    for t in (1, 16, 64, 256, 1024, 8192):
        for h in (16, 128):
            for n in (2, 4, 8):
                rows = t * (h // n)
                for partial in (torch.float32, torch.bfloat16):
                    o = torch.randn(n, rows, DV, device="cuda").to(partial)
                    lse = torch.rand(n, rows, device="cuda") * 8 - 4
                    out = torch.empty(rows, DV, dtype=torch.bfloat16, device="cuda")
                    esize = o.element_size()
                    nbytes = n * rows * (DV * esize + 4) + rows * DV * 2
                    pname = "fp32" if partial == torch.float32 else "bf16"
                    for impl, fn in (("torch_eager", lambda: torch_merge(o, lse)),
                                     ("triton", lambda: triton_merge(o, lse, out))):
                        ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
                        us = ms * 1e3
                        gbs = nbytes / (us * 1e3)
                        print(f"{impl:12} {pname:7} {t:6} {h:4} {n:2} {us:10.2f} {gbs:8.0f} "
                              f"{100 * gbs / copy_gbs:5.1f}%")
                        records.append({"impl": impl, "partial": pname, "T": t, "H": h, "N": n,
                                        "H_local": h // n, "median_us": us, "bytes": nbytes,
                                        "gbps": gbs, "pct_copy_bw": 100 * gbs / copy_gbs})
                    del o, lse, out
    with open(out_path, "w") as f:
        json.dump(records, f, indent=1)
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
