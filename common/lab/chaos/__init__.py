"""The chaos harness: the PrfaaS system across a faulty WAN link, scenario by scenario.

The system runs as two datacenters on one machine (:mod:`common.lab.topology`). Each scenario sends
its requests while a fault is applied, drains the system and judges every request by what the client
got (exact tokens against ``model.generate``, a clean error, a hang, or lost). The parts:

* :mod:`.scenarios` -- the matrix of scenarios and the run settings (:class:`~.scenarios.Options`);
* :mod:`.requests` -- the workload (prompts and their references) and one request's exchange and verdict;
* :mod:`.faults` -- the fault coroutines a scenario runs while its workload flows;
* :mod:`.report` -- a scenario's row, the table and the acceptance line;
* :mod:`.harness` -- starts the system once and runs scenarios on it.

``scripts/chaos.py`` is the CLI; ``tests/test_chaos.py`` runs a trimmed matrix in CI.
"""
