"""Shared cores (``common/model/cores.py``): the busy worker gets every core, a prefill leaves a busy
decode worker its cores, a home core is waited for, a dead process's cores come back. Each
:class:`CoreShare` opens its own lock files, so two of them in one process contend like two workers."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest
import torch

from common.model.cores import CoreShare


@pytest.fixture
def share(tmp_path):
    made: list[CoreShare] = []

    def make() -> CoreShare:
        made.append(CoreShare(str(tmp_path), cores=2))
        return made[-1]
    yield make
    for s in made:
        s.close()


def test_an_idle_machine_gives_every_core_to_either_role(share):
    a = share()
    for role in ("decode", "prefill"):
        with a.lease(role) as n:
            assert n == 2 and torch.get_num_threads() == 2


def test_two_busy_workers_split_the_cores(share):
    decode, prefill = share(), share()
    decode.set_busy("decode", True)
    p = prefill.acquire("prefill")
    d = decode.acquire("decode")
    assert (p, d) == ([1], [0])  # each on its home core, one thread each
    assert torch.get_num_threads() == 1
    decode.release(d)
    prefill.release(p)


def test_a_decode_step_takes_no_extra_core_while_a_prefill_is_under_way(share):
    decode, prefill = share(), share()
    prefill.set_busy("prefill", True)  # between two layers: no core held, but the prefill goes on
    with decode.lease("decode") as n:
        assert n == 1
    prefill.set_busy("prefill", False)
    with decode.lease("decode") as n:
        assert n == 2


def test_decode_waits_for_its_home_core_then_takes_both(share):
    decode, prefill = share(), share()
    p = prefill.acquire("prefill")  # the machine was idle: the prefill took both cores for its layer
    assert p == [1, 0]
    got: list[list[int]] = []
    t = threading.Thread(target=lambda: got.append(decode.acquire("decode")))
    t.start()
    time.sleep(0.2)
    assert not got, "decode ran on core 0 while the prefill's layer held it"
    prefill.release(p)
    t.join(5)
    assert got == [[0, 1]]
    decode.release(got[0])


def test_a_prefill_takes_no_extra_core_while_a_decode_worker_is_busy(share):
    decode, prefill = share(), share()
    decode.set_busy("decode", True)
    with prefill.lease("prefill") as n:
        assert n == 1 and torch.get_num_threads() == 1
    decode.set_busy("decode", False)
    with prefill.lease("prefill") as n:
        assert n == 2


def test_a_killed_process_gives_its_cores_back(tmp_path):
    code = ("import sys, time; from common.model.cores import CoreShare; "
            f"s = CoreShare({str(tmp_path)!r}, cores=1); s.acquire('decode'); print('held', flush=True); time.sleep(60)")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "held"
        other = CoreShare(str(tmp_path), cores=2)
        with other.lease("prefill") as n:
            assert n == 1  # core 1 only: the live process holds core 0
        p.kill()
        p.wait()
        with other.lease("prefill") as n:
            assert n == 2
        other.close()
    finally:
        p.kill()
        p.wait()


def test_unknown_role(share):
    with pytest.raises(ValueError, match="unknown role"):
        share().acquire("router")


def test_a_backend_on_shared_cores_computes_the_same_and_holds_none_after(tmp_path):
    from common.lab.reference import reference_model
    from common.model.backend import TorchBackend

    lm = reference_model("tiny-dense")
    plain, shared = TorchBackend(lm), TorchBackend(lm, cores=CoreShare(str(tmp_path), cores=2))
    ids = list(range(40, 90))
    leases: list[int] = []
    orig = shared.cores.acquire
    shared.cores.acquire = lambda role: leases.append(role) or orig(role)
    a = plain.prefill(ids, lambda *_: None)
    b = shared.prefill(ids, lambda *_: None)
    assert torch.equal(a, b)
    assert leases == ["prefill"] * len(lm.layer_types)  # one lease per layer
    probe = CoreShare(str(tmp_path), cores=2)
    with probe.lease("decode") as n:  # nothing is left held or marked busy
        assert n == 2
    probe.close()


def test_threads_flag():
    import argparse

    from common.worker.flags import threads_flag

    assert threads_flag("shared") == "shared" and threads_flag("2") == 2 and threads_flag("0") == 0
    for bad in ("-1", "two", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            threads_flag(bad)
