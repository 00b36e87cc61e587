"""common.lab.hostload: busy time from /proc/stat and the cores other processes kept busy."""

import math
import os
import time

import pytest

from common.lab.hostload import HostLoad, others_cores, parse_proc_stat

STAT = """cpu  100 20 30 1000 50 5 5 10 7 0
cpu0 50 10 15 500 25 2 3 5 0 0
intr 12345
"""


def test_busy_is_every_field_but_idle_and_iowait():
    # user 100 + nice 20 + system 30 + irq 5 + softirq 5 + steal 10 = 170 ticks; guest (7) is inside user
    assert parse_proc_stat(STAT, 100) == pytest.approx(1.70)
    assert parse_proc_stat(STAT.replace("cpu ", "cpuX", 1) + "cpu 1 0 0 9 0 0 0 0\n", 1) == 1.0


def test_bad_stat_raises():
    with pytest.raises(ValueError):
        parse_proc_stat("cpu0 1 2 3 4 5 6 7 8\n", 100)
    with pytest.raises(ValueError):
        parse_proc_stat("cpu 1 2 3\n", 100)


def test_others_cores_subtracts_our_own_time():
    assert others_cores(3.0, 1.0, 2.0) == pytest.approx(1.0)
    assert others_cores(1.0, 1.2, 2.0) == 0.0  # clock skew never goes negative
    with pytest.raises(ValueError):
        others_cores(1.0, 0.0, 0.0)


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="needs /proc/stat")
def test_own_busy_loop_is_not_counted_as_others():
    with HostLoad() as h:
        end = time.monotonic() + 0.4
        while time.monotonic() < end:  # one core busy, with us
            pass
    assert not math.isnan(h.others_cores)
    # the host may run other things meanwhile, but our own busy core is ours, not theirs
    assert h.host_cores - h.others_cores > 0.7
