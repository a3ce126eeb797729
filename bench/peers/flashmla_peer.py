#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""FlashMLA peer of the MLA decode kernels (bench/bench_mla_decode.cu), on the same shapes.

FlashMLA (DeepSeek's MLA decoding kernels for Hopper) is the field's reference for this work. It
is not on PyPI by itself; vLLM's wheel ships it as a PyTorch extension, `vllm/_flashmla_C.abi3.so`,
whose operators register under `torch.ops._flashmla_C`. This script loads that library from the
path in FLASHMLA_OPS (nothing else of vLLM is imported) and calls its two decoding operators as
FlashMLA's Python interface does:
  out, lse, meta, splits = dense_decode_fwd(q, k_cache, 512, cache_seqlens, block_table, scale,
                                            causal, meta, splits, None)
  out, lse, meta, splits = sparse_decode_fwd(q, k_cache, indices, None, None, meta, splits,
                                             None, None, None, 512, scale, None)
The first call of a case gets meta = splits = None and computes FlashMLA's schedule; the timed calls
pass it back, as an engine does for all layers of a step. The library must match the machine's
PyTorch and CUDA: vLLM 0.26.0's (PyTorch 2.11, CUDA 13) for the H200 of docs/performance.md:
  pip download --no-deps vllm==0.26.0 && unzip -j vllm-0.26.0-*.whl vllm/_flashmla_C.abi3.so

Cases (those of bench_mla_decode that FlashMLA computes):
- dense bf16: its dense paged kernel, 64-token pages scattered over the cache by a permutation,
  16 and 128 heads, B in {1, 8, 64, 128}, L in {4K, 32K, 128K};
- sparse fp8: its sparse kernel on the same 656-byte ds_mla entries (512 e4m3 codes, 4 fp32 group
  scales, 64 bf16 RoPE values), top-k 2048 distinct positions of a 32K context, 64 and 128 heads;
- dense fp8, 128 heads: FlashMLA has no dense kernel for the 656-byte entry, so its sparse kernel
  is given every position of the context, in order, as the top-k list (the same tokens and the
  same dequantization; the list is read in addition). FlashMLA's sparse kernel takes fp8 entries
  only: there is no bf16 sparse case.

Before timing, each kind is checked against a PyTorch reference in fp32 (the max abs error of o
goes into the JSON record of that case); a kind whose check fails is not timed.
Times, as bench_mla_decode: `median_us` is one call behind a 256 MiB L2 flush, CUDA events, median
of 30; `behind_flush_us` is [flush, call] minus [flush], without the start event in between;
`sustained_us` the first timing again after a second of flushes and calls; `window_us` the time
per call of a second of calls back to back (replays of a CUDA graph of 8 calls), with the GPU's
energy over it (`energy_mj_per_call`, `energy_watts`).
Writes a JSON array to argv[1] (default mla_decode_peer.flashmla.json: bench/plot.py draws files
named mla_decode*.json, mla_decode_peer*.json into mla_decode.png). DCPATTN_BENCH_FILTER as in
mla_decode_peer.py.
"""
import json
import os
import sys
import time

# The shapes, the scale, the flush buffer and the random caches are the PyTorch peer's (it exits
# when PyTorch is missing).
from mla_decode_peer import PAGE, QK, SCALE, TOPK, V, dev, flush, random_cache  # noqa: E402

import torch  # noqa: E402


def load_ops():
    path = os.environ.get("FLASHMLA_OPS")
    if not path or not os.path.exists(path):
        print("flashmla_peer: set FLASHMLA_OPS to vLLM's _flashmla_C.abi3.so; skipped")
        sys.exit(0)
    torch.ops.load_library(path)
    return torch.ops._flashmla_C


ops = load_ops()


# The sustained load before each case's second timing (bench_mla_decode's default; 0 skips it).
WARMUP_MS = float(os.environ.get("DCPATTN_BENCH_WARMUP_MS", "1000"))


def sustain(fn, ms):
    """Keeps the GPU busy with fn() for about ms milliseconds, batches of 8 calls with a
    synchronization between them (as bench_common.cuh's sustain); returns the calls and the
    seconds they took."""
    t0, calls = time.perf_counter(), 0
    while (time.perf_counter() - t0) * 1e3 < ms:
        for _ in range(8):
            fn()
        calls += 8
        torch.cuda.synchronize()
    return calls, time.perf_counter() - t0


def flush_and(fn):
    """fn behind an L2 flush, as the timed calls are: what the sustained load repeats."""
    def both():
        flush.sum()
        fn()
    return both


def sm_clock_mhz(cycles=1000000):
    """The SM clock in MHz where the stream stands: torch.cuda._sleep spins one thread for
    `cycles` clock64() cycles (about 500 us at 1.98 GHz), timed by events. Enqueued behind the
    timed calls (and launched once before, so that the module is loaded), it starts with no host
    latency and tells the clock those calls ended at."""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    torch.cuda._sleep(cycles)
    b.record()
    b.synchronize()
    return cycles / (a.elapsed_time(b) * 1e3)


# The window of back-to-back calls whose energy is read (bench_mla_decode's default; 0 skips it).
ENERGY_MS = float(os.environ.get("DCPATTN_BENCH_ENERGY_MS", "1000"))


class EnergyCounter:
    """NVML's total energy counter of this GPU (mJ), through the driver's libnvidia-ml.so.1 by
    ctypes, as bench_common.cuh's EnergyCounter; mj() is -1 where it is missing."""

    def __init__(self):
        import ctypes
        self._get = None
        try:
            lib = ctypes.CDLL("libnvidia-ml.so.1")
            if lib.nvmlInit_v2() != 0:
                return
            dev = ctypes.c_void_p()
            p = torch.cuda.get_device_properties(torch.cuda.current_device())
            bus = f"{p.pci_domain_id:04x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0".encode()
            if lib.nvmlDeviceGetHandleByPciBusId_v2(ctypes.c_char_p(bus), ctypes.byref(dev)) != 0:
                return
            e = ctypes.c_ulonglong()
            if lib.nvmlDeviceGetTotalEnergyConsumption(dev, ctypes.byref(e)) != 0:
                return
            self._lib, self._dev, self._e, self._ct = lib, dev, e, ctypes
            self._get = lib.nvmlDeviceGetTotalEnergyConsumption
        except (OSError, AttributeError):
            self._get = None

    def mj(self):
        if self._get is None or self._get(self._dev, self._ct.byref(self._e)) != 0:
            return -1.0
        return float(self._e.value)


energy = EnergyCounter()


def replay_of(fn, n=8):
    """fn() n times captured as one CUDA graph, and a function that replays it; (None, 'eager')
    where the capture fails. The peer's Python enqueue takes 79-84 us a call (run 29 of
    docs/performance.md), longer than the GPU time of the small cases, so calls back to back are
    replayed, as a graph-captured decode step would run them."""
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(n):
                fn()
        torch.cuda.synchronize()
        return graph.replay, "graph"
    except RuntimeError:
        torch.cuda.synchronize()
        return None, "eager"


def back_to_back(fn, ms):
    """Calls back to back for about ms milliseconds (sustain), with the energy counter read at both
    ends, like bench_common.cuh's back_to_back: (us per call, mJ per call, mean W, how the calls
    were launched), -1 for what was not measured (ms <= 0, or no counter for the energy). Unlike
    the C++ benchmark, whose launches take 4-11 us, the calls are replays of a CUDA graph of 8
    calls (replay_of), or, where the capture fails, enqueued from Python one by one."""
    if ms <= 0:
        return -1.0, -1.0, -1.0, "none"
    replay, launch = replay_of(fn)
    per = 8 if replay is not None else 1
    torch.cuda.synchronize()
    e0 = energy.mj()
    calls, seconds = sustain(replay if replay is not None else fn, ms)
    e1 = energy.mj()
    calls *= per
    us = seconds * 1e6 / calls
    if e0 < 0 or e1 < 0:
        return us, -1.0, -1.0, launch
    return us, (e1 - e0) / calls, (e1 - e0) / (seconds * 1e3), launch


def events_us(fn, reps=30, warmup=5):
    """Median of event-bracketed calls, each behind an L2 flush that reads 256 MiB, and the SM
    clock right behind them (MHz)."""
    torch.cuda._sleep(1000)  # loads the spin kernel's module before the clock is read
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for a, b in ev:
        flush.sum()
        a.record()
        fn()
        b.record()
    mhz = sm_clock_mhz()
    torch.cuda.synchronize()
    t = sorted(a.elapsed_time(b) * 1000.0 for a, b in ev)
    return t[len(t) // 2], mhz


def behind_flush_us(fn, reps=30, warmup=5):
    """Median of [flush, call] minus [flush]: the call enqueued right behind the flush."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ev = [[torch.cuda.Event(enable_timing=True) for _ in range(4)] for _ in range(reps)]
    for e in ev:
        flush.sum()
        e[0].record()
        flush.sum()
        e[1].record()
        flush.sum()
        e[2].record()
        flush.sum()
        fn()
        e[3].record()
    torch.cuda.synchronize()
    t = sorted((e[2].elapsed_time(e[3]) - e[0].elapsed_time(e[1])) * 1000.0 for e in ev)
    return t[len(t) // 2]


def dequant_fp8(entries):
    """entries (..., 656) uint8 -> (..., 576) fp32."""
    codes = entries[..., :512].contiguous().view(torch.float8_e4m3fn).float()
    scales = entries[..., 512:528].contiguous().view(torch.float32)
    latent = (codes.unflatten(-1, (4, 128)) * scales.unsqueeze(-1)).flatten(-2)
    rope = entries[..., 528:656].contiguous().view(torch.bfloat16).float()
    return torch.cat((latent, rope), -1)


def reference(q, kv):
    """q (B, H, 576), kv (B, n, 576) -> o (B, H, 512) in fp32."""
    s = torch.bmm(q.float(), kv.float().transpose(1, 2)) * SCALE
    p = torch.softmax(s, -1)
    return torch.bmm(p, kv[..., :V].float())


def setup(kind, fmt, B, L, H, seed=1):
    """Inputs and the call. kind: dense (bf16 paged), sparse (fp8 top-k), all (fp8, every position)."""
    gen = torch.Generator(device=dev)
    gen.manual_seed(seed)
    pages = L // PAGE
    q = (torch.rand(B, 1, H, QK, device=dev, generator=gen) * 2 - 1).to(torch.bfloat16)
    cache = random_cache(B * L, fmt, gen)
    # request b's page p is cache page table[b, p]; no two consecutive pages are neighbours
    table = torch.randperm(B * pages, device=dev, generator=gen).to(torch.int32).view(B, pages)
    seqlens = torch.full((B,), L, dtype=torch.int32, device=dev)
    if kind == "dense":
        k_cache = cache.view(B * pages, PAGE, 1, QK)
        call = lambda m, s: ops.dense_decode_fwd(q, k_cache, V, seqlens, table, SCALE, False, m, s, None)
        gathered = lambda: cache.view(B * pages, PAGE, QK)[table.long()].view(B, L, QK)
    else:
        n = TOPK if kind == "sparse" else L
        if kind == "all":
            pos = torch.arange(L, device=dev).expand(B, L)
        else:
            pos = torch.stack([torch.randperm(L, device=dev, generator=gen)[:n] for _ in range(B)])
        # a position's entry in the flat cache: its page's number times 64 plus its offset
        flat = (table.long().gather(1, pos // PAGE) * PAGE + pos % PAGE).to(torch.int32)
        indices = flat.view(B, 1, n)
        k_cache = cache.view(torch.float8_e4m3fn).view(B * pages, PAGE, 1, 656)
        call = lambda m, s: ops.sparse_decode_fwd(q, k_cache, indices, None, None, m, s, None, None, None, V, SCALE,
                                                  None)
        gathered = lambda: dequant_fp8(cache[flat.long().flatten()]).view(B, n, QK)
    _, _, meta, splits = call(None, None)  # FlashMLA's schedule for this case, computed once
    fn = lambda: call(meta, splits)[:2]
    return q, fn, gathered


def check(kind, fmt, B, L, H):
    try:
        q, fn, gathered = setup(kind, fmt, B, L, H, seed=7)
        out, _ = fn()
    except RuntimeError as e:  # a shape FlashMLA refuses: the cases of this kind are not run
        print(f"check {kind} {fmt} B={B} L={L} H={H}: FlashMLA refused the call ({e}); not run", flush=True)
        return False, str(e)
    ref = reference(q.view(B, H, QK), gathered())
    err = (out.view(B, H, V).float() - ref).abs().max().item()
    scale = ref.abs().max().item()
    ok = err <= 2e-2 * max(scale, 1e-3) + 4e-3
    print(f"check {kind} {fmt} B={B} L={L} H={H}: max |o - ref| {err:.3g} (max |ref| {scale:.3g}) {'ok' if ok else 'FAILED'}",
          flush=True)
    return ok, err


def run(kind, fmt, B, L, H, records, check_err):
    n = TOPK if kind == "sparse" else L
    entry = 1152 if fmt == "bf16" else 656
    free, _ = torch.cuda.mem_get_info()
    if B * L * entry * 2 + (1 << 30) > free:
        print(f"{kind} {fmt} B={B} L={L} H={H}: skipped (memory)")
        return
    q, fn, _ = setup(kind, fmt, B, L, H)
    us, mhz = events_us(fn)
    behind = behind_flush_us(fn)
    sus_us, sus_mhz = -1.0, -1.0
    if WARMUP_MS > 0:
        sustain(flush_and(fn), WARMUP_MS)
        sus_us, sus_mhz = events_us(fn, warmup=0)
    window, mj, watts, window_launch = back_to_back(fn, ENERGY_MS)
    flops = 2.0 * B * H * n * (QK + V)
    nbytes = B * n * entry + B * H * QK * 2 + B * H * V * 2 + B * H * 4
    label = "dense" if kind in ("dense", "all") else "sparse"
    rec = dict(kernel=label, cache=fmt, batch=B, context=L, heads=H, topk=TOPK if kind == "sparse" else 0,
               median_us=us, sm_mhz=mhz, sustained_ms=WARMUP_MS, sustained_us=sus_us, sustained_mhz=sus_mhz,
               tflops_sustained=flops / (sus_us * 1e6) if sus_us > 0 else -1.0,
               energy_ms=ENERGY_MS, window_us=window, window_launch=window_launch,
               tflops_window=flops / (window * 1e6) if window > 0 else -1.0, energy_mj_per_call=mj, energy_watts=watts, tflops=flops / (us * 1e6), gbs=nbytes / (us * 1e3), behind_flush_us=behind,
               tflops_behind_flush=flops / (behind * 1e6), peer="flashmla",
               path={"dense": "dense paged kernel", "sparse": "sparse fp8 kernel",
                     "all": "sparse fp8 kernel given every position"}[kind],
               check_max_abs_err=check_err)
    records.append(rec)
    print(f"{label:6s} {fmt:4s} B={B:4d} L={L:7d} H={H:4d}  {us:9.1f} us  {rec['tflops']:6.1f} TFLOP/s  "
          f"{rec['gbs']:6.0f} GB/s  behind flush {behind:9.1f} us  {rec['tflops_behind_flush']:6.1f} TFLOP/s  "
          f"{mhz:5.0f} MHz  sustained {sus_us:9.1f} us {sus_mhz:5.0f} MHz  back to back {window:9.1f} us  "
          f"{mj:.2f} mJ/call ({watts:.0f} W)",
          flush=True)
    del q, fn
    torch.cuda.empty_cache()


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "mla_decode_peer.flashmla.json"
    pattern = os.environ.get("DCPATTN_BENCH_FILTER")

    def selected(kind, fmt, B, L, H):
        return pattern is None or pattern in f"{kind} {fmt} B={B} L={L} H={H}"

    checks = {}
    for kind, fmt, B, L, H in (("dense", "bf16", 2, 4096, 128), ("dense", "bf16", 2, 4096, 16),
                               ("sparse", "fp8", 2, 32768, 128), ("sparse", "fp8", 2, 32768, 64),
                               ("all", "fp8", 2, 4096, 128)):
        checks[(kind, H)] = check(kind, fmt, B, L, H)
    records = []
    for H in (16, 128):
        for L in (4096, 32768, 131072):
            for B in (1, 8, 64, 128):
                ok, err = checks[("dense", H)]
                if ok and selected("dense", "bf16", B, L, H):
                    run("dense", "bf16", B, L, H, records, err)
    for L in (4096, 32768, 131072):
        for B in (1, 8, 64, 128):
            ok, err = checks[("all", 128)]
            if ok and selected("dense", "fp8", B, L, 128):
                run("all", "fp8", B, L, 128, records, err)
    for H in (64, 128):
        for B in (1, 8, 64, 128):
            ok, err = checks[("sparse", H)]
            if ok and selected("sparse", "fp8", B, 32768, H):
                run("sparse", "fp8", B, 32768, H, records, err)
    with open(out, "w") as f:
        json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
