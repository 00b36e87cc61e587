"""The hostile-peer suite (issue 17): the real services attacked, kind by kind, while normal traffic
flows. :mod:`~common.lab.abuse.harness` runs the system and judges each scenario,
:mod:`~common.lab.abuse.hostile` holds the attackers' tools, :mod:`~common.lab.abuse.scenarios` the
attacks; ``scripts/abuse.py`` is the command line and ``tests/test_abuse.py`` the trimmed CI run."""
