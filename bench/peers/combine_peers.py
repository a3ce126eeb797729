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
Three timings per case, as bench_combine takes them:
  median_us  per call, CUDA-graph replay of back-to-back calls (triton.testing.do_bench_cudagraph,
             median): no host launch work
  single_us  one call behind an L2 flush (triton.testing.do_bench, median; it flushes 256 MiB
             before each call, so host launch work is hidden as well)
  eager_us   one call from an idle stream between two events: host launch work included (for
             Python launchers that is most of it)
L2: every case rotates among `sets` copies of its inputs and output, sets = clamp(ceil(3 L2 /
bytes), 1, 64), the rule bench_combine uses; the graph captures the rotation. Bytes count every
input read once and the output written once, as bench_combine does.

Usage: python3 combine_peers.py [out.json]   (default: combine_peers.json)
"""

import json
import math
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


MAX_SETS = 64


def sets_for(nbytes, l2):
    """Input sets to rotate over: enough that 3x the L2 size passes between two uses of one set."""
    return int(min(MAX_SETS, max(1, math.ceil(3.0 * l2 / nbytes))))


def graph_us(fn):
    """Per-call time from CUDA-graph replays (triton.testing.do_bench_cudagraph), median."""
    try:
        ms = triton.testing.do_bench_cudagraph(fn, rep=20, return_mode="median")
    except TypeError:  # older Triton: no return_mode
        ms = triton.testing.do_bench_cudagraph(fn, rep=20)
    return ms * 1e3


def single_us(fn):
    """One call behind an L2 flush (triton.testing.do_bench), median."""
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3


def eager_us(fn, warmup=10, reps=50):
    """One call from an idle stream between two events (bench_common.cuh median_us), median."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    a = torch.cuda.Event(enable_timing=True)
    b = torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    times.sort()
    return times[len(times) // 2]


def main():
    out_path = sys.argv[1] if len(sys.argv) > 1 else "combine_peers.json"
    torch.manual_seed(0)
    copy_gbs = copy_bandwidth_gbs()
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    l2 = getattr(props, "L2_cache_size", 50 << 20)
    print(f"device: {torch.cuda.get_device_name()}, L2 {l2 >> 20} MiB, copy bandwidth "
          f"{copy_gbs:.0f} GB/s")
    records = [{"impl": "copy_ceiling", "gbps": copy_gbs,
                "device": torch.cuda.get_device_name(),
                "torch": torch.__version__, "triton": triton.__version__, "l2_bytes": l2,
                "note": "median_us: triton do_bench_cudagraph (median); single_us: triton "
                        "do_bench (L2 flush before each call); eager_us: events around one call "
                        "from an idle stream; inputs rotate over sets = clamp(ceil(3 L2 / bytes), "
                        "1, 64) copies; gbps and pct_copy_bw from median_us"}]

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

    print(f"{'impl':12} {'partial':7} {'T':>6} {'H':>4} {'N':>2} {'graph_us':>9} {'single_us':>9} "
          f"{'eager_us':>9} {'GB/s':>8} {'%copy':>6} {'%copy1':>6} {'sets':>4}")
    for t in (1, 16, 64, 256, 1024, 8192):
        for h in (16, 128):
            for n in (2, 4, 8):
                rows = t * (h // n)
                for partial in (torch.float32, torch.bfloat16):
                    esize = torch.tensor([], dtype=partial).element_size()
                    nbytes = n * rows * (DV * esize + 4) + rows * DV * 2
                    sets = sets_for(nbytes, l2)
                    os_ = [torch.randn(n, rows, DV, device="cuda").to(partial) for _ in range(sets)]
                    lses = [torch.rand(n, rows, device="cuda") * 8 - 4 for _ in range(sets)]
                    outs = [torch.empty(rows, DV, dtype=torch.bfloat16, device="cuda")
                            for _ in range(sets)]
                    pname = "fp32" if partial == torch.float32 else "bf16"
                    state = {"i": 0}

                    def rotate(call):
                        def fn():
                            i = state["i"] % sets
                            state["i"] += 1
                            return call(i)
                        return fn

                    impls = (("torch_eager", rotate(lambda i: torch_merge(os_[i], lses[i]))),
                             ("triton", rotate(lambda i: triton_merge(os_[i], lses[i], outs[i]))))
                    for impl, fn in impls:
                        e_us = eager_us(fn)
                        s_us = single_us(fn)
                        state["i"] = 0
                        us = graph_us(fn)
                        gbs = nbytes / (us * 1e3)
                        gbs1 = nbytes / (s_us * 1e3)
                        print(f"{impl:12} {pname:7} {t:6} {h:4} {n:2} {us:9.2f} {s_us:9.2f} "
                              f"{e_us:9.2f} {gbs:8.0f} {100 * gbs / copy_gbs:5.1f}% "
                              f"{100 * gbs1 / copy_gbs:5.1f}% {sets:4}")
                        records.append({"impl": impl, "partial": pname, "T": t, "H": h, "N": n,
                                        "H_local": h // n, "median_us": us, "single_us": s_us,
                                        "eager_us": e_us, "bytes": nbytes, "gbps": gbs,
                                        "pct_copy_bw": 100 * gbs / copy_gbs,
                                        "pct_copy_bw_single": 100 * gbs1 / copy_gbs,
                                        "sets": sets,
                                        "pct_l2_footprint": 100.0 * sets * nbytes / l2})
                    del os_, lses, outs
                    torch.cuda.empty_cache()
    with open(out_path, "w") as f:
        json.dump(records, f, indent=1)
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
