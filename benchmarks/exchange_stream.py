"""Can the fused exchange of one slice run beside the decode-sum of another (N = 2, NVLink)?

The fused all-reduce (`algorithm="fused"`: the encode kernel stores its codes into the peer's
memory, then a decode-sum kernel) runs its kernels one after the other on XLA's compute stream.
Here the message is cut into S slices, composed by hand from the same kernels as
`taco_jax.compressed_psum(..., algorithm="fused", slices=S)`, with the exchange kernel
- on stream 0 (as the library runs it) or on stream 1 (`jax.experimental.compute_on`,
  `compute_type="gpu_stream:1"`), and
- with or without the exchange of slice k + 1 and the decode-sum of slice k in one scheduling
  group (`set_xla_metadata(_scheduling_group_id=...)`),
so that the scheduler may run them together. Each variant is checked byte for byte against the
library's op, timed against `lax.psum` in the same run (5 all-reduces in one jitted loop, median
of `--reps` calls), and its compiled schedule is summarized (`_common.collective_windows`: an
async call whose window holds a kernel overlapped something).

    NCCL_NVLS_ENABLE=0 XLA_FLAGS="--xla_gpu_experimental_stream_annotation=true \
        --xla_gpu_enable_latency_hiding_scheduler=true" python benchmarks/exchange_stream.py

Needs two Hopper GPUs on NVLink (the fused kernel's conditions, `pallas_kernels.exchange_mosaic`).
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
from _common import collective_windows, looped_on_tp, message_and_psum, run_study, seconds_per_op
from jax.experimental.compute_on import compute_on
from jax.experimental.xla_metadata import set_xla_metadata

import taco_jax as tj
from taco_jax import _backends, codecs

MiB = 1 << 20
INNER = 5


def sliced_fused_all_reduce(x, slices: int, stream: int, grouped: bool):
    """The fused all-reduce of x (this rank's [n]) in `slices` pieces, exchange on `stream`."""
    codec, ops = codecs.get_codec("taco"), _backends.get_ops("auto")
    pieces = jnp.split(x.reshape(1, -1), slices, axis=-1)
    kernel = _backends.fused_exchange("all_gather", "auto", codec, pieces[0], "tp")
    if kernel is None:
        raise SystemExit("the fused exchange does not run here (needs Hopper GPUs, NVLink)")

    def exchange(piece):
        return kernel(piece, replicated=False)[:, 0]

    if stream:
        exchange = compute_on(exchange, compute_type=f"gpu_stream:{stream}",
                              out_memory_spaces=jax.memory.Space.Device)  # fmt: skip
    gathered, outs = [exchange(pieces[0])], []
    for k in range(slices):
        with (
            set_xla_metadata(_scheduling_group_id=str(k + 1))
            if grouped
            else contextlib.nullcontext()
        ):
            if k + 1 < slices:
                gathered.append(exchange(pieces[k + 1]))
            outs.append(ops.decode_sum(codec, gathered[k], pieces[k].shape[-1], x.dtype))
    return jnp.concatenate(outs).reshape(x.shape)


def _library(slices: int):
    return lambda v: tj.compressed_psum(
        v, "tp", codec="taco", algorithm="fused", slices=slices, min_compress_bytes=0
    )


def run(args) -> dict:
    rows = []
    for size_mib in args.sizes_mib:
        mesh, x, timing, lax_s = message_and_psum(size_mib, inner=INNER, reps=args.reps)
        for slices in args.slices:
            want = looped_on_tp(mesh, _library(slices), 1)(x)
            library_s = seconds_per_op(mesh, _library(slices), x, **timing)
            for stream in (0, 1):
                for grouped in (False, True) if slices > 1 else (False,):
                    op = functools.partial(
                        sliced_fused_all_reduce, slices=slices, stream=stream, grouped=grouped
                    )
                    fn = looped_on_tp(mesh, op, INNER)
                    text = fn.lower(x).compile().as_text()
                    same = bool(jnp.all(looped_on_tp(mesh, op, 1)(x) == want))
                    seconds = seconds_per_op(mesh, op, x, **timing)
                    rows.append(dict(bytes=int(size_mib * MiB), slices=slices, stream=stream,
                                     grouped=grouped, seconds=seconds, library_seconds=library_s,
                                     lax_seconds=lax_s, speedup=lax_s / seconds,
                                     equals_library=same,
                                     windows=collective_windows(text)))  # fmt: skip
                    print(f"{size_mib:6.0f} MiB S={slices} stream={stream} grouped={grouped!s:5}"
                          f" {seconds * 1e3:7.3f} ms (library {library_s * 1e3:.3f}, psum "
                          f"{lax_s * 1e3:.3f}) {lax_s / seconds:.2f}x same={same} "
                          f"windows={rows[-1]['windows']}", flush=True)  # fmt: skip
    return {"rows": rows, "inner": INNER}


def options(parser) -> None:
    parser.add_argument("--slices", type=int, nargs="+", default=[1, 2, 4])


def main() -> None:
    run_study("exchange_stream", __doc__, run, options)


if __name__ == "__main__":
    main()
