"""One-off: encode and decode-sum launches at a TP step's per-device sizes, with tile loops
software-pipelined by Triton (num_stages > 1), against the shipped launch (the A/A baseline)."""
import json, os, sys, time, traceback
from pathlib import Path
import jax, jax.numpy as jnp, numpy as np
import pallas_kernels as pk
from pallas_kernels import decode_sum_kernel, encode_kernel
from pallas_kernels.config import BlockConfig
from taco_jax import codecs, timing

OUT = Path(os.environ.get("OUT", "/tmp/out")); OUT.mkdir(parents=True, exist_ok=True)
SMALL = bool(os.environ.get("SMALL"))
MiB = 1 << 20
codec = codecs.get_codec("taco", 128)
BUDGET = 4 if SMALL else 18
rec = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "date": time.strftime("%Y-%m-%d"), "cases": []}

def B(g, w, tiles=1, stages=1, dot=16, per_peer=False):
    return BlockConfig(g, num_warps=w, num_stages=stages, tiles_per_program=tiles, hadamard_dot=dot, hadamard_per_peer=per_peer)

ENCODE = {"e32w2": None, "e16w1": B(16, 1), "e64w4": B(64, 4), "e32w4": B(32, 4),
          "e32w2t2s2": B(32, 2, 2, 2), "e32w2t4s3": B(32, 2, 4, 3), "e16w1t4s3": B(16, 1, 4, 3),
          "e64w4t2s2": B(64, 4, 2, 2), "e32w2t8s3": B(32, 2, 8, 3), "e16w2t4s2": B(16, 2, 4, 2)}
SUM4 = {"s16w4d64": None, "s16w2d64": B(16, 2, dot=64), "s16w4d16": B(16, 4, dot=16), "s16w4d128": B(16, 4, dot=128),
        "s16w4d64t2s2": B(16, 4, 2, 2, dot=64), "s16w4d64t4s3": B(16, 4, 4, 3, dot=64), "s32w4d64": B(32, 4, dot=64),
        "s16w4pp": B(16, 4, dot=16, per_peer=True), "s16w8d64": B(16, 8, dot=64)}
SUM2 = {"p64w2": None, "p64w2t2s2": B(64, 2, 2, 2, per_peer=True), "p32w2": B(32, 2, per_peer=True),
        "p16w1": B(16, 1, per_peer=True), "p64w4": B(64, 4, per_peer=True), "p32w1t4s3": B(32, 1, 4, 3, per_peer=True)}

def inputs(peers, size, kind, seed=0):
    el = size // 2
    sets = max(1, min(16, (256 * MiB) // (2 * el))) if not SMALL else 2
    out = []
    for i in range(sets):
        x = jax.random.normal(jax.random.key(i + 100 * seed), (peers, el // peers), jnp.bfloat16)
        out.append((x if kind == "x" else pk.encode_reference(codec, x),))
    return out

def study(op, peers, size, configs, dtype=jnp.float32):
    kind = "x" if op == "encode" else "wire"
    ins = inputs(peers, size, kind)
    n = size // 2 // peers
    def fn(cfg):
        if op == "encode":
            return jax.jit(lambda x: encode_kernel.encode(codec, x, config=cfg, interpret=SMALL))
        return jax.jit(lambda w: decode_sum_kernel.decode_sum(codec, w, n, dtype, config=cfg, interpret=SMALL))
    base_name = next(iter(configs))
    base_out = np.asarray(fn(None)(*ins[0]).astype(jnp.float32))
    samplers, errors, diffs, launches = {}, {}, {}, {}
    calls = 2 if SMALL else 16
    for name, cfg in configs.items():
        try:
            f = fn(cfg)
            out = np.asarray(f(*ins[0]).astype(jnp.float32))
            diffs[name] = float(np.max(np.abs(out - base_out))) if op != "encode" else int(np.sum(out != base_out))
            samplers[name] = timing.in_program(f, ins, calls)
            launches[name] = None if cfg is None else vars(cfg)
        except Exception as e:
            errors[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
    samplers["base_b"] = timing.in_program(fn(None), inputs(peers, size, kind, seed=1), calls)
    samplers["copy"] = timing.in_program(lambda x: -x, inputs(peers, size, "x"), calls)
    res = timing.compare(samplers, base_name, budget_s=BUDGET, min_repeats=6, max_repeats=40)
    summ = {k: {kk: v[kk] for kk in ("median", "interval", "verdict") if kk in v} for k, v in res["summary"].items()}
    t = {k: float(np.median(v)) for k, v in res["times_s"].items()}
    case = dict(op=op, peers=peers, mib=size / MiB, base=base_name, median_s=t, vs_base=summ, errors=errors, diff=diffs, launches=launches, times_s=res["times_s"])
    rec["cases"].append(case)
    (OUT / "launch_confirm_study.json").write_text(json.dumps(rec, indent=1))
    copy = t["copy"]
    line = " ".join(f"{k}={copy / v * 0 + v * 1e6:.1f}us({summ.get(k, {}).get('median', 1):.3f} {summ.get(k, {}).get('verdict', '')})" for k, v in t.items())
    print(f"{op} P={peers} {size / MiB:g}MiB: {line}", flush=True)
    if errors: print("  errors:", errors, flush=True)
    print("  diffs:", diffs, flush=True)

ENC = {"e32w2": None, "e16w1": B(16, 1), "e32w2t2s2": B(32, 2, 2, 2), "e16w1t4s3": B(16, 1, 4, 3)}
TWO = {"p64w2": None, "p16w1": B(16, 1, per_peer=True), "p32w1": B(32, 1, per_peer=True), "p16w2": B(16, 2, per_peer=True)}
t0 = time.time()
for peers, mib in ([(8, 16), (4, 16), (4, 24), (2, 32), (8, 64)] if not SMALL else [(4, 1)]):
    study("encode", peers, int(mib * MiB), ENC)
for mib in ([8, 16, 32, 64, 256] if not SMALL else [1]):
    study("decode_sum", 2, int(mib * MiB), TWO)
for mib in ([32, 64] if not SMALL else [1]):
    study("decode_sum", 2, int(mib * MiB), TWO, dtype=jnp.bfloat16)
print("total", time.time() - t0)
