"""The Pallas path of compressed_psum under shard_map(check_vma=True), on >= 2 GPUs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import taco_jax as tj

pytestmark = pytest.mark.gpu
U = 2.0**-4  # E4M3 relative rounding bound, see tests/taco_jax/test_collectives.py


@pytest.mark.skipif(
    jax.default_backend() != "gpu" or jax.device_count() < 2, reason="needs >= 2 GPUs"
)
def test_pallas_psum_under_check_vma():
    n = jax.device_count()
    mesh = jax.make_mesh((n,), ("tp",), axis_types=(jax.sharding.AxisType.Auto,))
    x = jax.device_put(
        jax.random.normal(jax.random.key(0), (n, 1 << 16)),
        jax.sharding.NamedSharding(mesh, jax.P("tp")),
    )
    run = lambda psum: jax.jit(
        jax.shard_map(psum, mesh=mesh, in_specs=jax.P("tp"), out_specs=jax.P())
    )(x)
    out = run(lambda v: tj.compressed_psum(v, "tp", impl="pallas"))
    ref = run(lambda v: tj.compressed_psum(v, "tp", impl="xla"))
    exact = run(lambda v: lax.psum(v, "tp"))
    # Same codes up to FP8 ties (one code step at a tie, see test_kernels.py): the two paths
    # agree to within one quantization of the sum, and both satisfy the all-reduce bound.
    bound = U * (1 + U) * float(jnp.sum(jnp.linalg.norm(x, axis=1))) + U * float(
        jnp.linalg.norm(exact)
    )
    assert float(jnp.linalg.norm(out - exact)) <= 1.01 * bound
    assert float(jnp.linalg.norm(out - ref)) <= U * float(jnp.linalg.norm(exact))
    np.testing.assert_array_equal(np.isfinite(out), True)
