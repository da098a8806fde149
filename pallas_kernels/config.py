"""The one launch heuristic of the package: how each kernel splits its rows into programs.

Kept in one table and a few functions (`block_config`; `mosaic_encode_launch` and
`mosaic_launch` for the Mosaic GPU encode and decodes) rather than pasted into each kernel;
each kernel module's `default_config` says which row it asks for. The values were chosen by
measurement on the H200; the sweeps behind them are summarised in docs/development_history.md
("Kernels") and BENCHMARKS.md. What they encode:
- kernels that apply the Hadamard dot stage its +-1 block in shared memory once per program, so
  a program walks a few tiles with 4 warps (the 8-bit codes; the sub-byte encodes and the
  decodes of codes over several bit planes measured faster with one tile per program);
- encode and decode take 8192-element tiles and 16-column dots, the rest of the Hadamard as fp32
  butterflies;
- kernels that hold N peer rows in registers (decode-sum, decode-sum-reencode) take small tiles,
  but for two peers, whose decode-sum takes decode's tile and a Hadamard per peer.
"""

from __future__ import annotations

import dataclasses

# Every operand and result of a kernel may hold at most this many bytes: the kernels address
# their buffers with 32-bit offsets. Measured on 2 x H200 (BENCHMARKS.md, "Messages of 2 GiB and
# more"): past it the fused all-reduce returned non-finite values and the all-gather's decode
# garbage, where it did not fault. `_pallas` refuses such calls; the collectives split their
# messages to stay below it (`taco_jax.collectives`, slices).
MAX_BUFFER_BYTES = (1 << 31) - 1


@dataclasses.dataclass(frozen=True)
class Launch:
    """One row of the launch table: the shape of a kernel's programs for one kind of kernel.

    elements_per_tile: G x groups per tile (capped to the row in `block_config`).
    num_warps: Triton warps per program.
    dot_columns: the Hadamard dot block b (None: the kernel has no dot).
    tiles_per_program: tiles one program walks in a loop, once the launch is large enough.
    hadamard_per_peer: decode-sum: `BlockConfig.hadamard_per_peer`.
    """

    elements_per_tile: int
    num_warps: int
    dot_columns: int | None
    tiles_per_program: int
    hadamard_per_peer: bool = False


# 64 groups of 128 per tile, one M = 64 block per warpgroup; 16-column dots + butterflies.
ENCODE_DECODE = Launch(elements_per_tile=8192, num_warps=4, dot_columns=16, tiles_per_program=2)
# Encode of the sub-byte codes and decode of codes split over several bit planes: one tile per
# program, not ENCODE_DECODE's loop of two (benchmarks/launch_sweep.py, 2 rows of 64 MiB and
# 1 GiB, BENCHMARKS.md "The 6-bit codec's kernels"): int6_hadamard encode 69 -> 76% and
# 75 -> 80% of the copy, decode 78 -> 84% and 79 -> 91%; int5 alike; int4's encode 66 -> 68%
# and 69 -> 74%, while its one-plane decode kept the loop (104% against 97% at 1 GiB). 8 warps
# and smaller tiles were slower.
PLANES_ENCODE_DECODE = Launch(
    elements_per_tile=8192, num_warps=4, dot_columns=16, tiles_per_program=1
)
# decode-sum: the N peer tiles live in registers at once.
PEERS_DOT = Launch(elements_per_tile=2048, num_warps=4, dot_columns=64, tiles_per_program=4)
# decode-sum of two peers (the one-shot and fused all-reduces and the reduce-scatter at N = 2, a
# full-size output): decode's tile fits, and one tile per program measured fastest
# (2026-11-30, docs/development_history.md: 73% of the copy for 2 rows of 1 GiB of bf16 each,
# against 51% with PEERS_DOT); each peer's exact codes through their own Hadamard rather than
# the fp32 sum's three bf16 pieces (`launch_sweep-2026-12-01-decode_sum-per-peer-p2.json`, 2
# rows of 512 MiB: 0.458 -> 0.401 ms, 75% -> 86% of the copy; measured for `taco` and the
# sub-byte codecs at G = 128, taken by every codec with a Hadamard). With 4 and 8 peers the
# best per-peer launch was 1.7-2.9x slower than PEERS_DOT, which keeps the sum.
TWO_PEERS_DOT = Launch(
    elements_per_tile=8192,
    num_warps=4,
    dot_columns=16,
    tiles_per_program=1,
    hadamard_per_peer=True,
)
# decode-sum-reencode (it needs no Hadamard: H H = I), and decode-sum without a Hadamard.
PEERS_NO_DOT = Launch(elements_per_tile=2048, num_warps=4, dot_columns=None, tiles_per_program=1)
# A plain streaming pass: the fp8 / int8 codecs without a Hadamard.
NO_DOT = Launch(elements_per_tile=8192, num_warps=8, dot_columns=None, tiles_per_program=1)
# TAH-Quant (`tahquant_kernel`), measured at 64 MiB of bf16 (benchmarks/stage_kernels.py
# --sweep-mib, G = 128): the encode is bound by its arithmetic (pivot rule, butterflies, the
# noise hash), not by HBM, and ran fastest with small tiles on 2 warps; the decode streams, and
# ran fastest with 64 groups of 128 (G = 32: 128 groups) on 2 warps.
STAGE_ENCODE = Launch(elements_per_tile=2048, num_warps=2, dot_columns=None, tiles_per_program=1)
STAGE_DECODE = Launch(elements_per_tile=8192, num_warps=2, dot_columns=None, tiles_per_program=1)
STAGE_DECODE_G32 = Launch(
    elements_per_tile=4096, num_warps=2, dot_columns=None, tiles_per_program=1
)
# By (peer rows summed into one: 1, 2 or more, Hadamard dot).
_LAUNCHES = {
    (1, True): ENCODE_DECODE,
    (1, False): NO_DOT,
    (2, True): TWO_PEERS_DOT,
    (2, False): PEERS_NO_DOT,
    (3, True): PEERS_DOT,
    (3, False): PEERS_NO_DOT,
}
# A dot program loops over its tiles only once the launch has enough tiles to fill the GPU with
# programs anyway (132 SMs x ~4 resident programs x the loop).
MIN_TILES_FOR_LOOP = 1024
# tl.dot needs every dimension >= 16 (the Hadamard is a tensor-core dot over groups).
MIN_GROUPS_PER_TILE = 16
# Largest Hadamard block applied as one dot; larger G peels its low index bits off first:
# S_G = S_b (x) S_{G/b}, G/b dots of b columns and fp32 butterflies (`_tile.signed_hadamard`).
MAX_DOT_HADAMARD = 128


@dataclasses.dataclass(frozen=True)
class BlockConfig:
    """How a kernel splits its rows into programs.

    groups_per_tile: groups of G one tile holds (a power of two, >= min_groups).
    tiles_per_program: consecutive tiles one program walks through in a loop (1: no loop).
    num_warps / num_stages: Triton launch parameters (stages pipeline the tile loop's loads).
    hadamard_dot: size b of the +-1 block applied as one tensor-core dot (G > b: G / b dots of
      b columns, combined by butterflies on the low index bits).
    signs_in_kernel: build that block from an iota in each program instead of loading it.
    prefetch: in the tile loop, load tile k + 1 before processing tile k.
    hadamard_per_peer: decode-sum only: apply the Hadamard to each peer's codes (exact bf16
      operands, one dot chain per peer) and sum the decoded values, instead of summing in the
      Hadamard domain and applying it once to the fp32 sum (three bf16 pieces, three chains).
    min_groups: the fewest groups a tile may hold: 16 for the kernels that run the Hadamard
      as a tensor-core dot over the tile's groups (the default, `block_config`); the stage
      kernels, which have no dot, take large groups one at a time.
    """

    groups_per_tile: int
    num_warps: int = 4
    num_stages: int = 2
    tiles_per_program: int = 1
    hadamard_dot: int = MAX_DOT_HADAMARD
    signs_in_kernel: bool = False
    prefetch: bool = False
    hadamard_per_peer: bool = False
    min_groups: int = MIN_GROUPS_PER_TILE

    def __post_init__(self):
        for name in ("groups_per_tile", "tiles_per_program", "hadamard_dot"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"BlockConfig.{name}={value} must be a power of two")
        if self.groups_per_tile < self.min_groups:
            raise ValueError(
                f"BlockConfig.groups_per_tile={self.groups_per_tile} must be >= "
                f"min_groups={self.min_groups}"
            )
        if not 16 <= self.hadamard_dot <= MAX_DOT_HADAMARD:
            raise ValueError(
                f"BlockConfig.hadamard_dot={self.hadamard_dot} must be in 16..{MAX_DOT_HADAMARD}"
            )

    def grid_size(self, num_groups: int) -> int:
        """Programs needed along a row of `num_groups` groups."""
        return cdiv(cdiv(num_groups, self.groups_per_tile), self.tiles_per_program)

    def masked(self, num_groups: int) -> bool:
        """Whether the programs overrun the row (then every load and store is masked)."""
        return num_groups % (self.groups_per_tile * self.tiles_per_program) != 0


def _next_pow2(v: int) -> int:
    return 1 << max(0, (v - 1).bit_length())


def block_config(group_size: int, num_groups: int, *, rows=1, peers=1, dot=True, planes=False,
                 launch: Launch | None = None,
                 min_groups: int = MIN_GROUPS_PER_TILE) -> BlockConfig:  # fmt: skip
    """The launch for `rows` rows (or `peers` rows summed into one) of `num_groups` groups.

    dot: the kernel applies the Hadamard dot (then it loops over tiles, see module docstring).
    planes: take `PLANES_ENCODE_DECODE` (one tile per program) for an encode or decode with the
      Hadamard dot; the kernels ask for it where a sweep measured it faster (`default_config`).
    launch: a row of the table to use instead of the one `peers`, `dot` and `planes` pick.
    min_groups: the fewest groups per tile (`BlockConfig.min_groups`).
    """
    if launch is None and planes and peers == 1 and dot:
        launch = PLANES_ENCODE_DECODE
    launch = launch or _LAUNCHES[(min(peers, 3), dot)]
    groups = max(min_groups, launch.elements_per_tile // group_size)
    groups = max(min_groups, min(groups, _next_pow2(num_groups)))
    tiles = rows * cdiv(num_groups, groups)
    loop = launch.tiles_per_program if tiles >= MIN_TILES_FOR_LOOP else 1
    return BlockConfig(
        groups,
        num_warps=launch.num_warps,
        num_stages=1,
        tiles_per_program=loop,
        hadamard_dot=launch.dot_columns or MAX_DOT_HADAMARD,  # unused without a dot
        hadamard_per_peer=launch.hadamard_per_peer,
        min_groups=min_groups,
    )


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclasses.dataclass(frozen=True)
class MosaicLaunch:
    """A Mosaic GPU kernel's launch (`encode_mosaic`, `decode_mosaic`): tiles each program
    pipelines, TMA load steps in flight, and the shared-memory slots its output tiles rotate
    through while TMA stores read them."""

    tiles_per_program: int
    steps_in_flight: int
    store_slots: int = 2

    def __post_init__(self):
        if min(self.tiles_per_program, self.steps_in_flight, self.store_slots) < 1:
            raise ValueError(f"{self} needs >= 1 tile, step in flight and store slot")


# Mosaic GPU kernels (`encode_mosaic`, `decode_mosaic`): a program pipelines up to
# MOSAIC_TILES_PER_PROGRAM tiles of 64 groups with MOSAIC_STEPS_IN_FLIGHT TMA stages, fewer where
# longer programs would leave the GPU part-idle (`mosaic_encode_launch`, `mosaic_launch`).
MOSAIC_GROUPS_PER_TILE = 64  # one wgmma M block of a warpgroup
MOSAIC_TILES_PER_PROGRAM = 16
MOSAIC_STEPS_IN_FLIGHT = 3
MOSAIC_MIN_PROGRAMS = 256
# "auto" takes the Mosaic encode from this many tiles (24 MiB of bf16). Its speed over
# Triton's (Triton's time / its own, same run), `taco`, 8 rows, one H200, three runs
# (`launch_sweep-2026-12-03-wave-r*.json`; the same launch timed twice in a run differed by up
# to 10-18%): 0.85-1.07 at 12 MiB (each program stages the 32 KiB sign matrix for 3 tiles),
# 0.98-1.03 at 16 MiB, 1.08-1.11 at 24, 0.97-1.05 at 32, 1.07-1.09 at 48, 1.08-1.09 at 64,
# 0.96-1.08 at 96 MiB; `int8_hadamard`, one run: 0.98 at 16, 1.11-1.17 from 24 MiB.
MOSAIC_MIN_TILES = (24 << 20) // (2 * MOSAIC_GROUPS_PER_TILE * 128)  # 1536 tiles of bf16
# ... and only for the codecs measured faster and checked on a GPU through it: `taco`,
# `int8_hadamard` (91% of the copy at 256 MiB against Triton's 77%, 65 against 61% at 16 MiB)
# and `taco_e5m2` (one run, `kernels-taco_e5m2-2026-12-03.json`: 1.11-1.15x Triton's speed at
# 24, 64 and 256 MiB). The codecs without a Hadamard (`fp8`, `int8`) measured faster on Triton
# at every size but one (`fp8` at 1 GiB: 120 / 121%, a tie).
MOSAIC_ENCODE_CODECS = ("taco", "int8_hadamard", "taco_e5m2")


def mosaic_launch(rows: int, tiles_per_row: int) -> MosaicLaunch:
    """The Mosaic decodes' launch for `rows` rows of `tiles_per_row` tiles (`decode_mosaic`
    then fits its steps in flight to shared memory; the encode: `mosaic_encode_launch`)."""
    per_program = MOSAIC_TILES_PER_PROGRAM
    while per_program > 1 and (
        tiles_per_row % per_program or rows * tiles_per_row // per_program < MOSAIC_MIN_PROGRAMS
    ):
        per_program //= 2
    return MosaicLaunch(per_program, min(MOSAIC_STEPS_IN_FLIGHT, per_program))


# The Mosaic encode's grid is sized in waves: a Hopper SM runs two encode programs at once (97 KiB
# of shared memory each with three steps in flight; a fourth step leaves room for one, and
# measured 15-25 points slower; programs of 1-2 tiles need less and may fit more, which the
# estimate ignores), a grid that leaves its last wave part-empty loses more than shorter
# programs cost, and among full waves longer programs win (each stages the 32 KiB sign matrix
# and fills its pipeline: ~0.4 of a tile's time, fit to 64 MiB below). Under one wave the
# estimate takes the most programs, which measured 10-30% slow at 8-12 MiB, sizes "auto" leaves
# to Triton. `taco`, 8 rows, one H200, % of a copy, three runs (docs/development_history.md,
# "Where the Mosaic encode starts"): at 48 MiB 384 programs of 8 tiles (1.45 waves) 74-86%, 768
# of 4 (2.9 waves) 83-94%; at 24 MiB 192 of 8 (0.73) 66-67%, 384 of 4 (1.45) 71-73%; at 64 MiB,
# whole waves, 256 programs of 16 tiles 91-92%, 512 of 8 87-89%, 1024 of 4 85-86%.
HOPPER_SMS = 132  # H100 / H200 SXM, where the device does not say (the CPU interpreter)
MOSAIC_ENCODE_PROGRAMS_PER_SM = 2
MOSAIC_PROGRAM_OVERHEAD_TILES = 0.4


def mosaic_encode_launch(rows: int, tiles_per_row: int, sms: int = HOPPER_SMS) -> MosaicLaunch:
    """The Mosaic encode's launch: of the program lengths t (at most MOSAIC_TILES_PER_PROGRAM
    tiles, dividing a row), the one of most estimated throughput: the grid's occupancy over
    whole waves of `sms * MOSAIC_ENCODE_PROGRAMS_PER_SM` programs, times the share of a
    program's time spent on tiles, t / (t + MOSAIC_PROGRAM_OVERHEAD_TILES); ties to the longer."""
    at_once = sms * MOSAIC_ENCODE_PROGRAMS_PER_SM

    def throughput(per_program: int) -> float:
        programs = rows * tiles_per_row // per_program
        occupancy = programs / (cdiv(programs, at_once) * at_once)
        return occupancy * per_program / (per_program + MOSAIC_PROGRAM_OVERHEAD_TILES)

    lengths = [t for t in range(MOSAIC_TILES_PER_PROGRAM, 0, -1) if tiles_per_row % t == 0]
    per_program = max(lengths, key=throughput)
    return MosaicLaunch(per_program, min(MOSAIC_STEPS_IN_FLIGHT, per_program))


# Two Mosaic programs share a Hopper SM where each takes at most (228 KiB - 2 x 1 KiB the driver
# reserves) / 2 = 113 KiB of shared memory, counting what Mosaic GPU adds beside a kernel's own
# buffers (Nsight Compute against `_pallas.smem_bytes`: 2.0 KiB for the sub-byte encode, 0.2
# KiB for its decode, taken as 0.5 for a margin). The sub-byte kernels take the most steps in
# flight, up to their usual cap, that leave room for two (`two_programs_steps`); the 8-bit ones
# keep their measured launches. `int6_hadamard` (three steps: 117 KiB for the encode's
# matrices, plane slots and tiles, 115 KiB for the decode with bf16 slots; two fit), 8 rows,
# 16 tiles a program, one H200, % of the copy at 64 / 256 MiB, one / two / three steps:
# encode 38 / 39, 42 / 44, 30 / 30 (`launch_sweep-2026-12-03-int6-scratch.json`); decode
# 48 / 56, 64 / 68, 43 / 44 (`launch_sweep-2026-12-03-int6-decode.json`; Triton 81 / 89).
# docs/development_history.md, "The sub-byte codecs on Mosaic GPU".
TWO_PROGRAMS_SMEM_BYTES = 113 << 10
MOSAIC_OWN_SMEM_BYTES = {"encode": 2 << 10, "decode": 512}


def two_programs_steps(fixed_bytes: int, step_bytes: int, cap: int, kernel: str) -> int:
    """Steps in flight, at most `cap`, for two programs of `kernel` ("encode", "decode") to share
    an SM, given a program's other shared memory and each step's; `cap` where not even one
    step leaves room for two."""
    room = TWO_PROGRAMS_SMEM_BYTES - MOSAIC_OWN_SMEM_BYTES[kernel] - fixed_bytes
    return min(cap, room // step_bytes) if room >= step_bytes else cap


# Mosaic GPU decode, decode-sum and decode-sum-reencode (`decode_mosaic`): "auto" takes them for
# the codecs of MOSAIC_DECODE_CODECS in calls of at least MOSAIC_DECODE_FROM_BYTES[op] wire
# bytes (None: never, the Triton kernel at every size). Measured on one H200, 8 rows, in one
# program, % of a copy, Triton / Mosaic (BENCHMARKS.md, "Kernels";
# `kernels-2026-12-02-register-operands.json`): the `taco` decode 91 / 97, 98 / 107 and
# 103 / 113% at 64 MiB, 256 MiB and 1 GiB of bf16; at 32 MiB 89-90 / 92-94% in three repeats,
# at 16 MiB 84-85 / 74-90% (docs/development_history.md, "Register operands"), so from 32 MiB
# (17 MiB of wire: 16 Mi elements at 17 / 16 bytes). The sums of eight peers with one peer's
# tile a step (`peer_steps`), fp32 out, at 16 / 64 / 256 MiB / 1 GiB: the decode-sum 47 / 38,
# 67 / 75, 85 / 86, 94 / 96 (bf16 out: 67 / 74, 81 / 79, 85 / 84 from 64 MiB,
# `launch_sweep-2026-12-04-decode_sum-p8-widened.json`), the re-encode 33 / 37, 80 / 81,
# 99 / 99, 116 / 110 (`kernels-2026-12-04-widened.json`): not ahead at every size from one on.
# `taco_e5m2`'s decode, one run (`kernels-taco_e5m2-2026-12-03.json`): 81 / 82% at 24 MiB,
# 91 / 98 at 64, 99 / 107 at 256 MiB. Without a Hadamard (`fp8`, `int8`) Triton's decode is
# the faster at every size.
MOSAIC_DECODE_CODECS = ("taco", "taco_e5m2")
MOSAIC_DECODE_FROM_BYTES: dict[str, int | None] = {
    "decode": 17 << 20,
    "decode_sum": 17 << 20,
    "decode_sum_reencode": 34 << 20,
}
# The decode-sum's table applies at these peer counts only: two peers' tiles a step, one output
# slot and two programs an SM (`decode_mosaic._decoded_rows`), `taco`, % of the copy, Mosaic /
# Triton: bf16 out 85 / 67 and 72 / 72 at 32 and 48 MiB, 92 / 73 at 64 MiB, 102 / 83 at
# 256 MiB (`launch_sweep-2026-12-04-decode_sum-p2-sizes.json`, 1.23-1.26x from 64 MiB); fp32
# out 90 / 76, 96 / 82, 102 / 89 at 32 / 64 / 256 MiB (`kernels-2026-12-04-p2.json`,
# 1.14-1.18x). At four and eight peers Triton's leads at 256 MiB in bf16 (peer steps, four:
# 69 / 71, `launch_sweep-2026-12-04-decode_sum-p4-widened.json`; eight: 79 / 81, above).
MOSAIC_DECODE_SUM_PEERS = (2,)
# The re-encode's table applies at these peer counts only: two peers' tiles a step, `taco`, %
# of the copy, Mosaic / Triton, 32 calls a program
# (`launch_sweep-2026-12-04-reencode-p2-sizes.json`): 83 / 87, 90 / 92 at 32 and 48 MiB,
# 94 / 93 at 64 MiB, 107 / 96 at 128 MiB, 105 / 98 at 256 MiB, 119 / 100 at 1 GiB; in
# `kernels-2026-12-04-p2-widened.json` 53 / 81 at 32 MiB, 89 / 86 at 64 MiB, 100 / 96 and
# 122 / 104 from 256 MiB. So from 64 MiB (34 MiB of wire). At four peers (peer steps)
# 89 / 94% at 64 MiB, 100 / 104 at 256 (`launch_sweep-2026-12-04-reencode-p4-widened.json`);
# at eight: above.
MOSAIC_REENCODE_PEERS = (2,)

# Pipeline steps in flight of the Mosaic peer-steps sums (`peer_steps=True`, one peer's tile a
# step, one output slot), at most. One H200, `taco`, 8 rows, fp32 output, % of a copy at
# 64 MiB / 256 MiB / 1 GiB: the decode-sum with three steps 69-71 / 79-80 / 83-84, four 73-74 /
# 81-82 / 87-89, five 71-73 / 80 / 84; the re-encode with three 73-76 / 86 / -, eight 74-75 /
# 90-91 / 97 (docs/development_history.md, "One output slot").
MOSAIC_PEER_STEPS_IN_FLIGHT = {"decode_sum": 4, "decode_sum_reencode": 8}

# Where the public ops' Mosaic sums take peer steps (`decode_mosaic.default_peer_steps`): from
# four peers, the re-encode at every size and the decode-sum from 16 MiB of wire. One H200,
# `taco`, fp32 out (the collectives write bf16: not measured), one run, in one program, % of a
# copy, every peer's tile a step / one peer's a step, at 16 / 32 / 64 MiB of bf16 over all rows
# (`kernels-2026-12-03-p{2,4,8}.json`; 32 MiB of bf16 = 17 MiB of wire): decode-sum, 8 peers
# 37 / 38, 37 / 63, 41 / 72 (4 MiB, before the peer steps' one output slot: 28 / 19 in
# `kernels-2026-12-02-mosaic-1gib.json`), 4 peers 47 / 51, 55 / 62, 66 / 71, 2 peers (16 / 64 /
# 128 MiB) 59 / 62, 84 / 73, 92 / 76; re-encode, 8 peers 30 / 30, 54 / 55, 49 / 76, 4 peers
# 32 / 37, 62 / 47 (against the trend on either side; one run), 61 / 73, 2 peers 42 / 32,
# 83 / 72, 93 / 78.
MOSAIC_PEER_STEPS_FROM_PEERS = 4
MOSAIC_PEER_STEPS_FROM_BYTES = 16 << 20


# `matmul_encode_mosaic`: "auto" fuses the encode into the matmul for products of at least this
# many elements, the smallest measured faster. One H200, `taco`, 16 calls in one program, us,
# the fused kernel (Hadamard in the epilogue) against XLA's matmul, transpose and encode /
# XLA's matmul and encode: 21.0 against 46.8 / 30.8 at 16384 x 192 x 768, 39.4 against
# 65.2 / 49.0 at 16384 x 768 x 768 (`matmul_encode-2026-12-04.json`). Smaller products: not
# measured.
MATMUL_ENCODE_FROM_ELEMENTS = 16384 * 768
# The codecs "auto" fuses: measured (`taco`); the GPU tests check `int8_hadamard` and `fp8` too.
MATMUL_ENCODE_CODECS = ("taco",)
# Where the fused kernel applies the groups' Hadamard: "folded" into the weight
# (`matmul_encode_mosaic.fold_hadamard`, a pass over the weight each call), or "epilogue" (a
# wgmma of each half tile, no fold). One H200, us, folded kernel + its fold against the
# epilogue kernel: 17.5 + 9.0 / 21.0 at 16384 x 192 x 768, 34.7 + 10.1 / 39.4 at 16384 x 768 x
# 768, 56.8 + 13.1 / 60.9 at 8192 x 1024 x 2048, 194.3 + 12.0 / 200.0 at 8192 x 4096 x 2048
# (`matmul_encode-2026-12-04.json`).
MATMUL_ENCODE_HADAMARD = "epilogue"
# The order the persistent programs take the output tiles in: None, row block after row block,
# or (minor dimension, width) of `plgpu.planar_snake` (bands of `width` tiles along the minor
# dimension, snaking back and forth). One H200, the epilogue kernel under `vmap` over two
# products, us, rows / (0, 4) / (0, 16): 124.7 / 124.5 / 120.9 at 8192 x 1024 x 2048 and
# 430.1 / 419.5 / 420.6 at 8192 x 4096 x 2048, one run; in GPT-1.3B's emulated step (0, 16)
# was no faster (docs/development_history.md, "The encode in the matmul, in the emulated
# steps"). At these shapes a wave of 132 programs covers every column block in any order, and
# a snake touches more row blocks a wave, so rows stay the default.
MATMUL_ENCODE_GRID_ORDER = None
