#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""PyTorch eager peer of the MLA decode kernels (bench/bench_mla_decode.cu), and the GPU's ceilings.

Ceilings measured in this run: the bf16 matrix rate (8192^3 torch.matmul on random data) and the
device-to-device copy bandwidth (bytes read + written).

Dense: q (B, H, 576) bf16 against each request's cache, scores in fp32, softmax, P (bf16) times
the first 512 dims, o and lse out. The peer gets a contiguous (B, L, 576) cache: eager PyTorch has
no cheap paged read, so the page gather is left out in its favour. fp8: the ds_mla entries are
dequantized to bf16 inside the timed call (what an eager engine must do).
Sparse: the top-k entries are gathered from the flat cache (index_select), then the same.
Shapes as in the CUDA benchmark; cases whose score tensor does not fit are skipped.
Times: median of CUDA-event-timed calls, each after an L2 flush that reads a 256 MiB buffer
(DCPATTN_BENCH_FLUSH=write: fills it, as triton.testing.do_bench), as bench_mla_decode does.
Writes a JSON array to argv[1] (default mla_decode_peer.json).
"""
import os
import json
import sys

try:
    import torch
except ImportError:
    print("mla_decode_peer: PyTorch is not installed, skipped")
    sys.exit(0)

QK, V, PAGE, TOPK = 576, 512, 64, 2048
SCALE = 0.0721688
dev = torch.device("cuda")
flush = torch.zeros(256 << 20, dtype=torch.uint8, device=dev)
# The L2 flush before each call reads the buffer, as bench_mla_decode does
# (DCPATTN_BENCH_FLUSH=write: fills it, as triton.testing.do_bench).
FLUSH_WRITE = os.environ.get("DCPATTN_BENCH_FLUSH") == "write"


def median_us(fn, reps=20, warmup=3):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for i in range(reps):
        if FLUSH_WRITE:
            flush.fill_(i & 0xFF)
        else:
            flush.sum()  # reads 256 MiB: the L2 holds clean lines, none of fn's inputs
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000.0)
    times.sort()
    return times[len(times) // 2]


def matmul_tflops():
    n = 8192
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    us = median_us(lambda: torch.matmul(a, b), reps=20, warmup=5)
    return 2.0 * n**3 / (us * 1e6)


def copy_gbs():
    n = 2 << 30
    a = torch.empty(n, dtype=torch.uint8, device=dev).fill_(1)
    b = torch.empty_like(a)
    us = median_us(lambda: b.copy_(a), reps=10)
    del a, b
    return 2.0 * n / (us * 1e3)


def dequant_fp8(entries):
    """entries (..., 656) uint8 -> (..., 576) bf16."""
    codes = entries[..., :512].contiguous().view(torch.float8_e4m3fn).float()
    scales = entries[..., 512:528].contiguous().view(torch.float32)
    latent = (codes.unflatten(-1, (4, 128)) * scales.unsqueeze(-1)).flatten(-2)
    rope = entries[..., 528:656].contiguous().view(torch.bfloat16).float()
    return torch.cat((latent, rope), -1).to(torch.bfloat16)


def attend(q, kv):
    """q (B, H, 576) bf16, kv (B, n, 576) bf16 -> o (B, H, 512) fp32, lse (B, H) fp32."""
    s = torch.bmm(q, kv.transpose(1, 2)).float() * SCALE
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse.unsqueeze(-1)).to(torch.bfloat16)
    o = torch.bmm(p, kv[..., :V]).float()
    return o, lse


def random_cache(n_entries, fmt, gen):
    if fmt == "bf16":
        return (torch.rand(n_entries, QK, device=dev, generator=gen) * 2 - 1).to(torch.bfloat16)
    codes = torch.randint(0, 256, (n_entries, 512), device=dev, dtype=torch.uint8, generator=gen) & 0xF7
    scales = ((1 + torch.rand(n_entries, 4, device=dev, generator=gen)) / 448.0).view(torch.uint8)
    rope = (torch.rand(n_entries, 64, device=dev, generator=gen) * 2 - 1).to(torch.bfloat16).view(torch.uint8)
    return torch.cat((codes, scales, rope), -1)


def run(kind, fmt, B, L, H, records):
    gen = torch.Generator(device=dev)
    gen.manual_seed(1)
    n = TOPK if kind == "sparse" else L
    entry = 1152 if fmt == "bf16" else 656
    free, _ = torch.cuda.mem_get_info()
    # cache + fp32 scores, exp and bf16 weights + the gathered/dequantized keys (fp8: fp32
    # intermediates of 512 + 576 values per key as well)
    need = B * L * entry + 3 * B * H * n * 4 + B * n * QK * (2 if fmt == "bf16" else 14) + (1 << 30)
    if need > free:
        print(f"{kind} {fmt} B={B} L={L} H={H}: skipped (needs {need / 2**30:.1f} GiB)")
        return
    q = (torch.rand(B, H, QK, device=dev, generator=gen) * 2 - 1).to(torch.bfloat16)
    cache = random_cache(B * L, fmt, gen)
    if kind == "dense":
        cache3 = cache.view(B, L, -1)
        if fmt == "bf16":
            fn = lambda: attend(q, cache3)
        else:
            fn = lambda: attend(q, dequant_fp8(cache3))
    else:
        idx = torch.stack([torch.randperm(L, device=dev, generator=gen)[:TOPK] + b * L for b in range(B)])
        flat_idx = idx.flatten()
        if fmt == "bf16":
            fn = lambda: attend(q, cache.index_select(0, flat_idx).view(B, TOPK, QK))
        else:
            fn = lambda: attend(q, dequant_fp8(cache.index_select(0, flat_idx)).view(B, TOPK, QK))
    try:
        us = median_us(fn)
    except torch.OutOfMemoryError:
        print(f"{kind} {fmt} B={B} L={L} H={H}: skipped (out of memory)")
        del q, cache
        torch.cuda.empty_cache()
        return
    flops = 2.0 * B * H * n * (QK + V)
    nbytes = B * n * entry + B * H * QK * 2 + B * H * (V + 1) * 4
    rec = dict(kernel=kind, cache=fmt, batch=B, context=L, heads=H, topk=TOPK if kind == "sparse" else 0,
               median_us=us, tflops=flops / (us * 1e6), gbs=nbytes / (us * 1e3), peer="pytorch_eager")
    records.append(rec)
    print(f"{kind:6s} {fmt:4s} B={B:4d} L={L:7d} H={H:4d}  {us:10.1f} us  {rec['tflops']:7.1f} TFLOP/s  {rec['gbs']:7.0f} GB/s",
          flush=True)
    del q, cache, fn
    torch.cuda.empty_cache()


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "mla_decode_peer.json"
    import os
    quick = os.environ.get("DCPATTN_BENCH_QUICK") is not None
    # DCPATTN_BENCH_FILTER="dense bf16 B=128 L=32768 H=16": only cases whose label contains it
    # (the labels of bench_mla_decode).
    pattern = os.environ.get("DCPATTN_BENCH_FILTER")

    def selected(kind, fmt, B, L, H):
        return pattern is None or pattern in f"{kind} {fmt} B={B} L={L} H={H}"

    records = []
    mm = matmul_tflops()
    cp = copy_gbs()
    print(f"bf16 matmul 8192^3: {mm:.0f} TFLOP/s; copy bandwidth {cp:.0f} GB/s", flush=True)
    records.append(dict(kernel="ceilings", matmul_tflops=mm, copy_gbs=cp))
    for fmt in ("bf16", "fp8"):
        for H in (16, 128):
            for L in (4096, 32768, 131072):
                for B in (1, 8, 64, 128):
                    if quick and not ((B == 64 and L == 32768) or (B == 1 and L == 131072)):
                        continue
                    if selected("dense", fmt, B, L, H):
                        run("dense", fmt, B, L, H, records)
    for fmt in ("bf16", "fp8"):
        for H in (64, 128):
            for B in (1, 8, 64, 128):
                if quick and B != 64:
                    continue
                if selected("sparse", fmt, B, 32768, H):
                    run("sparse", fmt, B, 32768, H, records)
    with open(out, "w") as f:
        json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
