"""`taco_jax.target`: the platform as an input. A `Target` is checked where it is made, `assume`
replaces the probes' answers for what is traced inside it (and only there), and which `impl`
asks for the kernels is a function of the target alone. How the probes read a traced axis
(a real link, peer stores) is tests/taco_jax/test_policy.py's."""

import pytest

from taco_jax import target
from taco_jax.target import Target


def test_a_target_names_what_cannot_be():
    with pytest.raises(ValueError, match="link='pcie'"):
        Target(backend="gpu", real_link=True, link="pcie")
    with pytest.raises(ValueError, match="peer_stores=True needs .*link='shm'"):
        Target(backend="gpu", real_link=True, link="shm", peer_stores=True)


def test_the_fused_exchange_needs_a_hopper_gpu_that_stores_into_its_peers():
    peers = dict(real_link=True, link="nvlink", peer_stores=True)
    assert Target(backend="gpu", hopper=True, **peers).fused_exchange_possible
    assert not Target(backend="gpu", **peers).fused_exchange_possible
    assert not Target(backend="gpu", hopper=True).fused_exchange_possible


def test_assume_replaces_the_probes_inside_it_only():
    here = target.probe()
    with target.assume(backend="gpu", hopper=True):
        assert (target.probe().backend, target.probe().hopper) == ("gpu", True)
        with target.assume(triton_missing="none here"):  # nests: the outer facts stay
            assert target.probe() == Target("gpu", True, "none here")
        assert target.probe().triton_missing == here.triton_missing
    assert target.probe() == here
    with pytest.raises(TypeError, match=r"unknown target fact\(s\) \['gpu'\]"):
        target.assume(gpu=True).__enter__()


@pytest.mark.parametrize(
    "impl,cpu,gpu",
    [("auto", False, True), ("xla", False, False), ("pallas", True, True)]
    + [("pallas_interpret", True, True)],
)
def test_which_impl_asks_for_the_kernels(impl, cpu, gpu):
    assert target.wants_kernels(impl, Target()) == cpu
    assert target.wants_kernels(impl, Target(backend="gpu")) == gpu


def test_an_unknown_impl_is_named():
    with pytest.raises(ValueError, match="impl='cuda'"):
        target.wants_kernels("cuda", Target())
