"""A model, not a measurement: a GPT-1.3B step in the TACO paper's 3D layout from measured pieces.

The layout: TP 4 x PP 2 x DP 2 on 16 GPUs, two nodes of 8, TP and PP inside a node and DP
between the nodes (Megatron's placement: the heaviest traffic on the fastest link). One step:
64 sequences of 2048 tokens, GPipe with M = 8 microbatches of 4 sequences per dp rank. The step
time is compute + TP + PP + DP, added without overlap, each from this repository's records:
- compute: the one-GPU bf16 step of GPT-1.3B per token (47% MFU), spread over the 16 GPUs, times
  the pipeline's (M + P - 1) / M. TP 4's smaller matmuls are taken at the same MFU.
- TP: per layer and microbatch, 4 all-reduces (2 forward, 2 backward) of [4, 2048, 2048] bf16
  (32 MiB). At N = 4: NCCL's N = 2 time on the link (log-log interpolation between measured
  sizes) times the ring's 2 (N - 1) / N = 1.5. Compressed with `taco`: N > 2 runs two-shot, at
  the speedup two-shot measured at N = 2 (four GPUs over shared memory measured more,
  `collectives-2026-11-30-x4-shm.json`), and only where that speedup reaches the policy's
  `MIN_SPEEDUP` ("auto": plain collectives elsewhere).
- PP: one 32 MiB send per microbatch and direction, taking what NCCL's N = 2 all-reduce of the
  same bytes takes on the link (each rank moves the message once either way); `tahquant`: the
  send of its 8.56 / 16 of the bytes plus its encode and decode (one H200, 64 MiB scaled).
- DP: what ZeRO-1's traffic (and SDP4Bit's) added to the dp = 2 GPT-350M step on a link, over
  the ZeRO-1 step on NVLink, scaled to GPT-1.3B's parameters per rank (1/8 of them).
Links: "nvlink"; between nodes, host shared memory (~28 GB/s) and sockets (~3.4 GB/s) stand in
for a network, as measured on the 2-GPU machine.

    python -m benchmarks.model_3d --out benchmarks/results   # reads the records; no device
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib

from benchmarks._common import write_record
from taco_jax import policy

RESULTS = pathlib.Path(__file__).parent / "results"
COLLECTIVES = {  # the policy's table: N = 2, every algorithm, 1 MiB .. 1 GiB
    "nvlink": "collectives-2026-11-30-x2-nvlink-fused.json",
    "shm": "collectives-2026-11-30-x2-shm.json",
    "socket": "collectives-2026-11-30-x2-socket.json",
}
ONE_GPU_STEP = "train_step-2026-11-29.json"  # label gpt_1p3b: bf16, one H200
DP_STEPS = "train_step-2026-11-30-dp2-{link}.json"  # GPT-350M, dp = 2
STAGE_KERNELS = "stage_kernels-2026-11-30-pivot-two-reductions.json"

MiB = 1 << 20
TP, PP, DP = 4, 2, 2
LAYERS, D_MODEL, SEQ = 24, 2048, 2048
SEQUENCES, MICROBATCHES = 64, 8
MICRO_SEQUENCES = SEQUENCES // DP // MICROBATCHES
MESSAGE = MICRO_SEQUENCES * SEQ * D_MODEL * 2  # one bf16 activation of a microbatch, bytes
TAHQUANT_BITS = 8.5625
SCENARIOS = (("nvlink", "shm"), ("nvlink", "socket"), ("shm", "shm"), ("shm", "socket"))


def _load(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def interpolated(points: dict[int, float], nbytes: float) -> float:
    """Seconds at `nbytes` by log-log interpolation between measured sizes (clamped to the
    measured range's end slopes)."""
    sizes = sorted(points)
    lo = max([s for s in sizes if s <= nbytes] or sizes[:1])
    hi = min([s for s in sizes if s >= nbytes] or sizes[-1:])
    if lo == hi:
        return points[lo] * nbytes / lo
    w = (math.log(nbytes) - math.log(lo)) / (math.log(hi) - math.log(lo))
    return math.exp((1 - w) * math.log(points[lo]) + w * math.log(points[hi]))


def all_reduce_seconds(link: str, nbytes: float, codec: str = "lax", algorithm: str = "-"):
    rows = _load(COLLECTIVES[link])["rows"]
    wanted = ("all_reduce", codec, algorithm)
    points = {
        r["bytes"]: r["seconds"] for r in rows if (r["op"], r["codec"], r["algorithm"]) == wanted
    }
    return interpolated(points, nbytes)


def _one_gpu_step() -> dict:
    return next(r for r in _load(ONE_GPU_STEP)["results"] if r["label"] == "gpt_1p3b")


def compute_seconds() -> float:
    step = _one_gpu_step()
    per_token = step["median_step_s"] / step["tokens_per_step"]
    bubble = (MICROBATCHES + PP - 1) / MICROBATCHES
    return SEQUENCES * SEQ * per_token / (TP * PP * DP) * bubble


def tp_seconds(link: str, compressed: bool) -> float:
    """A step's TP all-reduces on `link` at N = 4 (one rank's, serial)."""
    calls = 4 * (LAYERS // PP) * MICROBATCHES
    plain = all_reduce_seconds(link, MESSAGE) * 2 * (TP - 1) / TP
    if not compressed:
        return calls * plain
    speedup = all_reduce_seconds(link, MESSAGE) / all_reduce_seconds(
        link, MESSAGE, "taco", "two_shot"
    )
    return calls * (plain / speedup if speedup >= policy.MIN_SPEEDUP else plain)


def pp_seconds(link: str, compressed: bool) -> float:
    """A step's stage sends of one rank: one per microbatch and direction."""
    if not compressed:
        return 2 * MICROBATCHES * all_reduce_seconds(link, MESSAGE)
    kernels = _load(STAGE_KERNELS)["results"][0]  # 64 MiB of bf16
    scale = MESSAGE / kernels["bytes"]
    codec = scale * (
        kernels["tahquant"]["encode"]["kernel_s"] + kernels["tahquant"]["decode"]["kernel_s"]
    )
    wire = all_reduce_seconds(link, MESSAGE * TAHQUANT_BITS / 16)
    return 2 * MICROBATCHES * (wire + codec)


def dp_seconds(link: str, compressed: bool) -> float:
    """ZeRO-1's exposed traffic per step (SDP4Bit's with `compressed`), scaled from GPT-350M
    at dp = 2 to GPT-1.3B's parameters per rank."""
    steps = {r["label"]: r for r in _load(DP_STEPS.format(link=link))["results"]}
    nvlink = {r["label"]: r for r in _load(DP_STEPS.format(link="nvlink"))["results"]}
    base = nvlink["gpt_350m dp=2 zero1 none"]["median_step_s"]
    label = "gpt_350m dp=2 zero1 " + ("sdp4bit" if compressed else "none")
    params_350m = steps[label]["num_params"]
    params_per_rank = _one_gpu_step()["num_params"] / (TP * PP)
    return max(steps[label]["median_step_s"] - base, 0.0) * params_per_rank / params_350m


VARIANTS = {  # name: (TACO on TP, TAH-Quant on PP, SDP4Bit on DP)
    "bf16": (False, False, False),
    "taco": (True, False, False),
    "tahquant": (False, True, False),
    "sdp4bit": (False, False, True),
    "all three": (True, True, True),
}


def scenario(inside: str, between: str) -> dict:
    compute = compute_seconds()
    rows = {}
    for name, (tp_c, pp_c, dp_c) in VARIANTS.items():
        parts = {
            "compute": compute,
            "tp": tp_seconds(inside, tp_c),
            "pp": pp_seconds(inside, pp_c),
            "dp": dp_seconds(between, dp_c),
        }
        rows[name] = {k: v * 1e3 for k, v in parts.items()} | {"step_ms": sum(parts.values()) * 1e3}
    for row in rows.values():
        row["speedup"] = rows["bf16"]["step_ms"] / row["step_ms"]
    return {"inside_node": inside, "between_nodes": between, "variants": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    args = parser.parse_args()
    results = [scenario(inside, between) for inside, between in SCENARIOS]
    for s in results:
        print(f"TP and PP on {s['inside_node']}, DP on {s['between_nodes']}:")
        for name, row in s["variants"].items():
            parts = ", ".join(f"{k} {row[k]:.1f}" for k in ("compute", "tp", "pp", "dp"))
            print(f"  {name:10s} {row['step_ms']:7.1f} ms ({parts}) {row['speedup']:.2f}x")
    write_record(
        "model_3d",
        args.out,
        device="none: a model from the records it names",
        records=[*COLLECTIVES.values(), ONE_GPU_STEP, DP_STEPS, STAGE_KERNELS],
        layout={
            "tp": TP,
            "pp": PP,
            "dp": DP,
            "sequences": SEQUENCES,
            "seq": SEQ,
            "microbatches": MICROBATCHES,
            "message_bytes": MESSAGE,
        },
        scenarios=results,
    )


if __name__ == "__main__":
    main()
