"""How "auto" finds the TP link (`taco_jax.policy.explain_link`, `mesh_link`, `resolve_link`):
NCCL's switches, the hosts of the group's devices, NVML's NVLink report, the fallback without
NVML. The machine's answers are mocked: fake devices (host, platform, kind) and a fake `pynvml`.
A TP group across two real processes is tests/taco_train/test_distributed.py's."""

import dataclasses
import logging
import sys
import types

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from taco_jax import policy


@dataclasses.dataclass(frozen=True)
class FakeDevice:
    id: int
    slice_index: int = 0
    process_index: int = 0
    platform: str = "gpu"
    device_kind: str = "NVIDIA H200"
    local_hardware_id: int = 0


def gpus(*slices: int, kind: str = "NVIDIA H200") -> list[FakeDevice]:
    return [FakeDevice(i, s, device_kind=kind, local_hardware_id=i) for i, s in enumerate(slices)]


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    """No NCCL switches from the environment, and no answer cached from another test."""
    for name in ("NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(name, raising=False)
    for cached in (policy._device_link, policy._say_once):
        cached.cache_clear()
    yield
    for cached in (policy._device_link, policy._say_once):
        cached.cache_clear()


def nvml_says(monkeypatch, joined: bool, count: int = 8):
    """A fake `pynvml` whose `count` GPUs are all joined by NVLink, or none."""
    pairs = {frozenset((a, b)) for a in range(count) for b in range(count) if a != b}
    nvml = fake_pynvml(pairs if joined else set(), count)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    return nvml


JOINED = "NVML: NVLink joins GPUs [0, 1] of this host"


@pytest.mark.parametrize(
    "env,link",
    [
        ({"NCCL_P2P_DISABLE": "1"}, "shm"),
        ({"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"}, "socket"),
    ],
)
def test_nccl_switches_win(monkeypatch, env, link):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    nvml_says(monkeypatch, True)
    assert policy.explain_link(gpus(0, 0)) == policy.Link(link, policy._nccl_switches().why)
    assert policy.detect_link(gpus(0, 1)) == link  # over the hosts too: NCCL's own choice
    assert policy.resolve_link("auto") == link
    assert policy.resolve_link("nvlink") == "nvlink"


def test_ranks_on_different_hosts_read_the_network_table(monkeypatch):
    nvml = nvml_says(monkeypatch, True)
    link = policy.explain_link(gpus(0, 0, 1, 1))
    assert (link.name, link.why, link.assumed) == (
        "socket",
        "the group's 4 devices are on 2 hosts",
        False,
    )
    assert nvml.calls == []  # NVML not asked


def test_cpu_devices_of_two_processes_are_a_network_link():
    """On one host too: CPU collectives between processes go through sockets."""
    devices = [
        FakeDevice(i, 0, process_index=i, platform="cpu", device_kind="cpu") for i in range(2)
    ]
    assert policy.explain_link(devices).name == "socket"
    assert policy.explain_link(devices[:1]).name == "shm"


@pytest.mark.parametrize("joined,link", [(True, "nvlink"), (False, "shm")])
def test_nvml_decides_within_a_host(monkeypatch, joined, link):
    nvml_says(monkeypatch, joined)
    why = JOINED if joined else "NVML: no NVLink between GPUs 0 and 1 of this host"
    assert policy.explain_link(gpus(0, 0)) == policy.Link(link, why)


@pytest.mark.parametrize("kind,link", [("NVIDIA H200", "nvlink"), ("NVIDIA H100 PCIe", "shm")])
def test_without_nvml_the_device_kind_decides_and_says_so(monkeypatch, kind, link):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # `import pynvml` raises ImportError
    found = policy.explain_link(gpus(0, 0, kind=kind))
    assert (found.name, found.assumed) == (link, True)
    assert found.why.startswith("NVML is not installed (pip install nvidia-ml-py)")
    assert repr(kind) in found.why


def fake_pynvml(pairs: set[frozenset[int]], count: int = 4, fail_init: bool = False):
    """A `pynvml` whose GPUs `count` are joined by NVLink exactly in `pairs`."""

    class NVMLError(Exception):
        pass

    calls = []

    def init():
        if fail_init:
            raise NVMLError("Driver Not Loaded")

    def p2p(a, b, index):
        assert index == module.NVML_P2P_CAPS_INDEX_NVLINK
        calls.append((a, b))
        return module.NVML_P2P_STATUS_OK if frozenset((a, b)) in pairs else 4

    module = types.SimpleNamespace(
        NVMLError=NVMLError,
        NVML_P2P_CAPS_INDEX_NVLINK=2,
        NVML_P2P_STATUS_OK=0,
        nvmlInit=init,
        nvmlShutdown=lambda: None,
        nvmlDeviceGetCount=lambda: count,
        nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetP2PStatus=p2p,
        calls=calls,
    )
    return module


BRIDGED = {frozenset((0, 1)), frozenset((2, 3))}  # two NVLink-bridged pairs on PCIe


@pytest.mark.parametrize(
    "visible,joined,why",
    [
        ("2,3", True, "NVML: NVLink joins GPUs [2, 3] of this host"),
        ("1,2", False, "NVML: no NVLink between GPUs 1 and 2 of this host"),
        (None, True, "NVML: NVLink joins GPUs [0, 1] of this host"),
    ],
)
def test_nvml_checks_the_groups_gpus_as_nvml_numbers_them(monkeypatch, visible, joined, why):
    """CUDA_VISIBLE_DEVICES maps the devices' CUDA numbers to NVML's."""
    nvml = fake_pynvml(BRIDGED)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    if visible is not None:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert policy._nvlink_joined(gpus(0, 0)) == (joined, why)
    assert len(nvml.calls) == 1


def test_nvml_checks_every_gpu_of_the_host_for_a_group_across_processes(monkeypatch):
    """GPUs of other processes on this host: NVML cannot tell which, so all of the host's."""
    nvml = fake_pynvml(BRIDGED)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    devices = [FakeDevice(0, 0, process_index=0), FakeDevice(1, 0, process_index=1)]
    assert policy._nvlink_joined(devices) == (
        False,
        "NVML: no NVLink between GPUs 0 and 2 of this host",
    )
    all_pairs = {frozenset((a, b)) for a in range(4) for b in range(a + 1, 4)}
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(all_pairs))  # an NVSwitch box
    assert policy._nvlink_joined(devices)[0] is True


def test_nvml_that_cannot_start_is_no_answer(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(BRIDGED, fail_init=True))
    assert policy._nvlink_joined(gpus(0, 0)) == (None, "NVML did not start (Driver Not Loaded)")


def test_mesh_link_reads_the_groups_along_the_axis(monkeypatch):
    """Two hosts of 4 GPUs, TP inside each host: NVLink; DP across the hosts: the network."""
    nvml_says(monkeypatch, True)
    devices = np.empty(8, dtype=object)
    devices[:] = gpus(0, 0, 0, 0, 1, 1, 1, 1)
    mesh = types.SimpleNamespace(devices=devices.reshape(2, 4), axis_names=("dp", "tp"))
    tp = policy.mesh_link(mesh, "tp")  # either host's group: NVLink joins its GPUs
    assert tp.name == "nvlink" and tp.why.startswith("NVML: NVLink joins GPUs [")
    assert policy.mesh_link(mesh, "dp") == policy.Link(
        "socket", "the group's 2 devices are on 2 hosts"
    )
    assert policy.mesh_link(mesh, ("dp", "tp")).name == "socket"


def test_resolve_link_reads_the_mesh_being_traced_and_says_it(caplog):
    """Under `jax.set_mesh` the TP groups are the mesh's (here 4 of the 8 devices); without a
    mesh, this process's devices (all 8). One log line says which and why."""
    if jax.device_count() < 8:
        pytest.skip("needs 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("dp", "tp"))
    seen = {}

    def probe(x):
        seen["auto"] = policy.resolve_link("auto", "tp")
        return x

    caplog.set_level(logging.INFO, logger=policy.__name__)
    with jax.set_mesh(mesh):
        jax.jit(probe)(1.0)
    assert seen["auto"] == "shm"
    assert "TP link shm: the group's 4 cpu devices share one process's memory" in caplog.text
    assert policy.resolve_link("auto", "tp") == "shm"
    assert "TP link shm: the group's 8 cpu devices share one process's memory" in caplog.text
