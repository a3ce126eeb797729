#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""PyTorch eager peer of the fused MLA prologue (bench/bench_prologue.cu), on the same shapes.

Per batch of T rows: q RMSNorm (fp32 math, bf16 out) into a preallocated q_c_out; top-k reset to -1;
KV RMSNorm + interleaved RoPE; the MLA cache entry (bf16, or fp8 ds_mla: 512 e4m3 with 4 fp32 scales
of amax / 448, then 64 bf16 RoPE values) written with index_copy_; the indexer key LayerNorm + neox
RoPE on dims [0, 64) + e4m3 with one fp32 scale, scattered into the paged indexer cache (128 code
bytes per token, then one scale per token, per page of 64 tokens).

Configurations as in the CUDA benchmark: fp8_indexer and bf16 (every row owns a slot), and
fp8_indexer_dcp4 (a quarter of the rows own a slot; the owned row list is computed outside the timed
region, which favours the peer: computing it per call in eager PyTorch needs a host sync).
median_us is per call, from back-to-back eager calls between two CUDA events (launch costs
included: that is what eager execution costs). Inputs rotate over several sets as in the CUDA
benchmark. Writes a JSON array to argv[1] (default prologue_peer.json).
"""
import json
import math
import sys

try:
    import torch
    import torch.nn.functional as F
except ImportError:
    print("prologue_peer: PyTorch is not installed, skipped")
    sys.exit(0)

Q, LATENT, ROPE, IDX, IDX_BYTES, PAGE = 1536, 512, 64, 128, 132, 64
MAX_POSITION = 65536
FP8_MAX = 448.0
EPS = 1e-6


def rms_norm(x, w):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS) * w.float()).to(torch.bfloat16)


def rope(x, cos, sin, neox):
    """x (T, 64) bf16; cos, sin (T, 32) fp32. Returns bf16."""
    xf = x.float()
    if neox:
        x0, x1 = xf[:, :32], xf[:, 32:]
        return torch.cat((x0 * cos - x1 * sin, x0 * sin + x1 * cos), -1).to(torch.bfloat16)
    x0, x1 = xf[:, 0::2], xf[:, 1::2]
    return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), -1).flatten(-2).to(torch.bfloat16)


def quant_fp8(x, group):
    """x (T, n) bf16 -> codes (T, n) uint8, scales (T, n / group) fp32 (amax / 448, 1 if zero)."""
    xf = x.float().unflatten(-1, (-1, group))
    amax = xf.abs().amax(-1, keepdim=True)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    codes = (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return codes.view(torch.uint8).flatten(-2), scale.squeeze(-1)


class Batch:
    def __init__(self, cfg, T, slots, positions, owned_rows, num_slots, dev, seed):
        g = torch.Generator(device=dev).manual_seed(seed)

        def rnd(shape, lo, hi):
            return (torch.rand(shape, generator=g, device=dev) * (hi - lo) + lo).to(torch.bfloat16)

        self.q_c = rnd((T, Q), -2, 2)
        self.q_out = torch.empty_like(self.q_c)
        self.kv_c = rnd((T, LATENT), -3, 3)
        self.k_pe = rnd((T, ROPE), -1, 1)
        self.positions = positions.clone()
        self.slots = slots.clone()
        self.owned_rows = owned_rows.clone()
        self.owned_slots = slots[owned_rows].clone()
        fp8 = cfg["cache"] == "fp8_ds_mla"
        width = 656 if fp8 else 576
        self.kv_cache = torch.zeros((num_slots, width), dtype=torch.uint8 if fp8 else torch.bfloat16, device=dev)
        self.topk = torch.zeros((T, cfg["topk"]), dtype=torch.int32, device=dev) if cfg["topk"] else None
        if cfg["indexer"]:
            self.index_k = rnd((T, IDX), -2, 3)
            pages = num_slots // PAGE
            self.index_cache = torch.zeros((pages, PAGE * IDX_BYTES), dtype=torch.uint8, device=dev)
            self.idx_codes = self.index_cache[:, : PAGE * IDX].view(pages, PAGE, IDX)
            self.idx_scales = self.index_cache[:, PAGE * IDX :].view(torch.float32)  # (pages, PAGE)


def prologue(cfg, b, w, cos_sin):
    b.q_out.copy_(rms_norm(b.q_c, w["q"]))
    if b.topk is not None:
        b.topk.fill_(-1)
    rows = b.owned_rows
    slots = b.owned_slots
    pos = b.positions[rows]
    cs = cos_sin[pos]
    cos, sin = cs[:, :32], cs[:, 32:]
    latent = rms_norm(b.kv_c[rows], w["kv"])
    kpe = rope(b.k_pe[rows], cos, sin, neox=False)
    n = rows.numel()
    if cfg["cache"] == "fp8_ds_mla":
        codes, scales = quant_fp8(latent, 128)
        entry = torch.cat(
            (codes, scales.contiguous().view(torch.uint8).view(n, 16), kpe.contiguous().view(torch.uint8).view(n, 128)), 1
        )
        b.kv_cache.index_copy_(0, slots, entry)
    else:
        b.kv_cache.index_copy_(0, slots, torch.cat((latent, kpe), 1))
    if cfg["indexer"]:
        k = F.layer_norm(b.index_k[rows].float(), (IDX,), w["ik_w"].float(), w["ik_b"].float(), EPS).to(torch.bfloat16)
        k = torch.cat((rope(k[:, :ROPE], cos, sin, neox=True), k[:, ROPE:]), 1)
        codes, scale = quant_fp8(k, IDX)
        page, s = slots // PAGE, slots % PAGE
        b.idx_codes[page, s] = codes
        b.idx_scales[page, s] = scale.squeeze(-1)


def min_bytes(cfg, T, owned):
    entry = 576 * 2 if cfg["cache"] == "bf16" else 656
    b = T * Q * 2 * 2 + T * 8
    b += owned * ((LATENT + ROPE) * 2 + 8 + ROPE * 4 + entry)
    if cfg["indexer"]:
        b += owned * (IDX * 2 + IDX_BYTES)
    b += T * cfg["topk"] * 4
    b += (Q + LATENT + (2 * IDX if cfg["indexer"] else 0)) * 2
    return float(b)


def time_us(fn, calls, reps):
    """Median over `reps` samples of the per-call time of `calls` back-to-back calls."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(reps):
        a, z = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(calls):
            fn()
        z.record()
        z.synchronize()
        samples.append(1000.0 * a.elapsed_time(z) / calls)
    samples.sort()
    return samples[len(samples) // 2]


def copy_bandwidth_gbs(dev):
    n = 2 << 30
    src = torch.ones(n, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    us = time_us(lambda: dst.copy_(src), 1, 20)
    del src, dst
    return 2.0 * n / (us * 1e3)


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "prologue_peer.json"
    if not torch.cuda.is_available():
        print("prologue_peer: no CUDA device, skipped")
        return 0
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    l2 = getattr(props, "L2_cache_size", 50 << 20)
    copy_gbs = copy_bandwidth_gbs(dev)
    print(f"device {props.name}, torch {torch.__version__}, copy bandwidth {copy_gbs:.0f} GB/s")

    g = torch.Generator(device=dev).manual_seed(7)
    w = {
        "q": (torch.rand(Q, generator=g, device=dev) + 0.5).to(torch.bfloat16),
        "kv": (torch.rand(LATENT, generator=g, device=dev) + 0.5).to(torch.bfloat16),
        "ik_w": (torch.rand(IDX, generator=g, device=dev) + 0.5).to(torch.bfloat16),
        "ik_b": ((torch.rand(IDX, generator=g, device=dev) - 0.5) * 0.4).to(torch.bfloat16),
    }
    p = torch.arange(MAX_POSITION, device=dev, dtype=torch.float64)[:, None]
    inv = torch.pow(10000.0, -2.0 * torch.arange(32, device=dev, dtype=torch.float64) / 64)
    cos_sin = torch.cat((torch.cos(p * inv), torch.sin(p * inv)), 1).float().contiguous()

    configs = [
        {"name": "fp8_indexer", "cache": "fp8_ds_mla", "indexer": True, "topk": 2048, "own": 1.0},
        {"name": "fp8_indexer_dcp4", "cache": "fp8_ds_mla", "indexer": True, "topk": 2048, "own": 0.25},
        {"name": "bf16", "cache": "bf16", "indexer": False, "topk": 0, "own": 1.0},
    ]
    records = []
    print(f"{'config':<18} {'T':>7} {'median_us':>10} {'MB':>10} {'GB/s':>9} {'%copy':>7}")
    for cfg in configs:
        for T in (64, 4096, 32768):
            gen = torch.Generator().manual_seed(T * 7 + int(cfg["indexer"]))
            num_slots = (T + PAGE - 1) // PAGE * PAGE
            pages = torch.randperm(num_slots // PAGE, generator=gen)
            own = torch.ones(T, dtype=torch.bool) if cfg["own"] >= 1.0 else torch.rand(T, generator=gen) < cfg["own"]
            owned = int(own.sum())
            slots = torch.full((T,), -1, dtype=torch.int64)
            k = torch.arange(owned)
            slots[own] = pages[k // PAGE] * PAGE + k % PAGE
            positions = torch.randint(0, MAX_POSITION, (T,), generator=gen)
            owned_rows = own.nonzero().squeeze(-1)
            bytes_ = min_bytes(cfg, T, owned)
            n_sets = int(min(64, max(1, math.ceil(3.0 * l2 / bytes_))))
            batches = [
                Batch(cfg, T, slots.to(dev), positions.to(dev), owned_rows.to(dev), num_slots, dev, 100 + i)
                for i in range(n_sets)
            ]
            state = {"i": 0}

            def call():
                prologue(cfg, batches[state["i"] % n_sets], w, cos_sin)
                state["i"] += 1

            calls = max(n_sets, 16) if T <= 4096 else 2
            us = time_us(call, calls, 30 if T <= 4096 else 10)
            gbs = bytes_ / (us * 1e3)
            print(f"{cfg['name']:<18} {T:>7} {us:>10.2f} {bytes_ / 1e6:>10.2f} {gbs:>9.0f} {100 * gbs / copy_gbs:>6.1f}%")
            records.append(
                {
                    "bench": "prologue",
                    "impl": "torch_eager",
                    "device": props.name,
                    "torch": torch.__version__,
                    "config": cfg["name"],
                    "cache": cfg["cache"],
                    "indexer": int(cfg["indexer"]),
                    "topk": cfg["topk"],
                    "T": T,
                    "owned_rows": owned,
                    "l2": "rotated",
                    "sets": n_sets,
                    "median_us": us,
                    "bytes": bytes_,
                    "gbs": gbs,
                    "copy_gbs": copy_gbs,
                    "pct_copy": 100.0 * gbs / copy_gbs,
                }
            )
            del batches
            torch.cuda.empty_cache()
    with open(out, "w") as f:
        json.dump(records, f, indent=1)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
