"""One-off: where a GPT-1.3B-sized async save's pause goes, and what a snapshot costs."""
import concurrent.futures as cf, hashlib, json, os, shutil, sys, threading, time
from pathlib import Path
import jax, jax.numpy as jnp, numpy as np
import orbax.checkpoint as ocp

OUT = Path(os.environ.get("OUT", "/tmp/out")); OUT.mkdir(parents=True, exist_ok=True)
DISK = Path("/tmp/ckpt_study"); shutil.rmtree(DISK, ignore_errors=True)
rec = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__}
def log(k, v):
    rec[k] = v; print(k, v, flush=True)
    (OUT / "ckpt_study.json").write_text(json.dumps(rec, indent=1))

d, layers, vocab = (2048, 24, 50304) if not os.environ.get("SMALL") else (128, 2, 512)
def make_state(seed):
    k = jax.random.key(seed)
    shapes = {"wte": (vocab, d)}
    for i in range(layers):
        shapes |= {f"l{i}_qkv": (d, 3 * d), f"l{i}_proj": (d, d), f"l{i}_fc1": (d, 4 * d), f"l{i}_fc2": (4 * d, d)}
    mk = jax.jit(lambda k, s: jax.random.normal(k, s, jnp.float32), static_argnums=1)
    return {part: {n: mk(jax.random.fold_in(k, hash((part, n)) % 2**31), s) for n, s in shapes.items()} for part in ("params", "mu", "nu")}

state = make_state(0); jax.block_until_ready(state)
nbytes = sum(x.nbytes for x in jax.tree.leaves(state)); log("state_gb", nbytes / 1e9)
log("mem_after_state", (jax.devices()[0].memory_stats() or {}).get("bytes_in_use"))

def timed(f):
    t = time.perf_counter(); r = f(); return r, time.perf_counter() - t

# 1. device snapshot
snap, t_disp = timed(lambda: jax.tree.map(jnp.copy, state)); _, t_ready = timed(lambda: jax.block_until_ready(snap))
log("devcopy_dispatch_s", t_disp); log("devcopy_ready_s", t_ready); del snap

# 2. pinned host snapshot, twice
pinned = lambda t: jax.tree.map(lambda x: x.sharding.with_memory_kind("pinned_host"), t)
for i in range(2):
    host, t_disp = timed(lambda: jax.device_put(state, pinned(state)))
    _, t_ready = timed(lambda: jax.block_until_ready(host))
    log(f"pinned_dispatch_s_{i}", t_disp); log(f"pinned_ready_s_{i}", t_ready)
_, t_np = timed(lambda: [np.asarray(x) for x in jax.tree.leaves(host)]); log("pinned_to_numpy_s", t_np)
del host
_, t_get = timed(lambda: jax.device_get(state)); log("device_get_s", t_get)

# 3. does a pinned copy in flight slow compute?
a = jnp.ones((8192, 8192) if not os.environ.get("SMALL") else (256, 256), jnp.bfloat16)
mm = jax.jit(lambda a: jnp.tanh(a @ a) * 0.01 + a)
def loop(n=40):
    x = a
    for _ in range(n): x = mm(x)
    return x
jax.block_until_ready(loop(3))
_, t_alone = timed(lambda: jax.block_until_ready(loop())); log("compute_alone_s", t_alone)
def overlapped():
    h = jax.device_put(state, pinned(state)); x = jax.block_until_ready(loop()); t = time.perf_counter() - t0
    jax.block_until_ready(h); return t, time.perf_counter() - t0
t0 = time.perf_counter(); t_c, t_all = overlapped(); log("compute_with_pinned_copy_s", t_c); log("pinned_copy_done_s", t_all)

# 4. orbax: default save call vs a save of a pinned snapshot from a thread
def manager(name, **kw):
    return ocp.CheckpointManager(DISK / name, options=ocp.CheckpointManagerOptions(max_to_keep=None, create=True, enable_async_checkpointing=True))
m = manager("default")
_, t_call = timed(lambda: m.save(1, args=ocp.args.StandardSave(state), force=True)); log("orbax_call_s", t_call)
_, t_wait = timed(m.wait_until_finished); log("orbax_write_after_call_s", t_wait)
_, t_call2 = timed(lambda: m.save(2, args=ocp.args.StandardSave(state), force=True)); log("orbax_call_2nd_s", t_call2)
m.wait_until_finished(); shutil.rmtree(DISK / "default" / "2")

def hash_seq(dir):
    return {str(p): hashlib.file_digest(open(p, "rb"), "sha256").hexdigest() for p in sorted(Path(dir).rglob("*")) if p.is_file()}
def hash_par(dir, n=8):
    files = [p for p in sorted(Path(dir).rglob("*")) if p.is_file()]
    def one(p):
        with open(p, "rb") as f: return str(p), hashlib.file_digest(f, "sha256").hexdigest()
    with cf.ThreadPoolExecutor(n) as ex: return dict(ex.map(one, files))
files = [p for p in (DISK / "default" / "1").rglob("*") if p.is_file()]
log("files", len(files)); log("largest_file_gb", max(p.stat().st_size for p in files) / 1e9)
os.system("sync; echo 3 > /proc/sys/vm/drop_caches 2>/dev/null")
h1, t_seq = timed(lambda: hash_seq(DISK / "default" / "1")); log("hash_seq_s", t_seq)
os.system("sync; echo 3 > /proc/sys/vm/drop_caches 2>/dev/null")
h2, t_par = timed(lambda: hash_par(DISK / "default" / "1")); log("hash_par8_s", t_par); log("hash_same", h1 == h2)
shutil.rmtree(DISK / "default")

m2 = manager("snap")
t0 = time.perf_counter()
host = jax.device_put(state, pinned(state)); log("snap_main_thread_s", time.perf_counter() - t0)
times = {}
def save_thread():
    s = time.perf_counter(); m2.save(1, args=ocp.args.StandardSave(host), force=True); times["call"] = time.perf_counter() - s
    s = time.perf_counter(); m2.wait_until_finished(); times["write"] = time.perf_counter() - s
th = threading.Thread(target=save_thread); th.start()
_, t_c = timed(lambda: jax.block_until_ready(loop())); log("compute_during_thread_save_s", t_c)
th.join(); log("thread_save_call_s", times["call"]); log("thread_save_write_s", times["write"]); log("thread_save_total_s", time.perf_counter() - t0)
# restore the pinned-snapshot checkpoint to device and compare
target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
back = m2.restore(1, args=ocp.args.StandardRestore(target))
log("restored_equal", bool(all(jax.tree.leaves(jax.tree.map(lambda a, b: bool((a == b).all()), back, state)))))
log("restored_memory_kind", jax.tree.leaves(back)[0].sharding.memory_kind)
