#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""PyTorch eager peer of bench_indexer: the lightning indexer and its top-k per decode step.

Same shapes as bench/bench_indexer.cu: B query rows, each the last token of its own request of L
cached tokens; 64 indexer heads x 128 dims; bf16 queries, fp32 head weights, fp8 e4m3 keys with
one fp32 scale per token; k = 2048. For each (L, B) in {8K, 32K, 128K} x {1, 32, 128}:

  score[b, s] = sum_j w[b, j] * relu(q[b, j] . (k[b, s] * k_scale[b, s]))
  topk        = torch.topk(score, 2048).indices, sorted ascending (what the sparse attention reads)

Two eager variants are timed (CUDA events, median):
  torch_fp32  dequantized keys and queries in fp32, einsum (fp32 logits, the DeepGEMM reference's
              arithmetic; TF32 off, PyTorch's default for matmul)
  torch_bf16  bf16 batched matmul (tensor cores, bf16 logits: faster, less exact)

usage: indexer_peer.py [out.json]   (default indexer_peer.json)
"""
import json
import statistics
import sys

import torch

HEADS, DIM, TOPK = 64, 128, 2048
LENGTHS = [8192, 32768, 131072]
BATCHES = [1, 32, 128]


def step_fp32(q, w, k_fp8, k_scale):
    k = k_fp8.float() * k_scale.unsqueeze(-1)                    # (B, L, D)
    logits = torch.einsum("bhd,bld->bhl", q.float(), k)          # (B, H, L)
    score = (logits.relu() * w.unsqueeze(-1)).sum(dim=1)          # (B, L)
    return torch.topk(score, TOPK, dim=-1).indices.sort(dim=-1).values


def step_bf16(q, w, k_fp8, k_scale):
    k = k_fp8.to(torch.bfloat16)                                  # raw e4m3 values, exact in bf16
    logits = torch.bmm(q, k.transpose(1, 2)).float()             # (B, H, L) raw dots, bf16 out
    score = (logits.relu() * w.unsqueeze(-1) * k_scale.unsqueeze(1)).sum(dim=1)
    return torch.topk(score, TOPK, dim=-1).indices.sort(dim=-1).values


def median_us(fn, warmup=3, reps=10):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000.0)
    return statistics.median(times)


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "indexer_peer.json"
    torch.manual_seed(0)
    dev = torch.device("cuda")
    records = []
    print(f"{'batch':>8} {'context':>8} {'fp32_us':>12} {'bf16_us':>12}")
    for length in LENGTHS:
        for batch in BATCHES:
            q = (torch.rand(batch, HEADS, DIM, device=dev) * 2 - 1).to(torch.bfloat16)
            w = torch.rand(batch, HEADS, device=dev)
            k_fp8 = (torch.rand(batch, length, DIM, device=dev, dtype=torch.bfloat16) * 4 - 2).to(
                torch.float8_e4m3fn)
            k_scale = torch.full((batch, length), 1.0 / 64.0, device=dev)
            row = {}
            for name, fn in (("torch_fp32", step_fp32), ("torch_bf16", step_bf16)):
                try:
                    us = median_us(lambda: fn(q, w, k_fp8, k_scale))
                except torch.cuda.OutOfMemoryError:
                    us = None  # reported as null
                    torch.cuda.empty_cache()
                row[name] = us
                records.append({"bench": "indexer_topk", "impl": name, "batch": batch,
                                "context": length, "heads": HEADS, "topk": TOPK, "us": us})
            cells = " ".join(f"{'OOM' if v is None else f'{v:.1f}':>12}" for v in row.values())
            print(f"{batch:>8} {length:>8} {cells}")
            del q, w, k_fp8, k_scale
            torch.cuda.empty_cache()
    with open(out, "w") as f:
        json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
