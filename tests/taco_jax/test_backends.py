"""The kernel dispatch: the ops each `impl` gets, and what happens when the kernels are missing."""

import sys
import warnings

import jax
import numpy as np
import pytest

from taco_jax import _backends, codecs
from taco_jax.target import Target

CPU, GPU = Target(), Target(backend="gpu")


@pytest.fixture
def fresh_dispatch():
    """Forgets the cached import of pallas_kernels (and the warning) before and after a test."""
    caches = (_backends._kernels, _backends._kernel_ops, _backends._warn_fallback)
    for cache in caches:
        cache.cache_clear()
    _backends._IMPORT_FALLBACK.clear()
    yield
    for cache in caches:
        cache.cache_clear()
    _backends._IMPORT_FALLBACK.clear()


@pytest.fixture
def kernels_missing(monkeypatch, fresh_dispatch):
    monkeypatch.setitem(sys.modules, "pallas_kernels", None)  # `import` raises ImportError


def test_xla_and_cpu_auto_use_the_reference(fresh_dispatch):
    assert _backends.get_ops("xla", GPU) is _backends.XLA_OPS
    assert _backends.get_ops("auto", CPU) is _backends.XLA_OPS
    assert _backends.get_ops("auto", GPU) is not _backends.XLA_OPS


def test_pallas_interpret_runs_the_kernels_except_for_none(fresh_dispatch):
    import pallas_kernels

    ops = _backends.get_ops("pallas_interpret", CPU)
    assert _backends._kernels() is pallas_kernels
    x = jax.random.normal(jax.random.key(0), (2, 256))
    taco, none = codecs.get_codec("taco"), codecs.get_codec("none")
    # The dispatcher routes to the kernel itself: the same bytes as calling it directly.
    np.testing.assert_array_equal(
        ops.encode(taco, x), pallas_kernels.encode(taco, x, interpret=True)
    )
    # "none" has no kernel: its ops are the reference's, bit for bit.
    np.testing.assert_array_equal(ops.encode(none, x), codecs.encode_wire(none, x))


def test_pallas_without_kernels_names_the_import_error(kernels_missing):
    with pytest.raises(ImportError, match="pallas_kernels.*failed to import.*halted"):
        _backends.get_ops("pallas", GPU)


def test_auto_on_gpu_without_kernels_warns_once(kernels_missing):
    with pytest.warns(RuntimeWarning, match="XLA reference.*halted"):
        assert _backends.get_ops("auto", GPU) is _backends.XLA_OPS
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _backends.get_ops("auto", GPU) is _backends.XLA_OPS  # no second warning
    # and a run's start-up summary names it (taco_train lists `reference_ops`)
    (why,) = _backends.reference_ops().values()
    assert why.startswith("pallas_kernels failed to import") and "halted" in why


def test_unknown_impl_names_the_value():
    with pytest.raises(ValueError, match="impl='cuda'"):
        _backends.get_ops("cuda", CPU)
